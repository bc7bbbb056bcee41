"""The FP8 casts of the fast spec's linears: one pass over a tensor, both layouts out.

``cast_transpose(t, scale, dtype)`` returns ``t * scale`` saturated into ``dtype`` twice,
row-major and transposed (the backward GEMMs read their FP8 operands transposed: cuBLAS's
FP8 GEMM takes both operands K-major), and ``t``'s amax. On a GPU one Triton kernel does it,
tile by tile: it reads ``t`` once, writes both copies through a tile transposed in shared
memory, and folds each tile's amax into one float with an atomic max.

Why a kernel of its own: left to inductor, the transposed copy was fused into the
reductions that produce the tensor (the layer norm's and GeLU's backward, the bias
gradient's sum), whose rows-first loops then wrote it one byte per row. On one H200
(2026-12-04, the wide layer of bench/bench_layer.py: 8 x 4096, sequence 4096) those
kernels took 1.95 ms of the FP8 layer's 6.39 ms against 0.55 ms of the bf16 layer's 7.98 ms.
As an operator inductor cannot see into, the cast reads the tensor that the fused kernels
write anyway (the GEMM's bf16 input in the bf16 layer) and writes 1-byte copies at once.

Elsewhere (the CPU, tests) the same operator runs in torch operations; a GPU test holds the
kernel against them, bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch without Triton: the torch operations serve
    triton = None


def _cast_reference(t: Tensor, scale: Tensor, dtype: torch.dtype, transpose: bool):
    limit = FP8_MAX[dtype]
    q = (t.float() * scale).clamp(-limit, limit).to(dtype)
    q_t = q.t().contiguous() if transpose else q.new_empty(0)
    return q, q_t, t.detach().abs().amax().float().reshape(1)


@torch.library.custom_op("megagpt::fp8_cast_transpose", mutates_args=())
def cast_transpose(t: Tensor, scale: Tensor, dtype: torch.dtype,
                   transpose: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(q, q_t, amax): ``t`` ([M, N], contiguous) times ``scale`` (float32, one element) in
    ``dtype``, row-major and, where ``transpose``, transposed ([N, M], contiguous; else an
    empty tensor); and the amax of ``t`` (float32, one element)."""
    return _cast_reference(t, scale, dtype, transpose)


@cast_transpose.register_fake
def _(t, scale, dtype, transpose):
    m, n = t.shape
    q_t = t.new_empty((n, m) if transpose else (0,), dtype=dtype)
    return t.new_empty((m, n), dtype=dtype), q_t, t.new_empty((1,), dtype=torch.float32)


if triton is not None:
    @triton.jit
    def _cast_transpose_kernel(t_ptr, scale_ptr, q_ptr, qt_ptr, amax_ptr, M, N,
                               LIMIT: tl.constexpr, TRANSPOSE: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(t_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        scale = tl.load(scale_ptr)
        q = tl.clamp(x * scale, -LIMIT, LIMIT).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows[:, None] * N + cols[None, :], q, mask=mask)
        if TRANSPOSE:
            tl.store(qt_ptr + cols[:, None] * M + rows[None, :], tl.trans(q),
                     mask=(cols[:, None] < N) & (rows[None, :] < M))
        # amaxes are >= 0: as int32 their bit patterns order as the floats do
        tile_amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)),
                      tile_amax.to(tl.int32, bitcast=True))

    @cast_transpose.register_kernel("cuda")
    def _(t, scale, dtype, transpose):
        m, n = t.shape
        t = t.contiguous()
        q = torch.empty((m, n), dtype=dtype, device=t.device)
        q_t = torch.empty((n, m) if transpose else (0,), dtype=dtype, device=t.device)
        amax = torch.zeros(1, dtype=torch.float32, device=t.device)
        block_m, block_n = 64, 64
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _cast_transpose_kernel[grid](t, scale, q, q_t, amax, m, n, LIMIT=FP8_MAX[dtype],
                                     TRANSPOSE=transpose, BLOCK_M=block_m, BLOCK_N=block_n,
                                     num_warps=4)
        return q, q_t, amax

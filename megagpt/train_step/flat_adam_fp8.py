"""The flat AdamW step's pass with the FP8 linears' weights written too (delayed scaling;
``megagpt.fast_spec.fp8_weights`` says why and when the forward reads them).

Where the model's fused layers mark their FP8 weights (``fp8_weights.mark``), the flat
step (``flat_adam``) runs ``flat_adamw_fp8_update`` instead of its compiled update: the same
AdamW step over the flat buffers, and for every marked weight, from the bf16 value it has
just written, that weight cast by the scale its next forward will read, row-major and
transposed (the layouts the forward and backward GEMMs read), with its amax: what the
forward's own cast (``fp8_cast.cast_transpose``) would give, bit for bit. The copies
live in two flat FP8 buffers allocated here once (``Fp8WeightWrites``), each layer holding
views of them.

On a GPU one Triton kernel does it, in one launch over a table of tiles: 2-D tiles of the
marked weights (AdamW, the bf16 weight, both FP8 layouts through a tile transposed in
registers, the amax folded in with an atomic max, as ``fp8_cast``'s kernel does) and 1-D
blocks of the rest of the buffer. The cast costs the pass 2 bytes per weight written
instead of the forward's read of the bf16 weight and its 2 bytes of writes. The AdamW
arithmetic is the compiled update's, operation by operation in the order inductor emits it
(the fp32 operations of ``adamw_update.adamw_flat_update_``, Triton's division and
``sqrt_rn``, libdevice's ``pow``), so that a step with the writes computes the weights a
step without them does. Elsewhere (the CPU, tests) the operator runs in torch operations:
the eager update, then ``fp8_cast``'s reference cast of each weight; a GPU test holds the
kernel against both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megagpt.fast_spec import fp8_cast, fp8_weights
from megagpt.fast_spec.fp8 import LINEARS

from .adamw_update import run_update

logger = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
# the 2-D tile of a weight (rows x columns: 32-byte rows of the transposed copy) and the 1-D
# block of the rest of the buffer, as many elements, for one program of the kernel
TILE_ROWS, TILE_COLS = 32, 64
BLOCK = TILE_ROWS * TILE_COLS
# each FP8 copy starts on a 16-byte boundary (cuBLAS's FP8 GEMM needs aligned operands)
ALIGN = 16

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # a CPU-only torch without Triton: the torch operations serve
    triton = None


def _reference(grad: Tensor, main: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, model: Tensor,
               group_index: Tensor, lr_and_wd: Tensor, step: Tensor, clip_coeff: Tensor,
               next_scales: Tensor, scales: Tensor, amax: Tensor, w8: Tensor, w8_t: Tensor,
               weights: Tensor, beta1: float, beta2: float, eps: float,
               decoupled: bool) -> None:
    run_update(grad, main, exp_avg, exp_avg_sq, model, group_index, lr_and_wd, step,
               clip_coeff, beta1=beta1, beta2=beta2, eps=eps, decoupled=decoupled,
               compiled=False)
    for offset, rows, cols, fp8_offset, slot in weights.tolist():
        n = rows * cols
        q, q_t, a = fp8_cast._cast_reference(model[offset:offset + n].view(rows, cols),
                                             next_scales[slot:slot + 1], E4M3, True)
        w8[fp8_offset:fp8_offset + n].copy_(q.view(-1))
        w8_t[fp8_offset:fp8_offset + n].copy_(q_t.view(-1))
        amax[slot:slot + 1].copy_(a)
    scales.copy_(next_scales)


@torch.library.custom_op(
    "megagpt::flat_adamw_fp8_update",
    mutates_args=("main", "exp_avg", "exp_avg_sq", "model", "scales", "amax", "w8", "w8_t"))
def flat_adamw_fp8_update(grad: Tensor, main: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                    model: Tensor, group_index: Tensor, lr_and_wd: Tensor, step: Tensor,
                    clip_coeff: Tensor, next_scales: Tensor, scales: Tensor, amax: Tensor,
                    w8: Tensor, w8_t: Tensor, weights: Tensor, tiles: Tensor, blocks: Tensor,
                    beta1: float, beta2: float, eps: float, decoupled: bool) -> None:
    """``adamw_update.adamw_flat_update_`` over the flat buffers, and each weight of
    ``weights`` (rows of (offset in the buffers, rows, columns, offset in the FP8 buffers,
    slot)) cast from its new bf16 value by ``next_scales[slot]`` into ``w8`` (row-major) and
    ``w8_t`` (transposed), its amax into ``amax[slot]``; ``scales`` becomes ``next_scales``.
    ``tiles`` and ``blocks`` lay the kernel's programs out (``Fp8WeightWrites``)."""
    _reference(grad, main, exp_avg, exp_avg_sq, model, group_index, lr_and_wd, step,
               clip_coeff, next_scales, scales, amax, w8, w8_t, weights, beta1, beta2, eps,
               decoupled)


if triton is not None:
    @triton.jit
    def _adamw(idx, mask, grad_ptr, main_ptr, m_ptr, v_ptr, model_ptr, group_ptr, lrwd_ptr,
               step, clip, n_groups, group_block, beta1, beta2, one_minus_beta1,
               one_minus_beta2, eps, DECOUPLED: tl.constexpr):
        """AdamW on the elements ``idx`` of the flat buffers; returns their bf16 weights.
        Each operation as inductor emits ``adamw_flat_update_``'s, in its order."""
        p = tl.load(main_ptr + idx, mask=mask, other=0.0)
        group = tl.load(group_ptr + idx // group_block, mask=mask, other=0).to(tl.int32)
        lr = tl.load(lrwd_ptr + group, mask=mask, other=0.0)
        wd = tl.load(lrwd_ptr + n_groups + group, mask=mask, other=0.0)
        g = tl.load(grad_ptr + idx, mask=mask, other=0.0).to(tl.float32) * clip
        if DECOUPLED:
            p = p - lr * wd * p
        else:
            g = g + p * wd
        step_size = lr / (1.0 - libdevice.pow(beta1, step))
        m = tl.load(m_ptr + idx, mask=mask, other=0.0) * beta1 + g * one_minus_beta1
        numerator = step_size * m
        v = tl.load(v_ptr + idx, mask=mask, other=0.0) * beta2 + g * one_minus_beta2 * g
        denom = tl.sqrt_rn(v) / tl.sqrt_rn(1.0 - libdevice.pow(beta2, step)) + eps
        p = p - numerator / denom
        weight = p.to(tl.bfloat16)
        tl.store(m_ptr + idx, m, mask=mask)
        tl.store(v_ptr + idx, v, mask=mask)
        tl.store(main_ptr + idx, p, mask=mask)
        tl.store(model_ptr + idx, weight, mask=mask)
        return weight

    @triton.jit
    def _flat_adamw_fp8_kernel(grad_ptr, main_ptr, m_ptr, v_ptr, model_ptr, group_ptr,
                               lrwd_ptr, step_ptr, clip_ptr, next_scale_ptr, amax_ptr, w8_ptr,
                               w8t_ptr, weights_ptr, tiles_ptr, blocks_ptr, n_tiles, n_groups,
                               group_block, beta1, beta2, one_minus_beta1, one_minus_beta2,
                               eps, LIMIT: tl.constexpr, DECOUPLED: tl.constexpr,
                               ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.load(step_ptr)
        clip = tl.load(clip_ptr)
        if pid < n_tiles:
            weight_row = tl.load(tiles_ptr + 3 * pid)
            tile_row = tl.load(tiles_ptr + 3 * pid + 1)
            tile_col = tl.load(tiles_ptr + 3 * pid + 2)
            offset = tl.load(weights_ptr + 5 * weight_row)
            n_rows = tl.load(weights_ptr + 5 * weight_row + 1)
            n_cols = tl.load(weights_ptr + 5 * weight_row + 2)
            fp8_offset = tl.load(weights_ptr + 5 * weight_row + 3)
            slot = tl.load(weights_ptr + 5 * weight_row + 4)
            rows = tile_row * ROWS + tl.arange(0, ROWS)
            cols = tile_col * COLS + tl.arange(0, COLS)
            mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
            within = rows[:, None] * n_cols + cols[None, :]
            w = _adamw(offset + within, mask, grad_ptr, main_ptr, m_ptr, v_ptr, model_ptr,
                       group_ptr, lrwd_ptr, step, clip, n_groups, group_block, beta1, beta2,
                       one_minus_beta1, one_minus_beta2, eps, DECOUPLED)
            # fp8_cast's cast of the bf16 weight, by the scale the next forward reads
            x = w.to(tl.float32)
            scale = tl.load(next_scale_ptr + slot)
            q = tl.clamp(x * scale, -LIMIT, LIMIT).to(w8_ptr.dtype.element_ty)
            tl.store(w8_ptr + fp8_offset + within, q, mask=mask)
            tl.store(w8t_ptr + fp8_offset + cols[:, None] * n_rows + rows[None, :],
                     tl.trans(q), mask=(cols[:, None] < n_cols) & (rows[None, :] < n_rows))
            # amaxes are >= 0: as int32 their bit patterns order as the floats do
            tile_amax = tl.max(tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1), axis=0)
            tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)) + slot,
                          tile_amax.to(tl.int32, bitcast=True))
        else:
            block = pid - n_tiles
            start = tl.load(blocks_ptr + 2 * block)
            end = tl.load(blocks_ptr + 2 * block + 1)
            idx = start + tl.arange(0, BLOCK)
            _adamw(idx, idx < end, grad_ptr, main_ptr, m_ptr, v_ptr, model_ptr, group_ptr,
                   lrwd_ptr, step, clip, n_groups, group_block, beta1, beta2,
                   one_minus_beta1, one_minus_beta2, eps, DECOUPLED)

    @flat_adamw_fp8_update.register_kernel("cuda")
    def _(grad, main, exp_avg, exp_avg_sq, model, group_index, lr_and_wd, step, clip_coeff,
          next_scales, scales, amax, w8, w8_t, weights, tiles, blocks, beta1, beta2, eps,
          decoupled):
        amax.zero_()
        scales.copy_(next_scales)
        n_tiles, n_blocks = tiles.shape[0], blocks.shape[0]
        _flat_adamw_fp8_kernel[(n_tiles + n_blocks,)](
            grad, main, exp_avg, exp_avg_sq, model, group_index, lr_and_wd, step, clip_coeff,
            next_scales, amax, w8, w8_t, weights, tiles, blocks, n_tiles, lr_and_wd.shape[1],
            grad.numel() // group_index.numel(), beta1, beta2, 1 - beta1, 1 - beta2, eps,
            LIMIT=fp8_cast.FP8_MAX[E4M3], DECOUPLED=decoupled, ROWS=TILE_ROWS, COLS=TILE_COLS,
            BLOCK=BLOCK, num_warps=4)


@dataclass
class _Marked:
    offset: int  # in the flat buffers
    rows: int
    cols: int
    copies: fp8_weights.LayerCopies
    linear: int


class Fp8WeightWrites:
    """The FP8 copies of the marked weights in one flat step's buffers: the copies' flat
    FP8 buffers, each layer's views of them, and the kernel's tables."""

    def __init__(self, marked: list, size: int, device):
        self.layers = list(dict.fromkeys(m.copies for m in marked))  # in the buffer's order
        rows, offset = [], 0
        for m in marked:
            n = m.rows * m.cols
            slot = LINEARS * self.layers.index(m.copies) + m.linear
            rows.append((m.offset, m.rows, m.cols, offset, slot))
            offset += -(-n // ALIGN) * ALIGN
        self.w8 = torch.zeros(offset, dtype=E4M3, device=device)
        self.w8_t = torch.zeros(offset, dtype=E4M3, device=device)
        slots = LINEARS * len(self.layers)
        self.scales = torch.ones(slots, dtype=torch.float32, device=device)
        self.amax = torch.zeros(slots, dtype=torch.float32, device=device)
        self.next_scales = torch.ones(slots, dtype=torch.float32, device=device)
        views: dict = {copies: ({}, {}) for copies in self.layers}
        for m, (_, r, c, fp8_offset, _) in zip(marked, rows):
            w8, w8_t = views[m.copies]
            w8[m.linear] = self.w8[fp8_offset:fp8_offset + r * c].view(r, c)
            w8_t[m.linear] = self.w8_t[fp8_offset:fp8_offset + r * c].view(c, r)
        for i, copies in enumerate(self.layers):
            block = slice(LINEARS * i, LINEARS * (i + 1))
            copies.bind(*views[copies], self.scales[block], self.amax[block],
                        self.next_scales[block])
        self.weights_on_host = torch.tensor(rows, dtype=torch.int64).reshape(-1, 5)
        self.weights = self.weights_on_host.to(device)
        self.tiles = _tiles(rows).to(device)
        self.blocks = _blocks([(r[0], r[0] + r[1] * r[2]) for r in rows], size).to(device)
        self.count = len(marked)
        self.kernel_error: Optional[str] = None

    def update(self, grad, main, exp_avg, exp_avg_sq, model, group_index, lr_and_wd, step,
               clip_coeff, *, beta1: float, beta2: float, eps: float,
               decoupled: bool) -> None:
        """One AdamW step over the flat buffers, the copies written in the same pass."""
        args = (grad, main, exp_avg, exp_avg_sq, model, group_index, lr_and_wd, step,
                clip_coeff, self.next_scales, self.scales, self.amax, self.w8, self.w8_t)
        if self.kernel_error is None:
            try:
                torch.ops.megagpt.flat_adamw_fp8_update(
                    *args, self.weights, self.tiles, self.blocks, beta1, beta2, eps, decoupled)
            except Exception as exc:  # noqa: BLE001 - Triton's failures come in many types
                if not (type(exc).__module__ or "").startswith("triton"):
                    raise
                # a kernel Triton cannot build must not stop training: the same step in
                # torch operations (two passes)
                self.kernel_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                logger.warning("flat AdamW: the FP8 weights' kernel failed (%s); stepping "
                               "with torch operations", self.kernel_error)
        if self.kernel_error is not None:
            _reference(*args, self.weights_on_host, beta1, beta2, eps, decoupled)
        for copies in self.layers:
            copies.written()


def _tiles(rows: list) -> Tensor:
    """(weight row, tile row, tile column) of every 2-D tile of the marked weights, int32."""
    parts = []
    for i, (_, r, c, _, _) in enumerate(rows):
        tr, tc = torch.meshgrid(torch.arange(-(-r // TILE_ROWS)),
                                torch.arange(-(-c // TILE_COLS)), indexing="ij")
        parts.append(torch.stack([torch.full_like(tr, i), tr, tc], dim=-1).reshape(-1, 3))
    return torch.cat(parts).to(torch.int32) if parts else torch.zeros(0, 3, dtype=torch.int32)


def _blocks(spans: list, size: int) -> Tensor:
    """(start, end) of 1-D blocks of ``BLOCK`` elements covering [0, size) outside
    ``spans`` (the marked weights), each within one gap (end: the gap's), int64."""
    parts, at = [], 0
    for start, end in sorted(spans) + [(size, size)]:
        if start > at:
            starts = torch.arange(at, start, BLOCK)
            parts.append(torch.stack([starts, torch.full_like(starts, start)], dim=-1))
        at = max(at, end)
    return torch.cat(parts) if parts else torch.zeros(0, 2, dtype=torch.int64)


def writes_for(entries, size: int, device) -> Optional[Fp8WeightWrites]:
    """The FP8 weight writes of a flat step over ``entries`` ((model parameter, main
    parameter, group, offset) of a buffer of ``size`` elements), None where no parameter
    is a marked FP8 weight."""
    marked = []
    for model_param, _, _, offset in entries:
        mark = fp8_weights.marked(model_param)
        if mark is not None and model_param.dtype == torch.bfloat16:  # the kernel's weights
            rows, cols = model_param.shape
            marked.append(_Marked(offset, rows, cols, *mark))
    # a layer whose FP8 weights this step does not all hold keeps casting them
    held = {}
    for m in marked:
        held.setdefault(m.copies, set()).add(m.linear)
    marked = [m for m in marked if held[m.copies] == set(m.copies.linears)]
    if not marked:
        return None
    marked.sort(key=lambda m: m.offset)
    return Fp8WeightWrites(marked, size, device)

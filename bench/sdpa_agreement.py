#!/usr/bin/env python3
"""torch's attention kernels' bf16 gradients against fp32's, in the layouts the fast spec
hands them (one GPU).

The fast spec's layer splits QKV out of one ``[s, b, 3 * heads * head_dim]`` GEMM output
and passes SDPA ``[b, heads, s, head_dim]`` views of it (strided: the sequence is the
outer dimension in memory), and its output's gradient arrives the same way. This runs
causal SDPA's forward and backward on such views and on contiguous copies, for each kernel
torch may pick (cuDNN's, flash, memory-efficient), eager and under ``torch.compile``, and
compares the output and the three input gradients with the math kernel in fp32 on the same
(bf16-rounded) inputs:

  rel err   ||x - x32|| / ||x32||
  sign      the share of elements above 1e-3 of the largest whose sign differs from fp32's

``--sharpness`` scales the queries: 1 gives the near-uniform attention of a fresh model,
larger values the peaked attention of a trained one.

  python bench/sdpa_agreement.py [--shape 345M] [--sharpness 1,8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grad_agreement import SHAPES as MODEL_SHAPES  # noqa: E402
from run_info import run_info  # noqa: E402

# heads, head_dim, seq, micro-batch of grad_agreement.py's shapes (hidden, heads, seq, batch)
SHAPES = {name: (heads, hidden // heads, seq, batch)
          for name, (hidden, heads, seq, batch) in MODEL_SHAPES.items()}
KERNELS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def _inputs(shape, sharpness: float, seed: int, device: str):
    """q, k, v as [s, b, 3, heads, head_dim] (one QKV GEMM's output) and the output's
    gradient as [s, b, heads * head_dim], bf16-rounded."""
    heads, dim, seq, batch = shape
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(seq, batch, 3, heads, dim, generator=g, device=device)
    qkv[:, :, 0] *= sharpness
    grad = torch.randn(seq, batch, heads * dim, generator=g, device=device)
    return qkv.bfloat16(), grad.bfloat16()


def _attend(qkv, grad, dtype, contiguous: bool, kernel, compiled: bool):
    """Output and gradients of causal attention over ``qkv``'s views, in ``dtype``."""
    qkv = qkv.to(dtype).detach().requires_grad_(True)
    seq, batch, _, heads, dim = qkv.shape

    def attention(qkv):
        q, k, v = (qkv[:, :, i].permute(1, 2, 0, 3) for i in range(3))  # [b, n, s, d] views
        if contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)

    fn = torch.compile(attention, fullgraph=True, dynamic=False) if compiled else attention
    with sdpa_kernel([kernel]):
        out = fn(qkv)
        out.backward(grad.to(dtype))
    return out.detach().float(), qkv.grad.detach().float()


def _compare(x, ref) -> dict:
    top = float(ref.abs().max())
    above = ref.abs() > 1e-3 * top
    wrong = int((above & (torch.sign(x) != torch.sign(ref))).sum())
    return {"rel_err": float((x - ref).norm() / ref.norm()),
            "sign_wrong": wrong / max(1, int(above.sum()))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="345M", choices=sorted(SHAPES))
    p.add_argument("--sharpness", default="1,8")
    p.add_argument("--kernels", default="cudnn,flash,efficient")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernels = [k for k in a.kernels.split(",") if k]
    if device == "cpu":
        kernels = ["math"]  # a smoke run: the fused kernels need a GPU
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    print(f"{'sharpness':>9s} {'kernel':10s} {'layout':10s} {'compiled':8s}"
          f"{'out':>10s}{'dq':>10s}{'dk':>10s}{'dv':>10s}{'sign dq':>9s}{'sign dk':>9s}")
    for sharpness in (float(x) for x in a.sharpness.split(",")):
        qkv, grad = _inputs(SHAPES[a.shape], sharpness, a.seed, device)
        ref_out, ref_grad = _attend(qkv, grad, torch.float32, True, SDPBackend.MATH, False)
        for kernel in kernels:
            for contiguous in (False, True):
                for compiled in (False, True):
                    try:
                        out, g = _attend(qkv, grad, torch.bfloat16, contiguous,
                                         KERNELS[kernel], compiled)
                    except RuntimeError as e:  # a kernel that cannot take the layout
                        print(f"{sharpness:9g} {kernel:10s} -- {str(e).splitlines()[0][:80]}")
                        continue
                    row = dict(sharpness=sharpness, kernel=kernel, compiled=compiled,
                               layout="contiguous" if contiguous else "strided",
                               out=_compare(out, ref_out),
                               **{n: _compare(g[:, :, i], ref_grad[:, :, i])
                                  for i, n in enumerate(("dq", "dk", "dv"))})
                    rows.append(row)
                    print(f"{sharpness:9g} {kernel:10s} {row['layout']:10s} {compiled!s:8s}"
                          + "".join(f"{row[n]['rel_err']:10.2e}" for n in
                                    ("out", "dq", "dk", "dv"))
                          + "".join(f"{100 * row[n]['sign_wrong']:8.2f}%" for n in
                                    ("dq", "dk")), flush=True)
    if a.json:
        a.json.write_text(json.dumps(dict(shape=a.shape, info=run_info(), rows=rows),
                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Column sums of [8192, N] bf16 gradients (the bias gradients of the 1.3B layer) on one GPU.

The fused layer's bias gradients are column sums of a [tokens, features] gradient: N = 2048
(projection, fc2), 6144 (QKV), 8192 (fc1) at the 1.3B shape. This times, per form, one sum
(CUDA graph of 50, median of 5 replays) and the bandwidth it reaches reading the gradient once:

  eager sum(0)        torch's reduction kernel
  compiled sum(0)     torch.compile of the sum alone
  mv(g.t(), ones)     cuBLAS GEMV against a vector of ones
  mm(ones_row, g)     cuBLAS GEMM with one row

and then the tanh-GeLU backward compiled alone and with the column sum of its output (is
the sum fused into the pointwise kernel, and what does it add?).

  python bench/bench_column_sums.py
"""

from __future__ import annotations

import torch

ROWS = 8192  # tokens of a 1.3B micro-batch: 4 x 2048


def time_us(fn, *args, reps: int = 50) -> float:
    """Median µs per call of ``fn(*args)``, captured as a CUDA graph of ``reps`` calls."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps * 1000)
    return sorted(times)[2]


def gelu_tanh_backward(dy, pre):
    x = pre.float()
    k = 0.7978845608028654
    t = torch.tanh(k * (x + 0.044715 * x * x * x))
    d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)
    return (dy.float() * d).to(dy.dtype)


def main() -> None:
    torch.manual_seed(0)
    print("torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
    for cols in (2048, 6144, 8192):
        g = torch.randn(ROWS, cols, device="cuda", dtype=torch.bfloat16)
        ones = torch.ones(ROWS, device="cuda", dtype=torch.bfloat16)
        ones_row = ones.view(1, ROWS)
        exact = g.float().sum(0)
        forms = {
            "eager sum(0)": lambda t: t.sum(0),
            "compiled sum(0)": torch.compile(lambda t: t.sum(0)),
            "mv(g.t(), ones)": lambda t: torch.mv(t.t(), ones),
            "mm(ones_row, g)": lambda t: torch.mm(ones_row, t).view(-1),
        }
        line = []
        for name, fn in forms.items():
            us = time_us(fn, g)
            err = (fn(g).float() - exact).abs().max().item() / exact.abs().max().item()
            tb_s = g.numel() * g.element_size() / (us * 1e-6) / 1e12
            line.append(f"{name} {us:.1f} us ({tb_s:.2f} TB/s, max rel err {err:.1e})")
        mib = g.numel() * g.element_size() / 2**20
        print(f"[{ROWS}, {cols}] bf16 ({mib:.0f} MiB): " + "; ".join(line), flush=True)
    dy = torch.randn(ROWS, 8192, device="cuda", dtype=torch.bfloat16)
    pre = torch.randn(ROWS, 8192, device="cuda", dtype=torch.bfloat16)
    alone = torch.compile(gelu_tanh_backward)
    with_sum = torch.compile(lambda a, b: (lambda g: (g, g.sum(0)))(gelu_tanh_backward(a, b)))
    print(f"GeLU backward [{ROWS}, 8192] compiled: alone {time_us(alone, dy, pre):.1f} us, "
          f"with its column sum {time_us(with_sum, dy, pre):.1f} us", flush=True)


if __name__ == "__main__":
    main()

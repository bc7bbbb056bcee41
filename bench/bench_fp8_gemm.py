#!/usr/bin/env python3
"""One linear's three GEMMs in FP8 against bf16, by GEMM size (one GPU): where FP8 gains.

A linear of the fused layer (x: [M, K] tokens by input width, w: [N, K]) forward and
backward, as the layer runs it: bf16 through ``_LinearIntoMainGrad`` (the weight gradient
written into a bf16 ``main_grad``, as the fast path keeps it), FP8 through
``megagpt.fast_spec.fp8.fp8_linear`` (the operand casts, ``_scaled_mm`` for the forward and
both gradients, the weight gradient into ``main_grad``), delayed scaling from a warm amax history unless ``--recipe tensorwise``.
Each is captured as one CUDA graph of ``--reps`` forward+backward passes and replayed in
turns (5 rounds, the median); the scale arithmetic runs eagerly here, where the compiled
layer fuses it, so the FP8 time is an upper bound.

  python bench/bench_fp8_gemm.py [--tokens 4096,8192,16384] [--widths 512,...] [--out F.json]

Prints one line per (M, K, N): bf16 and FP8 microseconds and the ratio; ``--shapes`` times
the fused layer's four linears at the named model shapes instead of the grid. The figures
behind ``megagpt.launch.fp8.FP8_MIN_WIDTH``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_graph_timing import capture, replay_us  # noqa: E402
from run_info import run_info  # noqa: E402

# hidden, FFN, tokens per micro-batch: bench_layer's shapes (seq x micro-batch)
MODEL_SHAPES = {"345M": (1024, 4096, 8192), "1.3B": (2048, 8192, 8192),
                "wide": (4096, 16384, 4096)}


def linears_of(shape: str) -> dict:
    """The fused layer's four linears at a model shape: name -> (M, K, N)."""
    h, ffn, m = MODEL_SHAPES[shape]
    return {"qkv": (m, h, 3 * h), "proj": (m, h, h), "fc1": (m, h, ffn), "fc2": (m, ffn, h)}


def _pass(kind: str, m: int, k: int, n: int, recipe: str):
    """A forward+backward closure over static tensors of one linear, and what it needs."""
    from megagpt.fast_spec import fp8, layer  # noqa: F401 (layer registers the bf16 op)

    dev = "cuda"
    x = (torch.randn(m, k, device=dev) * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
    g = (torch.randn(m, n, device=dev) * 1e-3).to(torch.bfloat16)
    # the fast path keeps bf16 gradients (--grad-reduce-in-bf16), which the bf16 op writes
    main_grad = torch.zeros(n, k, device=dev, dtype=torch.bfloat16)
    if kind == "bf16":
        def run():
            y = layer._linear(x, w, None, main_grad)
            torch.autograd.grad(y, (x, w), g)
        return run
    r = fp8.Fp8Recipe(scaling=recipe)
    history = fp8.new_history(r, dev) if r.delayed else None
    if history is not None:  # a warm history: an amax above every operand's, no overflow
        history.fill_(4.0)

    def run():
        step = fp8.start_step(r, history, warm=history is not None)
        y = fp8.fp8_linear(x, w, None, main_grad, step, fp8.FC1)
        torch.autograd.grad(y, (x, w), g)
    return run


def time_pair(m: int, k: int, n: int, recipe: str, reps: int) -> dict:
    # about 5 ms of GEMMs per graph at 600 TFLOP/s: small GEMMs many times, large ones once
    reps = reps or max(1, min(20, int(3e12 / (6 * m * k * n))))
    graphs = {kind: capture(_pass(kind, m, k, n, recipe), reps) for kind in ("bf16", "fp8")}
    rounds = {kind: [] for kind in graphs}
    for _ in range(5):
        for kind, graph in graphs.items():
            graph.replay()  # warm
            rounds[kind].append(replay_us(graph, reps))
    us = {kind: statistics.median(v) for kind, v in rounds.items()}
    del graphs
    torch.cuda.empty_cache()
    return dict(m=m, k=k, n=n, bf16_us=us["bf16"], fp8_us=us["fp8"],
                gain=us["bf16"] / us["fp8"])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="4096,8192,16384")
    p.add_argument("--widths", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--shapes", default="", help="model shapes (345M,1.3B,wide) instead")
    p.add_argument("--recipe", choices=("delayed", "tensorwise"), default="delayed")
    p.add_argument("--reps", type=int, default=0,
                   help="passes per graph (default: about 5 ms of bf16 GEMMs, 1 to 20)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_fp8_gemm.py needs a CUDA GPU with FP8 tensor cores")
        return {}
    rows = []
    if a.shapes:
        for shape in a.shapes.split(","):
            for name, (m, k, n) in linears_of(shape).items():
                rows.append(dict(shape=shape, linear=name, **time_pair(m, k, n, a.recipe, a.reps)))
                print("fp8 gemm {shape} {linear}: M {m} K {k} N {n}: bf16 {bf16_us:.1f} us, "
                      "fp8 {fp8_us:.1f} us, {gain:.3f}x".format(**rows[-1]), flush=True)
    else:
        tokens = [int(t) for t in a.tokens.split(",")]
        widths = [int(w) for w in a.widths.split(",")]
        for m, k, n in itertools.product(tokens, widths, widths):
            rows.append(time_pair(m, k, n, a.recipe, a.reps))
            print("fp8 gemm M {m} K {k} N {n}: bf16 {bf16_us:.1f} us, fp8 {fp8_us:.1f} us, "
                  "{gain:.3f}x".format(**rows[-1]), flush=True)
    result = dict(info=run_info(), recipe=a.recipe, rows=rows)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

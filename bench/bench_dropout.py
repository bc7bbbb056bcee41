#!/usr/bin/env python3
"""What a residual dropout costs, and what cheaper random numbers would save (one GPU).

The residual branch of a layer, ``x + dropout(a + b)`` at p = 0.1 (megatron's default
``--hidden-dropout``), forward and backward in bf16 at the 345M and 1.3B shapes of
``[seq, batch, hidden]``, in these forms:

  eager F.dropout / eager no dropout        torch's own kernels
  compiled F.dropout (inductor rand)        what the fused layer compiles: inductor draws a
                                            Philox number per element inside the kernel
  compiled F.dropout fallback_random        inductor taking its random numbers from aten
  compiled no dropout                       the floor
  compiled, mask16 triton                   the mask drawn first by a Triton kernel that takes
                                            eight 16-bit uniforms from each Philox call (one
                                            byte per element), then applied by the compiled
                                            kernel: the cheapest random numbers on offer
  compiled, mask torch.rand / bernoulli_    the mask from torch's own generators

Each form's steps are captured as one CUDA graph (the GPU's time, not the host's); it prints
µs per forward + backward and the share of elements kept (from the input's gradient), and
the mask kernels' own times.

  python bench/bench_dropout.py [--shapes 345M,1.3B] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from cuda_graph_timing import capture, replay_us

SHAPES = {"345M": (1024, 8, 1024), "1.3B": (2048, 4, 2048)}
P = 0.1


def _mask16_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def mask16(key_ptr, out_ptr, n, drop_below, CALLS: tl.constexpr):
        key = tl.load(key_ptr)
        counters = tl.program_id(0) * CALLS + tl.arange(0, CALLS)
        r0, r1, r2, r3 = tl.randint4x(key, counters)
        words = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [CALLS * 4])
        words = words.to(tl.uint32, bitcast=True)
        uniforms = tl.reshape(tl.join(words & 0xFFFF, words >> 16), [CALLS * 8])
        idx = tl.program_id(0) * CALLS * 8 + tl.arange(0, CALLS * 8)
        tl.store(out_ptr + idx, (uniforms >= drop_below).to(tl.int8), mask=idx < n)

    def draw(shape, p):
        n = 1
        for d in shape:
            n *= d
        # the key from torch's CUDA generator: seeded, and new at every graph replay
        key = torch.randint(0, 1 << 62, (1,), device="cuda", dtype=torch.int64)
        out = torch.empty(shape, device="cuda", dtype=torch.bool)
        mask16[(triton.cdiv(n, 256 * 8),)](key, out.view(torch.int8), n,
                                          int(round(p * 65536)), CALLS=256)
        return out

    return draw


def residual(x, a, b):
    return x + F.dropout(a + b, P, True)


def residual_no_dropout(x, a, b):
    return x + (a + b)


def residual_with_mask(x, a, b, keep):
    return x + (a + b) * keep * (1.0 / (1.0 - P))


def time_form(shape, fn, make_mask=None, reps: int = 20, rounds: int = 5) -> dict:
    x, a = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    b = torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)

    def step():
        for t in (x, a, b):
            t.grad = None
        out = fn(x, a, b) if make_mask is None else fn(x, a, b, make_mask())
        out.backward(g)

    graph = capture(step, reps)
    times = [replay_us(graph, reps) for _ in range(rounds)]
    return {"us_fwd_bwd": statistics.median(times),
            "kept": (a.grad != 0).float().mean().item()}


def time_alone(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    return replay_us(graph, reps)


def forms(shape) -> dict:
    mask16 = _mask16_kernel()
    out = {}

    def run(name, fn, make_mask=None):
        out[name] = time_form(shape, fn, make_mask)
        print(f"  {name:38s} {out[name]['us_fwd_bwd']:8.1f} µs fwd+bwd   kept "
              f"{out[name]['kept']:.4f}", flush=True)

    run("eager F.dropout", residual)
    run("eager no dropout", residual_no_dropout)
    run("compiled F.dropout (inductor rand)", torch.compile(residual, fullgraph=True))
    with torch._inductor.config.patch(fallback_random=True):
        torch._dynamo.reset()
        run("compiled F.dropout fallback_random", torch.compile(residual, fullgraph=True))
    torch._dynamo.reset()
    run("compiled no dropout", torch.compile(residual_no_dropout, fullgraph=True))
    with_mask = torch.compile(residual_with_mask, fullgraph=True)
    run("compiled, mask16 triton", with_mask, lambda: mask16(shape, P))
    run("compiled, mask torch.rand", with_mask,
        lambda: torch.rand(*shape, device="cuda", dtype=torch.bfloat16) >= P)
    run("compiled, mask bernoulli_", with_mask,
        lambda: torch.empty(*shape, device="cuda", dtype=torch.bool).bernoulli_(1 - P))
    for name, fn in (("mask16 kernel, one mask", lambda: mask16(shape, P)),
                     ("mask16 kernel, two masks", lambda: mask16((2, *shape), P)),
                     ("torch.rand bf16, one mask", lambda: torch.rand(
                         *shape, device="cuda", dtype=torch.bfloat16))):
        out[name] = {"us": time_alone(fn)}
        print(f"  {name:38s} {out[name]['us']:8.1f} µs", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="345M,1.3B")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_dropout.py needs a CUDA GPU", flush=True)
        return 2
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    results = {}
    for shape in a.shapes.split(","):
        print(f"{shape}: [seq, batch, hidden] = {list(SHAPES[shape])}, p = {P}", flush=True)
        results[shape] = forms(SHAPES[shape])
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

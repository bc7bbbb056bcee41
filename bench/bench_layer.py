#!/usr/bin/env python3
"""The fast spec's compiled layer, forward + backward, under inductor settings (one GPU).

Times ``megagpt.fast_spec.layer.fused_layer_forward`` (torch.compile'd, bf16, weight
gradients written into ``main_grad`` views as in a training step, no dropout unless a setting
says so) at the 345M and 1.3B shapes, once per inductor setting:

  default              what the fast path compiles with
  no mix-order         the layer norms' weight/bias gradient sums as reductions of their own
                       (by default inductor's mix-order reduction sums them over 16-row
                       slices inside the norm-backward kernel, then the slices' partial sums
                       with an eager ``sum(dim=0)``)
  mix-order N          --split-sizes: slices of N rows instead (inductor picks 16 from the
                       token and SM counts at both shapes on an H200)
  tiled reductions     2-D tiled reductions (the bias gradients' column sums)
  aggressive fusion    fuse kernels without common reads
  no split reductions  each reduction in one kernel rather than partial sums + a second pass
  multi-kernel         persistent and looped variants of each reduction, picked by timing
  dropout, attention dropout, hidden dropout
                       megatron's dropout 0.1 in attention and after the projection and fc2,
                       and each alone (not run unless named)
  hidden dropout eager random
                       the residual dropouts with aten's random numbers (fallback_random)
  hidden dropout hashed
                       the residual dropouts with masks hashed from each element's index and
                       a seed drawn per step, as the fast path's compiled layer runs them
                       (megagpt.fast_spec.hash_dropout; the other dropout settings: F.dropout)
  fp8 tensorwise, fp8 delayed
                       the four linears in FP8 (megagpt.fast_spec.fp8, hybrid format), with
                       current or delayed scaling (not run unless named)

  python bench/bench_layer.py [--shapes 345M,1.3B,wide] [--settings default,...] [--split-sizes N,...]
                              [--out F.json]

Each setting's forward + backward is captured as one CUDA graph; the graphs take turns,
7 rounds of 10 replays each. It prints ms per layer (CUDA events, the median round; x24 for
the step's 24 layers) and, from the profiler, the kernels' own time: in all, and in the layer
norms' backward and the sums (what the mix-order setting changes). Per-kernel times go to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# hidden, heads, seq, micro-batch: bench/benchmarks.md's shapes
SHAPES = {"345M": (1024, 16, 1024, 8), "1.3B": (2048, 16, 2048, 4),
          # a 6.7B-wide layer (FP8's case: matmuls dominate)
          "wide": (4096, 32, 4096, 1),
          "tiny": (128, 4, 128, 2)}  # tiny: for the GPU test of this script


def _layer_inputs(hidden: int, heads: int, seq: int, batch: int, dev: str = "cuda"):
    dt = torch.bfloat16

    def param(*shape, scale=0.02):
        return (torch.randn(*shape, device=dev, dtype=dt) * scale).requires_grad_()

    weights = dict(
        ln1_w=param(hidden, scale=1.0), ln1_b=param(hidden), qkv_w=param(3 * hidden, hidden),
        qkv_b=param(3 * hidden), proj_w=param(hidden, hidden), proj_b=param(hidden),
        ln2_w=param(hidden, scale=1.0), ln2_b=param(hidden), fc1_w=param(4 * hidden, hidden),
        fc1_b=param(4 * hidden), fc2_w=param(hidden, 4 * hidden), fc2_b=param(hidden))
    main_grads = {f"{n}_main_grad": torch.zeros_like(weights[f"{n}_w"])
                  for n in ("qkv", "proj", "fc1", "fc2")}
    x = torch.randn(seq, batch, hidden, device=dev, dtype=dt, requires_grad=True)
    static = dict(rope=None, eps=1e-5, rms=False, groups=heads, q_per_group=1,
                  head_dim=hidden // heads, scale=(hidden // heads) ** -0.5, attn_p=0.0,
                  hidden_p=0.0, act="gelu_tanh", rotary_interleaved=False, rope_mscale=1.0,
                  training=True)
    return x, weights, main_grads, static


def capture_layer(shape: str, inductor_options: dict) -> torch.cuda.CUDAGraph:
    """One compiled layer's forward + backward under ``inductor_options``, captured as a
    CUDA graph (as the fast path runs its step: the GPU's time, not the host's launch rate;
    at 345M launching the layer's kernels eagerly takes longer than running them)."""
    from megagpt.fast_spec import hash_dropout
    from megagpt.fast_spec.layer import fused_layer_forward

    torch._dynamo.reset()
    options = dict(inductor_options)
    dropout = {"attn_p": options.pop("_attn_p", 0.0), "hidden_p": options.pop("_hidden_p", 0.0)}
    hashed = options.pop("_hashed", False)
    fp8_recipe = options.pop("_fp8", None)
    # as the fast path compiles it (megagpt.fast_spec.layer.layer_function)
    fn = torch.compile(fused_layer_forward, dynamic=False, fullgraph=True, options=options)
    x, weights, main_grads, static = _layer_inputs(*SHAPES[shape])
    static.update(dropout)
    grad_out = torch.randn_like(x)
    fp8 = _fp8_arguments(fp8_recipe, x.device)

    def step():
        for t in (x, *weights.values()):  # gradients assigned, not accumulated
            t.grad = None
        seeds = hash_dropout.draw_seeds(2, x.device) if hashed else None
        out = fn(x, **weights, **static, **main_grads, dropout_seeds=seeds, **fp8)
        out.backward(grad_out)
        if "fp8_history" in fp8:
            fp8["fp8_warm"] = True  # as FastTransformerLayer marks it after a forward

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # forward and backward compile in the first steps
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _fp8_arguments(recipe: str | None, device) -> dict:
    """The fused function's FP8 arguments for ``recipe`` ("tensorwise", "delayed",
    "delayed-grads": delayed gradients too; None: none, bf16), as ``FastTransformerLayer``
    passes them."""
    if recipe is None:
        return {}
    from megagpt.fast_spec import fp8

    scaling, _, grads = recipe.partition("-")
    r = fp8.Fp8Recipe(format="hybrid", scaling=scaling,
                      grad_scaling="delayed" if grads else "current")
    if not r.delayed:
        return {"fp8": r}
    return {"fp8": r, "fp8_history": fp8.new_history(r, device), "fp8_warm": False}


def time_graphs(graphs: dict, reps: int = 10, rounds: int = 7) -> dict:
    """Median ms per replay of each graph, the graphs taking turns round by round (the GPU
    slows as it warms: timing one setting after another would favour the first)."""
    times = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / reps)
    return {name: statistics.median(ts) for name, ts in times.items()}


def kernel_times(graph: torch.cuda.CUDAGraph, reps: int = 5) -> dict:
    """GPU time per replay of each kernel in ``graph`` (ms, by kernel name), from the profiler:
    the kernels' own durations, which a clock change moves far less than a wall-clock
    difference of a few percent between settings."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    out = {}
    for event in prof.key_averages():
        ms = getattr(event, "device_time_total", None)
        if ms is None:
            ms = event.cuda_time_total
        if ms:
            out[event.key] = out.get(event.key, 0.0) + ms / 1000.0 / reps
    return out


def summarise_kernels(per_kernel: dict) -> dict:
    """Total kernel time, the part in the layer norms' backward and in reductions, and the
    time by kind of kernel (``kernel_kind``)."""
    total = sum(per_kernel.values())
    norm = sum(ms for name, ms in per_kernel.items()
               if "layer_norm" in name or "reduce_kernel" in name or "sum" in name)
    kinds: dict = {}
    for name, ms in per_kernel.items():
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + ms
    return {"kernels_ms": total, "norm_and_sum_kernels_ms": norm, "by_kind_ms": kinds}


def kernel_kind(name: str) -> str:
    """GEMM, attention, the FP8 cast kernel, inductor's fused kernels (norms, activations,
    amax reductions), or other, from a CUDA kernel's name."""
    low = name.lower()
    if "cast_transpose" in low:  # megagpt.fast_spec.fp8_cast's kernel
        return "fp8 cast"
    if any(k in low for k in ("flash", "fmha", "cudnn", "attention", "sdpa")):
        return "attention"
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul")):
        return "gemm"
    if low.startswith("triton") or "triton" in low:
        return "fused (inductor)"
    return "other"


# named inductor settings (torch.compile options) to compare with the default
SETTINGS = {
    "default": {},
    "no mix-order": {"triton.mix_order_reduction": False},
    "tiled reductions": {"triton.tile_reductions": True, "triton.prefer_nd_tiling": True},
    "aggressive fusion": {"aggressive_fusion": True},
    "no split reductions": {"split_reductions": False},
    "multi-kernel": {"triton.multi_kernel": 1},
    # megatron's default dropout 0.1, in attention and after the projection and fc2; and each
    # alone (what each costs); "eager random": inductor takes its random numbers from aten's
    # kernels instead of drawing them inside its own (fallback_random)
    "dropout": {"_attn_p": 0.1, "_hidden_p": 0.1},
    "attention dropout": {"_attn_p": 0.1},
    "hidden dropout": {"_hidden_p": 0.1},
    "hidden dropout eager random": {"_hidden_p": 0.1, "fallback_random": True},
    "hidden dropout hashed": {"_hidden_p": 0.1, "_hashed": True},
    # the four linears in FP8 (megagpt.fast_spec.fp8), hybrid format
    "fp8 tensorwise": {"_fp8": "tensorwise"},
    "fp8 delayed": {"_fp8": "delayed"},
    # delayed scaling with the gradients scaled by the backward before's amax (TE's): no
    # reduction over the gradient before its cast
    "fp8 delayed gradients": {"_fp8": "delayed-grads"},
}
DEFAULT_SETTINGS = [name for name in SETTINGS if "dropout" not in name and "fp8" not in name]


def settings(names, split_sizes) -> dict:
    out = {name: SETTINGS[name] for name in names}
    for n in split_sizes:
        out[f"mix-order {n}"] = {"triton.mix_order_reduction_split_size": n}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="345M,1.3B")
    p.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                   help=f"which of {', '.join(SETTINGS)} (comma-separated)")
    p.add_argument("--split-sizes", default="",
                   help="mix-order reduction split sizes to try as well, e.g. 16,32,64,128")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    print("torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
    split_sizes = [int(n) for n in a.split_sizes.split(",") if n]
    results = {}
    for shape in a.shapes.split(","):
        graphs = {}
        for name, options in settings([n for n in a.settings.split(",") if n],
                                      split_sizes).items():
            try:
                graphs[name] = capture_layer(shape, options)
            except Exception as exc:  # a setting inductor or the capture refuses
                print(f"layer {shape} {name}: not run: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:160] if str(exc) else ''}", flush=True)
        wall = time_graphs(graphs)
        results[shape] = {}
        for name, graph in graphs.items():
            per_kernel = kernel_times(graph)
            row = {"wall_ms": wall[name], **summarise_kernels(per_kernel),
                   "kernels": per_kernel}
            results[shape][name] = row
            kinds = ", ".join(f"{kind} {ms:.3f}" for kind, ms in
                              sorted(row["by_kind_ms"].items(), key=lambda kv: -kv[1]))
            print(f"layer {shape} {name:>14}: {row['wall_ms']:.3f} ms fwd+bwd "
                  f"(x24 = {24 * row['wall_ms']:.2f}); kernels {row['kernels_ms']:.3f} ms "
                  f"({kinds}), of which norm backward + sums "
                  f"{row['norm_and_sum_kernels_ms']:.3f} ms", flush=True)
        del graphs
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The kernel choices behind the fast path, timed on one GPU.

1. Core attention: forward+backward of ``scaled_dot_product_attention`` (causal, bf16) for
   each backend torch offers — flash, cuDNN, memory-efficient — with and without dropout,
   at the 345M and 1.3B shapes. Which one torch picks by default is what the fast path gets.
   Beside them torch's FlexAttention (a Triton flash attention, compiled; no dropout): how
   near a Triton kernel comes to cuDNN at these shapes.
2. Weight-gradient GEMM: ``grad_out^T @ input`` in bf16 then added into an fp32 gradient
   (what megatron's DDP hook does without TE/apex), against one GEMM that accumulates into
   the fp32 tensor directly (``torch.addmm(..., out_dtype=torch.float32)``, written into the
   accumulator or into a new tensor) — timed, and checked for accumulating: two calls onto
   a non-zero accumulator must give three times one product. And the bf16 form of
   gradient-accumulation fusion: ``main_grad.addmm_(g.T, x)`` into a bf16 buffer (one GEMM,
   beta=1) against GEMM + add, with a check that onto zeros it equals the plain GEMM.
3. The floor of attention dropout (``dropout-floor``): the random numbers alone that an
   attention dropout of p = 0.1 needs in one training step — one decision per causal score,
   b·h·s(s+1)/2 per layer, drawn in the forward and again in the backward, 24 layers —
   drawn the cheapest way a Philox kernel can (16 one-byte decisions from each 4×32-bit call,
   as FlashAttention-2 does), with 10 rounds (the standard) and 7, and counted rather than
   stored. An attention kernel that draws them pays at least this much integer work unless
   it hides it behind its matrix products.

``--import-first transformer_engine.pytorch`` imports modules before anything runs: whether
a library's import (its own CUDA libraries, loaded globally) changes the kernels torch picks;
``--import-first megagpt,transformer_engine.pytorch``: as the entry imports them.

  python bench/bench_kernels.py [--parts attention,wgrad,dropout-floor] [--out F.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def cuda_time(fn, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


ATTENTION_SHAPES = {"345M": (8, 16, 1024, 64), "1.3B": (4, 16, 2048, 128)}
BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}


def attention(layers: int = 24, flex: bool = True) -> dict:
    results = {}
    for shape, (b, h, s, d) in ATTENTION_SHAPES.items():
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)
        for p in (0.0, 0.1):
            for name, backend in BACKENDS.items():
                def step():
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
                    o.backward(grad)
                try:
                    if backend is None:
                        ms = cuda_time(step)
                    else:
                        with sdpa_kernel([backend]):
                            ms = cuda_time(step)
                    val = round(ms * layers, 2)
                except RuntimeError as exc:
                    val = f"unsupported: {str(exc).splitlines()[0][:80]}"
                results[f"{shape} dropout={p} {name}"] = val
                print(f"attention {shape} dropout={p} {name:9s} fwd+bwd x{layers} layers:"
                      f" {val} ms", flush=True)
        if not flex:
            continue
        val = round(flex_attention_ms(q, k, v, grad) * layers, 2)
        results[f"{shape} dropout=0.0 flex"] = val
        print(f"attention {shape} dropout=0.0 flex      fwd+bwd x{layers} layers: {val} ms",
              flush=True)
    return results


def loaded_cudnn_libraries() -> list[str]:
    """The cuDNN shared libraries this process has mapped (Linux): two copies of one library
    (torch's and another's) show up as two paths."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps
                           if "libcudnn" in line and line.split()[-1].startswith("/")})
    except OSError:
        return []


def flex_attention_ms(q, k, v, grad) -> float:
    """Forward + backward of torch's FlexAttention, causal, compiled (it has no dropout)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    s = q.shape[2]
    block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, s, s,
                                   device="cuda")
    flex = torch.compile(flex_attention, fullgraph=True)

    def step():
        flex(q, k, v, block_mask=block_mask).backward(grad)

    return cuda_time(step)


def _keep_count_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def keep_count(key, out_ptr, drop_below, N_ROUNDS: tl.constexpr, CALLS: tl.constexpr):
        counters = tl.program_id(0) * CALLS + tl.arange(0, CALLS)
        r0, r1, r2, r3 = tl.randint4x(key, counters, N_ROUNDS)
        words = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [CALLS * 4])
        words = words.to(tl.uint32, bitcast=True)
        kept = ((words & 0xFF) >= drop_below).to(tl.int32)
        kept += (((words >> 8) & 0xFF) >= drop_below).to(tl.int32)
        kept += (((words >> 16) & 0xFF) >= drop_below).to(tl.int32)
        kept += ((words >> 24) >= drop_below).to(tl.int32)
        tl.store(out_ptr + tl.program_id(0), tl.sum(kept))

    def draw(decisions: int, p: float, rounds: int, calls: int = 1024):
        programs = triton.cdiv(triton.cdiv(decisions, 16), calls)
        out = torch.empty(programs, device="cuda" if torch.cuda.is_available() else "cpu",
                          dtype=torch.int32)
        keep_count[(programs,)](12345, out, int(round(p * 256)), N_ROUNDS=rounds, CALLS=calls)
        return out

    return draw


def attention_dropout_decisions(b: int, h: int, s: int, layers: int = 24) -> int:
    """Keep-or-drop decisions per training step: the causal scores of every layer, drawn in
    the forward and again in the backward (which regenerates the mask rather than store it)."""
    return b * h * s * (s + 1) // 2 * 2 * layers


def dropout_floor(p: float = 0.1) -> dict:
    draw = _keep_count_kernel()
    results = {}
    for shape, (b, h, s, _d) in ATTENTION_SHAPES.items():
        decisions = attention_dropout_decisions(b, h, s)
        for rounds in (10, 7):
            ms = cuda_time(lambda: draw(decisions, p, rounds), reps=10)
            counts = draw(decisions, p, rounds)
            kept = counts.double().sum().item() / (counts.numel() * 1024 * 16)
            results[f"{shape} philox-{rounds} ms"] = round(ms, 3)
            results[f"{shape} philox-{rounds} kept"] = round(kept, 5)
            print(f"dropout floor {shape}: {decisions / 1e9:.2f} G decisions per step,"
                  f" Philox-{rounds}, 16 per call: {ms:.3f} ms, kept {kept:.5f}", flush=True)
    return results


def wgrad(tokens: int = 8192, shapes=((1024, 3072), (1024, 4096), (4096, 1024),
                                      (1024, 50304))) -> dict:
    results = {}
    for fan_in, fan_out in shapes:
        x = torch.randn(tokens, fan_in, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(tokens, fan_out, device="cuda", dtype=torch.bfloat16)
        main_grad = torch.zeros(fan_out, fan_in, device="cuda", dtype=torch.float32)
        once = g.t().float() @ x.float()

        def separate(acc):
            acc.add_(g.t() @ x)
            return acc

        def aliased(acc):  # one GEMM writing fp32 into the accumulator itself
            return torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc)

        def out_of_place(acc):  # one GEMM, fp32 result in a new tensor
            return torch.addmm(acc, g.t(), x, out_dtype=torch.float32)

        row = {}
        for name, fn in (("bf16 GEMM + fp32 add", separate), ("addmm out_dtype, out=acc", aliased),
                         ("addmm out_dtype, new tensor", out_of_place)):
            try:
                row[name + " ms"] = round(cuda_time(lambda fn=fn: fn(main_grad)), 4)
                # correctness of *accumulation*: two calls onto a non-zero accumulator
                acc = once.clone()
                acc = fn(fn(acc))
                row[name + " rel err"] = float((acc - 3 * once).norm() / (3 * once).norm())
            except (RuntimeError, TypeError) as exc:
                row[name] = f"unsupported: {str(exc).splitlines()[0][:80]}"
        # gradient-accumulation fusion into a bf16 buffer (megatron's bf16 main_grad): the
        # GEMM accumulates in place with beta=1, against GEMM + add
        acc16 = torch.zeros(fan_out, fan_in, device="cuda", dtype=torch.bfloat16)
        once16 = (g.t() @ x)
        for name, fn in (("bf16 GEMM + bf16 add", lambda a: a.add_(g.t() @ x)),
                         ("bf16 addmm_ in place", lambda a: a.addmm_(g.t(), x))):
            row[name + " ms"] = round(cuda_time(lambda fn=fn: fn(acc16)), 4)
            a = torch.zeros_like(acc16)
            fn(a)
            row[name + " equals one GEMM"] = bool(torch.equal(a, once16))
        results[f"{fan_out}x{fan_in}"] = row
        print(f"wgrad {fan_out}x{fan_in} over {tokens} tokens: {row}", flush=True)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="attention,wgrad",
                   help="which of attention, wgrad, dropout-floor (comma-separated)")
    p.add_argument("--out", default="")
    p.add_argument("--no-flex", action="store_true",
                   help="leave FlexAttention (a compile of some 30 s) out of the attention part")
    p.add_argument("--import-first", default="", metavar="MODULES",
                   help="import these (comma-separated) before timing, e.g. "
                        "transformer_engine.pytorch, or megagpt,transformer_engine.pytorch "
                        "as the entry imports them")
    a = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # megagpt, as the entry has it
    for module in filter(None, a.import_first.split(",")):
        importlib.import_module(module)
    parts = [n for n in a.parts.split(",") if n]
    unknown = sorted(set(parts) - {"attention", "wgrad", "dropout-floor"})
    if unknown:
        p.error(f"--parts: unknown {', '.join(unknown)} (attention, wgrad, dropout-floor)")
    print(torch.__version__, torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version(),
          "imported first:", a.import_first or "-")
    res = {}
    if "attention" in parts:
        res["attention_ms_per_24_layers"] = attention(flex=not a.no_flex)
    if "wgrad" in parts:
        res["wgrad_ms"] = wgrad()
    if "dropout-floor" in parts:
        res["attention_dropout_floor"] = dropout_floor()
    res["cudnn_libraries_loaded"] = loaded_cudnn_libraries()
    print("cuDNN libraries loaded:", *res["cudnn_libraries_loaded"], sep="\n  ")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

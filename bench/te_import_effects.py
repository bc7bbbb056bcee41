#!/usr/bin/env python3
"""What importing Transformer Engine changes in a process, and whether torch's own kernels
run slower afterwards.

Imports ``megagpt`` and torch as the entry does, starts CUDA, takes a snapshot (environment,
torch's backend flags, dynamo and inductor settings, the shared libraries the process maps),
imports ``transformer_engine.pytorch`` when it is importable, takes a second snapshot and
prints what differs and the folders cuDNN is mapped from. Then it times, on the GPU, the
kernels the fast path spends its step in: the attention backend torch picks and its time,
bf16 GEMMs of the 345M and 1.3B layers (forward and both backward shapes), torch's fused
AdamW over fp32 state, and a bandwidth-bound elementwise pass.

Run it twice in one call, with TE importable and with TE hidden (PYTHONPATH without TE's
folder); the timing lines of the two runs compare directly:

  PYTHONPATH=$MCORE:$TE python bench/te_import_effects.py --out with.json
  PYTHONPATH=$MCORE python bench/te_import_effects.py --out without.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import megagpt  # noqa: E402,F401  first, as every entry imports it
import torch  # noqa: E402
from megagpt import te_cudnn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import ATTENTION_SHAPES, cuda_time  # noqa: E402

LIBRARY_WORDS = ("cublas", "cudnn", "cudart", "nvrtc", "nvjitlink", "nccl", "cufft", "curand",
                 "cusparse", "cusolver", "transformer_engine", "triton", "libtorch_cuda")


def mapped_libraries() -> list[str]:
    """The CUDA-side shared libraries this process maps (paths, sorted)."""
    found = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if ".so" in path and any(w in path.lower() for w in LIBRARY_WORDS):
                    found.add(path)
    except OSError:
        pass
    return sorted(found)


def _config_dict(module) -> dict:
    try:
        return {k: repr(v) for k, v in module.config.get_config_copy().items()}
    except Exception:  # noqa: BLE001  a torch without that config module
        return {}


def snapshot() -> dict:
    import torch._dynamo  # noqa: F401
    import torch._inductor.config  # noqa: F401

    b = torch.backends
    flags = {
        "matmul.allow_tf32": b.cuda.matmul.allow_tf32,
        "matmul.allow_bf16_reduced_precision_reduction":
            b.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "matmul.allow_fp16_reduced_precision_reduction":
            b.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "preferred_blas_library": str(b.cuda.preferred_blas_library()),
        "cudnn.enabled": b.cudnn.enabled, "cudnn.benchmark": b.cudnn.benchmark,
        "cudnn.deterministic": b.cudnn.deterministic, "cudnn.allow_tf32": b.cudnn.allow_tf32,
        "cudnn.version": b.cudnn.version(),
        "flash_sdp": b.cuda.flash_sdp_enabled(), "cudnn_sdp": b.cuda.cudnn_sdp_enabled(),
        "mem_efficient_sdp": b.cuda.mem_efficient_sdp_enabled(),
        "math_sdp": b.cuda.math_sdp_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": str(torch.get_default_dtype()),
        "grad_enabled": torch.is_grad_enabled(),
        "num_threads": torch.get_num_threads(),
        "cuda.allocator_settings": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }
    return {
        "environ": dict(os.environ),
        "torch": flags,
        "dynamo": _config_dict(torch._dynamo),
        "inductor": _config_dict(torch._inductor),
        "libraries": mapped_libraries(),
        "modules": sorted(m for m in sys.modules if not m.startswith("transformer_engine")),
    }


def diff(before: dict, after: dict) -> dict:
    out = {}
    for key in ("environ", "torch", "dynamo", "inductor"):
        b, a = before[key], after[key]
        changed = {k: [b.get(k), a.get(k)] for k in sorted(set(b) | set(a)) if b.get(k) != a.get(k)}
        if changed:
            out[key] = changed
    out["libraries_added"] = [p for p in after["libraries"] if p not in before["libraries"]]
    added = [m for m in after["modules"] if m not in set(before["modules"])]
    out["modules_added"] = [m for m in added if "." not in m]
    return out


def gemm_timings() -> dict:
    """bf16 GEMMs of one layer's forward and backward, tokens = micro-batch x sequence."""
    results = {}
    shapes = {"345M": (8 * 1024, 1024), "1.3B": (4 * 2048, 2048)}
    for name, (tokens, hidden) in shapes.items():
        for label, n_out in (("qkv", 3 * hidden), ("proj", hidden), ("fc1", 4 * hidden),
                             ("fc2", hidden)):
            k_in = 4 * hidden if label == "fc2" else hidden
            x = torch.randn(tokens, k_in, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n_out, k_in, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16)
            fwd = cuda_time(lambda: x @ w.t(), 50)
            dgrad = cuda_time(lambda: dy @ w, 50)
            wgrad = cuda_time(lambda: dy.t() @ x, 50)
            results[f"{name} {label} fwd/dgrad/wgrad ms"] = [round(fwd, 4), round(dgrad, 4),
                                                             round(wgrad, 4)]
    return results


def attention_timings() -> dict:
    """The backend torch's SDPA picks for the 345M layer's attention (bf16, causal, micro-batch
    8, 16 heads of 64, sequence 1024), and its forward+backward time."""
    import torch.nn.functional as F

    q, k, v = (torch.randn(*ATTENTION_SHAPES["345M"], device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    choice = int(torch._fused_sdp_choice(q, k, v, is_causal=True))
    try:
        from torch.nn.attention import SDPBackend

        name = SDPBackend(choice).name
    except (ImportError, ValueError):
        name = str(choice)
    grad = torch.randn_like(q)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    return {"345M SDPA backend": name, "345M SDPA fwd+bwd ms": round(cuda_time(step, 20), 4)}


def optimizer_timings(numel: int = 100_000_000) -> dict:
    """torch's fused AdamW step over one fp32 tensor, and a read-modify-write pass."""
    p = torch.zeros(numel, device="cuda", requires_grad=True)
    p.grad = torch.randn(numel, device="cuda")
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    step_ms = cuda_time(opt.step, 20)
    y = torch.empty_like(p)
    add_ms = cuda_time(lambda: torch.add(p.detach(), p.grad, out=y), 20)
    return {"fused AdamW step, 100M fp32 ms": round(step_ms, 3),
            "fp32 add, 100M (1.2 GB moved) ms": round(add_ms, 3),
            "add bandwidth GB/s": round(1.2e9 / (add_ms * 1e-3) / 1e9, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the report as JSON here too")
    parser.add_argument("--no-timing", action="store_true")
    args = parser.parse_args()

    if torch.cuda.is_available():  # CUDA and its libraries started, as before a model is built
        torch.zeros(1, device="cuda")
    before = snapshot()
    te = importlib.util.find_spec("transformer_engine") is not None
    if te:
        import transformer_engine.pytorch  # noqa: F401
    after = snapshot()
    report = {"transformer_engine": te, "changed_by_importing_te": diff(before, after),
              "cudnn_folders": te_cudnn.mapped_cudnn_folders(),
              "libraries": after["libraries"], "torch_flags": after["torch"]}
    if not args.no_timing and torch.cuda.is_available():
        report["timings"] = {**attention_timings(), **gemm_timings(), **optimizer_timings()}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

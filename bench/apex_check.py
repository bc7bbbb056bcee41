#!/usr/bin/env python3
"""Check the apex megatron takes: every part imports, and on a GPU each kernel, used as megatron
uses it, agrees with torch's own computation.

    PYTHONPATH=/tmp/apex-site python bench/apex_check.py [--json OUT.json]

One line per part (``megagpt.launch.apex_kernels.PARTS``): "ok" with the largest relative
difference from torch, or why it failed. Without CUDA only the imports are checked. Exit 1
when a part is missing or disagrees.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megagpt.launch import apex_kernels  # noqa: E402

# bf16 kernels against torch's: both round to bf16 (8 bits of mantissa), in other orders
BF16_TOLERANCE = 2e-2
FP32_TOLERANCE = 1e-4


def rel(a, b) -> float:
    """Largest difference of ``a`` from ``b``, relative to ``b``'s largest magnitude."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def check_wgrad(torch):
    import fused_weight_gradient_mlp_cuda as k

    # megatron's LinearWithGradAccumulationAndAsyncCommunication.backward: the 2-D input and
    # output gradient, the weight's main_grad accumulated in place (fp32, or bf16 with a
    # bf16 gradient buffer)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    worst = 0.0
    for dtype, accumulate in ((torch.float32, k.wgrad_gemm_accum_fp32),
                              (torch.bfloat16, k.wgrad_gemm_accum_fp16)):
        start = torch.randn(384, 256, device="cuda", dtype=dtype)
        main_grad = start.clone()
        accumulate(x, dy, main_grad)
        want = start.float() + dy.float().t() @ x.float()
        worst = max(worst, rel(main_grad, want))
    return worst, BF16_TOLERANCE


def check_optimizer(torch):
    from apex.optimizers import FusedAdam

    # megatron's Adam with decoupled weight decay (adam_w_mode) against torch's AdamW
    params = [torch.randn(1000, device="cuda", requires_grad=True) for _ in range(3)]
    theirs = [p.detach().clone().requires_grad_() for p in params]
    grads = [torch.randn_like(p) for p in params]
    ours = FusedAdam(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                     adam_w_mode=True)
    ref = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        for p, q, g in zip(params, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    return max(rel(p, q) for p, q in zip(params, theirs)), FP32_TOLERANCE


def check_multi_tensor(torch):
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier

    # megatron's clip_grads: the 2-norm over all gradients, then a scale of each
    grads = [torch.randn(n, device="cuda") for n in (1000, 4097, 33)]
    flag = torch.zeros(1, dtype=torch.int, device="cuda")
    norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [grads], False)
    want = torch.linalg.vector_norm(torch.cat(grads))
    out = [torch.empty_like(g) for g in grads]
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [grads, out], 0.5)
    return max(rel(norm, want), *(rel(o, g * 0.5) for o, g in zip(out, grads))), FP32_TOLERANCE


def _layer_norm_inputs(torch, hidden):
    x = torch.randn(64, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    b = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    return x, w.requires_grad_(), b.requires_grad_()


def _against_torch_layer_norm(torch, apply, hidden):
    x, w, b = _layer_norm_inputs(torch, hidden)
    y = apply(x, w, b)
    y.float().square().sum().backward()
    got = (y, x.grad, w.grad, b.grad)
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y2 = torch.nn.functional.layer_norm(x2, (hidden,), w2, b2, 1e-5)
    y2.float().square().sum().backward()
    return max(rel(a, c) for a, c in zip(got, (y2, x2.grad, w2.grad, b2.grad)))


def check_layer_norm(torch):
    from apex.normalization.fused_layer_norm import FusedLayerNormAffineFunction

    # megatron's FusedLayerNorm.forward (no persistent kernel): the affine function, with
    # memory_efficient False
    worst = _against_torch_layer_norm(
        torch, lambda x, w, b: FusedLayerNormAffineFunction.apply(
            x, w, b, torch.Size((x.shape[-1],)), 1e-5, False), 1000)
    return worst, BF16_TOLERANCE


def check_persistent_layer_norm(torch):
    from apex.contrib.layer_norm.layer_norm import FastLayerNormFN

    # megatron's FusedLayerNorm.forward with the persistent kernel (a hidden size it has)
    worst = _against_torch_layer_norm(
        torch, lambda x, w, b: FastLayerNormFN.apply(x, w, b, 1e-5, False), 1024)
    return worst, BF16_TOLERANCE


def check_softmax(torch):
    import scaled_masked_softmax_cuda
    import scaled_softmax_cuda
    import scaled_upper_triang_masked_softmax_cuda

    # megatron's fused_softmax: scores [b*heads, sq, sk] with a causal mask, [b, heads, sq,
    # sk] with a boolean mask (True: masked out) or none, the scale as a float
    b, heads, s, scale = 2, 4, 128, 0.125
    x = torch.randn(b, heads, s, s, device="cuda", dtype=torch.bfloat16)
    causal = torch.triu(torch.ones(s, s, device="cuda", dtype=torch.bool), diagonal=1)

    def softmax(t, mask=None):
        t = t.float() * scale
        return torch.softmax(t.masked_fill(mask, -10000.0) if mask is not None else t, -1)

    got = scaled_upper_triang_masked_softmax_cuda.forward(x.view(b * heads, s, s), scale)
    worst = rel(got.view_as(x), softmax(x, causal))
    pad = torch.zeros(b, 1, s, s, device="cuda", dtype=torch.bool)
    pad[..., s - 16:] = True
    worst = max(worst, rel(scaled_masked_softmax_cuda.forward(x, pad, scale), softmax(x, pad)))
    worst = max(worst, rel(scaled_softmax_cuda.forward(x, scale), softmax(x)))
    return worst, BF16_TOLERANCE


CHECKS = {"wgrad": check_wgrad, "optimizer": check_optimizer,
          "multi_tensor": check_multi_tensor, "layer_norm": check_layer_norm,
          "persistent_layer_norm": check_persistent_layer_norm, "softmax": check_softmax}


def check_part(part: apex_kernels.Part, cuda: bool) -> dict:
    missing = [m for m in part.modules if not apex_kernels.imports(m)]
    if missing:
        return dict(ok=False, why=f"does not import: {', '.join(missing)}")
    if not cuda:
        return dict(ok=True, why="imports (no GPU: kernels not run)")
    import torch

    try:
        worst, tolerance = CHECKS[part.key](torch)
    except Exception as exc:  # noqa: BLE001 - reported, and the exit code says it
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return dict(ok=False, why=f"raised {last[:300]}")
    ok = math.isfinite(worst) and worst <= tolerance
    return dict(ok=ok, max_rel_diff=worst,
                why=f"max relative difference from torch {worst:.1e} (bound {tolerance:.0e})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write the results here too")
    a = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    results = {}
    for part in apex_kernels.PARTS:
        results[part.key] = check_part(part, cuda)
        r = results[part.key]
        print(f"apex check: {part.label}: {'ok' if r['ok'] else 'FAILED'}: {r['why']}",
              flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

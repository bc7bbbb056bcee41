"""The flat AdamW step's arithmetic: one AdamW update over 1-D buffers in place
(``adamw_flat_update_``), as one compiled kernel or eagerly in chunks (``run_update``). The
flat step (``flat_adam``) runs it over megatron's buffers; with FP8 weights written, the
kernel of ``flat_adam_fp8`` does the same arithmetic and casts the weights in the same pass.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

# chunk size for the eager (uncompiled) update, which materialises temporaries
_EAGER_CHUNK = 1 << 24


def adamw_flat_update_(
    grad: torch.Tensor,
    main: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    model: torch.Tensor,
    group_index: torch.Tensor,
    lr_and_wd: torch.Tensor,
    step: torch.Tensor,
    clip_coeff: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    decoupled: bool,
) -> None:
    """One AdamW step over 1-D buffers, in place.

    ``grad`` (bf16 or fp32), ``main``/``exp_avg``/``exp_avg_sq`` (fp32) and ``model`` (the
    low-precision weights) are aligned element by element; ``group_index`` (uint8, one entry
    per block of ``len(grad) // len(group_index)`` elements) picks the column
    ``lr_and_wd[:, k] = (lr, weight_decay)`` of the block's parameter group. ``step``
    is the step count after this update, ``clip_coeff`` the factor megatron would multiply the
    gradients by (1 when not clipping). Mirrors torch's ``_fused_adamw_`` per element.
    """
    g = grad.float() * clip_coeff
    block = grad.numel() // group_index.numel()
    # each block's group, repeated over its elements (compiled: an index computation)
    index = group_index.long().view(-1, 1).expand(-1, block).reshape(-1)
    lr = lr_and_wd[0][index]
    wd = lr_and_wd[1][index]
    p = main
    if decoupled:
        p = p - lr * wd * p
    else:
        g = g + p * wd
    m = beta1 * exp_avg + (1 - beta1) * g
    v = beta2 * exp_avg_sq + (1 - beta2) * g * g
    bias_correction1 = 1 - torch.pow(beta1, step)
    bias_correction2_sqrt = torch.sqrt(1 - torch.pow(beta2, step))
    step_size = lr / bias_correction1
    denom = torch.sqrt(v) / bias_correction2_sqrt + eps
    p = p - step_size * m / denom
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    main.copy_(p)
    model.copy_(p)


@functools.lru_cache(maxsize=None)
def _compiled_update() -> Callable:
    # one graph per buffer size; the hyper-parameters that change per step are tensors
    return torch.compile(adamw_flat_update_, fullgraph=True, dynamic=False)


def run_update(grad, main, exp_avg, exp_avg_sq, model, group_index, lr_and_wd, step, clip_coeff,
               *, beta1: float, beta2: float, eps: float, decoupled: bool,
               compiled: bool) -> None:
    """``adamw_flat_update_`` over the whole buffers: one compiled kernel, or eager in chunks
    (eager materialises fp32 temporaries; chunks keep them small)."""
    kw = dict(beta1=beta1, beta2=beta2, eps=eps, decoupled=decoupled)
    if compiled:
        _compiled_update()(grad, main, exp_avg, exp_avg_sq, model, group_index, lr_and_wd,
                           step, clip_coeff, **kw)
        return
    block = grad.numel() // group_index.numel()
    for s in range(0, grad.numel(), _EAGER_CHUNK):  # a multiple of every block size
        e = min(s + _EAGER_CHUNK, grad.numel())
        adamw_flat_update_(grad[s:e], main[s:e], exp_avg[s:e], exp_avg_sq[s:e], model[s:e],
                           group_index[s // block:e // block], lr_and_wd, step, clip_coeff, **kw)

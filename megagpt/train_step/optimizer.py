"""Faster optimizer step for megatron-core without Transformer Engine or apex.

Without TE/apex, megatron-core 0.19.2 falls back to:
- ``torch.optim.AdamW`` with its default implementation (``foreach``, several passes over
  the fp32 master weights and states), not the single-kernel ``fused=True`` one;
- ``megatron.core.utils.local_multi_tensor_l2_norm`` for the gradient norm: one
  ``torch.norm`` per tensor *and one host synchronisation per tensor* (it builds a CPU
  tensor from a list of CUDA scalars) — hundreds of syncs a step;
- ``local_multi_tensor_scale``: one ``dst.copy_(src * scale)`` pair of kernels per tensor;
- for bf16 (``_dummy_overflow_buf is None``) a Python loop of per-tensor copies to write the
  updated fp32 master weights back into the bf16 model weights.

``fast_kernels()`` replaces these fallbacks, inside megatron's optimizer modules only and
for the duration of a block, with torch's fused AdamW and ``torch._foreach_*`` kernels (a handful of launches per
step, one host synchronisation for the norm as with apex). Where TE or apex provides the
multi-tensor kernels they are kept, and each part can be left out. Numerics: the same
operations in fp32 (AdamW math is torch's own; the norm is the same 2-norm computed in
another order).

Each replacement is installed through ``megagpt.megatron_wrappers`` under this module's name.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Optional

import torch

from megagpt import megatron_wrappers
from megagpt.megatron_change import REPLACES, Change


# ---------------------------------------------------------------------------------------
# multi-tensor kernels with the apex / TE calling convention
#   op(chunk_size, noop_flag, tensor_lists, *args)
# ---------------------------------------------------------------------------------------
def foreach_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``dst[i] = src[i] * scale`` for ``tensor_lists = [src, dst]`` (drop-in for amp_C's)."""
    src: List[torch.Tensor] = list(tensor_lists[0])
    dst: List[torch.Tensor] = list(tensor_lists[1])
    if not src:
        return
    assert len(src) == len(dst)
    same = all(s is d for s, d in zip(src, dst))
    if same:
        if scale != 1.0:
            torch._foreach_mul_(dst, scale)
        return
    if scale == 1.0:
        _foreach_copy(dst, src)
    else:
        _foreach_copy(dst, torch._foreach_mul(src, scale))


def foreach_multi_tensor_scale_tensor(chunk_size, noop_flag, tensor_lists, scale):
    """``dst[i] = src[i] * scale`` with ``scale`` a 1-element tensor on the device.

    The calling convention of TE's ``multi_tensor_scale_tensor``. With it installed,
    megatron keeps the gradient norm on the GPU and clips by a tensor coefficient
    (``clip_grads.get_grad_norm_fp32`` / ``clip_grad_by_total_norm_fp32``), so the step does
    not wait for the norm to reach the host.
    """
    src: List[torch.Tensor] = list(tensor_lists[0])
    dst: List[torch.Tensor] = list(tensor_lists[1])
    if not src:
        return
    assert len(src) == len(dst)
    scale = scale.reshape(()).float()
    if all(s is d for s, d in zip(src, dst)):
        for group in _by_dtype_and_device(dst).values():
            torch._foreach_mul_(group, scale.to(group[0].device))
        return
    _foreach_copy(dst, torch._foreach_mul(src, scale))


def _by_dtype_and_device(tensors: List[torch.Tensor]) -> dict:
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _foreach_copy(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    # group by (dtype pair, device) so that each group can take torch's fast path
    groups: dict = {}
    for d, s in zip(dst, src):
        if _is_dtensor(d) or _is_dtensor(s):
            # FSDP2's sharded parameters: DTensor has no sharding rule for _foreach_copy_
            # (torch 2.11: NotImplementedError at the first step); one copy each, as
            # megatron's own fallback does
            d.copy_(s)
            continue
        groups.setdefault((d.dtype, s.dtype, d.device), ([], []))
        groups[(d.dtype, s.dtype, d.device)][0].append(d)
        groups[(d.dtype, s.dtype, d.device)][1].append(s)
    for ds, ss in groups.values():
        torch._foreach_copy_(ds, ss)


def foreach_multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Total 2-norm of ``tensor_lists[0]`` as a 1-element fp32 tensor, no host sync.

    Same return convention as megatron's local fallback: ``(norm[1], None)``.
    """
    tensors = list(tensor_lists[0])
    if not tensors:
        dev = noop_flag.device if isinstance(noop_flag, torch.Tensor) else "cpu"
        return torch.zeros(1, dtype=torch.float, device=dev), None
    partial = []
    for ts in _by_dtype_and_device(tensors).values():
        # accumulate and return fp32 norms for bf16/fp16 gradients too (the flat AdamW step
        # takes the norm of the bf16 main_grad views themselves)
        norms = torch._foreach_norm(ts, 2, dtype=torch.float32)
        partial.append(torch.linalg.vector_norm(torch.stack(norms)))
    total = torch.linalg.vector_norm(torch.stack(partial)) if len(partial) > 1 else partial[0]
    return total.reshape(1).float(), None


def foreach_copy_this_to_that(this, that, overflow_buf=None):
    """Drop-in for ``megatron.core.optimizer.optimizer._multi_tensor_copy_this_to_that``."""
    if this:
        _foreach_copy(list(that), list(this))


# ---------------------------------------------------------------------------------------
# model gradients -> fp32 main gradients, one cast per gradient buffer
# ---------------------------------------------------------------------------------------
def _storage_key(t: torch.Tensor):
    return (t.device, t.dtype, t.untyped_storage().data_ptr())


def _main_grad_plan(pairs):
    """Group (model_param, main_param) pairs by the buffer their ``main_grad`` views.

    Returns ``(groups, others)``: ``groups`` lists ``(base, start, end, members)`` where
    ``base`` is the whole buffer as a flat tensor, ``[start, end)`` the span of these
    gradients in it and ``members`` ``(model_param, main_param, main_grad, offset)``;
    ``others`` are the pairs without a ``main_grad`` (no megatron DDP).
    """
    by_storage: dict = {}
    others = []
    for model_param, main_param in pairs:
        grad = getattr(model_param, "main_grad", None)
        if grad is None or not grad.is_contiguous():
            others.append((model_param, main_param))
            continue
        by_storage.setdefault(_storage_key(grad), []).append((model_param, main_param, grad))
    groups = []
    for members in by_storage.values():
        first = members[0][2]
        base = torch.empty(0, dtype=first.dtype, device=first.device).set_(
            first.untyped_storage())
        offsets = [g.storage_offset() for _, _, g in members]
        start = min(offsets)
        end = max(o + g.numel() for o, (_, _, g) in zip(offsets, members))
        groups.append((base, start, end,
                       [(m, p, g, o - start) for (m, p, g), o in zip(members, offsets)]))
    return groups, others


def copy_model_grads_to_main_grads(self) -> None:
    """Drop-in for ``Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads``.

    megatron casts each ``main_grad`` to fp32 separately (``main_param.grad =
    model_param.main_grad.float()``): one kernel and one allocation per parameter tensor,
    ~300 at the 345M shape. The gradients are views of megatron's contiguous gradient
    buffer, so one cast of the buffer's span gives the same fp32 values, and each main
    parameter's gradient is a view of it. An fp32 buffer is used in place, as ``.float()``
    does.
    """
    pairs = [(m, p) for mg, pg in zip(self.float16_groups, self.fp32_from_float16_groups)
             for m, p in zip(mg, pg)]
    plan = getattr(self, "_megagpt_main_grad_plan", None)
    if plan is None or len(plan[2]) != len(pairs) or any(
        getattr(m, "main_grad", None) is not g for (m, _), g in zip(pairs, plan[2])
    ):
        groups, others = _main_grad_plan(pairs)
        plan = (groups, others, [getattr(m, "main_grad", None) for m, _ in pairs])
        self._megagpt_main_grad_plan = plan
    groups, others, _ = plan
    for base, start, end, members in groups:
        flat = base[start:end].float()
        for model_param, main_param, grad, offset in members:
            main_param.grad = flat[offset:offset + grad.numel()].view(grad.shape)
            model_param.grad = None
    for model_param, main_param in others:
        if model_param.grad is not None:
            main_param.grad = model_param.grad.float()
        model_param.grad = None
    for model_group in self.fp32_from_fp32_groups:
        for model_param in model_group:
            model_param.grad = model_param.main_grad


# ---------------------------------------------------------------------------------------
# fused AdamW with the TE/apex FusedAdam constructor megatron calls
# ---------------------------------------------------------------------------------------
def torch_fused_adam(
    params,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    betas=(0.9, 0.999),
    eps: float = 1e-8,
    capturable: bool = False,
    adam_w_mode: bool = True,
    **unsupported,
):
    """torch AdamW/Adam with ``fused=True``, called the way megatron calls apex/TE FusedAdam.

    ``adam_w_mode=True`` (megatron's ``decoupled_weight_decay``, the default) gives AdamW,
    otherwise Adam with L2 weight decay — the same split megatron makes for torch's classes.
    Precision-aware options (``exp_avg_dtype``, ``master_weights``...) are TE-only.
    """
    if unsupported:
        raise TypeError(
            "torch fused AdamW does not take "
            + ", ".join(sorted(unsupported))
            + " (TE-only options); run with --fast-disable optimizer"
        )
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    return cls(
        params,
        lr=lr,
        weight_decay=weight_decay,
        betas=tuple(betas),
        eps=eps,
        capturable=capturable,
        fused=True,
    )


# ---------------------------------------------------------------------------------------
def megatron_uses_local_fallbacks() -> bool:
    """True when megatron's optimizer modules took the no-TE/no-apex fallbacks (as megatron
    set them, whatever this module has replaced since)."""
    import megatron.core.optimizer as mopt

    try:
        return bool(megatron_wrappers.original(mopt, "USING_PYTORCH_OPTIMIZER"))
    except AttributeError:
        return False


# What ``fast_kernels`` changes in megatron, in the order it installs it (``_replacements``
# says which apply).
_CLIP = "megatron.core.optimizer.clip_grads."
_OPTIMIZER = "megatron.core.optimizer.optimizer."
ADAM = Change(
    "megatron.core.optimizer.Adam", REPLACES, __name__,
    does="torch's fused=True AdamW, one kernel",
    why="without TE/apex megatron takes torch's AdamW in its multi-pass foreach form; the "
        "flat AdamW step builds on torch's fused one",
    fingerprint="8a40ef85203f")
USING_PYTORCH_OPTIMIZER = Change(
    "megatron.core.optimizer.USING_PYTORCH_OPTIMIZER", REPLACES, __name__,
    does="False, with fused AdamW",
    why="megatron then passes it the fused optimizer's arguments",
    fingerprint="e901a03a490f")
L2_NORM = Change(
    _CLIP + "l2_norm_impl", REPLACES, __name__,
    does="the gradient norm by torch._foreach_norm, one host wait",
    why="megatron's local fallback reads one norm per tensor back to the host (hundreds of "
        "waits a step)",
    fingerprint="27093e9af287")
CLIP_SCALE = Change(
    _CLIP + "multi_tensor_scale_impl", REPLACES, __name__,
    does="the clipping scale by torch._foreach_mul_, a few kernels",
    why="the local fallback scales tensor by tensor",
    fingerprint="19c4e8618112")
OPTIMIZER_SCALE = Change(
    _OPTIMIZER + "multi_tensor_scale_impl", REPLACES, __name__,
    does="as clip_grads' (the optimizer module's own binding)",
    why="the local fallback scales tensor by tensor",
    fingerprint="19c4e8618112")
COPY_THIS_TO_THAT = Change(
    _OPTIMIZER + "_multi_tensor_copy_this_to_that", REPLACES, __name__,
    does="the master weights copied into the model weights by torch._foreach_copy_",
    why="for bf16 megatron runs a Python loop of per-tensor copies",
    fingerprint="1c15b8061ac0")
COPY_MODEL_GRADS = Change(
    _OPTIMIZER + "Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads",
    REPLACES, __name__,
    does="one fp32 cast per gradient buffer",
    why="megatron casts each parameter tensor on its own (~300 kernels)",
    fingerprint="fe8017bd890f")
CLIP_SCALE_TENSOR = Change(
    _CLIP + "multi_tensor_scale_tensor_impl", REPLACES, __name__,
    does="TE's tensor-scale kernel in torch._foreach form: the norm and the clipping stay on "
         "the GPU",
    why="None without TE, so megatron brings the norm to the host to clip",
    fingerprint="f2ef0c158231")
MEGATRON_CHANGES = (ADAM, USING_PYTORCH_OPTIMIZER, L2_NORM, CLIP_SCALE, OPTIMIZER_SCALE,
                    COPY_THIS_TO_THAT, COPY_MODEL_GRADS, CLIP_SCALE_TENSOR)


def _replacements(fused_adam: bool, multi_tensor: bool, tensor_clip: bool,
                  megatron_fused_optimizer: bool
                  ) -> tuple[list[tuple[object, str, object]], list[str]]:
    """(the ``(module, name, value)`` replacements megatron's optimizer modules get, the log
    lines saying what they change). Where TE or apex provides the multi-tensor kernels,
    theirs are kept (the norm, the scales); ``fused_adam`` still puts torch's fused AdamW in
    place of their FusedAdam, which the flat AdamW step needs (``flat_adam``).
    ``megatron_fused_optimizer``: megatron bound TE's or apex's FusedAdam (``compat
    .Installed``), for the log line."""
    import megatron.core.optimizer as mopt
    import megatron.core.optimizer.clip_grads as mclip
    import megatron.core.optimizer.optimizer as moo
    from megatron.core import utils as mutils

    swaps: list[tuple[object, str, object]] = []
    changed: List[str] = []
    if fused_adam:
        swaps += [(mopt, "Adam", torch_fused_adam), (mopt, "USING_PYTORCH_OPTIMIZER", False)]
        # torch's Adam, not TE's / apex's FusedAdam: the flat AdamW step builds on it
        changed.append("AdamW: torch fused=True (single kernel) instead of "
                       + ("TE's/apex's FusedAdam" if megatron_fused_optimizer else "foreach"))
    if multi_tensor:
        if mclip.l2_norm_impl is mutils.local_multi_tensor_l2_norm:
            swaps.append((mclip, "l2_norm_impl", foreach_multi_tensor_l2norm))
            changed.append("grad norm: torch._foreach_norm (was one host sync per tensor)")
        if mclip.multi_tensor_scale_impl is mutils.local_multi_tensor_scale:
            swaps.append((mclip, "multi_tensor_scale_impl", foreach_multi_tensor_scale))
            changed.append("grad clip scale: torch._foreach_mul_")
        if moo.multi_tensor_scale_impl is mutils.local_multi_tensor_scale:
            swaps.append((moo, "multi_tensor_scale_impl", foreach_multi_tensor_scale))
        swaps.append((moo, "_multi_tensor_copy_this_to_that", foreach_copy_this_to_that))
        changed.append("main<->model param copies: torch._foreach_copy_")
        swaps.append((moo.Float16OptimizerWithFloat16Params, "_copy_model_grads_to_main_grads",
                      copy_model_grads_to_main_grads))
        changed.append("model->main grads: one fp32 cast per gradient buffer")
    if tensor_clip and mclip.multi_tensor_scale_tensor_impl is None:
        swaps.append((mclip, "multi_tensor_scale_tensor_impl", foreach_multi_tensor_scale_tensor))
        changed.append("grad norm and clipping stay on the GPU (no host sync for the norm)")
    return swaps, changed


@contextlib.contextmanager
def fast_kernels(megatron_fused_optimizer: bool, fused_adam: bool = True,
                 multi_tensor: bool = True, tensor_clip: bool = False,
                 log: Optional[Callable[[str], None]] = None) -> Iterator[List[str]]:
    """megatron's optimizer modules with torch's fused AdamW and the foreach kernels for the
    duration of the block; yields what was changed. ``megatron_fused_optimizer``: whether
    megatron bound TE's or apex's FusedAdam, as what is installed says (``compat.Installed``;
    the launch's ``installed``).

    ``tensor_clip`` also gives megatron a tensor-scale kernel, which makes it keep the
    gradient norm on the GPU (see ``foreach_multi_tensor_scale_tensor``): the norm that
    ``optimizer.step()`` returns is then a 1-element CUDA tensor. Enter before
    ``get_megatron_optimizer`` builds the optimizer (before ``setup_model_and_optimizer``).
    """
    swaps, changed = _replacements(fused_adam, multi_tensor, tensor_clip,
                                   megatron_fused_optimizer)
    with megatron_wrappers.wrapped_all([(module, name, __name__, megatron_wrappers.replacing(value))
                                        for module, name, value in swaps]):
        for line in changed if log else ():
            log(f"fast optimizer: {line}")
        yield changed

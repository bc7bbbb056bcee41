"""megatron's bf16 AdamW step as one pass over flat buffers (``--fast-disable flat-adam``
leaves it out).

Without TE/apex, megatron's ``Float16OptimizerWithFloat16Params`` steps in five passes over
memory, each a full read (and most a write) of every parameter's worth of data:

  1. cast the bf16 gradient buffer to fp32 main gradients      (read 2 B, write 4 B / param)
  2. the gradient norm over the fp32 gradients                 (read 4 B)
  3. clip: multiply the fp32 gradients by the clip factor      (read 4 B, write 4 B)
  4. torch's fused AdamW over fp32 master weights and states    (read 16 B, write 12 B)
  5. copy the fp32 master weights into the bf16 model weights  (read 4 B, write 2 B)

52 bytes per parameter, bandwidth-bound: about a tenth of the 345M step (bench/notes/fast-path.md,
"Where the time went"). TE's and apex's fused Adam with master weights do it in one pass.
So does this module: one elementwise kernel (``torch.compile``d on a GPU) reads the
gradient straight from megatron's contiguous gradient buffer, applies the clip factor,
updates the fp32 master weight and both moments, and writes the bf16 model weight — 28
bytes per parameter — after one norm pass over the gradient buffer (2 bytes when it is
bf16; the norm equals megatron's per-parameter one to fp32 rounding).

How: the master weights, both AdamW moments and the bf16 model weights are re-pointed to
views of four flat buffers laid out exactly like the gradient buffer, so element ``i`` of
each belongs to the same parameter entry. The tensors megatron and torch hold (``main_param``,
``optimizer.state[p]['exp_avg']``, the model ``Parameter`` objects) stay the same objects
with the same values, so checkpoints are unchanged; anything that replaces them (loading an
optimizer state dict replaces torch's state tensors) is noticed at the next step and copied
back into the flat buffers. Per-parameter-group learning rate and weight decay come from a
one-byte group index per block of elements that no parameter boundary splits (1024 elements
when every parameter's size is a multiple of 1024, as at 345M).

Arithmetic: the same fp32 operations, in the same order, as torch's fused AdamW kernel on
the gradients megatron would have produced (the fp32 main gradient of a bf16 gradient is its
exact widening; the clip multiplies it by the same factor); results can differ from
torch's kernel in the last bit where the compiler contracts a multiply-add.

Where the model's fused FP8 layers mark their weights (delayed scaling), the same pass also
writes each of those weights' FP8 copies for the next forward (``flat_adam_fp8``).

Where it applies (``unsupported_reason``): megatron's ``Float16OptimizerWithFloat16Params``
(bf16, no loss scaler) alone or alone in a ``ChainedOptimizer``, around torch's Adam/AdamW
without amsgrad/maximize, every parameter a view of one contiguous megatron gradient
buffer holding no other parameter, no separate gradient-norm groups, and
``--log-num-zeros-in-grad`` off. Under tensor and pipeline parallelism the norm leaves out
what megatron's leaves out (parameters shared with another stage, tensor-parallel
duplicates). Elsewhere megatron's step runs unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Callable, Iterator, List, Optional

import torch

from megagpt.megatron_change import TRAINING, WRAPS, Change

from . import flat_adam_fp8
from .adamw_update import run_update

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------
# flat buffers behind a megatron Float16OptimizerWithFloat16Params
# ---------------------------------------------------------------------------------------
def _inner_adam_settings(torch_opt) -> Optional[tuple]:
    """(beta1, beta2, eps, decoupled) shared by every param group, or None."""
    if not isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):
        return None
    settings = set()
    for g in torch_opt.param_groups:
        if g.get("amsgrad") or g.get("maximize") or g.get("differentiable"):
            return None
        decoupled = isinstance(torch_opt, torch.optim.AdamW) or bool(
            g.get("decoupled_weight_decay", False))
        b1, b2 = g["betas"]
        if isinstance(g["lr"], torch.Tensor):
            return None
        settings.add((float(b1), float(b2), float(g["eps"]), decoupled))
    return settings.pop() if len(settings) == 1 else None


class FlatAdamState:
    """The four flat buffers and the parameter layout of one megatron bf16 optimizer."""

    def __init__(self, opt, entries, base, start, end, settings, compiled: bool = False):
        self.opt = opt
        self.compiled = compiled
        self.compile_error: Optional[str] = None
        # entries: (model_param, main_param, group number, offset in the span)
        self.entries = entries
        self.grad = base[start:end]
        self.beta1, self.beta2, self.eps, self.decoupled = settings
        n, dev = end - start, base.device
        model_dtype = entries[0][0].dtype
        self.main = torch.zeros(n, dtype=torch.float32, device=dev)
        self.exp_avg = torch.zeros(n, dtype=torch.float32, device=dev)
        self.exp_avg_sq = torch.zeros(n, dtype=torch.float32, device=dev)
        self.model = torch.zeros(n, dtype=model_dtype, device=dev)
        # one group entry per block of elements that no parameter boundary splits (a power
        # of two up to 1024): 1 byte per parameter would add 355 MB at 345M, this adds 0.35 MB
        self.block = _block_size([0, n] + [o for *_, o in entries]
                                 + [o + m.numel() for m, _, _, o in entries])
        self.group_index = torch.zeros(n // self.block, dtype=torch.uint8, device=dev)
        for model_param, _, group, offset in entries:
            self.group_index[offset // self.block:(offset + model_param.numel()) // self.block] = group
        self.steps: List[torch.Tensor] = []
        # runs of the buffer the gradient norm is taken over (``attach`` sets them)
        self.norm_spans: Optional[List[tuple]] = None
        # the FP8 linears' weights written in the same pass (flat_adam_fp8), where the
        # model's fused layers mark them
        self.fp8_weights = flat_adam_fp8.writes_for(entries, n, dev)
        self.adopt()

    def _views(self, offset: int, shape):
        n = math.prod(shape)
        return tuple(buf[offset:offset + n].view(shape)
                     for buf in (self.main, self.exp_avg, self.exp_avg_sq, self.model))

    def adopt(self) -> None:
        """Copy the current values into the flat buffers and re-point every tensor at them."""
        state = self.opt.optimizer.state
        steps = []
        for model_param, main_param, _, offset in self.entries:
            main, m, v, model = self._views(offset, model_param.shape)
            main.copy_(main_param.data)
            model.copy_(model_param.data)
            main_param.data = main
            model_param.data = model
            st = state[main_param]
            for key, view in (("exp_avg", m), ("exp_avg_sq", v)):
                if key in st:
                    view.copy_(st[key])
                else:
                    view.zero_()
                st[key] = view
            step = st.get("step")
            if not isinstance(step, torch.Tensor) or step.device != main.device:
                step = torch.tensor(float(step or 0), dtype=torch.float32, device=main.device)
                st["step"] = step
            steps.append(step)
        self.steps = steps
        self._check = self._identity()

    def _identity(self):
        state = self.opt.optimizer.state
        return [(mp.data_ptr(), pp.data_ptr(), state[pp].get("exp_avg"),
                 state[pp].get("exp_avg_sq"), state[pp].get("step"))
                for mp, pp, _, _ in self.entries]

    def ensure_adopted(self) -> None:
        """Re-adopt when something replaced a tensor (e.g. an optimizer state dict load)."""
        state = self.opt.optimizer.state
        for (mp, pp, _, _), (mptr, pptr, m, v, s) in zip(self.entries, self._check):
            st = state[pp]
            if (mp.data_ptr() != mptr or pp.data_ptr() != pptr or st.get("exp_avg") is not m
                    or st.get("exp_avg_sq") is not v or st.get("step") is not s):
                self.adopt()
                return

    def grad_norm(self, group):
        """megatron's ``get_grad_norm_fp32`` (2-norm) over ``self.norm_spans`` of the gradient
        buffer: the squares summed in fp32, all-reduced over ``group``, the same return type
        (a 1-element tensor where megatron's clip takes tensors, else a float)."""
        from megatron.core.optimizer import clip_grads

        total = torch.zeros(1, dtype=torch.float32, device=self.grad.device)
        for start, end in self.norm_spans:
            total += self._sum_of_squares(self.grad[start:end])
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=group)
        if clip_grads.multi_tensor_scale_tensor_impl is not None:
            return total.pow(0.5)
        return total.item() ** 0.5

    def _sum_of_squares(self, x: torch.Tensor) -> torch.Tensor:
        if self.compiled:
            try:
                return _compiled_sum_of_squares()(x)
            except Exception as exc:  # noqa: BLE001 - compiler failures come in many types
                self._compile_failed(exc)
        return sum_of_squares(x)

    def _compile_failed(self, exc: Exception) -> None:
        """A compiler failure must not stop training: the same arithmetic, eagerly."""
        from megagpt.torch_compile import is_compile_error

        if not is_compile_error(exc):
            raise exc
        self.compiled = False
        self.compile_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        logger.warning("flat AdamW: torch.compile failed (%s); running the norm and the "
                       "update eagerly", self.compile_error)

    def hyperparameters(self) -> torch.Tensor:
        groups = self.opt.optimizer.param_groups
        return _to_device([[float(g["lr"]) for g in groups],
                           [float(g["weight_decay"]) for g in groups]], self.grad.device)

    def step(self, clip_coeff: torch.Tensor) -> None:
        self.ensure_adopted()
        torch._foreach_add_(self.steps, 1.0)
        args = (self.grad, self.main, self.exp_avg, self.exp_avg_sq, self.model,
                self.group_index, self.hyperparameters(), self.steps[0], clip_coeff)
        kw = dict(beta1=self.beta1, beta2=self.beta2, eps=self.eps, decoupled=self.decoupled)
        if self.fp8_weights is not None:
            # the same step with the FP8 weights written in its pass: a Triton kernel of
            # the compiled update's arithmetic on a GPU, torch operations elsewhere
            self.fp8_weights.update(*args, **kw)
            return
        if self.compiled:
            try:
                run_update(*args, **kw, compiled=True)
                return
            except Exception as exc:  # noqa: BLE001 - compiler failures come in many types
                self._compile_failed(exc)
        run_update(*args, **kw, compiled=False)


def _block_size(boundaries, largest: int = 1024) -> int:
    """The largest power of two (at most ``largest``) dividing every boundary."""
    block = largest
    while block > 1 and any(b % block for b in boundaries):
        block //= 2
    return block


def _storage_base(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())


def flat_layout(opt, all_buffer_params=None):
    """``(entries, base, start, end)`` for ``opt``'s bf16 parameters, or a reason string.

    ``all_buffer_params``: every parameter held in the same gradient buffer(s) (the DDP
    buffers' ``param_index_map`` keys); the span must hold no parameter of another optimizer.
    """
    entries, storages = [], set()
    for group_number, (model_group, main_group) in enumerate(
            zip(opt.float16_groups, opt.fp32_from_float16_groups)):
        for model_param, main_param in zip(model_group, main_group):
            grad = getattr(model_param, "main_grad", None)
            if grad is None or not grad.is_contiguous():
                return "a parameter without a contiguous megatron main_grad (no DDP buffer)"
            storages.add((grad.device, grad.untyped_storage().data_ptr()))
            entries.append((model_param, main_param, group_number, grad.storage_offset()))
    if not entries:
        return "no bf16 parameters"
    if len(storages) != 1:
        return f"the gradients live in {len(storages)} buffers, not one"
    if len(opt.optimizer.param_groups) > 255:
        return "more than 255 parameter groups"
    first = entries[0][0].main_grad
    start = min(o for *_, o in entries)
    end = max(o + m.numel() for m, _, _, o in entries)
    ours = {id(m) for m, *_ in entries}
    for p in all_buffer_params or ():
        g = getattr(p, "main_grad", None)
        if id(p) in ours or g is None:
            continue
        if (g.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                and g.storage_offset() < end and g.storage_offset() + g.numel() > start):
            return "the gradient buffer also holds parameters of another optimizer"
    covered = sum(m.numel() for m, *_ in entries)
    if covered > end - start:
        return "parameters overlap in the gradient buffer"
    base = _storage_base(first)
    entries = [(m, p, g, o - start) for m, p, g, o in entries]
    return entries, base, start, end


def unsupported_reason(opt, all_buffer_params=None) -> Optional[str]:
    """Why the flat step cannot run for this megatron optimizer (None when it can)."""
    import megatron.core.optimizer.optimizer as moo

    if type(opt) is not moo.Float16OptimizerWithFloat16Params:
        return f"{type(opt).__name__} is not megatron's bf16 optimizer (Float16OptimizerWithFloat16Params)"
    if getattr(opt, "is_stub_optimizer", False):
        return "no parameters"
    if opt.grad_scaler is not None:
        return "a loss scaler (fp16) checks gradients for inf/nan first"
    if any(opt.fp32_from_fp32_groups):
        return "some parameters are fp32"
    cfg = opt.config
    if getattr(cfg, "log_num_zeros_in_grad", False):
        return "--log-num-zeros-in-grad counts zeros in the fp32 main gradients"
    if getattr(cfg, "use_precision_aware_optimizer", False):
        return "precision-aware optimizer"
    if _inner_adam_settings(opt.optimizer) is None:
        return "the inner optimizer is not torch Adam/AdamW with one set of betas/eps"
    for main_group in opt.fp32_from_float16_groups:
        for p in main_group:
            if moo._get_param_grad_norm_group(p) is not None:
                return "a separate gradient-norm group"
    layout = flat_layout(opt, all_buffer_params)
    return layout if isinstance(layout, str) else None


def counted_in_norm(opt, main_param) -> bool:
    """megatron's ``_filter_grads_for_norm`` test for one parameter: a parameter shared with
    another pipeline stage (the tied output weight) or duplicated on every tensor-parallel rank
    (norms, row-parallel biases on ranks > 0) is counted once, elsewhere."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import param_is_not_shared

    return (param_is_not_shared(main_param)
            and tensor_parallel.param_is_not_tensor_parallel_duplicate(
                main_param, tp_group=getattr(opt, "tp_group", None),
                expert_tp_group=getattr(opt, "expert_tp_group", None))
            and tensor_parallel.param_is_not_gtp_duplicate(main_param))


# At most this many runs of counted parameters in the gradient buffer for the norm to be
# taken over the runs; more (tensor-parallel duplicates scattered through the buffer) and
# megatron's per-parameter norm is taken instead.
_MAX_NORM_SPANS = 8


def norm_spans(entries, counted) -> Optional[List[tuple]]:
    """``(start, end)`` runs of the flat gradient span covering exactly the parameters for
    which ``counted(main_param)`` holds, adjacent parameters merged; None when there are more
    than ``_MAX_NORM_SPANS``."""
    runs: List[list] = []
    for model_param, main_param, _, offset in sorted(entries, key=lambda e: e[3]):
        if not counted(main_param):
            continue
        end = offset + model_param.numel()
        if runs and runs[-1][1] == offset:
            runs[-1][1] = end
        else:
            runs.append([offset, end])
    if len(runs) > _MAX_NORM_SPANS:
        return None
    return [tuple(r) for r in runs]


def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """``sum(x**2)`` accumulated in fp32 (0-dim)."""
    return torch.linalg.vector_norm(x, 2, dtype=torch.float32).square()


@functools.lru_cache(maxsize=None)
def _compiled_sum_of_squares() -> Callable:
    # one read of the (bf16) buffer at full bandwidth: inductor's split reduction
    def fn(x):
        x = x.float()
        return (x * x).sum()

    return torch.compile(fn, fullgraph=True, dynamic=False)


def _to_device(values, device) -> torch.Tensor:
    """Host values as an fp32 tensor on ``device``, copied from pinned memory without a wait."""
    from .async_step import to_device_without_waiting

    return to_device_without_waiting(torch.tensor(values, dtype=torch.float32), device)


def attach(opt, all_buffer_params=None, compiled: bool = True) -> FlatAdamState:
    """Give megatron optimizer ``opt`` the flat step (check ``unsupported_reason`` first).

    Overrides, on this instance only, the methods megatron's step calls:

    - ``prepare_grads``: nothing to copy (the step reads the gradient buffer itself);
    - ``get_grad_norm`` / ``clip_grad_norm``: the norm over the parameters megatron's norm
      counts, read from the flat gradient buffer in a few runs (megatron's own
      ``get_grad_norm_fp32`` where they are scattered), reduced over the grad-stats group as
      megatron's, same return type, remembered for the step; the clipping itself is folded
      into the step;
    - ``step_with_ready_grads``: the flat AdamW update with megatron's clip factor
      ``min(1, clip_grad / (norm + 1e-6))``.
    """
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    entries, base, start, end = flat_layout(opt, all_buffer_params)
    state = FlatAdamState(opt, entries, base, start, end, _inner_adam_settings(opt.optimizer),
                          compiled=compiled)

    def prepare_grads() -> bool:
        for model_group in opt.float16_groups:
            for model_param in model_group:
                model_param.grad = None
        return False

    # The norm over the gradients megatron's norm counts, read from the flat buffer in a few
    # long runs: one read of the buffer instead of torch._foreach_norm's ~64 launches over
    # 294 tensors at the 1.3B shape, which run well below the memory bandwidth (figures:
    # bench/notes/fast-path.md, "Flat AdamW step"). Summed in
    # another order than megatron's per-parameter norms, it equals theirs to fp32 rounding,
    # not bit for bit. Where the counted parameters are scattered, megatron's own norm.
    state.norm_spans = norm_spans(entries, lambda main_param: counted_in_norm(opt, main_param))
    grads_in_megatron_order = None if state.norm_spans is not None else [
        model_param.main_grad
        for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups)
        for model_param, main_param in zip(model_group, main_group)
        if counted_in_norm(opt, main_param)]

    def get_grad_norm():
        group = opt.get_grad_stats_parallel_group()
        if state.norm_spans is None:
            norm = get_grad_norm_fp32(grads_in_megatron_order, grad_stats_parallel_group=group)
        else:
            norm = state.grad_norm(group)
        opt._megagpt_flat_norm = norm
        return norm

    def clip_grad_norm(clip_grad: float):
        opt.grad_norms_by_group = {}
        return get_grad_norm()

    def step_with_ready_grads() -> bool:
        clip = float(opt.config.clip_grad)
        device = state.grad.device
        if clip > 0.0:
            norm = getattr(opt, "_megagpt_flat_norm", None)
            if norm is None:
                norm = get_grad_norm()
            if isinstance(norm, torch.Tensor):
                coeff = (clip / (norm.reshape(()).float() + 1.0e-6)).clamp_max(1.0)
            else:
                coeff = _to_device(min(1.0, clip / (norm + 1.0e-6)), device)
        else:
            coeff = _to_device(1.0, device)
        opt._megagpt_flat_norm = None
        state.step(coeff)
        return True

    opt.prepare_grads = prepare_grads
    opt.get_grad_norm = get_grad_norm
    opt.clip_grad_norm = clip_grad_norm
    opt.step_with_ready_grads = step_with_ready_grads
    opt._megagpt_flat_adam = state
    return state


def megatron_optimizers(optimizer) -> list:
    """The optimizers inside megatron's (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def buffer_params(model_chunks) -> list:
    """Every parameter held in the DDP gradient buffers of ``model_chunks`` (none where a
    chunk is not wrapped in megatron's DDP, as under ``--skip-train``: its ``buffers`` is
    then ``nn.Module.buffers``, a method)."""
    params = []
    for chunk in model_chunks or []:
        for name in ("buffers", "expert_parallel_buffers"):
            held = getattr(chunk, name, None)
            for buf in held if isinstance(held, (list, tuple)) else []:
                params.extend(getattr(buf, "param_index_map", {}).keys())
    return params


def attach_after_setup(setup: Callable, log: Callable[[str], None], compiled: bool) -> Callable:
    """Wrap ``setup_model_and_optimizer``: give its optimizer the flat step where it applies."""

    @functools.wraps(setup)
    def setup_model_and_optimizer(*args, **kwargs):
        result = setup(*args, **kwargs)
        model, optimizer = result[0], result[1]
        subs = megatron_optimizers(optimizer)
        params = buffer_params(model)
        if len(subs) != 1:
            reason = f"{len(subs)} chained optimizers (the norm spans all of them)"
        else:
            reason = unsupported_reason(subs[0], params)
        if reason:
            from megagpt.fast_spec.fp8_weights import marked

            cast = ("; the FP8 linears' weights are cast in each forward instead"
                    if any(marked(p) for p in params) else "")
            log(f"fast optimizer: flat AdamW step not used: {reason}{cast}")
        else:
            state = attach(subs[0], params, compiled=compiled)
            fp8 = "" if state.fp8_weights is None else (
                f" and the FP8 copies of {state.fp8_weights.count} linear weights")
            log(f"fast optimizer: flat AdamW step over {state.grad.numel():,} gradient-buffer "
                f"elements ({state.grad.dtype}), {'compiled' if compiled else 'eager'}: "
                f"clip, AdamW and the bf16 weight copy{fp8} in one pass (--fast-disable "
                "flat-adam: megatron's step)")
        return result

    return setup_model_and_optimizer


# What ``flat_steps`` changes in megatron.
SETUP_MODEL_AND_OPTIMIZER = Change(
    TRAINING + "setup_model_and_optimizer", WRAPS, __name__,
    does="gives the optimizer it returns the flat AdamW step where it applies",
    why="one pass over flat buffers (clip, AdamW and the bf16 weight copy) instead of "
        "megatron's five",
    fingerprint="e564c0eccd76")
MEGATRON_CHANGES = (SETUP_MODEL_AND_OPTIMIZER,)


@contextlib.contextmanager
def flat_steps(log: Optional[Callable[[str], None]] = None,
               compiled: Optional[bool] = None) -> Iterator[None]:
    """Wrap megatron's ``setup_model_and_optimizer`` for the duration of the block, so that
    the optimizer it returns gets the flat step where it applies. ``compiled`` defaults to
    "on a GPU" (one kernel; eager runs the same update in chunks)."""
    import megatron.training.training as mtraining

    from megagpt import megatron_wrappers

    if compiled is None:
        compiled = torch.cuda.is_available()
    wrap = lambda setup: attach_after_setup(setup, log or (lambda s: None), compiled)  # noqa: E731
    with megatron_wrappers.wrapped(mtraining, [("setup_model_and_optimizer", __name__, wrap)]):
        yield

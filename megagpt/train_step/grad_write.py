"""Gradients written into megatron's gradient buffer, not added to a zeroed one.

Megatron's DDP zeroes its whole gradient buffer at the start of every step, and its backward
hook then adds each parameter's gradient into that buffer (``main_grad.add_(grad)``). With
one micro-batch per step and one data-parallel rank nothing is ever accumulated there: each
parameter receives exactly one gradient per step (autograd has already summed the uses of a
parameter used twice, like tied embeddings), and ``0 + g`` is ``g``. So the zero fill
(2 bytes per parameter in a bf16 buffer) and the add's read of the zeros (2 more) move memory
for nothing, and the add needs the gradient in a tensor of its own first: one more write
of the whole buffer and one more read of it per step (the kernel time and the step-time gain:
bench/notes/fast-path.md, "Gradients written"; bench/benchmarks.md, ``--fast-disable grad-write``).

With writing on (the default where it applies; ``--fast-disable grad-write`` turns it off):

- the buffer is not zeroed at the start of a step (megatron's bookkeeping is still reset);
- the DDP hook copies the gradient into ``main_grad`` instead of adding it (small ones,
  biases and norm weights, all together at the end of the backward pass);
- the fused layer's four weight GEMMs write their product straight into ``main_grad``
  (``layer.py``: beta = 0, no gradient tensor of their own, no copy);
- at the end of the backward pass (``finish_grad_sync``, before any reduction or optimizer
  step) every parameter that received no gradient in this step has its ``main_grad`` zeroed,
  so what the optimizer reads is exactly this step's gradients, as after megatron's zeroing.

Inside the full-iteration CUDA graph the hooks and ``finish_grad_sync`` run while the graph
is captured, so the copies, the GEMMs' writes and any zeroing are replayed each step. Each
``zero_grad_buffer`` decides for its own step whether to write; a second gradient of one
parameter in one step (accumulation after all) stops the run rather than overwrite the first.

It applies when one micro-batch per step reaches one data-parallel rank and nothing else adds
into ``main_grad`` (megatron's gradient-accumulation fusion, the distributed optimizer, FSDP
and buffers with extra local gradients are excluded);
``megagpt.launch.fast_path_reasons.grad_write_unsupported_reason(args, path)`` says why not.

Writing is on inside ``writing()`` (its wrappers of megatron's DDP methods, through
``megagpt.megatron_wrappers``): process-wide while they are in place, as megatron's DDP methods
are. The hooks made meanwhile outlive the block, and do megatron's work for a DDP that did not
start its last step under the wrappers (one that did still counts that step as written).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

from megagpt import megatron_wrappers
from megagpt.fast_spec.grad_marks import open_step, written_by_gemm
from megagpt.megatron_change import WRAPS, Change


def grad_write_enabled() -> bool:
    """Whether the next ``zero_grad_buffer`` of an eligible DDP starts a step that writes
    (inside ``writing``)."""
    from megatron.core.distributed import DistributedDataParallel as DDP

    return __name__ in megatron_wrappers.installed(DDP, "zero_grad_buffer")


def _eligible(ddp) -> bool:
    """Whether this DDP instance's buffers hold nothing but its hooks' gradients."""
    buffers = list(getattr(ddp, "buffers", []))
    return (not getattr(ddp, "expert_parallel_buffers", None)
            and all(not getattr(b, "extra_main_grads", None) for b in buffers))


def _active(ddp) -> bool:
    """Decided by each ``zero_grad_buffer`` (the start of a step) for that step."""
    return getattr(ddp, "_megagpt_grad_write_step", False)


def _written(ddp) -> set:
    written = getattr(ddp, "_megagpt_grads_written", None)
    if written is None:
        written = ddp._megagpt_grads_written = set()
    return written


# Gradients held in at most this many bytes (biases, norm weights) are copied together at
# the end of the backward pass, in a few multi-tensor kernels instead of one copy kernel
# each: ~200 copies of a few KB per 1.3B step, each a kernel launch and a gap in the graph.
# The larger ones are copied at once, so that no big gradient (nor a big tensor a small
# gradient is a view of) outlives its hook.
_COPY_LATER_MAX_BYTES = 4 << 20


def _copy_later(ddp, grad) -> bool:
    """Whether gradient ``grad`` may wait for ``finish_grad_sync`` to reach ``main_grad``:
    its storage is small, and nothing reads the buffer before then (with overlapped
    reduction megatron starts a bucket's reduction as soon as its last gradient arrives)."""
    return (grad.untyped_storage().nbytes() <= _COPY_LATER_MAX_BYTES
            and not getattr(getattr(ddp, "ddp_config", None), "overlap_grad_reduce", False))


def _pending_copies(ddp) -> list:
    pending = getattr(ddp, "_megagpt_pending_copies", None)
    if pending is None:
        pending = ddp._megagpt_pending_copies = []
    return pending


def _copy_pending(ddp) -> None:
    """The small gradients held back by the hooks, into ``main_grad`` (one multi-tensor copy
    per dtype pair)."""
    import torch

    pending = _pending_copies(ddp)
    by_dtypes: dict = {}
    for dst, src in pending:
        dsts, srcs = by_dtypes.setdefault((dst.dtype, src.dtype, dst.device), ([], []))
        dsts.append(dst)
        srcs.append(src)
    for dsts, srcs in by_dtypes.values():
        torch._foreach_copy_(dsts, srcs)
    pending.clear()


def _second_gradient(param) -> RuntimeError:
    return RuntimeError(
        f"gradients written: a second gradient of a parameter of shape {tuple(param.shape)} "
        "arrived in one step (more than one micro-batch, or a parameter's gradient "
        "accumulated outside megagpt's fused layer); gradients must be added there: "
        "relaunch with --fast-disable grad-write")


# What ``writing`` changes in megatron, in the order it installs it.
_DDP = "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel."
BACKWARD_POST_HOOK = Change(
    _DDP + "_make_backward_post_hook", WRAPS, __name__,
    does="makes hooks that copy each gradient into the buffer where the step writes",
    why="its hook adds each gradient into the buffer megatron zeroed; with one micro-batch "
        "per step and one data-parallel rank the hook copies instead",
    fingerprint="01aa652d523b")
ZERO_GRAD_BUFFER = Change(
    _DDP + "zero_grad_buffer", WRAPS, __name__,
    does="decides whether the step writes; where it does, resets megatron's bookkeeping only",
    why="it fills the whole gradient buffer with zeros every step (2.6 GB at 1.3B); gradients "
        "are written while these wrappers are installed, process-wide as megatron's DDP "
        "methods are",
    fingerprint="3e76d9a34a92")
FINISH_GRAD_SYNC = Change(
    _DDP + "finish_grad_sync", WRAPS, __name__,
    does="zeroes the parameters that got no gradient this step and copies the small "
         "gradients held back, before any reduction",
    why="where the step writes, nothing zeroed the buffer: what the optimizer reads must be "
        "exactly this step's gradients",
    fingerprint="2081a02efcfb")
MEGATRON_CHANGES = (BACKWARD_POST_HOOK, ZERO_GRAD_BUFFER, FINISH_GRAD_SYNC)


@contextlib.contextmanager
def writing(log: Optional[Callable[[str], None]] = None) -> Iterator[None]:
    """Wrap megatron's DDP hook factory, ``zero_grad_buffer`` and ``finish_grad_sync`` for the
    duration of the block, which turns writing on. Each ``zero_grad_buffer`` decides for its
    step whether to write (a DDP whose buffers hold only its hooks' gradients); otherwise the
    wrappers do megatron's work unchanged. Enter before the model is wrapped in DDP: the hooks
    are made then."""
    from megatron.core.distributed import DistributedDataParallel as DDP

    wrappers = (("_make_backward_post_hook", _writing_hooks),
                ("zero_grad_buffer", _zeroing_when_not_writing),
                ("finish_grad_sync", _zeroing_what_got_no_gradient))
    with megatron_wrappers.wrapped(DDP, [(name, __name__, wrap) for name, wrap in wrappers]):
        if log:
            log(_LOG_LINE)
        yield


def _writing_hooks(make_hook):
    def _make_backward_post_hook(self, param):
        megatron_hook = make_hook(self, param)

        def hook(*unused):
            if _active(self) and param in self.param_to_bucket_group and param.grad is not None:
                written = _written(self)
                if param in written:
                    raise _second_gradient(param)
                written.add(param)
                if param.grad_added_to_main_grad:
                    if not written_by_gemm(param):
                        # added into main_grad by something else: onto last step's values
                        raise _second_gradient(param)
                    return megatron_hook(*unused)
                if _copy_later(self, param.grad):
                    _pending_copies(self).append((param.main_grad, param.grad.data))
                else:
                    param.main_grad.copy_(param.grad.data)
                param.grad_added_to_main_grad = True  # megatron's hook: do not add ...
                # ... unless zero_out_wgrad: megatron marks a tied embedding so, for TE's
                # fused output layer, whose placeholder is zeros; here the gradient holds both
                # uses, copied already
                zero_out = getattr(param, "zero_out_wgrad", False)
                param.zero_out_wgrad = False
                try:
                    return megatron_hook(*unused)
                finally:
                    param.zero_out_wgrad = zero_out
            return megatron_hook(*unused)

        return hook

    return _make_backward_post_hook


def _zeroing_when_not_writing(zero_grad_buffer):
    def _zero_grad_buffer(self):
        active = _eligible(self)
        self._megagpt_grad_write_step = active
        _written(self).clear()
        _pending_copies(self).clear()
        for param in self.params_with_grad:
            open_step(param, active)
            if active:
                param.grad_added_to_main_grad = False
        if not active:
            return zero_grad_buffer(self)
        # megatron's reset without the fill: every main_grad is written during the step,
        # or zeroed at its end if it gets no gradient
        for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:
            bucket_group.reset()

    return _zero_grad_buffer


def _zeroing_what_got_no_gradient(finish_grad_sync):
    def _finish_grad_sync(self, *args, **kwargs):
        if _active(self):
            _copy_pending(self)
            written = _written(self)
            for param in self.params_with_grad:
                if param not in written:
                    param.main_grad.zero_()  # no gradient this step: zero, as megatron's fill
                    written.add(param)
        return finish_grad_sync(self, *args, **kwargs)

    return _finish_grad_sync


_LOG_LINE = ("fast path: gradients written into megatron's buffer, not zeroed and added "
             "(--fast-disable grad-write adds them)")

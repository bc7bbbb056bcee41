"""Keep the host from waiting for the GPU inside every training iteration.

Megatron's training loop reads values back from the GPU several times per iteration, and
every read (``.item()``, or building a CUDA tensor from a Python number, which copies from
pageable memory and waits) stalls the CPU until all queued GPU work is done. While the CPU
then runs the rest of the step in Python — optimizer bookkeeping, logging, the next batch,
zeroing gradients — the GPU idles. A profile at the 345M shape (``bench/profile_entry.py``;
figures: bench/notes/fast-path.md, "Asynchronous step") put the largest idle gaps after these reads:

1. the gradient norm: without TE's ``multi_tensor_scale_tensor`` megatron brings the norm
   to the host to decide the clipping factor. ``optim.foreach_multi_tensor_scale_tensor``
   (installed by ``optimizer.fast_kernels(tensor_clip=True)``) is TE's kernel in torch
   ``_foreach`` form, with which megatron clips by a tensor coefficient and returns the norm
   as a tensor (one extra pass over the fp32 gradients, no wait);
2. ``logical_and_across_model_parallel_group`` / ``reduce_max_stat_across_model_parallel_group``
   after every step and for the learning rate in ``training_log``: an all-reduce over the
   model-parallel group followed by ``.item()``. Over a group of one rank (no tensor,
   pipeline or context parallelism) the all-reduce is the identity; the wrapper returns the
   value unchanged there and calls megatron's function otherwise;
3. ``training_log`` builds ``torch.tensor([0.0], device='cuda')`` per loss key per iteration
   (the default of a ``dict.get``): within it, scalar CUDA tensors are built in pinned host
   memory and copied without blocking (same values, no wait);
4. with ``--exit-signal-handler``, ``DistributedSignalHandler.signals_received`` all-gathers
   a flag each iteration; over one process that is the local flag;
5. ``optimizer.get_loss_scale().item()`` in the loop, every iteration, for the log: without a
   grad scaler (bf16) the scale is a constant one, which ``host_loss_scale_of_one`` keeps on
   the host.

(megatron's rerun state machine also all-reduces a flag before every step unless
``--rerun-mode disabled``; ``resilience.divergence`` chooses that mode by default.)

The gradient norm then stays on the GPU until something needs it: the log line every
``--log-interval`` iterations and the divergence guard (``resilience.divergence``), which
reads each norm one iteration late — by then the GPU is working on the next iteration, so
the read does not idle it — and before every checkpoint save.

``without_host_waits(log)`` wraps them through ``megagpt.megatron_wrappers`` for the duration
of a block; ``--fast-disable async-step`` keeps megatron's behaviour.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

from megagpt.megatron_change import TRAINING, WRAPS, Change


def _group_size(group) -> int:
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group)


def _model_parallel_group(group):
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_model_parallel_group()


def single_rank_reduce_max_stat(original: Callable) -> Callable:
    """``reduce_max_stat_across_model_parallel_group`` without the all-reduce over one rank.

    A tensor statistic (the gradient norm kept on the GPU) comes back as a 0-dim tensor, so
    that ``f"{grad_norm:.3f}"`` and tensorboard's ``add_scalar`` read it only when they log.
    """

    @functools.wraps(original)
    def reduce_max_stat(stat, group=None):
        if _group_size(_model_parallel_group(group)) == 1:
            if isinstance(stat, torch.Tensor):
                return stat.detach().reshape(()).float()
            return stat
        if isinstance(stat, torch.Tensor):
            stat = float(stat)
        return original(stat, group=group)

    return reduce_max_stat


def single_rank_logical_and(original: Callable) -> Callable:
    """``logical_and_across_model_parallel_group`` without the all-reduce over one rank."""

    @functools.wraps(original)
    def logical_and(input, group=None):
        if _group_size(_model_parallel_group(group)) == 1:
            return bool(input)
        return original(input, group=group)

    return logical_and


def single_process_all_gather_item(original: Callable) -> Callable:
    """``dist_signal_handler.all_gather_item`` over a world of one process: ``[item]``."""

    @functools.wraps(original)
    def all_gather_item(item, dtype, group=None, async_op=False, local_rank=None):
        if _group_size(group) == 1:
            return [item]
        return original(item, dtype, group=group, async_op=async_op, local_rank=local_rank)

    return all_gather_item


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    return torch.device(device).type == "cuda"


def to_device_without_waiting(host: torch.Tensor, device) -> torch.Tensor:
    """``host.to(device)`` through pinned memory: a copy from pageable memory would
    synchronise the stream, this one is queued behind the work already there."""
    if _is_cuda(device) and torch.cuda.is_available():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class NonBlockingScalarTensors(TorchFunctionMode):
    """``torch.tensor(python_data, device=cuda)`` built in pinned memory, copied async.

    The plain call copies from pageable memory and synchronises the stream; this gives the
    same tensor without waiting. Everything else passes through untouched.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tensor and _is_cuda(kwargs.get("device")) and args and not (
            isinstance(args[0], torch.Tensor)
        ):
            device = kwargs.pop("device")
            return to_device_without_waiting(torch.tensor(*args, **kwargs), device)
        return func(*args, **kwargs)


def without_blocking_scalar_tensors(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with NonBlockingScalarTensors():
            return fn(*args, **kwargs)

    return wrapper


def host_loss_scale_of_one(setup: Callable) -> Callable:
    """Wrap ``setup_model_and_optimizer``: a bf16 optimizer's constant loss scale lives on
    the host.

    Without a grad scaler (bf16, fp32) megatron's loss scale is a constant one held as a
    CUDA tensor, and the training loop calls ``optimizer.get_loss_scale().item()`` every
    iteration just to log it — a wait for the GPU. As a 0-dim CPU tensor it scales the loss
    the same way (a CPU scalar times a CUDA tensor) and reads back for free.
    """

    @functools.wraps(setup)
    def setup_model_and_optimizer(*args, **kwargs):
        result = setup(*args, **kwargs)
        optimizer = result[1] if isinstance(result, tuple) and len(result) > 1 else None
        for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            if (opt is not None and getattr(opt, "grad_scaler", "absent") is None
                    and isinstance(getattr(opt, "_scale_one", None), torch.Tensor)):
                opt._scale_one = torch.tensor(1.0, dtype=opt._scale_one.dtype)
        return result

    return setup_model_and_optimizer


# What ``without_host_waits`` changes in megatron, in the order it installs it.
REDUCE_MAX_STAT = Change(
    TRAINING + "reduce_max_stat_across_model_parallel_group", WRAPS, __name__,
    does="returns the value itself over a model-parallel group of one rank",
    why="an all-reduce followed by .item() each iteration; over a model-parallel group of one "
        "rank it is the identity, and the gradient norm stays on the GPU",
    fingerprint="7189f9a94723")
LOGICAL_AND = Change(
    TRAINING + "logical_and_across_model_parallel_group", WRAPS, __name__,
    does="returns the flag itself over a model-parallel group of one rank",
    why="an all-reduce followed by .item() after every step; the identity over one rank",
    fingerprint="aaa17a1cbd04")
ALL_GATHER_ITEM = Change(
    "megatron.training.dist_signal_handler.all_gather_item", WRAPS, __name__,
    does="returns the local flag over one process",
    why="with --exit-signal-handler it all-gathers a flag every iteration; over one process "
        "that is the local flag",
    fingerprint="6554fa85bd11")
TRAINING_LOG = Change(
    TRAINING + "training_log", WRAPS, __name__,
    does="builds its scalar CUDA tensors in pinned memory and copies them without blocking",
    why="it builds torch.tensor([0.0], device='cuda') per loss key each iteration, a copy "
        "from pageable memory that waits for the GPU; built in pinned memory it does not",
    fingerprint="7e7ebec01bcf", needle="torch.tensor([0.0], dtype=torch.float, device='cuda')")
SETUP_MODEL_AND_OPTIMIZER = Change(
    TRAINING + "setup_model_and_optimizer", WRAPS, __name__,
    does="keeps a bf16 optimizer's constant loss scale of one on the host",
    why="the loop's optimizer.get_loss_scale().item() then does not wait for the GPU; outside "
        "the flat step's wrapper (it reads the optimizer that one has finished)",
    fingerprint="e564c0eccd76", outside=("megagpt.train_step.flat_adam",))
MEGATRON_CHANGES = (REDUCE_MAX_STAT, LOGICAL_AND, ALL_GATHER_ITEM, TRAINING_LOG,
                    SETUP_MODEL_AND_OPTIMIZER)


@contextlib.contextmanager
def without_host_waits(log: Optional[Callable[[str], None]] = None) -> Iterator[None]:
    """Wrap megatron's training loop for the duration of the block (see the module
    docstring)."""
    import megatron.training.dist_signal_handler as msignal
    import megatron.training.training as mtraining

    from megagpt import megatron_wrappers

    changes = [
        (mtraining, "reduce_max_stat_across_model_parallel_group", __name__,
         single_rank_reduce_max_stat),
        (mtraining, "logical_and_across_model_parallel_group", __name__, single_rank_logical_and),
        (msignal, "all_gather_item", __name__, single_process_all_gather_item),
        (mtraining, "training_log", __name__, without_blocking_scalar_tensors),
        (mtraining, "setup_model_and_optimizer", __name__, host_loss_scale_of_one),
    ]
    with megatron_wrappers.wrapped_all(changes):
        if log:
            log("fast path: no host synchronisation inside a step (single-rank reductions are "
                "identities; scalars logged without blocking; --fast-disable async-step keeps "
                "megatron's)")
        yield

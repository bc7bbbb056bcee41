"""CUDA out of memory in training, as one line: what was allocated, what the dry run
expected, and what lowers it.

The dry run's memory estimate (``megagpt.preflight.estimate``) is computed again for this
launch's validated arguments, and once more for each knob that lowers it (half the
micro-batch, selective then full recompute, the distributed optimizer, twice the TP or PP);
the knobs are named largest saving first, each with the estimate it leads to. The peak is
torch's (``max_memory_allocated``, plus the allocation that failed). With megatron's
``--record-memory-history`` megatron dumps a snapshot at the failure itself (its
out-of-memory observer, ``<--memory-snapshot-path>_oom_rank-<rank>``): the line names it, for
torch's memory viewer (https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass

from megagpt.errors import UserError

GIB = 2**30


class OutOfMemory(UserError):
    """CUDA ran out of memory in training; the message says how far and what lowers it."""


def out_of_memory_in(exc: BaseException) -> BaseException | None:
    """torch's out-of-memory error, where ``exc`` is one or was raised from one (a compiled
    region reports a failed allocation wrapped in its own error)."""
    import torch

    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, torch.OutOfMemoryError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def is_out_of_memory(exc: BaseException) -> bool:
    return out_of_memory_in(exc) is not None


@dataclass(frozen=True)
class Knob:
    flags: str  # what to add to the command line
    estimate_bytes: float  # the dry run's estimate with it

    def saving(self, base: float) -> float:
        return base - self.estimate_bytes


def estimate_bytes(args) -> float:
    """The dry run's memory estimate per GPU (most loaded rank) for validated ``args``."""
    from megagpt.preflight import estimate as est

    params = est.count_parameters(args)
    return est.estimate_memory(args, params, est.microbatches_per_step(args)).total


def _with(args, **changes):
    changed = copy.copy(args)
    for name, value in changes.items():
        setattr(changed, name, value)
    return changed


def _layouts(args) -> list[tuple[str, object]]:
    """(flags, args) for each change of the launch that lowers memory and still divides."""
    out = []
    mbs, gbs, dp = args.micro_batch_size, args.global_batch_size, args.data_parallel_size
    if mbs > 1:
        out.append((f"--micro-batch-size {mbs // 2}", _with(args, micro_batch_size=mbs // 2)))
    if args.recompute_granularity is None:
        out.append(("--recompute-activations", _with(args, recompute_granularity="selective")))
    if args.recompute_granularity != "full":
        out.append(("--recompute-granularity full --recompute-method uniform "
                    "--recompute-num-layers 1",
                    _with(args, recompute_granularity="full", recompute_method="uniform",
                          recompute_num_layers=1)))
    if not args.use_distributed_optimizer and dp > 1:
        out.append(("--use-distributed-optimizer", _with(args, use_distributed_optimizer=True)))
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    for flag, attr, size, divides in (
            ("--tensor-model-parallel-size", "tensor_model_parallel_size", 2 * tp,
             args.num_attention_heads % (2 * tp) == 0 and groups % (2 * tp) == 0),
            ("--pipeline-model-parallel-size", "pipeline_model_parallel_size", 2 * pp,
             args.num_layers % (2 * pp) == 0)):
        model_parallel = 2 * tp * pp * cp
        if not divides or args.world_size % model_parallel:
            continue
        new_dp = args.world_size // model_parallel  # the GPUs stay: DP gives them up
        if gbs % (mbs * new_dp):
            continue
        out.append((f"{flag} {size}", _with(args, **{attr: size, "data_parallel_size": new_dp})))
    return out


def memory_knobs(args) -> tuple[float, list[Knob]]:
    """(this launch's estimate, the knobs that lower it, largest saving first)."""
    base = estimate_bytes(args)
    knobs = []
    for flags, changed in _layouts(args):
        try:
            knobs.append(Knob(flags, estimate_bytes(changed)))
        except (NotImplementedError, ZeroDivisionError):
            continue
    knobs = [k for k in knobs if k.saving(base) > 0]
    knobs.sort(key=lambda k: -k.saving(base))
    return base, knobs


def requested_bytes(exc: BaseException) -> float | None:
    """The allocation that failed, from torch's message ("Tried to allocate 2.00 GiB")."""
    match = re.search(r"Tried to allocate ([0-9.]+) (GiB|MiB|KiB|B)", str(exc))
    if not match:
        return None
    scale = {"GiB": GIB, "MiB": 2**20, "KiB": 2**10, "B": 1}[match.group(2)]
    return float(match.group(1)) * scale


def snapshot_file(args, rank: int) -> str | None:
    """Where megatron's out-of-memory observer wrote this rank's snapshot, if it did."""
    if not getattr(args, "record_memory_history", False):
        return None
    base, ext = os.path.splitext(args.memory_snapshot_path)
    path = f"{base}_oom_rank-{rank}{ext}"
    return path if os.path.exists(path) else None


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def describe(exc: BaseException, args, rank: int, iteration: int | None, peak_bytes: float,
             capacity_bytes: float | None, estimate: float | None, knobs: list[Knob],
             snapshot: str | None) -> str:
    requested = requested_bytes(exc)
    at = f"at iteration {iteration + 1}" if iteration is not None else "in training"
    need = f" + the {_gib(requested)} it asked for" if requested else ""
    of = f" of {_gib(capacity_bytes)}" if capacity_bytes else ""
    parts = [f"CUDA out of memory {at} on rank {rank}: {_gib(peak_bytes)} allocated at the "
             f"peak{need}{of}"]
    if estimate is not None:
        parts.append(f"the dry run's estimate for this launch is {_gib(estimate)} per GPU "
                     "(most loaded rank, with the runtime reserve; --dry-run shows its parts)")
    if knobs:
        parts.append("lower it with " + ", ".join(
            f"{k.flags} (→ {_gib(k.estimate_bytes)})" for k in knobs))
    elif estimate is not None:
        parts.append("nothing the entry can change lowers the estimate on "
                     f"{args.world_size} GPU{'s' if args.world_size > 1 else ''}: more GPUs "
                     "(with a larger TP or PP), or a smaller model or sequence")
    if snapshot:
        parts.append(f"memory snapshot: {snapshot} (https://pytorch.org/memory_viz)")
    elif not getattr(args, "record_memory_history", False):
        parts.append("--record-memory-history writes a snapshot of what was allocated at the "
                     "failure (torch's memory viewer reads it)")
    return "; ".join(parts)


def out_of_memory_error(exc: BaseException, args) -> OutOfMemory:
    """The one-line error for ``exc`` (or the out-of-memory error under it) on this rank."""
    import torch

    exc = out_of_memory_in(exc) or exc

    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory \
        if cuda else None
    try:
        estimate, knobs = memory_knobs(args)
    except (NotImplementedError, AttributeError, TypeError, ZeroDivisionError):
        estimate, knobs = None, []  # a model the estimate does not cover (MoE, MLA)
    return OutOfMemory(describe(exc, args, rank, getattr(args, "curr_iteration", None), peak,
                                capacity, estimate, knobs, snapshot_file(args, rank)))

"""CUDA out of memory in training, as one line: what was allocated, what the dry run
expected, and what lowers it.

The dry run's estimate and the knobs that lower it come from the caller
(``memory_knobs``: ``megagpt.preflight.memory_knobs.memory_knobs``, which the entry hands in,
so that this package, below the dry run, does not reach up into it); the knobs are named
largest saving first, each with the estimate it leads to. The peak is
torch's (``max_memory_allocated``, plus the allocation that failed). With megatron's
``--record-memory-history`` megatron dumps a snapshot at the failure itself (its
out-of-memory observer, ``<--memory-snapshot-path>_oom_rank-<rank>``): the line names it, for
torch's memory viewer (https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable

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


def out_of_memory_error(exc: BaseException, args,
                        memory_knobs: Callable[[object], tuple[float, list[Knob]]] | None = None
                        ) -> OutOfMemory:
    """The one-line error for ``exc`` (or the out-of-memory error under it) on this rank;
    ``memory_knobs(args)``: the dry run's estimate and the knobs that lower it (None: the line
    names neither)."""
    import torch

    exc = out_of_memory_in(exc) or exc

    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory \
        if cuda else None
    estimate, knobs = None, []
    if memory_knobs is not None:
        try:
            estimate, knobs = memory_knobs(args)
        except (NotImplementedError, AttributeError, TypeError, ZeroDivisionError):
            estimate, knobs = None, []  # a model the estimate does not cover (MoE, MLA)
    return OutOfMemory(describe(exc, args, rank, getattr(args, "curr_iteration", None), peak,
                                capacity, estimate, knobs, snapshot_file(args, rank)))

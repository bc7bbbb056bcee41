"""A deadline on the full-iteration CUDA graph's capture: a stuck capture stops the run.

A capture whose collectives wait for a peer that never joins (NCCL connecting a peer lazily,
a rank that took another branch) blocks its process for good: the launcher sees a hung
job, not an error. ``deadline(timeout_s, log)`` wraps megatron's
``FullCudaGraphWrapper.__call__``: the iteration that captures (megatron's barrier, the
capture, the barrier after it and the first replay) runs under ``run_with_deadline``. If it
has not returned after ``timeout_s`` seconds, this rank prints one line naming itself and
exits with status 3; torchrun then stops the other ranks.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Callable, Iterator, Optional, TextIO

from megagpt.megatron_change import WRAPS, Change

EXIT_STATUS = 3


def run_with_deadline(call: Callable, timeout_s: float, what: str, rank: int,
                      exit_fn: Callable[[int], None] = os._exit,
                      stream: Optional[TextIO] = None):
    """``call()``; if it has not returned within ``timeout_s``, print an ``error:`` line
    naming ``rank`` and ``what`` and call ``exit_fn(EXIT_STATUS)`` from a watcher thread
    (``os._exit``: the stuck main thread cannot be interrupted from Python)."""
    done = threading.Event()

    def watch():
        if not done.wait(timeout_s):
            out = stream or sys.stderr
            print(f"error: rank {rank}: {what} did not finish within {timeout_s:g} s; "
                  "stopping rather than hanging (--fast-cuda-graph-capture-timeout sets the "
                  "limit; --fast-cuda-graphs none runs without the graph)", file=out, flush=True)
            exit_fn(EXIT_STATUS)

    watcher = threading.Thread(target=watch, name="megagpt-capture-watchdog", daemon=True)
    watcher.start()
    try:
        return call()
    finally:
        done.set()
        watcher.join(timeout=5)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _under_deadline(timeout_s: float):
    """A wrapper of ``FullCudaGraphWrapper.__call__`` whose capturing call has ``timeout_s``."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    def wrap(inner):
        def __call__(self, *args, **kwargs):
            stage = "validation" if kwargs.get("forward_only") else "training"
            if FullCudaGraphWrapper.curr_iteration[stage] != self.cuda_graph_warmup_steps:
                return inner(self, *args, **kwargs)
            return run_with_deadline(lambda: inner(self, *args, **kwargs), timeout_s,
                                     f"the full-iteration CUDA graph capture ({stage})", _rank())
        return __call__
    return wrap


# What ``deadline`` changes in megatron.
FULL_CUDA_GRAPH_CALL = Change(
    "megatron.core.full_cuda_graph.FullCudaGraphWrapper.__call__", WRAPS, __name__,
    does="runs the capturing iteration under a deadline that stops the run with one line "
         "naming the rank",
    why="a capture whose collectives wait for a peer that never joins blocks its process for "
        "good",
    fingerprint="53c96c89e211", needle="curr_iteration == self.cuda_graph_warmup_steps")
MEGATRON_CHANGES = (FULL_CUDA_GRAPH_CALL,)


@contextlib.contextmanager
def deadline(timeout_s: float, log: Optional[Callable[[str], None]] = None) -> Iterator[None]:
    """Put the capture iteration of megatron's full-iteration graph under the deadline for the
    duration of the block (through ``megagpt.megatron_wrappers``)."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    from megagpt import megatron_wrappers

    with megatron_wrappers.wrapped(FullCudaGraphWrapper,
                                   [("__call__", __name__, _under_deadline(timeout_s))]):
        if log:
            log(f"fast path: the full-iteration graph's capture must finish within "
                f"{timeout_s:g} s (--fast-cuda-graph-capture-timeout)")
        yield

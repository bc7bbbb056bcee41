"""The collective timeout over a run: long while the first iterations warm up, then tight.

Megatron creates every process group with ``--distributed-timeout-minutes`` (10 by default):
a rank that stops answering holds all the others for that long. The first iterations need
it (compilation, CUDA-graph capture, the first data and checkpoint reads); after them a
collective that waits ten steps is stuck. After the warm-up iterations of each launch the
timeout becomes the plan's (``settings.TimeoutPolicy``: fixed, or derived from the measured
iteration time with a floor), set on every group through megatron's own
``parallel_state.update_pg_timeout`` (a barrier, then torch's ``set_timeout`` on each group
megatron made). A checkpoint save writes for as long as the file system needs, between
collectives, so it runs under the launch timeout again and the tight one comes back after.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Callable

from megagpt.diagnostics.settings import TimeoutPolicy, duration_text
from megagpt.megatron_change import TRAINING, WRAPS, Change


def set_collective_timeout(seconds: float) -> None:
    """Every process group megatron made (and the default one) waits ``seconds`` at most."""
    import warnings

    from megatron.core import parallel_state

    with warnings.catch_warnings():  # torch deprecates the name megatron calls, not the call
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        parallel_state.update_pg_timeout(timedelta(seconds=seconds))


# What ``CollectiveTimeout.relaxed`` changes in megatron (diagnostics.active installs it).
SAVE_CHECKPOINT = Change(
    TRAINING + "save_checkpoint", WRAPS, __name__,
    does="runs the save under the launch timeout; the tightened one comes back after",
    why="a save writes for as long as the file system needs between its collectives; "
        "outermost, so that the checksums' gather and the divergence guard's check run under "
        "it too",
    fingerprint="42e813b3aa30",
    outside=("megagpt.resilience.checkpoint_guard", "megagpt.resilience.config_snapshot",
             "megagpt.resilience.checkpoint_integrity", "megagpt.resilience.divergence"))
MEGATRON_CHANGES = (SAVE_CHECKPOINT,)


class CollectiveTimeout:
    """Follows one launch's iterations and sets the timeout the policy gives them."""

    def __init__(self, policy: TimeoutPolicy, log: Callable[[str], None],
                 apply: Callable[[float], None] = set_collective_timeout):
        self.policy = policy
        self.log = log
        self.apply = apply
        self.current_s = policy.launch_s
        self.tight_s: float | None = None
        self._first_iteration: int | None = None
        self._last_end: float | None = None
        self._periods: list[float] = []
        self.in_save = False  # read by on_sigterm: a save's collectives may wait for long

    def iteration_done(self, iteration: int) -> None:
        """Called after each iteration (megatron's count, 1 after the first): measures the
        iteration's period and, after the warm-up ones, tightens the timeout once."""
        now = time.monotonic()
        if self._first_iteration is None:
            self._first_iteration = iteration
        elif self._last_end is not None:
            self._periods.append(now - self._last_end)
        self._last_end = now
        done = iteration - self._first_iteration + 1
        if not self.policy.tightens or self.tight_s is not None \
                or done < self.policy.warmup_iterations:
            return
        # the first period measured is the second iteration's: the first's is the start-up
        # to a tenth of a second: the value logged is the value set (and the one a timed-out
        # collective reports)
        self.tight_s = round(self.policy.after_warmup(self._periods), 1)
        self._set(self.tight_s)
        slowest = round(max(self._periods), 3) if self._periods else None
        measured = f"the slowest warm iteration took {duration_text(slowest)}" \
            if slowest is not None else "one warm iteration"
        self.log(f"collective timeout: {duration_text(self.tight_s)} from iteration "
                 f"{iteration + 1} ({measured}; was {duration_text(self.policy.launch_s)})")

    @contextlib.contextmanager
    def relaxed(self):
        """The launch timeout for the enclosed block (a checkpoint save), the tight one after."""
        self.in_save = True
        try:
            if self.tight_s is None:
                yield
                return
            self._set(self.policy.launch_s)
            yield
            # not after a failed save: its process groups may be broken, and the error is
            # what the rank reports
            self._set(self.tight_s)
            self._last_end = time.monotonic()  # the save is not an iteration's period
        finally:
            self.in_save = False

    def _set(self, seconds: float) -> None:
        if seconds != self.current_s:
            self.apply(seconds)
            self.current_s = seconds

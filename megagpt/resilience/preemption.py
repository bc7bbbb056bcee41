"""Preemption: SIGTERM (what SLURM and Kubernetes send before a kill) saves and exits.

Megatron has the mechanism: with ``--exit-signal-handler`` every rank records the signal,
the ranks agree after each iteration (an all-gather of one flag), save a checkpoint to
``--save`` and leave with status 0; the data-loader workers ignore the signal instead of
dying under the trainer. It is off by default. This entry turns it on whenever ``--save``
is given: a run that writes checkpoints should not lose the work since the last one to
a routine preemption. ``--exit-duration-in-mins`` and ``--exit-interval`` (megatron's)
save and exit the same way. The next launch with the same command continues from the
newest complete checkpoint (``--load`` = ``--save``; see ``checkpoint_guard``).

Under torchrun, SIGTERM to torchrun is forwarded to every worker, which then has 30 s
(torchrun's grace period) to save before it is killed; the checkpoint must fit in that.

The data-loader workers take megatron's handler in megatron's ``worker_init_fn``, but torch's
worker loop installs a SIGTERM handler of its own first (the worker dies unless the trainer
sent the signal). A SIGTERM to the process group between the two (a preemption in the
seconds while the workers start; on a busy host, seconds into training) killed a worker, and
the trainer then stopped with "DataLoader worker ... killed by signal" wherever it was, in
the middle of its save too. ``workers_keep_running_through_sigterm`` closes that window: a
process forked while megatron's handler holds SIGTERM keeps the signal blocked.
"""

from __future__ import annotations

import contextlib
import os
import signal


_keeping_workers = False
_fork_hook_registered = False


def _megatrons_handler_holds_sigterm() -> bool:
    handler = signal.getsignal(signal.SIGTERM)
    return "DistributedSignalHandler" in getattr(handler, "__qualname__", "")


def _in_forked_child() -> None:
    """A child forked while megatron's exit-signal handler holds SIGTERM (a data-loader
    worker) blocks the signal: it stays pending, through torch's worker handler and
    megatron's after it, and the worker ends the way the trainer ends it (its queue's
    sentinel, or a kill)."""
    if _keeping_workers and _megatrons_handler_holds_sigterm():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


@contextlib.contextmanager
def workers_keep_running_through_sigterm():
    """For the duration of the block, processes forked while megatron's exit-signal handler
    holds SIGTERM keep SIGTERM blocked (see the module docstring)."""
    global _keeping_workers, _fork_hook_registered
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_in_forked_child)
        _fork_hook_registered = True
    _keeping_workers = True
    try:
        yield
    finally:
        _keeping_workers = False

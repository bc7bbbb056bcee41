"""A data-loader worker's death, raised once.

torch's DataLoader installs a SIGCHLD handler (its first iterator with workers does) that
raises "DataLoader worker (pid N) is killed by signal: ..." in the main thread as soon as a
worker has died. It then forgets that iterator's workers, but not the other iterators': with
the kernel's out-of-memory killer or a launcher's kill of the process group, which take every
worker, megatron's training, validation and test loaders each raise on a SIGCHLD of their
own, at whatever line the leaving run has reached. Raised inside torch's own bookkeeping of
a function mode, it leaves the mode stack broken; raised as a context's ``__exit__`` begins,
it takes the place of the first error before the launch's context has seen it, so that none
of the entry's handlers runs (status 1 and three chained tracebacks, where a SIGTERM's end is
status 143 and one line).

Once megatron's ``build_train_valid_test_data_iterators`` has made the iterators, torch's
handler stays, raising once: the first death still stops the run where it is, and the
DataLoader itself raises for a worker that is gone when it next reads from it. The handler
stays for the process (torch installs its own only once per process, and never removes it).
"""

from __future__ import annotations

import functools
import signal
import threading

from megagpt.megatron_change import TRAINING, WRAPS, Change

TORCHS_HANDLER_MODULE = "torch.utils.data._utils.signal_handling"


class RaisingOnce:
    """torch's SIGCHLD handler, quiet after the first error it raises."""

    def __init__(self, torchs_handler):
        self.torchs_handler = torchs_handler
        self.raised = False

    def __call__(self, signum, frame) -> None:
        if self.raised:
            return
        try:
            self.torchs_handler(signum, frame)
        except RuntimeError:
            self.raised = True
            raise


def raise_worker_deaths_once() -> bool:
    """Make torch's SIGCHLD handler, where it is the one installed, raise once (the main thread
    alone sets handlers). Whether it did."""
    if threading.current_thread() is not threading.main_thread():
        return False
    handler = signal.getsignal(signal.SIGCHLD)
    if getattr(handler, "__module__", None) != TORCHS_HANDLER_MODULE:
        return False  # no iterator with workers, or already ours
    signal.signal(signal.SIGCHLD, RaisingOnce(handler))
    return True


DATA_ITERATORS = Change(
    TRAINING + "build_train_valid_test_data_iterators", WRAPS, __name__,
    does="torch's SIGCHLD handler, installed by the iterators it makes, raises once",
    why="that handler raises a dead data-loader worker's error once for each loader, on "
        "SIGCHLDs after the first",
    fingerprint="bd84366cbf26")
MEGATRON_CHANGES = (DATA_ITERATORS,)


def after_building_iterators(build):
    """Wraps megatron's ``build_train_valid_test_data_iterators``: torch's handler, installed
    by the iterators it makes, raises once."""
    @functools.wraps(build)
    def building(*args, **kwargs):
        iterators = build(*args, **kwargs)
        raise_worker_deaths_once()
        return iterators
    return building

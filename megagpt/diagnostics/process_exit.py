"""The launch's process groups ended before the process exits, within a bounded wait.

megatron's ``pretrain`` returns with torch's process groups still up. Left to the
interpreter's exit, NCCL's ``ProcessGroupNCCL`` is torn down by its destructor; with the
flight recorder's dump on timeout on (``flight_recorder``: on by default), its heartbeat
monitor takes that teardown for a timed-out collective, starts a dump that never completes
("Flight recorder dump in heartbeatMonitor: std::future_error: Broken promise") and holds
the process for its heartbeat timeout (8 minutes) after the last iteration. Seen on one
H200 with torch 2.11: a 60-iteration 345M run finished training in 14 s and had not exited
5 minutes later. ``torch.distributed.destroy_process_group`` shuts the groups down in
order, as torch's documentation asks of every training script.

Ending them can itself wait on a rank that is gone (a rank stopped elsewhere, a launcher
ending the job): the wait is bounded, and past it the process exits with its status and a
line that says so rather than hanging where nothing is left to do.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable, Optional

# long enough for NCCL's communicators to be aborted in order, short against a launcher's
# patience (torchrun waits for every worker)
END_WAIT_S = 60.0


def end_process_groups(wait_s: float = END_WAIT_S,
                       log: Optional[Callable[[str], None]] = None) -> bool:
    """Destroy torch's process groups where they are up; True when that finished (or there
    were none) within ``wait_s`` seconds. It runs on a thread of its own, so that a teardown
    stuck on a missing peer does not keep the caller."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    failure: list[BaseException] = []

    def destroy():
        try:
            dist.destroy_process_group()
        except BaseException as exc:  # noqa: BLE001 (reported below; exiting regardless)
            failure.append(exc)

    ender = threading.Thread(target=destroy, name="megagpt-end-process-groups", daemon=True)
    ender.start()
    ender.join(wait_s)
    if ender.is_alive():
        if log:
            log(f"process groups did not end within {wait_s:.0f} s (a peer rank is gone?); "
                "exiting without them")
        return False
    if failure and log:
        log(f"ending the process groups: {type(failure[0]).__name__}: {failure[0]}")
    return True


def end_or_leave(status: int, log: Optional[Callable[[str], None]] = None,
                 wait_s: float = END_WAIT_S,
                 before_leaving: Optional[Callable[[], None]] = None) -> None:
    """At the end of a launch leaving with ``status``: its process groups ended
    (``end_process_groups``); where they would not end in time, the process leaves at once
    with that status (``os._exit``: the interpreter's own exit would wait in the same
    destructor), ``before_leaving`` called first (a traceback not yet printed)."""
    if end_process_groups(wait_s, log):
        return
    if before_leaving is not None:
        before_leaving()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class LaunchProcessGroups:
    """``end_or_leave`` for the groups a launch starts: where torch's process groups were
    up already when it began (a caller's, such as a test's or a notebook's), they are the
    caller's to end, and nothing is done."""

    def __init__(self):
        import torch.distributed as dist

        self.caller_had_groups = dist.is_available() and dist.is_initialized()

    def end_or_leave(self, status: int, log: Optional[Callable[[str], None]] = None,
                     **options) -> None:
        if not self.caller_had_groups:
            end_or_leave(status, log, **options)


def status_of(exc: SystemExit) -> int:
    """The exit status ``sys.exit(code)`` leaves with."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1

"""What a rank does when one of its collectives fails or hangs: its dump, the others', one line.

``FailureReporter`` is this rank's part, once per process: write its own flight-recorder dump
(under gloo; NCCL's watchdog writes its own), wait up to ``DUMP_WAIT_S`` for the other ranks'
dumps, read who did not join (``hangs.find_hang``), and have the lowest rank that wrote a dump
raise the one ``error:`` line (``CollectiveFailure``) while the others leave quietly. It is
started by the collective's error in the main thread (``exception_for``), by a SIGTERM that
finds the rank stuck (``on_sigterm``), or under NCCL by the watchdog's dump (``DumpWatcher``),
whichever comes first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from dataclasses import dataclass
from typing import Callable

from megagpt.diagnostics import flight_recorder
from megagpt.diagnostics.hangs import describe, describe_gone, failure_cause, find_hang
from megagpt.errors import UserError

# Seconds a rank whose collective failed waits for the other ranks' dumps: the others fail
# within about one step of it (their own waits time out, or their peers leave), and a rank
# that never writes one (stopped, killed) is waited for no longer than this.
DUMP_WAIT_S = 10.0
# The exit status of a rank that leaves the error line to another rank.
QUIET_EXIT_STATUS = 2


class CollectiveFailure(UserError):
    """A collective failed or timed out; the message names who did not join, and where."""


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's failure: torch.distributed's error types, or gloo's
    and NCCL's runtime errors (gloo raises a plain RuntimeError from its transport)."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(marker in text for marker in (
        "gloo/transport", "Connection closed by peer", "Connection reset by peer",
        "caused pair closure", "ProcessGroupNCCL", "NCCL communicator",
        "Watchdog caught collective"))


def termination_consequence(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain that a launcher's SIGTERM caused (``exc`` itself, or one it
    was raised while handling), else None. torch's SIGCHLD handler raises "DataLoader worker ...
    killed" at whatever Python line runs when a worker dies, inside a torch function mode's
    own bookkeeping too: the mode stack is then left broken, and leaving the mode raises
    "trying to pop from empty mode stack" in place of the worker's error."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if is_termination_consequence(exc):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def is_termination_consequence(exc: BaseException) -> bool:
    """Whether ``exc`` is what a launcher's SIGTERM does to a rank it ends: a collective cut
    short (a peer ended first), or the rank's data-loader workers ended under it (torchrun
    signals each rank's whole process group). Any other error after a SIGTERM — a save that
    megatron's exit-signal handler began and that failed, say — is the run's own."""
    return is_collective_failure(exc) or (isinstance(exc, RuntimeError)
                                          and "DataLoader worker" in str(exc))


@contextlib.contextmanager
def _sigterm_deferred():
    """While a rank reports, a launcher's SIGTERM (torchrun sends it to every rank once one
    has failed) waits: the report is bounded (``DUMP_WAIT_S``), and cut short it says nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class FailureReporter:
    """This rank's part in reporting a failed collective, once per process (from the main
    thread's exception, or from ``DumpWatcher``, whichever comes first)."""

    dump_prefix: str | None
    launched_at: float  # time.time() at the launch: older dumps in the folder are not this run's
    rank: int
    world_size: int
    backend: str
    resume_hint: Callable[[], str] = lambda: ""  # which checkpoint a relaunch resumes from
    dump_wait_s: float = DUMP_WAIT_S
    reported: bool = False

    def __post_init__(self):
        self._lock = threading.Lock()

    @property
    def folder(self) -> str | None:
        return (os.path.dirname(self.dump_prefix) or ".") if self.dump_prefix else None

    def report(self, cause: str, only_if_silent: bool = False,
               ended_by: str | None = None) -> tuple[str, int] | None:
        """(the line, the rank that prints it), after this rank's dump and the wait for the
        others'; None where this process has reported already, or (``only_if_silent``)
        where every rank wrote a dump (no rank is gone). ``ended_by``: the launcher ended
        this rank outside a collective, by the error in these few words; where a rank is gone,
        the line says so (the dumps then show no collective it was missing from)."""
        with self._lock:
            if self.reported:
                return None
            self.reported = True
            dumps = self._dumps()
            hang = find_hang(dumps, self.world_size) if dumps else None
            reporter = min(dumps) if dumps else self.rank
            gone = set(range(self.world_size)) - set(dumps) if dumps else set()
            if ended_by is not None and gone and not (hang is not None and hang.silent):
                return describe_gone(gone, ended_by, self.rank, self.folder, set(dumps),
                                     self.resume_hint()), reporter
            if only_if_silent and (hang is None or not hang.silent):
                return None
            return describe(hang, cause, self.rank, self.folder, set(dumps), self.world_size,
                            self.resume_hint()), reporter

    def _dumps(self) -> dict[int, dict]:
        """This rank's dump written, and the others' read once they are there (or after
        ``dump_wait_s``); empty without a recorder."""
        if self.dump_prefix is None:
            return {}
        if not flight_recorder.written_since(self.dump_prefix, self.rank, self.launched_at):
            with contextlib.suppress(Exception):  # a recorder that cannot dump says so below
                flight_recorder.write_this_ranks_dump(self.dump_prefix, self.rank,
                                                      self.backend)
        dumped = flight_recorder.wait_for_dumps(self.dump_prefix, self.world_size,
                                                self.launched_at, self.dump_wait_s)
        return flight_recorder.read_dumps(self.dump_prefix, dumped)

    def exception_for(self, exc: BaseException) -> BaseException:
        """What to raise in place of ``exc``: the one-line error on the reporting rank, a
        quiet exit on the others (and where the line was printed already)."""
        with _sigterm_deferred():
            reported = self.report(failure_cause(exc))
        if reported is not None and reported[1] == self.rank:
            return CollectiveFailure(reported[0])
        return SystemExit(QUIET_EXIT_STATUS)

    def exception_for_termination(self, exc: BaseException) -> BaseException:
        """What to raise in place of ``exc``, an error raised while a SIGTERM ends this rank
        (its collective cut short, or, outside any collective, its data-loader workers
        killed with it: torchrun signals each rank's whole process group): the one line
        where a rank is gone, else the quiet exit SIGTERM would have been."""
        outside = None if is_collective_failure(exc) else failure_cause(exc)
        reported = self.report("was cut short by a SIGTERM (the launcher's, once a rank has "
                               "ended)", only_if_silent=True, ended_by=outside)
        if reported is not None and reported[1] == self.rank:
            return CollectiveFailure(reported[0])
        return SystemExit(128 + signal.SIGTERM)


class DumpWatcher:
    """Under NCCL, torch's watchdog dumps the recorder when a collective times out and then
    ends the process, before Python sees an error: this thread notices this rank's dump
    (one ``stat`` a second) and reports it first, as a failed gloo collective is reported."""

    def __init__(self, reporter: FailureReporter, print_line, poll_s: float = 1.0):
        self.reporter = reporter
        self.print_line = print_line
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megagpt-dump-watcher",
                                        daemon=True)

    def start(self) -> "DumpWatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        r = self.reporter
        while not self._stop.wait(self.poll_s):
            if r.reported or not flight_recorder.written_since(r.dump_prefix, r.rank,
                                                               r.launched_at):
                continue
            reported = r.report("timed out: torch's NCCL watchdog dumped the recorder")
            if reported is not None and reported[1] == r.rank and not self._stop.is_set():
                self.print_line(f"error: {reported[0]}")
            return

"""A SIGTERM that finds this rank stuck inside a collective: reported before the kill.

When one rank dies (killed, crashed), torchrun sends SIGTERM to the others at once and kills
them 30 s later; a scheduler cancelling a hung job does the same. The survivors are then
waiting in a collective the dead rank will never join, and their own collective timeout
(``timeouts``) may be far off: without this, they die with nothing said. Python runs a signal
handler only in the main thread, and only once it is back in Python, which a rank blocked in
a collective is not; so the entry has Python write each signal's number to a socket
(``signal.set_wakeup_fd``) that a thread of its own reads. On SIGTERM the thread looks at the
flight recorder: a collective still pending after ``STUCK_S`` is stuck, and the rank reports
it as a failed collective (``collective_failure.FailureReporter``: its dump, the others', one line).

What SIGTERM then does is unchanged: with megatron's ``--exit-signal-handler`` (on whenever
``--save`` is given, ``megagpt.resilience.preemption``) megatron's handler keeps it, to save at
the end of the iteration; without it the rank ends as the default action would, once the
report is written (or at once, when no collective is stuck). Which of the two holds is read
when the signal comes, not when the watcher is installed: megatron installs its handler
later, while it initialises, over the watcher's stand-in for the default. (Read at install
time, the watcher ended every preempted rank with status 143 up to 2 s after SIGTERM, before
or during megatron's save.)
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import threading
import time

from megagpt.diagnostics.collective_failure import FailureReporter

# A collective still pending this long after SIGTERM is stuck: a healthy one, outside a
# save (which runs under the launch timeout and is not looked at), completes in less.
STUCK_S = 2.0

# How long an error a SIGTERM may have caused outside any collective (a data-loader worker
# killed with the rank) waits for the thread to read a signal on its socket: a dead worker is
# the run's end either way, and a SIGTERM already sent is read within milliseconds. (A failed
# collective does not wait: a launcher's SIGTERM after it must not decide its report.)
CATCH_UP_S = 1.0

_child_resets_installed = False
_wakeup_socket: socket.socket | None = None


def _pending_collective(backend: str) -> int | None:
    """The record id of the collective this rank waits in, from its recorder; None if none."""
    import torch._C._distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None) if backend != "nccl" else None
    dump = dump or c10d._dump_nccl_trace
    try:
        trace = pickle.loads(dump(includeCollectives=True, includeStackTraces=False,
                                  onlyActive=False))
    except Exception:  # noqa: BLE001 - no recorder, no process group yet: nothing is pending
        return None
    entries = sorted(trace.get("entries", ()), key=lambda e: e.get("record_id", 0))
    if backend == "nccl":
        pending = [e for e in entries if e.get("state") != "completed" and not e.get("retired")]
        return pending[0]["record_id"] if pending else None
    # gloo's collectives block the thread that calls them: the newest, until it is retired
    return entries[-1]["record_id"] if entries and not entries[-1].get("retired") else None


def _reset_in_child() -> None:
    """A forked process (a data-loader worker) must not write its signals to the trainer's
    socket: the trainer would take a worker's SIGTERM for its own."""
    if _wakeup_socket is None:
        return  # forked while no watcher was installed: nothing of ours to undo
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass


class SigtermWatcher:
    """The thread that reads the signals' socket; ``install``/``remove`` from the main thread."""

    def __init__(self, reporter: FailureReporter, print_line, in_save,
                 stuck_s: float = STUCK_S):
        self.reporter = reporter
        self.print_line = print_line
        self.in_save = in_save  # () -> bool: a save is running (its collectives are slow)
        self.stuck_s = stuck_s
        self._ours = False
        self._previous_handler = None
        self._previous_fd = -1
        self._read, self._write = socket.socketpair()
        self._read.settimeout(None)
        self._write.setblocking(False)
        self._received = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megagpt-sigterm",
                                        daemon=True)

    def install(self) -> "SigtermWatcher":
        global _child_resets_installed, _wakeup_socket
        if threading.current_thread() is not threading.main_thread():
            return self
        handler = signal.getsignal(signal.SIGTERM)
        if handler in (signal.SIG_DFL, None):
            # a Python handler makes Python write the signal to the socket; it does nothing
            # itself: the thread below decides (the default action, after the report)
            self._ours = True
            self._previous_handler = handler
            signal.signal(signal.SIGTERM, self._stand_in)
        elif handler is signal.SIG_IGN:
            return self  # someone wants SIGTERM ignored: so be it
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        _wakeup_socket = self._write
        if not _child_resets_installed:
            os.register_at_fork(after_in_child=_reset_in_child)
            _child_resets_installed = True
        self._thread.start()
        return self

    @staticmethod
    def _stand_in(signum, frame) -> None:
        """SIGTERM's default, while it is the watcher's: Python writes the signal to the
        socket for any Python handler; the thread decides."""

    def _default_is_ours(self) -> bool:
        """Whether SIGTERM still has the default action the watcher stands in for (no one,
        megatron's exit-signal handler say, has taken it since)."""
        return self._ours and signal.getsignal(signal.SIGTERM) == self._stand_in

    def remove(self) -> None:
        global _wakeup_socket
        if threading.current_thread() is not threading.main_thread():
            return
        if _wakeup_socket is self._write:
            signal.set_wakeup_fd(self._previous_fd)
            _wakeup_socket = None
        if self._default_is_ours():
            signal.signal(signal.SIGTERM, self._previous_handler or signal.SIG_DFL)
        self._ours = False
        try:
            self._write.send(b"\0")  # wakes the thread, which then ends
        except OSError:
            pass

    def _watch(self) -> None:
        while True:
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if not data or b"\0" in data:
                return
            if signal.SIGTERM in data:
                self._on_sigterm()

    def _stuck_collective(self) -> int | None:
        """The collective this rank is stuck in: pending now, or entered within ``stuck_s``
        (a launcher's SIGTERM can find a rank between two collectives, computing; the dead
        rank's peers reach their next one within a step), and still pending ``stuck_s``
        after that. None where the rank is not stuck, or its main thread reports a failed
        collective meanwhile."""
        r = self.reporter
        first = _pending_collective(r.backend)
        reach_by = time.monotonic() + self.stuck_s
        while first is None and not r.reported and time.monotonic() < reach_by:
            time.sleep(0.05)
            first = _pending_collective(r.backend)
        if first is None:
            return None
        time.sleep(self.stuck_s)
        # a save that began meanwhile (megatron's, on SIGTERM) may wait for long
        if _pending_collective(r.backend) == first and not self.in_save():
            return first
        return None

    @property
    def received(self) -> bool:
        """A SIGTERM has arrived: this rank is being ended."""
        return self._received.is_set()

    def received_within(self, timeout_s: float) -> bool:
        """Whether a SIGTERM has arrived, giving the thread ``timeout_s`` to read one that is
        on its socket: the main thread runs on, holding the interpreter's lock, and an error
        the signal caused there (a data-loader worker killed with the rank: torch's SIGCHLD
        handler raises at once) can reach its handler before the thread has said so."""
        return self._received.wait(timeout_s)

    def _on_sigterm(self) -> None:
        self._received.set()
        r = self.reporter
        stuck = None
        if r.dump_prefix is not None and not self.in_save():
            stuck = self._stuck_collective()
        if stuck is not None:
            reported = r.report(f"was still waiting {self.stuck_s:g} s after a SIGTERM (the "
                                "launcher's, once a rank has ended)")
            if reported is None:
                return  # the main thread reports (an error cut its collective short): it ends
            if reported[1] == r.rank:
                self.print_line(f"error: {reported[0]}")
        elif r.reported:
            return  # the main thread is reporting: it ends the process
        if self._default_is_ours():  # SIGTERM's default: end the process, stdout flushed
            import sys

            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + signal.SIGTERM)

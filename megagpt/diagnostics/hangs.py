"""A collective that failed or hung, said in one line from the flight recorder's dumps.

When a rank stops answering inside a collective, the other ranks of its group wait there
until the collective timeout (``timeouts``), and then their collective fails: under gloo it
raises in the calling thread; under NCCL torch's watchdog dumps the recorder and ends the
process. Either way every rank that still runs leaves a dump (``flight_recorder``), and the
dumps say who is missing: each rank's dump names the collective it waited in (group,
sequence number, operation, the Python frame that called it), and for every group the last
collective the rank entered (``pg_status``). A member of that group whose dump shows it never
entered that collective is elsewhere (its own waiting collective is named); a member with no
dump at all did not answer (stopped, killed, or on a node that is gone).

``find_hang(dumps)`` is that reading, a pure function of the dumps; ``describe`` the line.
``report_collective_failure`` is what a rank does when its collective fails: write its dump
(gloo), wait a stated margin for the others' dumps, and return the one-line error (on the
lowest rank that wrote a dump; the others leave quietly).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from dataclasses import dataclass
from typing import Callable

from megagpt.diagnostics import flight_recorder
from megagpt.errors import UserError

# Seconds a rank whose collective failed waits for the other ranks' dumps: the others fail
# within about one step of it (their own waits time out, or their peers leave), and a rank
# that never writes one (stopped, killed) is waited for no longer than this.
DUMP_WAIT_S = 10.0
# The exit status of a rank that leaves the error line to another rank.
QUIET_EXIT_STATUS = 2

# megatron's process-group descriptions (``parallel_state``'s group_desc) as users name them.
GROUP_LABELS = {
    "TENSOR_MODEL_PARALLEL_GROUP": "TP",
    "PIPELINE_MODEL_PARALLEL_GROUP": "PP",
    "CONTEXT_PARALLEL_GROUP": "CP",
    "DATA_PARALLEL_GROUP": "DP",
    "DATA_PARALLEL_GROUP_WITH_CP": "DP",  # the gradients' group: DP × CP (DP when CP is 1)
    "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "DP",
    "MODEL_PARALLEL_GROUP": "TP×PP",
    "TENSOR_AND_DATA_PARALLEL_GROUP": "TP×DP",
    "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "TP×DP×CP",
    "TENSOR_AND_CONTEXT_PARALLEL_GROUP": "TP×CP",
    "EMBEDDING_GROUP": "embedding (first and last PP stage)",
    "POSITION_EMBEDDING_GROUP": "position-embedding",
    "EXPERT_MODEL_PARALLEL_GROUP": "EP",
    "EXPERT_TENSOR_PARALLEL_GROUP": "expert TP",
    "EXPERT_DATA_PARALLEL_GROUP": "expert DP",
    "default_pg": "world",
}


class CollectiveFailure(UserError):
    """A collective failed or timed out; the message names who did not join, and where."""


def group_label(desc: str) -> str:
    base = desc[:-len("_GLOO")] if desc.endswith("_GLOO") else desc
    label = GROUP_LABELS.get(base, desc)
    return f"{label} (gloo)" if base != desc else label


def ranks_text(ranks) -> str:
    """[0, 1, 2, 3] -> '0-3'; [0, 2] -> '0, 2'."""
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


# ---------------------------------------------------------------------------
# Reading the dumps
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Waiting:
    """One rank inside one collective, as its dump shows it."""

    rank: int
    operation: str  # all_reduce, broadcast, ...
    group: str  # the process group's name (torch's)
    desc: str  # megatron's description of the group
    sequence: int  # the collective's number in its group
    created_ns: int
    site: str | None  # the first caller outside torch: file:line (function)

    @property
    def label(self) -> str:
        return group_label(self.desc)

    def describe(self) -> str:
        return f"{self.operation} #{self.sequence} of the {self.label} group"


@dataclass(frozen=True)
class Hang:
    """The collective some ranks waited in while members of its group did not join."""

    waiting: tuple[Waiting, ...]  # the members that entered it (one per rank)
    group_ranks: tuple[int, ...]
    silent: tuple[int, ...]  # members with no dump: they did not answer
    elsewhere: tuple[tuple[int, Waiting | None], ...]  # dumped, never entered it: where they were

    @property
    def collective(self) -> Waiting:
        return self.waiting[0]

    @property
    def missing(self) -> tuple[int, ...]:
        return tuple(sorted(self.silent + tuple(rank for rank, _ in self.elsewhere)))


def _operation(entry: dict) -> str:
    name = entry.get("profiling_name", "collective")
    return name.split(":", 1)[-1]  # "nccl:all_reduce" -> "all_reduce"


# Frames that are not the caller of a collective: torch's own, CPU mode's function mode
# (through which every torch call passes in --cpu runs), and Python's standard library.
_PASS_THROUGH = ("/torch/", "megagpt/cpu_mode.py")


def _passes_through(filename: str) -> bool:
    standard_library = "/lib/python3" in filename and "site-packages" not in filename
    return not filename or standard_library or any(p in filename for p in _PASS_THROUGH)


def _site(entry: dict) -> str | None:
    for frame in entry.get("frames") or ():
        filename = frame.get("filename", "")
        if _passes_through(filename):
            continue
        short = filename.split("site-packages/", 1)[-1]
        if os.path.isabs(short) and short.startswith(os.getcwd() + os.sep):
            short = os.path.relpath(short)
        return f"{short}:{frame.get('line')} ({frame.get('name')})"
    return None


def waiting_in(rank: int, dump: dict) -> Waiting | None:
    """The collective ``dump``'s rank waited in: under NCCL the oldest one not completed (its
    stream runs them in order); gloo records no states, and its collectives block the thread
    that calls them, so there the newest one (whose wait raised)."""
    entries = sorted((e for e in dump.get("entries", ()) if not e.get("is_p2p")),
                     key=lambda e: e.get("record_id", 0))
    if not entries:
        return None
    if any(e.get("profiling_name", "").startswith("nccl:") for e in entries):
        pending = [e for e in entries if e.get("state") != "completed"]
        if not pending:
            return None
        entry = pending[0]
    else:
        entry = entries[-1]
    group, desc = entry.get("process_group", ("?", "undefined"))
    return Waiting(rank, _operation(entry), str(group), str(desc),
                   int(entry.get("collective_seq_id", 0)), int(entry.get("time_created_ns", 0)),
                   _site(entry))


def _members(group: str, dumps: dict[int, dict], default: tuple[int, ...]) -> tuple[int, ...]:
    import ast

    for dump in dumps.values():
        config = dump.get("pg_config", {}).get(group)
        if config and config.get("ranks"):
            ranks = config["ranks"]
            return tuple(ast.literal_eval(ranks) if isinstance(ranks, str) else ranks)
    return default


def last_entered(dump: dict, group: str) -> int:
    """The sequence number of the last collective ``dump``'s rank entered in ``group`` (a
    group name, the same on every rank): its entries show it, and ``pg_status`` (keyed by the
    rank's own id of the group, which the entries map to the name) beyond the entries the
    ring buffer kept."""
    last = -1
    for entry in dump.get("entries", ()):
        if str(entry.get("process_group", ("",))[0]) != group or entry.get("is_p2p"):
            continue
        last = max(last, int(entry.get("collective_seq_id", -1)))
        status = dump.get("pg_status", {}).get(str(entry.get("pg_id")), {})
        last = max(last, int(status.get("last_enqueued_collective", -1)))
    return last


def find_hang(dumps: dict[int, dict], world_size: int) -> Hang | None:
    """The collective that some ranks waited in and some members of its group did not join,
    from the dumps of the ranks that wrote one; None where every group was complete."""
    waits = [w for rank, dump in sorted(dumps.items()) if (w := waiting_in(rank, dump))]
    candidates = []
    for key in dict.fromkeys((w.group, w.sequence) for w in waits):
        group, sequence = key
        inside = tuple(w for w in waits if (w.group, w.sequence) == key)
        members = _members(group, dumps, tuple(range(world_size)))
        silent = tuple(m for m in members if m not in dumps)
        elsewhere = tuple((m, waiting_in(m, dumps[m])) for m in members
                          if m in dumps and last_entered(dumps[m], group) < sequence)
        if silent or elsewhere:
            candidates.append(Hang(inside, members, silent, elsewhere))
    # the first cause: a collective a member never answered, then the earliest one
    candidates.sort(key=lambda h: (not h.silent, min(w.created_ns for w in h.waiting)))
    return candidates[0] if candidates else None


# ---------------------------------------------------------------------------
# The line
# ---------------------------------------------------------------------------

def failure_cause(exc: BaseException) -> str:
    """What this rank's collective reported, in a few words."""
    text = str(exc)
    timed_out = re.search(r"[Tt]imed out (?:waiting )?(?:after )?(\d+)\s*ms", text) \
        or re.search(r"Timeout\(ms\)=(\d+)", text)
    if timed_out:
        return f"timed out after {int(timed_out.group(1)) / 1000:g} s"
    if re.search(r"[Cc]onnection (closed|reset) by peer|Broken pipe", text):
        return "lost its connection to a peer"
    if "Application timeout caused pair closure" in text:
        return "timed out (gloo closed the connection)"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first[:160]


def describe(hang: Hang | None, cause: str, reporting_rank: int, folder: str | None,
             dumped: set[int], world_size: int, resume: str = "") -> str:
    """The one line for ``hang`` (None: the dumps name no missing rank)."""
    where = (f"dumps in {folder} (python -m torch.distributed.flight_recorder.fr_trace -j "
             f"{folder} prints every entry)" if dumped else
             "no flight-recorder dumps (--no-flight-recorder)" if folder is None else
             f"no flight-recorder dump in {folder}")
    if hang is None:
        head = (f"a collective failed on rank {reporting_rank} ({cause}); the dumps of ranks "
                f"{ranks_text(dumped)} show no group with a missing member" if dumped else
                f"a collective failed on rank {reporting_rank} ({cause})")
        return "; ".join(part for part in (head, where, resume) if part)
    c = hang.collective
    missing = hang.missing
    waited = ranks_text(w.rank for w in hang.waiting)
    head = (f"rank{'s' if len(missing) > 1 else ''} {ranks_text(missing)} did not join "
            f"{c.describe()} (ranks {ranks_text(hang.group_ranks)}): rank"
            f"{'s' if len(hang.waiting) > 1 else ''} {waited} waited there"
            + (f" ({c.site})" if c.site else "") + f"; rank {reporting_rank}'s collective "
            f"{cause}")
    parts = [head]
    if hang.silent:
        parts.append(f"rank{'s' if len(hang.silent) > 1 else ''} {ranks_text(hang.silent)} "
                     "wrote no dump (stopped, killed or unreachable)")
    for rank, wait in hang.elsewhere:
        parts.append(f"rank {rank} was in {wait.describe()}" if wait else
                     f"rank {rank} had entered no collective of that group")
    parts += [where, resume]
    return "; ".join(part for part in parts if part)


# ---------------------------------------------------------------------------
# What a rank does when its collective fails
# ---------------------------------------------------------------------------

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

    def report(self, cause: str, only_if_silent: bool = False) -> tuple[str, int] | None:
        """(the line, the rank that prints it), after this rank's dump and the wait for the
        others'; None where this process has reported already, or (``only_if_silent``)
        where every member of the group wrote a dump (no rank is gone)."""
        with self._lock:
            if self.reported:
                return None
            self.reported = True
            text, reporter, hang = self._line(cause)
            if only_if_silent and (hang is None or not hang.silent):
                return None
            return text, reporter

    def _line(self, cause: str) -> tuple[str, int, Hang | None]:
        dumps: dict[int, dict] = {}
        if self.dump_prefix is not None:
            if not flight_recorder.written_since(self.dump_prefix, self.rank, self.launched_at):
                with contextlib.suppress(Exception):  # a recorder that cannot dump says so below
                    flight_recorder.write_this_ranks_dump(self.dump_prefix, self.rank,
                                                          self.backend)
            dumped = flight_recorder.wait_for_dumps(self.dump_prefix, self.world_size,
                                                    self.launched_at, self.dump_wait_s)
            dumps = flight_recorder.read_dumps(self.dump_prefix, dumped)
        hang = find_hang(dumps, self.world_size) if dumps else None
        reporter = min(dumps) if dumps else self.rank
        return describe(hang, cause, self.rank, self.folder, set(dumps), self.world_size,
                        self.resume_hint()), reporter, hang

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
        (its data-loader workers killed with it, its collective cut short): the one line
        where a rank of the group is gone, else the quiet exit SIGTERM would have been."""
        reported = self.report("was cut short by a SIGTERM (the launcher's, once a rank has "
                               "ended)", only_if_silent=True)
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

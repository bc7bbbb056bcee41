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

``find_hang(dumps)`` is that reading, a pure function of the dumps, and ``describe`` the line;
what a rank does when its collective fails (its dump, the wait for the others', who prints)
is ``collective_failure``'s.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

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
# (through which every torch call passes in --cpu runs), decorators' wrappers (megatron marks
# some of its functions with typing_extensions' ``@deprecated``, whose wrapper is then the
# frame above torch's), and Python's standard library.
_PASS_THROUGH = ("/torch/", "megagpt/cpu_mode.py", "/typing_extensions.py")


def _passes_through(filename: str) -> bool:
    standard_library = "/lib/python3" in filename and "site-packages" not in filename
    return not filename or standard_library or any(p in filename for p in _PASS_THROUGH)


# the folder that holds this package (a checkout, or site-packages): the entry's own frames
# are named from there, as megatron's are from site-packages, wherever the run started
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _site(entry: dict) -> str | None:
    for frame in entry.get("frames") or ():
        filename = frame.get("filename", "")
        if _passes_through(filename):
            continue
        short = filename.split("site-packages/", 1)[-1]
        for root in (_PACKAGE_PARENT, os.getcwd()):
            if os.path.isabs(short) and short.startswith(root + os.sep):
                short = os.path.relpath(short, root)
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
    if "unhandled cuda error" in text.lower():
        # NCCL's own CUDA call failed; twice on one H100 (2026-12-06) it was the GPU's memory
        # running out under other processes, which NCCL's message does not say
        return (f"{first[:160]}: a CUDA call inside NCCL failed, most often an allocation on "
                "a GPU whose memory is full (other processes on it, or a batch at the limit)")
    return first[:160]


def _where(folder: str | None, dumped: set[int]) -> str:
    return (f"dumps in {folder} (python -m torch.distributed.flight_recorder.fr_trace -j "
            f"{folder} prints every entry)" if dumped else
            "no flight-recorder dumps (--no-flight-recorder)" if folder is None else
            f"no flight-recorder dump in {folder}")


def describe_gone(gone, cause: str, reporting_rank: int, folder: str | None, dumped: set[int],
                  resume: str = "") -> str:
    """The one line where the launcher ended ``reporting_rank`` outside any collective with
    the ranks ``gone`` (they wrote no dump): what ended it (``cause``, its exception in a few
    words), and who is gone."""
    gone = tuple(sorted(gone))
    head = (f"rank{'s' if len(gone) > 1 else ''} {ranks_text(gone)} wrote no dump (stopped, "
            f"killed or unreachable) and the launcher then ended rank {reporting_rank} outside "
            f"any collective with {'them' if len(gone) > 1 else 'it'} (a SIGTERM: {cause})")
    return "; ".join(part for part in (head, _where(folder, dumped), resume) if part)


def describe(hang: Hang | None, cause: str, reporting_rank: int, folder: str | None,
             dumped: set[int], world_size: int, resume: str = "") -> str:
    """The one line for ``hang`` (None: the dumps name no missing rank)."""
    where = _where(folder, dumped)
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

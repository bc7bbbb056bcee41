"""torch's flight recorder dumps: this rank's written where torch writes its own, all read back.

Every process group records its last collectives (megatron turns the recorder on from
``--flight-recorder-dump-path``, which the entry sets; ``settings``). A dump is a pickle at
``<prefix><global rank>`` holding the entries (each collective: group, sequence number,
operation, sizes, state, Python frames), ``pg_status`` (per group the last collective
enqueued, started and completed) and ``pg_config`` (per group its description and ranks).

Who writes it: under NCCL, torch's watchdog, when a collective times out
(``TORCH_NCCL_DUMP_ON_TIMEOUT``). Gloo has no watchdog: a collective that times out raises in
the thread that called it, and ``write_this_ranks_dump`` then writes the same pickle from
``torch._C._distributed_c10d._dump_fr_trace``. Gloo's recorder leaves ``pg_config`` without
most groups; the dump written here carries the full table from ``torch.distributed``'s own
record of the groups, so that torch's analyzer (``python -m
torch.distributed.flight_recorder.fr_trace FOLDER``) reads these dumps as it reads NCCL's.
"""

from __future__ import annotations

import os
import pickle
import time


def dump_path(prefix: str, rank: int) -> str:
    return f"{prefix}{rank}"


def group_table() -> dict[str, dict[str, str]]:
    """Every process group this rank knows, as a dump's ``pg_config`` describes one."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    table = {}
    for group, name in world.pg_names.items():
        ranks = sorted(world.pg_group_ranks.get(group, {}))
        table[str(name)] = {"name": str(name), "desc": getattr(group, "group_desc", "undefined"),
                            "ranks": str(ranks)}
    return table


def this_ranks_trace(backend: str) -> dict:
    """The recorder's content on this rank (every entry, with Python frames), unpickled."""
    import torch._C._distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None) if backend != "nccl" else None
    dump = dump or c10d._dump_nccl_trace
    trace = pickle.loads(dump(includeCollectives=True, includeStackTraces=True,
                              onlyActive=False))
    if backend != "nccl":
        trace["pg_config"] = {**trace.get("pg_config", {}), **group_table()}
    return trace


def write_this_ranks_dump(prefix: str, rank: int, backend: str) -> str:
    """Write this rank's dump at ``<prefix><rank>`` (whole or not at all); its path."""
    path = dump_path(prefix, rank)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "wb") as f:
        pickle.dump(this_ranks_trace(backend), f)
    os.replace(partial, path)
    return path


def written_since(prefix: str, rank: int, since: float) -> bool:
    """Whether rank ``rank`` wrote its dump after ``since`` (a ``time.time()``): an older
    one belongs to an earlier launch into the same folder."""
    try:
        return os.path.getmtime(dump_path(prefix, rank)) >= since
    except OSError:
        return False


def ranks_written_since(prefix: str, since: float) -> set[int]:
    """The ranks whose dumps were written after ``since`` (one listing of the folder)."""
    folder, name = os.path.split(prefix)
    ranks = set()
    try:
        listing = list(os.scandir(folder or "."))
    except OSError:
        return ranks
    for entry in listing:
        rest = entry.name[len(name):]
        if entry.name.startswith(name) and rest.isdigit():
            try:
                if entry.stat().st_mtime >= since:
                    ranks.add(int(rest))
            except OSError:
                continue
    return ranks


def wait_for_dumps(prefix: str, world_size: int, since: float, seconds: float,
                   poll: float = 0.2) -> set[int]:
    """The ranks whose dumps this launch has written, waiting up to ``seconds`` for all."""
    deadline = time.monotonic() + seconds
    while True:
        present = {r for r in ranks_written_since(prefix, since) if r < world_size}
        if len(present) == world_size or time.monotonic() >= deadline:
            return present
        time.sleep(poll)


def read_dumps(prefix: str, ranks) -> dict[int, dict]:
    """``{rank: dump}`` for the given ranks' dumps (a dump that cannot be read is left out:
    a rank that died while torch wrote it)."""
    dumps = {}
    for rank in sorted(ranks):
        try:
            with open(dump_path(prefix, rank), "rb") as f:
                dumps[rank] = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            continue
    return dumps

"""A checksum of every checkpoint file, recorded at save and checked before a load.

A shard whose bytes were overwritten in place keeps its length, so ``checkpoint_guard``'s
completeness check (every file there and long enough) passes it; megatron then loads raw
tensor bytes without looking at them, and the run or the tool goes on with garbage (NaN
weights, a loss of ``nan``). So after every persistent save each rank hashes the files it
wrote, rank 0 gathers the digests and writes ``megagpt_checksums.json`` beside them; before
megatron loads a checkpoint its files are hashed again, shared out among the ranks, and
compared (``megagpt.resilience.verified_load`` decides what a mismatch leads to).

The digest of a file is SHA-256 over the SHA-256 digests of its 16 MiB blocks, in order: the
blocks of all files are hashed side by side on a few threads (hashlib releases the GIL), so a
save or a load pays the read and a fraction of the hashing. Its cost per GB, and for the 345M
and 1.3B checkpoints, is measured by ``bench/checkpoint_checksums.py`` (bench/notes/resume.md).
A checkpoint without the file (saved by megatron's own entry, by this entry with
``--no-checkpoint-checksums``, or killed between the tracker and the manifest) loads
unchecked, with a log line.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

MANIFEST = "megagpt_checksums.json"
ALGORITHM = "sha256 of the sha256 digests of 16 MiB blocks"
BLOCK_BYTES = 16 * 2**20
# torch.distributed.checkpoint names each rank's shards __<rank>_<n>.distcp
_RANK_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
# a few threads per rank: the hashing of one rank keeps up with a disk at that, and eight
# ranks of a node with eight threads each still leave its cores to the data loaders
MAX_THREADS = 8


@dataclass(frozen=True)
class Mismatch:
    """A file of a checkpoint that is not what was saved."""

    folder: str
    name: str
    why: str

    def __str__(self) -> str:
        return f"{os.path.join(self.folder, self.name)} {self.why}"


@dataclass(frozen=True)
class Summary:
    """What a hashing pass read: files, bytes, seconds."""

    files: int
    bytes: int
    seconds: float

    def describe(self) -> str:
        size = (f"{self.bytes / 1e9:.2f} GB" if self.bytes >= 1e9
                else f"{self.bytes / 1e6:.1f} MB")
        return f"{self.files} files, {size} hashed in {self.seconds:.2f} s"


def default_threads() -> int:
    """Threads per process: the CPUs this process may use, shared by the node's ranks."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(MAX_THREADS, cpus // max(1, local_ranks)))


def _hash_block(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise OSError(f"{path}: {len(data)} of {length} bytes at offset {offset}")
    return hashlib.sha256(data).digest()


def digest_files(folder: str, names: list[str], threads: int | None = None
                 ) -> tuple[dict[str, dict], Summary]:
    """``{name: {"bytes": n, "sha256": hex}}`` for files of ``folder``, and what it read."""
    start = time.perf_counter()
    sizes = {name: os.path.getsize(os.path.join(folder, name)) for name in names}
    blocks = [(name, offset, min(BLOCK_BYTES, size - offset))
              for name, size in sizes.items() for offset in range(0, size, BLOCK_BYTES)]
    with ThreadPoolExecutor(threads or default_threads()) as pool:
        digests = list(pool.map(lambda b: _hash_block(os.path.join(folder, b[0]), b[1], b[2]),
                                blocks))
    per_file: dict[str, list[bytes]] = {name: [] for name in names}
    for (name, _, _), digest in zip(blocks, digests):
        per_file[name].append(digest)
    files = {name: {"bytes": sizes[name],
                    "sha256": hashlib.sha256(b"".join(per_file[name])).hexdigest()}
             for name in names}
    return files, Summary(len(names), sum(sizes.values()), time.perf_counter() - start)


def checkpoint_files(folder: str) -> list[str]:
    """Every file of a checkpoint folder (subfolders too: the legacy format's mp_rank_*),
    relative to it, but the manifest and files being written (``*.tmp-*``)."""
    found = []
    for root, _, files in os.walk(folder):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel != MANIFEST and ".tmp-" not in name:
                found.append(rel)
    return sorted(found)


def written_by(names: list[str], rank: int) -> list[str]:
    """The files ``rank`` hashes after a save: its own shards, and on rank 0 everything
    that is no rank's shard (the index, metadata.json, the configuration snapshot, the
    legacy format's files)."""
    mine = []
    for name in names:
        match = _RANK_SHARD.match(name)
        if (int(match.group(1)) == rank) if match else rank == 0:
            mine.append(name)
    return mine


def share_of(names: list[str], rank: int, world: int) -> list[str]:
    """The files ``rank`` of ``world`` checks before a load: every world-th one, so that
    the ranks read the checkpoint once between them."""
    return [name for i, name in enumerate(sorted(names)) if i % world == rank]


def write_manifest(folder: str, files: dict[str, dict]) -> str:
    """Write the manifest atomically; return its path."""
    path = os.path.join(folder, MANIFEST)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"algorithm": ALGORITHM, "block_bytes": BLOCK_BYTES,
                   "files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


class ManifestError(ValueError):
    """The manifest itself cannot be read; the message says why, not where."""


def read_manifest(folder: str) -> dict[str, dict] | None:
    """The recorded ``{name: {"bytes", "sha256"}}``, None without a manifest;
    ManifestError when it is there but unreadable or of another algorithm."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        files = data["files"]
        algorithm, block = data["algorithm"], data["block_bytes"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ManifestError(f"is unreadable ({type(exc).__name__}: {exc})") from None
    if algorithm != ALGORITHM or block != BLOCK_BYTES:
        raise ManifestError(f"records {algorithm!r} over {block}-byte blocks, which this "
                            "version does not compute")
    return files


def compare(folder: str, recorded: dict[str, dict], names: list[str],
            threads: int | None = None) -> tuple[Mismatch | None, Summary]:
    """The first of ``names`` whose bytes are not the recorded ones, and what was read.
    Sizes are compared first: a missing or truncated file costs no reading."""
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return Mismatch(folder, name, "is missing"), Summary(0, 0, 0.0)
        size = os.path.getsize(path)
        if size != recorded[name]["bytes"]:
            return (Mismatch(folder, name, f"is {size:,} bytes, {recorded[name]['bytes']:,} "
                                           "when it was saved"), Summary(0, 0, 0.0))
    try:
        found, summary = digest_files(folder, names, threads)
    except OSError as exc:
        return Mismatch(folder, "?", f"cannot be read ({exc})"), Summary(0, 0, 0.0)
    for name in names:
        if found[name]["sha256"] != recorded[name]["sha256"]:
            return (Mismatch(folder, name, "does not match the checksum recorded when it was "
                                           "saved (its bytes changed since)"), summary)
    return None, summary


def verify(folder: str, threads: int | None = None) -> tuple[Mismatch | None, Summary | None]:
    """Check every recorded file of ``folder`` in this process. (None, None): no manifest."""
    try:
        recorded = read_manifest(folder)
    except ManifestError as exc:
        return Mismatch(folder, MANIFEST, str(exc)), None
    if recorded is None:
        return None, None
    return compare(folder, recorded, sorted(recorded), threads)


# ---------------------------------------------------------------------------
# Across the ranks of a run (torch.distributed initialised)
# ---------------------------------------------------------------------------

def _world() -> tuple[int, int]:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def record_after_save(folder: str) -> Summary | None:
    """Every rank hashes the files it wrote; rank 0 writes the manifest. A collective:
    every rank calls it. Returns rank 0's view of the whole pass (None elsewhere)."""
    import torch

    rank, world = _world()
    start = time.perf_counter()
    mine, _ = digest_files(folder, written_by(checkpoint_files(folder), rank))
    gathered = [mine]
    if world > 1:
        gathered = [None] * world if rank == 0 else None
        torch.distributed.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return None
    files = {name: entry for part in gathered for name, entry in part.items()}
    write_manifest(folder, files)
    return Summary(len(files), sum(e["bytes"] for e in files.values()),
                   time.perf_counter() - start)


def verify_across_ranks(folder: str) -> tuple[Mismatch | None, Summary | None, bool]:
    """Each rank checks its share of the recorded files; every rank gets the same answer:
    (the first mismatch or None, the pass's totals, whether the checkpoint has a manifest)."""
    import torch

    rank, world = _world()
    try:
        recorded = read_manifest(folder)
    except ManifestError as exc:
        return Mismatch(folder, MANIFEST, str(exc)), None, True
    if recorded is None:
        return None, None, False
    start = time.perf_counter()
    mismatch, summary = compare(folder, recorded, share_of(list(recorded), rank, world))
    results = [(mismatch, summary)]
    if world > 1:
        results = [None] * world
        torch.distributed.all_gather_object(results, (mismatch, summary))
    found = next((m for m, _ in results if m is not None), None)
    total = Summary(sum(s.files for _, s in results), sum(s.bytes for _, s in results),
                    time.perf_counter() - start)
    return found, total, True

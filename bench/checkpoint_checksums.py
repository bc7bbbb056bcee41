#!/usr/bin/env python3
"""What checkpoint checksums cost: seconds per GB, and per save of the 345M and 1.3B models.

    python bench/checkpoint_checksums.py [--sizes 1GB 345M 1.3B] [--threads 1 2 8]
        [--dir /tmp/ckpt-bench] [--folder CHECKPOINT_DIR] [--json OUT.json] [--record]

For each size it writes files of that many bytes into ``--dir`` (as a save does: 1 GiB shards,
flushed and synced; timed, for scale), then hashes them with ``megagpt.resilience.checksums``
as the save wrapper does right after a save (the files in the page cache) at each thread
count, and deletes them. The content does not change the cost of SHA-256, so the files hold
random bytes; a model's size is its checkpoint's: ``params x 14`` bytes for a bf16 run with
Adam (bf16 weights, fp32 main weights, two fp32 moments), the parameters counted by the dry
run's ``count_parameters`` from ``configs/``. ``--folder`` also times a real checkpoint
folder (its manifest written beside it, as a save would).

A load checks the same bytes once more, shared among the ranks (each rank its share); a
save hashes each rank's own shards on that rank. So on N GPUs of one node a pass takes
about the one-process time / N where the node's cores and disk keep up.

``--json`` writes the results with the run's info; ``--record`` adds them as records of the
``checkpoint-checksums`` table under bench/figures/runs (then ``make tables``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from run_info import run_info  # noqa: E402

from megagpt.resilience import checksums  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"345M": ROOT / "configs" / "gpt2_345m.yaml", "1.3B": ROOT / "configs" / "gpt3_1.3b.yaml"}
BYTES_PER_PARAMETER = 2 + 4 + 4 + 4  # bf16 weight, fp32 main weight, Adam's two fp32 moments
SHARD = 2**30
CHUNK = 64 * 2**20


def parameters(shape: str) -> int:
    """The model's parameters as the dry run counts them (GPT-2's vocabulary, TP 1)."""
    import contextlib
    import io

    from megagpt.command_line.arguments import validate_arguments
    from megagpt.launch import parse_arguments
    from megagpt.preflight import estimate

    with contextlib.redirect_stdout(io.StringIO()):
        args = parse_arguments(["--config", str(CONFIGS[shape]), "--mock-data", "--vocab-size",
                                "50257", "--dry-run"])
        validate_arguments(args, device_arch=9)
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = -(-50257 // multiple) * multiple
    return estimate.count_parameters(args).total


def size_of(spec: str) -> tuple[str, int, int | None]:
    """(label, bytes, parameters) for ``1GB``-style sizes and model names."""
    if spec in CONFIGS:
        n = parameters(spec)
        return spec, n * BYTES_PER_PARAMETER, n
    if spec.upper().endswith("GB"):
        return spec, int(float(spec[:-2]) * 1e9), None
    raise SystemExit(f"--sizes {spec}: a size like 1GB or one of {', '.join(CONFIGS)}")


def write_files(folder: Path, total: int) -> float:
    """``total`` bytes of random data in 1 GiB files, synced; the seconds it took."""
    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(CHUNK)
    start = time.perf_counter()
    written, index = 0, 0
    while written < total:
        size = min(SHARD, total - written)
        with open(folder / f"__{0}_{index}.distcp", "wb") as f:
            left = size
            while left:
                n = min(CHUNK, left)
                f.write(block[:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())
        written += size
        index += 1
    return time.perf_counter() - start


def hash_folder(folder: Path, threads: int) -> float:
    names = checksums.checkpoint_files(str(folder))
    start = time.perf_counter()
    files, _ = checksums.digest_files(str(folder), names, threads)
    checksums.write_manifest(str(folder), files)
    return time.perf_counter() - start


def measure(label: str, total: int, params, threads: list[int], work: Path) -> list[dict]:
    folder = work / label
    write_s = write_files(folder, total)
    hash_folder(folder, max(threads))  # a first pass reads everything into the page cache
    rows = []
    for n in threads:
        seconds = hash_folder(folder, n)
        rows.append(dict(size=label, parameters=params, gb=total / 1e9, threads=n,
                         write_s=write_s, hash_s=seconds, s_per_gb=seconds / (total / 1e9),
                         vs_write=seconds / write_s))
        print(f"{label:>6} {total / 1e9:7.2f} GB  {n} thread(s): {seconds:6.2f} s "
              f"({seconds / (total / 1e9):.3f} s/GB; writing them took {write_s:.1f} s)",
              flush=True)
    shutil.rmtree(folder)
    return rows


def records(result: dict) -> list[dict]:
    info = result["info"]
    base = {k: info[k] for k in ("date", "commit", "machine", "versions", "command")}
    return [dict(table="checkpoint-checksums",
                 row=dict(size=r["size"], threads=r["threads"]),
                 figures={k: round(r[k], 3) for k in ("gb", "hash_s", "s_per_gb", "write_s",
                                                      "vs_write")},
                 note="files in the page cache, as right after a save; one process",
                 **base) for r in result["rows"]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="*", default=["1GB", "345M", "1.3B"],
                   help="sizes to write and hash (none: only --folder)")
    p.add_argument("--threads", nargs="+", type=int,
                   default=sorted({1, checksums.default_threads()}))
    p.add_argument("--dir", default="/tmp/megagpt-checksum-bench")
    p.add_argument("--folder", default=None, help="also time this checkpoint folder")
    p.add_argument("--json", default=None, metavar="OUT.json")
    p.add_argument("--record", action="store_true")
    a = p.parse_args(argv)
    work = Path(a.dir)
    rows = []
    for spec in a.sizes:
        label, total, params = size_of(spec)
        rows.extend(measure(label, total, params, a.threads, work))
    if a.folder:
        folder = Path(a.folder)
        total = sum((folder / n).stat().st_size for n in checksums.checkpoint_files(str(folder)))
        for n in a.threads:
            seconds = hash_folder(folder, n)
            rows.append(dict(size=str(folder), parameters=None, gb=total / 1e9, threads=n,
                             write_s=float("nan"), hash_s=seconds,
                             s_per_gb=seconds / (total / 1e9), vs_write=float("nan")))
            print(f"{folder}: {total / 1e9:.2f} GB, {n} thread(s): {seconds:.2f} s")
    result = {"info": run_info(), "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    if a.record:
        import records as bench_records

        for record in records(result):
            if record["row"]["size"] in CONFIGS or record["row"]["size"].endswith("GB"):
                print(bench_records.write(record).relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())

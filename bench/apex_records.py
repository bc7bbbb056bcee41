#!/usr/bin/env python3
"""Records of the ``apex`` table of bench/benchmarks.md from bench/gpu_record_apex.sh's output.

    python bench/apex_records.py OUT_DIR [--commit C] [--dry-run]

OUT_DIR is what one run of ``bench/gpu_record_apex.sh OUT_DIR speed,pieces,pieces_local``
left: per step folders ``<install>_<shape>/bench_<shape>.json`` (bench/bench_throughput.py's output) and
``versions.txt`` (the apex tag and build). One record per path measured: ms/iter, TFLOP/s,
peak memory, and against the same launch without apex in the same run (``vs_without_apex``:
its ms/iter ÷ this row's, above 1: faster with apex) and, for a piece switched by its flag,
against the same launch without the flag (``vs_piece_on``). Then ``make tables``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import records  # noqa: E402

# the folder's install -> (the row's install, the install without apex to compare with)
INSTALLS = {"apex": ("apex", "hidden"), "hidden": ("without apex", None),
            "apex_local": ("apex", "hidden_local"), "hidden_local": ("without apex", None),
            "apex_te": ("apex beside TE", "te"), "te": ("TE without apex", None)}
# the folder installs that had Transformer Engine importable
TE_INSTALLS = ("apex_te", "te")
# a piece's path -> (the launch without the flag, the flag that switches the piece)
PIECES = {"nowrite": ("fast", "--fast-disable grad-write"),
          "distopt": ("fast", "--use-distributed-optimizer"),
          "megatron_optimizer": ("fast", "--fast-disable optimizer"),
          "nopersist": ("local", "--no-persist-layer-norm"),  # before the entry left it
          "persist": ("local", "--persist-layer-norm"),  # the piece the entry leaves, taken
          "nosoftmax": ("local", "--no-masked-softmax-fusion"),
          "nofusion": ("local", "--no-gradient-accumulation-fusion")}
NOTE = ("one run of `bash bench/gpu_record_apex.sh OUT {step}` on one GPU: apex on PYTHONPATH "
        "for the rows marked apex, hidden from the process for those without; bf16, mock data, "
        "dropout 0, 30 iterations, the last 20 timed")


def versions(out: Path) -> tuple[str | None, str | None]:
    """apex's ("25.09 (4bdecd06)") and Transformer Engine's ("2.20.2", where it was built
    there) versions from the run's versions.txt."""
    text = (out / "versions.txt").read_text() if (out / "versions.txt").exists() else ""
    apex = re.search(r"apex (\S+) \(([0-9a-f]{8})", text)
    te = re.search(r"transformer-engine (\d\S*)", text)
    return (f"{apex.group(1)} ({apex.group(2)})" if apex else None,
            te.group(1) if te else None)


def _runs(out: Path) -> dict:
    """{(step, folder install, shape): bench summary}"""
    found = {}
    for path in sorted(out.glob("*/*_*/bench_*.json")):
        install, _, shape = path.parent.name.rpartition("_")
        if install in INSTALLS:
            found[(path.parent.parent.name, install, shape)] = json.loads(path.read_text())
    return found


def _step_of(folder: str, install: str) -> str:
    """The gpu_record_apex.sh step that made a run: the local spec's pieces land in the
    fast path's folder (``pieces``) but are their own step."""
    return "pieces_local" if folder == "pieces" and install.endswith("_local") else folder


def make_records(out: Path, commit: str | None = None) -> list[dict]:
    runs = _runs(out)
    version, te = versions(out)
    made = []
    for (step, install, shape), summary in runs.items():
        base = records._provenance(summary["info"])
        if commit:
            base["commit"] = commit
        row_install, without = INSTALLS[install]
        if version:
            base["versions"]["apex"] = version if without else "hidden"
        if te and install in TE_INSTALLS:
            base["versions"]["transformer-engine"] = te
        other = runs.get((step, without, shape), {}).get("results", {}) if without else {}
        results = summary["results"]
        for path, r in results.items():
            if not r.get("ms_per_iter"):
                continue
            figures = dict(ms_per_iter=r["ms_per_iter"], tflops_per_gpu=r.get("tflops_per_gpu"),
                           peak_mib=r.get("peak_mem_mib"))
            if other.get(path, {}).get("ms_per_iter"):
                figures["vs_without_apex"] = other[path]["ms_per_iter"] / r["ms_per_iter"]
            if path in PIECES and results.get(PIECES[path][0], {}).get("ms_per_iter"):
                figures["vs_piece_on"] = results[PIECES[path][0]]["ms_per_iter"] / r["ms_per_iter"]
            made.append(dict(table="apex", row=dict(shape=shape, install=row_install, path=path),
                             figures=records._rounded(figures, 3), **base,
                             note=NOTE.format(step=_step_of(step, install))))
    return made


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--commit", help="the commit measured (default: the one the run recorded)")
    p.add_argument("--dry-run", action="store_true", help="print the records, write none")
    a = p.parse_args(argv)
    made = make_records(a.out, a.commit)
    if not made:
        print(f"error: no bench_*.json under {a.out}/<step>/<install>_<shape>/",
              file=sys.stderr)
        return 2
    for record in made:
        if a.dry_run:
            print(json.dumps(record))
        else:
            print(records.write(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())

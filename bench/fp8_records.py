#!/usr/bin/env python3
"""Records of the ``fp8-fast`` table of bench/benchmarks.md from one run of bench/gpu_fp8.sh.

    python bench/fp8_records.py BENCH.json [BENCH.json ...] [--note TEXT] [--te-version V]
                                [--torchao-version V] [--dry-run]

Each BENCH.json is bench/bench_throughput.py's ``bench_<shape>.json`` of one invocation of
``bench/gpu_fp8.sh OUT train`` (``OUT/train_<shape>/``), all of one shape, run back to back:
the fast path's rows without Transformer Engine importable, TE's rows with it, in separate
invocations (step ``te``: ``fast,fp8,referencefp8``, then ``tefp8,tefp8cs``, then ``fp8own``;
step ``weights``: ``fast,fp8,fp8cast``, then ``tefp8``).
One record per path, keyed by the shape, the table's ``call`` (the first invocation's date,
naming the runs compared) and the path: ms/iter, TFLOP/s, and against the fast path's bf16
(``vs_fast_bf16``) and TE's FP8 with delayed scaling (``vs_te_fp8``) of the same run, each
that ms/iter ÷ this row's; where a path ran in more than one invocation, the first's is kept.
Then ``make tables``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import records  # noqa: E402

TABLE = "fp8-fast"
TE_PATHS = ("tefp8", "tefp8cs", "te")


def make_records(summaries: list[dict], note: str | None = None,
                 te_version: str | None = None, torchao_version: str | None = None
                 ) -> list[dict]:
    """The ``fp8-fast`` records of one run's bench outputs, in the order given."""
    shapes = {s["info"]["shape"] for s in summaries}
    if len(shapes) != 1:
        raise ValueError(f"one shape per run: these outputs hold {sorted(shapes)}")
    call = summaries[0]["info"]["date"]
    runs: dict[str, tuple[dict, dict]] = {}  # path -> (result, the invocation's summary)
    for summary in summaries:
        for path, result in summary.get("results", {}).items():
            if result.get("ms_per_iter") and path not in runs:
                runs[path] = (result, summary)

    def ms(path: str) -> float | None:
        return runs[path][0]["ms_per_iter"] if path in runs else None

    made = []
    for path, (result, summary) in runs.items():
        base = records._provenance(summary["info"])
        if path in TE_PATHS and te_version:
            base["versions"]["transformer-engine"] = te_version
        if path == "referencefp8" and torchao_version:
            base["versions"]["torchao"] = torchao_version
        figures = dict(ms_per_iter=round(result["ms_per_iter"], 1))
        if result.get("tflops_per_gpu"):
            figures["tflops_per_gpu"] = round(result["tflops_per_gpu"], 1)
        for key, against in (("vs_fast_bf16", ms("fast")), ("vs_te_fp8", ms("tefp8"))):
            if against:
                figures[key] = round(against / result["ms_per_iter"], 3)
        record = dict(table=TABLE, row=dict(shape=summary["info"]["shape"], call=call,
                                            path=path),
                      figures=figures, **base)
        if note:
            record["note"] = note
        made.append(record)
    return made


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("outputs", nargs="+", type=Path, metavar="BENCH.json")
    p.add_argument("--note", help="how the runs ran (a note for every record)")
    p.add_argument("--te-version", help="Transformer Engine's version, for TE's rows")
    p.add_argument("--torchao-version", help="torchao's version, for the referencefp8 row")
    p.add_argument("--dry-run", action="store_true", help="print the records, write none")
    a = p.parse_args(argv)
    missing = [str(f) for f in a.outputs if not f.is_file()]
    if missing:
        print(f"error: no bench output at {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        made = make_records([json.loads(f.read_text()) for f in a.outputs], a.note,
                            a.te_version, a.torchao_version)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"error: {', '.join(map(str, a.outputs))}: {e}", file=sys.stderr)
        return 2
    for record in made:
        print(json.dumps(record) if a.dry_run else records.write(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The measured runs behind bench/benchmarks.md: one JSON file per row, under bench/figures/runs/.

A record is one measured row of one table:

    {
      "table":    "train-1gpu",            # a table of bench/benchmarks.md (bench/table_specs.py)
      "row":      {"shape": "345M", "path": "fast", "dropout": 0},   # what was measured
      "figures":  {"ms_per_iter": 44.8, "tflops_per_gpu": 415.5, ...},  # what came out
      "date":     "2026-11-29 23:43 UTC",
      "commit":   "5883aa4",                     # the code measured (null: not known)
      "machine":  "NVIDIA H200",                 # "2× NVIDIA H200", "2-core x86_64 CPU", ...
      "versions": {"torch": "2.11.0+cu130", "megatron-core": "0.19.2", ...},
      "command":  "python bench/bench_throughput.py --shape 345M ...",
      "note":     "...",                          # optional: what a reader must know
      "data":     "bench/figures/....csv",        # optional: the per-iteration values
      "current":  false, "why": "..."             # optional: never the table's current row
    }

``row`` identifies the row: of the records with the same table and row, the newest (by
``date``) is the table's current figure and the others go to the dated log below the tables.
A record with ``"current": false`` (an outlier, a run cut short) is only ever in the log,
with its ``why``. ``commit`` is the commit whose code ran (``+changes``: with uncommitted
changes). Records converted from the benchmark notes kept before this format (2026-11-29)
carry the commit those notes name for the code measured, else the commit that recorded the
figure (``git log --follow bench/benchmarks.md``): the code measured is that commit's, or the
one before it with the changes that commit brought.

The tables and their keys (``bench/table_specs.py`` renders them; a table it does not know
is shown with its keys as headers):

    train-1gpu      row: shape, path (local | fast | reference), dropout
                    figures: ms_per_iter, tokens_per_s, tflops_per_gpu, peak_mib (or peak_gb),
                    bf16_matmul_peak_tflops
    switches        row: shape, switch (the flags), dropout
                    figures: default_ms, switch_ms, default_mib, switch_mib
    layouts         row: shape, processes, layout (tp2, pp2, dp2, ...; flags after a space:
                    "dp2 --fast-cuda-graphs iteration")
                    figures: ms_per_iter, tflops_per_gpu, per_gpu_vs_one, max_rel_loss_diff,
                    max_abs_loss_diff, iterations; or not_run / failed: the reason
    loss-agreement  row: shape, data, compared, flags
                    figures: iterations, max_abs_diff, max_rel_diff, mean_abs_diff, identical
    resume          row: shape, saved_under, resumed_under
                    figures: saved_at, iterations, identical, max_abs_diff
    dropout         row: shape, path (local | fast), attention_dropout, hidden_dropout
                    figures: ms_per_iter, tflops_per_gpu, cost (ms_per_iter / the same path's
                    without any dropout, same invocation, − 1)
    preprocess      row: tool (baseline | megagpt), workers
                    figures: wall_s, documents_per_s, tokens_per_s, mb_per_s, cpu_s

Adding a row is adding one file. Bench scripts write ``info`` (``bench/run_info.py``) into
their JSON output, and

    python bench/records.py add OUT/bench_345M.json [--commit C] [--note TEXT]

turns such an output into record files (``bench_throughput.py``'s ``bench_<shape>.json``,
``layouts.py``'s ``layouts.json``, ``bench_preprocess.py --json``'s file,
``resume_fidelity.py``'s ``resume_fidelity.json``); a hand-written file in the same format is
as good. Then ``python bench/tables.py`` (``make tables``) writes bench/benchmarks.md and the
current figures of the pages that show them (``bench/page_figures.py``).
``python bench/records.py check`` validates every record.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "bench" / "figures" / "runs"
DATE_FORMAT = "%Y-%m-%d %H:%M UTC"
REQUIRED = {"table": str, "row": dict, "figures": dict, "date": str, "machine": str,
            "versions": dict, "command": str}
OPTIONAL = {"commit": (str, type(None)), "note": str, "data": str, "current": bool, "why": str}


# ---------------------------------------------------------------------------------------
# the format
# ---------------------------------------------------------------------------------------
def problems(record: dict) -> list[str]:
    """What makes ``record`` not a record (empty: it is one)."""
    found = []
    for key, kind in REQUIRED.items():
        if not isinstance(record.get(key), kind):
            found.append(f"{key}: missing or not a {kind.__name__}")
    if "commit" not in record:
        found.append("commit: missing (null when not known)")
    for key, kinds in OPTIONAL.items():
        if key in record and not isinstance(record[key], kinds):
            found.append(f"{key}: wrong type")
    unknown = set(record) - set(REQUIRED) - set(OPTIONAL)
    if unknown:
        found.append(f"unknown keys {sorted(unknown)}")
    try:
        datetime.strptime(record.get("date", ""), DATE_FORMAT)
    except ValueError:
        found.append(f"date: not like {datetime(2026, 11, 29, 23, 43).strftime(DATE_FORMAT)!r}")
    if record.get("current") is False and not record.get("why"):
        found.append("current: false needs a why")
    if "data" in record and not (ROOT / record["data"]).is_file():
        found.append(f"data: {record['data']} is not a file of the repository")
    for key in ("torch", "megatron-core"):
        if key not in record.get("versions", {}):
            found.append(f"versions: no {key}")
    return found


def when(record: dict) -> datetime:
    return datetime.strptime(record["date"], DATE_FORMAT)


def load(directory: Path = RUNS) -> list[dict]:
    """Every record under ``directory``, each with its ``_file``; ValueError on a bad one."""
    records = []
    for path in sorted(directory.glob("*.json")):
        record = json.loads(path.read_text())
        bad = problems(record)
        if bad:
            raise ValueError(f"{path}: " + "; ".join(bad))
        record["_file"] = path.name
        records.append(record)
    return records


def _slug(value) -> str:
    text = re.sub(r"[^A-Za-z0-9.]+", "-", str(value)).strip("-")
    return text or "x"


def file_name(record: dict) -> str:
    """``2026-11-29T2343_train-1gpu_345M_fast_0.json``: date, table, then the row's values."""
    stamp = when(record).strftime("%Y-%m-%dT%H%M")
    row = "_".join(_slug(v) for v in record["row"].values())
    return f"{stamp}_{record['table']}_{row}"[:150] + ".json"


def write(record: dict, directory: Path = RUNS) -> Path:
    """Write ``record`` as a new file (a name taken by another record gets a suffix)."""
    bad = problems(record)
    if bad:
        raise ValueError("; ".join(bad))
    directory.mkdir(parents=True, exist_ok=True)
    order = ["table", "row", "figures", "date", "commit", "machine", "versions", "command",
             *OPTIONAL]
    record = {k: record[k] for k in order if k in record}
    text = json.dumps(record, indent=1, ensure_ascii=False) + "\n"
    base = file_name(record)[:-5]
    path, n = directory / f"{base}.json", 2
    while path.exists() and path.read_text() != text:
        path, n = directory / f"{base}-{n}.json", n + 1
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------
# bench outputs -> records
# ---------------------------------------------------------------------------------------
def _provenance(info: dict) -> dict:
    versions = dict(info.get("versions") or {})
    for key, name in (("torch", "torch"), ("megatron_core", "megatron-core")):
        if info.get(key):
            versions.setdefault(name, info[key])
    return dict(date=info["date"], commit=info.get("commit"),
                machine=info.get("machine") or info.get("gpu") or "unknown",
                versions=versions, command=_portable_command(info.get("command") or ""))


def _portable_command(command: str) -> str:
    """The command as a reader would run it: the output folder of the machine that ran it
    (``--out /root/out/tp``) becomes ``OUT``."""
    return re.sub(r"(--out[ =])\S+", r"\1OUT", command)


def _flag(tokens: list[str], flag: str) -> str | None:
    return tokens[tokens.index(flag) + 1] if flag in tokens[:-1] else None


DROPOUT_FLAGS = ("--hidden-dropout", "--attention-dropout")


def _without_dropout_flags(tokens: list[str]) -> list[str]:
    out, skip = [], False
    for token in tokens:
        if skip:
            skip = False
        elif token in DROPOUT_FLAGS:
            skip = True
        else:
            out.append(token)
    return out


def _rounded(figures: dict, decimals: int = 2) -> dict:
    return {k: (round(v, decimals) if isinstance(v, float) else v) for k, v in figures.items()
            if v is not None}


def from_throughput(summary: dict) -> list[dict]:
    """``bench_throughput.py``'s ``bench_<shape>.json``: one ``train-1gpu`` record per path
    run as the shape's default (the same dropout in attention and on the residuals), one
    ``switches`` record per path that adds other flags (against the default path with the
    same dropout, same invocation), one ``dropout`` record per path that differs from a run
    without dropout in the same invocation by its dropout flags alone, one
    ``loss-agreement`` record for ``--compare-losses``."""
    info = summary["info"]
    base = _provenance(info)
    shape = info["shape"]
    data = summary.get("data", "mock")
    path_flags = summary.get("path_flags", {})
    entry_args = shlex.split(summary.get("entry_args", ""))
    # figures by (path kind, dropout, the flags beyond dropout): what a switch is set against
    measured, records, by_dropout = {}, [], {}
    other_entries = summary.get("entry_of", {})
    for path, r in summary.get("results", {}).items():
        if not r.get("ms_per_iter") or path in other_entries:
            continue
        figures = _rounded(dict(ms_per_iter=r["ms_per_iter"], tokens_per_s=r.get("tokens_per_s"),
                                tflops_per_gpu=r.get("tflops_per_gpu"),
                                peak_mib=r.get("peak_mem_mib"),
                                bf16_matmul_peak_tflops=info.get("bf16_matmul_peak_tflops")))
        if path == "reference":
            dropout = float(r.get("dropout", 0.1))
            other = []
        else:
            flags = path_flags.get(path, []) + entry_args
            dropout = float(_flag(flags, "--hidden-dropout") or 0.1)
            attention = float(_flag(flags, "--attention-dropout") or 0.1)
            other = _without_dropout_flags(flags if path != "local" else entry_args)
        kind = {"local": "local", "reference": "reference"}.get(path, "fast")
        row = dict(shape=shape, path=kind, dropout=dropout)
        if path != "reference" and not other:
            by_dropout[(kind, attention, dropout)] = figures
            if attention != dropout:
                continue  # only the dropout table has a row for it
        if other:
            on = _switched_on(other, path, summary)
            row = dict(shape=shape, switch=shlex.join(other[len(on or []):]), dropout=dropout)
            if on:
                row["on"] = shlex.join(on)
            records.append(dict(table="switches", _against=(kind, dropout, shlex.join(on or [])),
                                _figures=figures, row=row, **base))
        if data != "mock":
            continue  # the throughput and switch tables are of mock data
        measured[(kind, dropout, shlex.join(other))] = figures
        if not other:
            records.append(dict(table="train-1gpu", row=row, figures=figures, **base))
    for record in [r for r in records if r["table"] == "switches"]:
        default = measured.get(record.pop("_against"))
        figures = record.pop("_figures")
        if default is None:
            records.remove(record)
            print(f"records: {record['row']['switch']}: no default run with the same "
                  "dropout in this invocation; left out", file=sys.stderr)
            continue
        record["figures"] = _rounded(dict(default_ms=default["ms_per_iter"],
                                          switch_ms=figures["ms_per_iter"],
                                          default_mib=default.get("peak_mib"),
                                          switch_mib=figures.get("peak_mib")))
    records += _dropout_records(by_dropout, shape, base, data)
    records += _against_commit_records(summary, shape, base)
    cmp = summary.get("loss_comparison")
    if cmp:
        a, b = cmp["paths"]
        records.append(dict(table="loss-agreement", **base, row=dict(
            shape=shape, data=data, compared=f"{b} vs {a}", flags=shlex.join(entry_args)),
            # loss differences are small: kept to 6 decimals (a relative 0.29 % is 0.0029)
            figures=_rounded(dict(iterations=cmp["iterations"], max_abs_diff=cmp["max_abs_diff"],
                                  max_rel_diff=cmp["max_rel_diff"],
                                  mean_abs_diff=cmp["mean_abs_diff"],
                                  identical=cmp.get("identical")), decimals=6)))
    return records


def _switched_on(other: list[str], path: str, summary: dict) -> list[str] | None:
    """The longest flags of another path of this invocation (dropout aside) that ``other``
    starts with: a switch added to that path (``--fast-disable deferred-nan-checks`` on the
    several-GPU path) is measured against it, not against the default."""
    entry_of = summary.get("entry_of", {})
    best = None
    for name, flags in summary.get("path_flags", {}).items():
        if name in (path, "local") or name in entry_of or name not in summary.get("results", {}):
            continue
        mine = _without_dropout_flags(flags)
        if mine and len(mine) < len(other) and other[:len(mine)] == mine \
                and (best is None or len(mine) > len(best)):
            best = mine
    return best


def _against_commit_records(summary: dict, shape: str, base: dict) -> list[dict]:
    """A path run through another checkout's entry (``--entry-of``) against the path of this
    checkout with the same flags, same invocation: one ``against-commit`` record each."""
    results, path_flags = summary.get("results", {}), summary.get("path_flags", {})
    records = []
    for path, other in summary.get("entry_of", {}).items():
        if path not in results:
            continue  # in the loss comparison alone
        flags = path_flags.get(path, [])
        mine = [x for x in results if x not in summary["entry_of"] and x != "reference"
                and path_flags.get(x, []) == flags]
        if not mine or not results.get(path, {}).get("ms_per_iter") \
                or not results[mine[0]].get("ms_per_iter"):
            print(f"records: {path}: no run of this checkout with the same flags; left out",
                  file=sys.stderr)
            continue
        earlier, now = results[path], results[mine[0]]
        records.append(dict(table="against-commit", **base, row=dict(
            shape=shape, path=mine[0], flags=shlex.join(flags + shlex.split(
                summary.get("entry_args", ""))), against=other.get("commit") or other["entry"]),
            figures=_rounded(dict(earlier_ms=earlier["ms_per_iter"], ms=now["ms_per_iter"],
                                  earlier_tflops=earlier.get("tflops_per_gpu"),
                                  tflops=now.get("tflops_per_gpu"),
                                  speed_vs_earlier=earlier["ms_per_iter"] / now["ms_per_iter"]),
                             decimals=3)))
    return records


def _dropout_records(by_dropout: dict, shape: str, base: dict, data: str) -> list[dict]:
    """What each dropout setting costs against the same path without dropout, measured in
    the same invocation (the runs in ``by_dropout``, keyed by path and the two dropouts)."""
    if data != "mock":
        return []
    records = []
    for (kind, attention, hidden), figures in sorted(by_dropout.items()):
        none = by_dropout.get((kind, 0.0, 0.0))
        if none is None or len([k for k in by_dropout if k[0] == kind]) < 2:
            continue
        records.append(dict(
            table="dropout", **base,
            row=dict(shape=shape, path=kind, attention_dropout=attention, hidden_dropout=hidden),
            figures=dict(_rounded(dict(ms_per_iter=figures["ms_per_iter"],
                                       tflops_per_gpu=figures.get("tflops_per_gpu"))),
                         cost=round(figures["ms_per_iter"] / none["ms_per_iter"] - 1, 4))))
    return records


def from_layouts(report: dict) -> list[dict]:
    """``layouts.py``'s ``layouts.json``: one ``layouts`` record per layout run (or refused),
    one ``resume`` record per ``--resume-check``."""
    base = _provenance(report["info"])
    one_tf = report["layouts"].get("one", {}).get("tflops_per_gpu")
    records = []
    for name, r in report["layouts"].items():
        if "skipped" in r:
            continue
        row = dict(shape=report["shape"], processes=r["processes"], layout=name)
        if "refused" in r:
            figures = dict(not_run=r["refused"])
        elif r.get("rc") != 0:
            figures = dict(failed=str(r.get("error") or r.get("rc")))
        else:
            c = r.get("against_one") or {}
            tf = r.get("tflops_per_gpu")
            figures = _rounded(dict(
                ms_per_iter=r.get("ms_per_iter"), tflops_per_gpu=tf,
                per_gpu_vs_one=(tf / one_tf) if tf and one_tf and name != "one" else None,
                max_rel_loss_diff=c.get("max_rel_diff"), max_abs_loss_diff=c.get("max_abs_diff"),
                iterations=report.get("iterations"), estimated_ms=r.get("estimated_ms"),
                estimated_on=report.get("estimate_gpu") if r.get("estimated_ms") else None))
        records.append(dict(table="layouts", row=row, figures=figures, **base))
    # "resume": one check, as layouts.json had it before --resume-check was repeatable
    resumes = report.get("resumes", [report["resume"]] if report.get("resume") else [])
    for resume in [r for r in resumes if "skipped" not in r]:
        c = resume.get("against_uninterrupted") or {}
        records.append(dict(table="resume", **base, row=dict(
            shape=report["shape"], saved_under=resume["saved_under"],
            resumed_under=resume["resumed_under"]), figures=_rounded(dict(
                iterations=c.get("iterations"), identical=c.get("identical"),
                max_abs_diff=c.get("max_abs_diff"), saved_at=resume["saved_at"]))))
    return records


SHAPE_NAMES = {("24", "1024"): "345M", ("24", "2048"): "1.3B"}


def from_resume(result: dict) -> list[dict]:
    """``resume_fidelity.py``'s ``resume_fidelity.json``: one ``resume`` record."""
    flags = result["flags"]
    dims = (_flag(flags, "--num-layers"), _flag(flags, "--hidden-size"))
    shape = SHAPE_NAMES.get(dims, f"{dims[0]} layers × {dims[1]}")
    c = result["all"]
    return [dict(table="resume", **_provenance(result["info"]), row=dict(
        shape=shape, saved_under="one process", resumed_under="one process"),
        figures=_rounded(dict(iterations=c["iterations_compared"],
                              identical=c.get("identical"), max_abs_diff=c["max_abs_diff"],
                              saved_at=result["stopped_at"])))]


def from_preprocess(result: dict) -> list[dict]:
    """``bench_preprocess.py --json``'s file: one ``preprocess`` record per tool."""
    base = _provenance(result["info"])
    corpus = result["corpus"]
    return [dict(table="preprocess", row=dict(tool=r["tool"], workers=result["workers"]),
                 figures=_rounded(dict(
                     wall_s=r["wall_s"], documents_per_s=corpus["documents"] / r["wall_s"],
                     tokens_per_s=corpus["tokens"] / r["wall_s"],
                     mb_per_s=corpus["bytes"] / 1e6 / r["wall_s"], cpu_s=r["cpu_s"])),
                 **base) for r in result["rows"]]


def from_output(output: dict) -> list[dict]:
    """Records from any bench script's JSON output (which script is told by its keys)."""
    if "results" in output and "flops_per_iter" in output:
        return from_throughput(output)
    if "layouts" in output:
        return from_layouts(output)
    if "after_resume" in output:
        return from_resume(output)
    if "rows" in output and "corpus" in output:
        return from_preprocess(output)
    raise ValueError("not an output of bench_throughput.py, layouts.py, resume_fidelity.py "
                     "or bench_preprocess.py")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    add = sub.add_parser("add", help="turn bench outputs into record files")
    add.add_argument("outputs", nargs="+", metavar="OUTPUT.json")
    add.add_argument("--commit", help="the commit measured, where the output does not say")
    add.add_argument("--note", help="a note for every record made")
    add.add_argument("--dir", default=str(RUNS))
    sub.add_parser("check", help="validate every record under bench/figures/runs")
    a = p.parse_args(argv)
    if a.what == "check":
        print(f"{len(load())} records, all valid")
        return 0
    for output in a.outputs:
        for record in from_output(json.loads(Path(output).read_text())):
            if a.commit:
                record["commit"] = a.commit
            if a.note:
                record["note"] = a.note
            path = write(record, Path(a.dir))
            print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

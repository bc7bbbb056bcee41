#!/usr/bin/env python3
"""bench/benchmarks.md and the current figures of the user's pages, generated from the records
in bench/figures/runs/.

    python bench/tables.py           # (make tables) write bench/benchmarks.md and the pages' figures
    python bench/tables.py --check   # exit 1 when any of them is not what the records give

The pages and their blocks are ``bench/page_figures.py``'s ``PAGES`` (README.md's table of
training throughput, the FP8 page's, ...); docs/several-gpus.md's cost lines come from the
dry run of the 175B example (``dry_run_cost``), which ``--records-only`` leaves out.

One table per concern (``TABLES`` in ``bench/table_specs.py``: training on one GPU, the fast path's switches,
several GPUs, losses against megatron's local spec, resume, preprocessing); every record
(format: ``bench/records.py``) is one row of one table. Of the records with the same table
and row, the newest is the table's current row; the others, and records marked
``"current": false``, form the dated log below the tables. A row a table expects and no
record has is shown as not measured, with the command that measures it.

To add a row: run the bench script, ``python bench/records.py add ITS_OUTPUT.json`` (or write
the record by hand), then ``python bench/tables.py``; commit the record and the files it
changed. A record of a table not in ``TABLES`` (a new concern, e.g. generation) gets a table
of its own, its columns the row's and figures' keys; give it a ``Table`` in
``bench/table_specs.py`` for headers, units and an introduction.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import page_figures  # noqa: E402
from records import RUNS, load, when  # noqa: E402
from table_specs import TABLES, Table, code, fig, rowval  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "bench" / "benchmarks.md"


# ---------------------------------------------------------------------------------------
# a table from its records
# ---------------------------------------------------------------------------------------
def row_key(record: dict) -> tuple:
    return (record["table"], tuple(sorted((k, str(v)) for k, v in record["row"].items())))


def current_and_earlier(records: list[dict]) -> tuple[dict[tuple, dict], list[dict]]:
    """The newest record of each row, and every other record."""
    newest: dict[tuple, dict] = {}
    for r in sorted(records, key=lambda r: (when(r), r["_file"])):
        if r.get("current", True):
            newest[row_key(r)] = r
    chosen = {id(r) for r in newest.values()}
    return newest, [r for r in records if id(r) not in chosen]


def generic_table(name: str, records: list[dict]) -> Table:
    """A table for records of a concern ``TABLES`` does not know: keys as headers."""
    row_keys = list(dict.fromkeys(k for r in records for k in r["row"]))
    fig_keys = list(dict.fromkeys(k for r in records for k in r["figures"]))
    return Table(name, name, "", columns=tuple(
        [(k, rowval(k)) for k in row_keys] + [(k, fig(k, 2)) for k in fig_keys]),
        text_columns=len(row_keys),
        sort=lambda r: tuple(str(r.get(k, "")) for k in row_keys),
        summary=lambda r: ", ".join(f"{k} {v}" for k, v in {**r["row"],
                                                            **r["figures"]}.items()))


def _run_label(record: dict) -> tuple:
    return (record["machine"], tuple(sorted(record["versions"].items())), record["command"])


def _letters(n: int) -> str:
    return "abcdefghijklmnopqrstuvwxyz"[n] if n < 26 else f"z{n - 25}"


def _versions(versions: dict) -> str:
    order = ["torch", "megatron-core", "python"]
    keys = order + sorted(k for k in versions if k not in order)
    return ", ".join(f"{k} {versions[k]}" for k in keys if k in versions)


def _row_text(row: dict) -> str:
    return ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())


def render_table(table: Table, current: list[dict], all_records: list[dict]) -> list[str]:
    rows = sorted(current, key=lambda r: table.sort(r["row"]))
    runs: dict[tuple, str] = {}
    for r in sorted(rows, key=when):
        runs.setdefault(_run_label(r), _letters(len(runs)))
    headers = [h for h, _ in table.columns] + ["date (UTC)", "commit", "run"]
    out = [f"## {table.title}", ""]
    if table.intro:
        out += [textwrap.fill(table.intro, 100, break_on_hyphens=False), ""]
    aligns = ["---" if i < table.text_columns or i >= len(table.columns) else "---:"
              for i in range(len(headers))]
    out += ["| " + " | ".join(headers) + " |", "| " + " | ".join(aligns) + " |"]
    for r in rows:
        cells = [cell(r) for _, cell in table.columns]
        cells += [r["date"].removesuffix(" UTC"), code(r["commit"] or "—"),
                  runs[_run_label(r)]]
        out.append("| " + " | ".join(cells) + " |")
    present = {tuple(sorted((k, str(v)) for k, v in r["row"].items())) for r in rows}
    missing = [(row, command) for row, command in table.expected
               if tuple(sorted((k, str(v)) for k, v in row.items())) not in present]
    out.append("")
    for label, letter in sorted(runs.items(), key=lambda x: x[1]):
        machine, versions, command = label
        out.append(f"- **{letter}**: {machine}; {_versions(dict(versions))}; {code(command)}")
    for r in rows:
        if r.get("note"):
            first = ", ".join(f"{k} {cell(r)}" for k, cell in
                              [(h, c) for h, c in table.columns][:3])
            out.append(f"- {first}: {r['note']}")
    for row, command in missing:
        out.append(f"- not measured yet: {_row_text(row)} ({code(command)})")
    return out + [""]


def render_log(records: list[dict], tables: dict[str, Table]) -> list[str]:
    out = ["## Earlier results", "", textwrap.fill(
        "Every other record under `bench/figures/runs/` (each with its command, machine and "
        "versions), newest first: rows measured again since, and runs that do not stand as a "
        "current figure (with the reason). Measurements of single pieces while the fast path "
        "was built (kernel choices, the compiled layer under inductor settings, column sums, "
        "the training step without the entry, profiles) are in this file's git history: "
        "`git show 5883aa4:docs/benchmarks.md`.", 100, break_on_hyphens=False), ""]
    for r in sorted(records, key=lambda r: (when(r), r["_file"]), reverse=True):
        table = tables[r["table"]]
        line = (f"- {r['date']} · {code(r['commit'] or '—')} · {table.title.split(':')[0]} · "
                f"{table.summary(r)}")
        if r.get("current") is False:
            line += f" — not a current figure: {r['why']}"
        elif r.get("note"):
            line += f" — {r['note']}"
        out.append(line)
    return out + [""]


def benchmarks_text(records: list[dict]) -> str:
    tables = {t.name: t for t in TABLES}
    for name in dict.fromkeys(r["table"] for r in records):
        if name not in tables:
            tables[name] = generic_table(name, [r for r in records if r["table"] == name])
    newest, earlier = current_and_earlier(records)
    out = ["# Benchmarks", "", textwrap.fill(
        "Generated by `python bench/tables.py` (`make tables`) from the records in "
        "[`figures/runs/`](figures/runs/), one JSON file per measured row (format: "
        "`bench/records.py`); do not edit by hand. Each table shows the newest measurement of "
        "each row with its date, the commit measured and a run letter naming the machine, "
        "versions and command below the table; older measurements are in the log at the end. "
        "Machines without Transformer Engine or apex unless a row says otherwise.", 100,
        break_on_hyphens=False), ""]
    for name, table in tables.items():
        current = [r for r in newest.values() if r["table"] == name]
        if current or table.expected:
            out += render_table(table, current, [r for r in records if r["table"] == name])
    out += render_log(earlier, tables)
    return "\n".join(out).rstrip() + "\n"


def pages_text(records: list[dict], with_cost: bool) -> dict[Path, str]:
    """Each page of ``page_figures.PAGES`` with its blocks written from the newest records
    (and docs/several-gpus.md's cost lines from the dry run, ``with_cost``)."""
    newest, _ = current_and_earlier(records)
    current = list(newest.values())
    out = {}
    for page in page_figures.PAGES:
        path = ROOT / page
        out[path] = page_figures.with_blocks(page, path.read_text(), current)
    if with_cost:
        import dry_run_cost

        path = ROOT / dry_run_cost.PAGE
        out[path] = dry_run_cost.with_block(out[path], dry_run_cost.dry_run_output())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true",
                   help="exit 1 if bench/benchmarks.md or a page's figures differ from the "
                   "records'")
    p.add_argument("--runs", default=str(RUNS), help=argparse.SUPPRESS)
    p.add_argument("--records-only", action="store_true",
                   help="leave out docs/several-gpus.md's cost lines (they run the dry run, "
                   "seconds)")
    a = p.parse_args(argv)
    records = load(Path(a.runs))
    outputs = {BENCHMARKS: benchmarks_text(records),
               **pages_text(records, with_cost=not a.records_only)}
    if a.check:
        stale = [str(path.relative_to(ROOT)) for path, text in outputs.items()
                 if path.read_text() != text]
        if stale:
            print(f"{', '.join(stale)}: not what bench/figures/runs gives; run "
                  "python bench/tables.py", file=sys.stderr)
            return 1
        print(f"bench/benchmarks.md and {len(outputs) - 1} pages match {len(records)} records"
              + ("" if a.records_only else " and the dry run"))
        return 0
    for path, text in outputs.items():
        if path.read_text() != text:
            path.write_text(text)
    print(f"wrote bench/benchmarks.md and the figures of {len(outputs) - 1} pages from "
          f"{len(records)} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())

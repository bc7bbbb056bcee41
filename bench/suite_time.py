#!/usr/bin/env python3
"""How long the two set-up commands take: ``make demo`` then ``make test``, timed in a fresh
clone, written as a record of the ``test-suite`` table (bench/records.py).

    python bench/suite_time.py                  # a fresh clone of HEAD in a temporary folder
    python bench/suite_time.py --here           # this checkout as it is
    python bench/suite_time.py --caches empty   # the label, when the caches were emptied first
    make tables                                 # then: bench/benchmarks.md and CONTRIBUTING.md

A fresh clone has no ``.venv``, so ``make demo`` includes ``make venv`` (pip's cache makes that
minutes, not a download of torch). "Caches warm" means torch inductor's, the project's
(``~/.cache/megagpt``) and Hugging Face's are left as earlier runs made them; with them empty
the first run compiles and fetches everything (``CI=true bash .ci/run`` is that run). The
record holds the minutes of each command, pytest's counts from its last line, the commit of
the clone, the machine and the versions its ``.venv`` has. A command that fails writes no
record and says which.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import records  # noqa: E402
from run_info import checkout_commit, machine, utc_now  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COUNTS = ("passed", "failed", "skipped", "xfailed", "xpassed", "errors", "error")


def pytest_counts(output: str) -> dict[str, int]:
    """The counts of pytest's summary line (``1117 passed, 12 skipped in 1038.20s``), the last
    one in ``output``; empty where there is none."""
    lines = [line for line in output.splitlines()
             if re.search(r"\b\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s", line)]
    if not lines:
        return {}
    found = dict((kind, int(n)) for n, kind in re.findall(r"(\d+) (\w+)", lines[-1])
                 if kind in COUNTS)
    if "error" in found:
        found["errors"] = found.pop("error") + found.get("errors", 0)
    return found


def venv_versions(checkout: Path) -> dict[str, str]:
    """python, torch and megatron-core as the checkout's ``.venv`` has them."""
    code = ("import json, platform; from importlib.metadata import version; "
            "print(json.dumps({'python': platform.python_version(), "
            "'torch': version('torch'), 'megatron-core': version('megatron-core')}))")
    out = subprocess.run([str(checkout / ".venv" / "bin" / "python"), "-c", code],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"error: {checkout}/.venv does not say its versions: {out.stderr[-500:]}")
    return json.loads(out.stdout)


def suite_record(demo_s: float, suite_s: float, counts: dict[str, int], *, caches: str,
                 date: str, commit: str | None, machine_name: str, versions: dict,
                 command: str) -> dict:
    """The ``test-suite`` record of one timing of ``make demo`` and ``make test``."""
    figures = dict(demo_min=round(demo_s / 60, 1), suite_min=round(suite_s / 60, 1))
    figures.update({k: v for k, v in counts.items() if v})
    return dict(table="test-suite", row=dict(caches=caches), figures=figures, date=date,
                commit=commit, machine=machine_name, versions=versions, command=command)


def timed(command: list[str], cwd: Path) -> tuple[float, str]:
    """(seconds, stdout and stderr) of ``command``; SystemExit naming it when it fails."""
    start = time.monotonic()
    out = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if out.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} failed in {cwd} (exit {out.returncode}):\n"
                         + (out.stdout + out.stderr)[-3000:])
    return seconds, out.stdout + out.stderr


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--here", action="store_true",
                   help="time this checkout instead of a fresh clone of its HEAD")
    p.add_argument("--caches", choices=("warm", "empty"), default="warm",
                   help="what the record says of the caches (default warm)")
    p.add_argument("--out", default=str(records.RUNS),
                   help="where the record goes (default bench/figures/runs)")
    a = p.parse_args(argv)
    command = "python bench/suite_time.py" + (" --here" if a.here else "") + (
        f" --caches {a.caches}" if a.caches != "warm" else "")
    with tempfile.TemporaryDirectory(prefix="megagpt-suite-") as folder:
        checkout = ROOT
        if not a.here:
            checkout = Path(folder) / "megagpt"
            subprocess.run(["git", "clone", "--quiet", str(ROOT), str(checkout)], check=True)
        date = utc_now()
        demo_s, _ = timed(["make", "demo"], checkout)
        suite_s, output = timed(["make", "test"], checkout)
        record = suite_record(demo_s, suite_s, pytest_counts(output), caches=a.caches,
                              date=date, commit=checkout_commit(checkout),
                              machine_name=machine(), versions=venv_versions(checkout),
                              command=command)
    path = records.write(record, Path(a.out))
    print(f"make demo {record['figures']['demo_min']} min, make test "
          f"{record['figures']['suite_min']} min ({record['figures'].get('passed', 0)} passed): "
          f"{path}; then make tables")
    return 0


if __name__ == "__main__":
    sys.exit(main())

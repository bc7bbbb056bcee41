"""What every benchmark records about its own run: date, commit, machine, versions, command.

``run_info()`` is written into each bench script's JSON output (``info``), from which
``bench/records.py add`` makes the rows of bench/benchmarks.md.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def commit() -> str | None:
    """``MEGAGPT_COMMIT`` when set: the code was copied where its git history is missing or
    stale (a device machine gets the working tree over an older checkout, whose HEAD is not
    the code that runs). Else the checkout's commit (short), ``+changes`` when tracked files
    differ from it; None when neither says."""
    return os.environ.get("MEGAGPT_COMMIT") or checkout_commit(ROOT)


def checkout_commit(folder: Path) -> str | None:
    """The commit of the git checkout whose top ``folder`` is (short), ``+changes`` when
    tracked files differ from it; else the commit named in ``folder/COMMIT`` (a ``git
    archive`` of another commit unpacked there: ``git archive C | tar -x -C DIR && echo C >
    DIR/COMMIT``); None where neither says. A folder inside another checkout (an unpacked
    archive under this one, ignored by git) is not that checkout's commit."""
    folder = Path(folder).resolve()
    named = folder / "COMMIT"
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=folder,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        top = None
    if top is None or top.returncode != 0 or Path(top.stdout.strip()).resolve() != folder:
        if named.is_file():
            return named.read_text().split()[0][:12] or None
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=folder,
                              capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=folder, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode == 0 and head.stdout.strip():
        return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    return None


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def machine() -> str:
    """``NVIDIA H200``, ``2× NVIDIA H200``, or the CPU when no GPU is seen."""
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            name = torch.cuda.get_device_name(0)
            return name if n == 1 else f"{n}× {name}"
    except ImportError:
        pass
    return f"{os.cpu_count()}-core {platform.machine()} CPU"


def versions(*extra: str) -> dict[str, str]:
    """Python, torch, megatron-core and any ``extra`` packages that are installed."""
    found = {"python": platform.python_version()}
    for package in ("torch", "megatron-core", *extra):
        v = _version(package)
        if v is not None:
            found[package] = v
    return found


def run_info(*extra_packages: str, argv: list[str] | None = None) -> dict:
    """date, commit, machine, versions and the command line of this process."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return dict(date=utc_now(), commit=commit(), machine=machine(),
                versions=versions(*extra_packages),
                command=shlex.join(["python", str(script), *argv[1:]]))

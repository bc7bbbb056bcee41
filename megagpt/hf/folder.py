"""Output folders written whole or not at all.

``check_output`` runs before any expensive work: an existing non-empty folder is refused
unless the caller allows overwriting. ``writing`` yields a temporary folder beside the
target; when the body finishes, the temporary folder takes the target's name (an old one
is moved aside first and deleted after), and when it fails the temporary folder is removed,
so a reader sees the old folder or the complete new one, never a half-written one.
"""

from __future__ import annotations

import contextlib
import os
import shutil

from megagpt.data.cache import make_readable
from megagpt.errors import UserError


class OutputError(UserError, ValueError):
    """The output path cannot be written as asked."""


def check_output(path: str, flag: str, overwrite: bool) -> None:
    if os.path.isfile(path) or (os.path.exists(path) and not os.path.isdir(path)):
        raise OutputError(f"{flag} {path}: exists and is not a folder")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise OutputError(f"{flag} {path}: exists and is not empty; pass --overwrite to "
                          "replace it")
    parent = os.path.dirname(os.path.abspath(path))
    probe = parent
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK):
        raise OutputError(f"{flag} {path}: {probe} is not writable")


@contextlib.contextmanager
def writing(path: str):
    """Yield a temporary folder that becomes ``path`` when the body succeeds."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for root, _, files in os.walk(tmp):
        for name_ in files:
            make_readable(os.path.join(root, name_))
    make_readable(tmp)
    old = None
    if os.path.exists(path):
        old = os.path.join(parent, f".{name}.old-{os.getpid()}")
        os.rename(path, old)
    os.rename(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

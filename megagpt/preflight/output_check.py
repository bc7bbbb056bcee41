"""What the run will write, checked before megatron validates the arguments.

Megatron asserts ``args.save_interval is not None`` with no message when ``--save`` is given
alone, and finds an unwritable ``--save`` only when it first saves, after the start-up and
the first interval of training (a ``FileNotFoundError`` or ``PermissionError`` traceback).
Here each is one line before anything is built. Nothing is created: writability is tried
with a temporary folder in the nearest existing parent, removed at once, so a dry run
leaves no trace.
"""

from __future__ import annotations

import os
import tempfile

from megagpt.errors import UserError

# Folders the run writes into: (argument, flag, what megatron writes there).
OUTPUT_DIRS = (
    ("save", "--save", "checkpoints"),
    ("tensorboard_dir", "--tensorboard-dir", "TensorBoard events"),
    ("data_cache_path", "--data-cache-path", "the dataset index cache"),
    ("wandb_save_dir", "--wandb-save-dir", "Weights & Biases files"),
)


class OutputError(UserError, OSError):
    """A folder the run writes into cannot be written; the message names the flag."""


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def writability_problem(path: str) -> str | None:
    """Why a run could not create and write ``path`` (a folder), or None."""
    if os.path.exists(path) and not os.path.isdir(path):
        return "it exists and is not a folder"
    existing = _nearest_existing(path)
    if not os.path.isdir(existing):
        return f"{existing} is not a folder"
    try:
        probe = tempfile.mkdtemp(prefix=".megagpt-write-test-", dir=existing)
        os.rmdir(probe)
    except OSError as exc:
        where = "" if existing == os.path.abspath(path) else f" (in {existing})"
        return f"cannot write there{where}: {exc.strerror or exc}"
    return None


def check_outputs(args) -> None:
    """Raise OutputError for --save without --save-interval, or an unwritable output folder."""
    if args.save and args.save_interval is None:
        raise OutputError(
            f"--save {args.save} needs --save-interval N: megatron saves a checkpoint every "
            "N iterations (and, in this entry, on SIGTERM and at the end of training)")
    if args.save and args.save_interval is not None and args.save_interval <= 0:
        raise OutputError(f"--save-interval {args.save_interval}: must be a positive number "
                          "of iterations")
    for attr, flag, what in OUTPUT_DIRS:
        path = getattr(args, attr, None)
        if not path:
            continue
        problem = writability_problem(path)
        if problem:
            raise OutputError(f"{flag} {path}: {problem} (the run writes {what} there)")

"""What a run keeps beside its checkpoints: megatron's argument table and the training plot.

The run folder is ``--save`` (where megatron writes its ``progress.txt`` too), else
``--tensorboard-dir``; a run with neither keeps nothing and says so.

``megatron_arguments.txt``
    the table of every argument megatron prints after validating them (about 830 lines, most
    of a short run's log); the log gets one line naming the file. ``--print-arguments``
    prints it in the log as well, as megatron does.
``iterations.jsonl``, ``training.png``
    each iteration line's figures (``iteration_line``), appended by every launch of the
    run; at the end of each launch (finished, stopped by a signal or a fault) the loss,
    learning rate and throughput are drawn from them (``megagpt.run_log.plots``), and
    ``python tools/plot_runs.py FOLDER`` draws them on request. ``MEGAGPT_NO_PLOT=1`` in the
    environment skips the drawing (a second of matplotlib; the test suite's runs skip it).

A launch refused after megatron opened its TensorBoard writer (bad data, a bad checkpoint)
leaves no empty event file: ``discard_empty_tensorboard``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megagpt.megatron_change import WRAPS, Change

ARGUMENTS = "megatron_arguments.txt"
PLOT = "training.png"

_DUMP: dict[str, str] = {}  # megatron's argument table, kept between validation and the run


def add_arguments(group) -> None:
    group.add_argument("--print-arguments", action="store_true",
                       help="Print megatron's table of every argument in the log too (it is "
                            f"always written to the run folder's {ARGUMENTS}).")
    group.add_argument("--megatron-iteration-log", action="store_true",
                       help="Print megatron's own iteration line instead of the entry's "
                            "(loss, tokens/s, TFLOP/s, MFU, time left).")


def run_folder(args) -> Path | None:
    folder = getattr(args, "save", None) or getattr(args, "tensorboard_dir", None)
    return Path(folder) if folder else None


PRINT_ARGS = Change(
    "megatron.training.arguments._print_args", WRAPS, __name__,
    does="keeps megatron's argument table for the run folder instead of printing it "
         "(--print-arguments: printed too)",
    why="validate_args prints every argument (about 830 lines, most of a short run's log)",
    when="around megatron's validate_args in pretrain_gpt.main (argument_table_kept), undone "
         "after",
    fingerprint="c69a5f5d3f0c")
MEGATRON_CHANGES = (PRINT_ARGS,)


def _kept_dump(print_args):
    @functools.wraps(print_args)
    def wrapper(title, args):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            print_args(title, args)
        _DUMP[title] = text.getvalue()
        if getattr(args, "print_arguments", False):
            print(text.getvalue(), end="", flush=True)

    return wrapper


@contextlib.contextmanager
def argument_table_kept():
    """Around megatron's ``validate_args``: its argument table is kept for the run folder
    rather than printed (``--print-arguments``: printed too)."""
    import megatron.training.arguments as margs

    from megagpt import megatron_wrappers

    with megatron_wrappers.wrapped(margs, [("_print_args", __name__, _kept_dump)]):
        yield


def _rank_writes(rank_env: str = "RANK") -> bool:
    return os.environ.get(rank_env, "0") == "0"


def write_argument_table(args, log: Callable[[str], None]) -> Path | None:
    """The kept table into the run folder (rank 0); one log line saying where."""
    table = _DUMP.get("arguments")
    folder = run_folder(args)
    if not table:
        return None
    if folder is None:
        log("megatron's arguments: not written (no --save or --tensorboard-dir); "
            "--print-arguments prints them")
        return None
    path = folder / ARGUMENTS
    if _rank_writes():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path.write_text(table)
        except OSError as exc:
            log(f"megatron's arguments: cannot write {path} ({exc})")
            return None
    shown = "" if getattr(args, "print_arguments", False) else " (--print-arguments prints them)"
    log(f"megatron's arguments: {path}{shown}")
    return path


NO_PLOT = "MEGAGPT_NO_PLOT"


def draw_plot(folder: Path, say: Callable[[str], None]) -> Path | None:
    """``training.png`` from the folder's iteration records; never fails the run."""
    if os.environ.get(NO_PLOT) == "1":
        return None
    from megagpt.errors import UserError
    from megagpt.run_log.plots import load_run, plot_runs

    try:
        run = load_run(str(folder), folder.parent.name if folder.name in (
            "checkpoints", "ckpt", "tensorboard") else folder.name)
        out = plot_runs([run], folder / PLOT, title=f"{run.label}: loss, learning rate, "
                                                     "throughput")
    except (UserError, OSError, ValueError, ImportError) as exc:
        say(f"plot: not drawn ({exc})")
        return None
    say(f"plot: {out} (python tools/plot_runs.py {folder} draws it again)")
    return out


# ---------------------------------------------------------------------------
# A launch that stops before training leaves no empty TensorBoard file behind
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorBoardBefore:
    """The --tensorboard-dir as it was before megatron opened its writer."""

    folder: Path | None
    existed: bool
    files: frozenset


def tensorboard_before(args) -> TensorBoardBefore:
    folder = Path(args.tensorboard_dir) if getattr(args, "tensorboard_dir", None) else None
    if folder is None or not folder.is_dir():
        return TensorBoardBefore(folder, False, frozenset())
    return TensorBoardBefore(folder, True, frozenset(folder.glob("events.out.tfevents.*")))


def _holds_summaries(path: Path) -> bool:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    try:
        return any(event.HasField("summary") for event in EventFileLoader(str(path)).Load())
    except Exception:  # noqa: BLE001 - unreadable: not ours to remove
        return True


def discard_empty_tensorboard(args, before: TensorBoardBefore) -> None:
    """After a launch stopped before training: close megatron's writer, remove the event file
    it opened if it holds nothing (megatron writes the arguments when training starts), and
    the folder if this launch created it and it is empty now."""
    if before.folder is None:
        return
    try:
        from megatron.training.global_vars import get_tensorboard_writer

        writer = get_tensorboard_writer()
    except ImportError:
        writer = None
    if writer is not None:
        writer.close()
    if not before.folder.is_dir():
        return
    for path in set(before.folder.glob("events.out.tfevents.*")) - before.files:
        if not _holds_summaries(path):
            path.unlink(missing_ok=True)
    if not before.existed and not any(before.folder.iterdir()):
        before.folder.rmdir()

"""What a run tells its user: the iteration line, the run folder's files, fewer warnings.

``active(args, log)``
    around ``megatron.training.pretrain``: megatron's argument table into the run folder
    (``run_folder``), this entry's iteration line in place of megatron's
    (``iteration_line``, through a wrapper of the ``print_rank_last`` megatron's training
    loop prints with), no memory report on the CPU (where every figure is 0), and the
    training plot at the end.
``argument_table_kept()``
    around megatron's ``validate_args``, which prints that table.
``quiet.install()``
    the filters of warnings that do not apply to this install (``compat`` calls it before
    megatron is imported).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

from megagpt.megatron_change import REPLACES, TRAINING, WRAPS, Change
from megagpt.run_log import iteration_line, quiet, run_folder
from megagpt.run_log.run_folder import argument_table_kept

__all__ = ["active", "argument_table_kept", "quiet"]


# What ``active`` changes in megatron, in the order it installs it.
PRINT_RANK_LAST = Change(
    TRAINING + "print_rank_last", WRAPS, __name__,
    does="prints this entry's iteration line in place of megatron's, with tokens/s, MFU and "
         "the time left, and records its figures for the run's plot; any other text passes",
    why="training_log prints its 300-character iteration line through it; the entry's line "
        "is made from the same figures",
    fingerprint="888f2c02a721")
REPORT_MEMORY = Change(
    TRAINING + "report_memory", REPLACES, __name__,
    does="nothing, on the CPU",
    why="on the CPU torch.cuda's memory counters are all 0, and megatron reports them after "
        "the first iterations and around every save",
    fingerprint="471d75cba957")
MEGATRON_CHANGES = (PRINT_RANK_LAST, REPORT_MEMORY)


def _printing_entry_line(print_rank_last, line: iteration_line.IterationLine, megatrons: bool):
    from megatron.training.utils import is_last_rank

    @functools.wraps(print_rank_last)
    def wrapper(message):
        import torch

        last = not torch.distributed.is_initialized() or is_last_rank()
        text = line.take(message) if last and isinstance(message, str) else None
        if text is None or megatrons:
            return print_rank_last(message)
        print(text, flush=True)

    return wrapper


def _no_memory_report(_report_memory):
    def report_memory(name, *args, **kwargs):
        """On the CPU torch.cuda's counters are all 0: nothing to report."""

    return report_memory


def _say_on_this_rank(message: str) -> None:
    print(f"[megagpt] {message}", flush=True)


@contextlib.contextmanager
def active(args, log: Callable[[str], None], fp8: bool = False):
    """The run's log and files for the duration of ``pretrain`` (see the module docstring);
    ``fp8``: the launch's linears run in FP8 (MFU against the GPU's FP8 peak)."""
    import megatron.training.training as mtraining
    from megatron.training.training import num_floating_point_operations

    from megagpt import megatron_wrappers

    run_folder.write_argument_table(args, log)
    folder = run_folder.run_folder(args)
    records = folder / iteration_line.RECORDS if folder is not None else None
    if records is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            records = None
    peak, about_peak = iteration_line.peak_for(args, fp8)
    line = iteration_line.IterationLine(
        args.seq_length, args.world_size,
        lambda batch: num_floating_point_operations(args, batch), peak, records)
    megatrons = getattr(args, "megatron_iteration_log", False)
    if not megatrons:
        log(f"log: every --log-interval iterations one line: losses, learning rate, grad norm, "
            f"tokens/s, TFLOP/s per GPU (megatron's count), {about_peak}, time left "
            "(--megatron-iteration-log: megatron's line)")
    wrappers = [("print_rank_last", __name__,
                 lambda original: _printing_entry_line(original, line, megatrons))]
    if getattr(args, "cpu", False):
        wrappers.append(("report_memory", __name__, _no_memory_report))
    try:
        with megatron_wrappers.wrapped(mtraining, wrappers):
            yield
    finally:
        if line.lines and records is not None:
            run_folder.draw_plot(folder, _say_on_this_rank)

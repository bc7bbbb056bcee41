"""The preflight: check a launch before it takes GPUs, and print what it will cost.

On every launch, before any model is built, in this order:
  ``check_layout(args, world_size)``  the parallel layout and batch arithmetic (before
                                      megatron's validate_args);
  ``check_outputs(args)``             --save and its interval, writable output folders;
  ``check_tokenizer_files(args)``     the tokenizer's files exist (before it is loaded);
  ``check_inputs(args, vocab, log)``  the learning-rate schedule and the data (after
                                      validation, with the tokenizer's vocabulary).
``run_dry_run(launch, args)`` is ``--dry-run``: the same checks at the intended GPU count,
then the plan: layout, batch, parameters, memory per GPU and FLOPs of what the launch runs (its
choices, ``launch_path.WhatRuns``; the resolved configuration only to ``--dry-run-yaml``). Its
options are the entry's (``megagpt.command_line.arguments``): the preflight sits above the
arguments and imports them, never the other way round.
"""

from megagpt.preflight.checks import LayoutError, check_layout
from megagpt.preflight.data_check import DataError, check_data
from megagpt.preflight.dry_run import MemoryBudgetError, Plan, make_plan, run_dry_run
from megagpt.preflight.output_check import OutputError, check_outputs
from megagpt.preflight.schedule_check import ScheduleError, check_schedule
from megagpt.data.tokenizer_files import TokenizerError, check_tokenizer_files


def check_inputs(args, vocab_size, log) -> None:
    """The schedule and the data, once the arguments are validated and the tokenizer known."""
    check_schedule(args)
    check_data(args, vocab_size, log)


__all__ = ["DataError", "LayoutError", "MemoryBudgetError", "OutputError", "Plan",
           "ScheduleError", "TokenizerError", "check_data", "check_inputs", "check_layout",
           "check_outputs", "check_schedule", "check_tokenizer_files", "make_plan",
           "run_dry_run"]

"""The preflight: check a launch before it takes GPUs, and print what it will cost.

``check_layout(args, world_size)`` runs first on every launch (the entry calls it before
megatron's validate_args); ``run_dry_run(args)`` is ``--dry-run``: the same checks at the
intended GPU count, then the plan: layout, batch, parameters, memory per GPU and FLOPs (the
resolved configuration only to ``--dry-run-yaml``). Its options are the entry's
(``megagpt.arguments``): the preflight sits above the arguments and imports them, never the
other way round.
"""

from megagpt.preflight.checks import LayoutError, check_layout
from megagpt.preflight.dry_run import MemoryBudgetError, Plan, make_plan, run_dry_run

__all__ = ["LayoutError", "MemoryBudgetError", "Plan", "check_layout", "make_plan", "run_dry_run"]

"""The preflight: check a launch before it takes GPUs, and print what it will cost.

``check_layout(args, world_size)`` runs first on every launch (the entry calls it before
megatron's validate_args); ``run_dry_run(args)`` is ``--dry-run``: the same checks at the
intended GPU count, then parameters, memory per GPU, FLOPs and the resolved configuration.
"""

from megagpt.preflight.checks import LayoutError, check_layout
from megagpt.preflight.dry_run import (MemoryBudgetError, Plan, add_preflight_arguments, make_plan,
                                       run_dry_run)

__all__ = ["LayoutError", "MemoryBudgetError", "Plan", "add_preflight_arguments", "check_layout",
           "make_plan", "run_dry_run"]

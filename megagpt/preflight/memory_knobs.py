"""What lowers the dry run's memory estimate of a launch: the knobs the out-of-memory line names.

The dry run's estimate (``megagpt.preflight.estimate``) computed again for a launch's
validated arguments and its choices (``launch_path.WhatRuns``), and once more for each change
that lowers it and still divides the GPUs (half the micro-batch, selective then full
recompute, the distributed optimizer, twice the TP or PP), largest saving first. The entry
hands ``memory_knobs`` with its launch's choices to the diagnostics (``megagpt.diagnostics
.out_of_memory``), which word the line.
"""

from __future__ import annotations

import copy

from megagpt.diagnostics.out_of_memory import Knob
from megagpt.preflight import estimate as est
from megagpt.preflight.launch_path import WhatRuns


def estimate_bytes(args, runs: WhatRuns) -> float:
    """The dry run's memory estimate per GPU (most loaded rank) for validated ``args`` as the
    launch runs them (``runs``)."""
    params = est.count_parameters(args)
    return est.estimate_memory(args, params, est.microbatches_per_step(args), runs).total


def _with(args, **changes):
    changed = copy.copy(args)
    for name, value in changes.items():
        setattr(changed, name, value)
    return changed


def _layouts(args) -> list[tuple[str, object]]:
    """(flags, args) for each change of the launch that lowers memory and still divides."""
    out = []
    mbs, gbs, dp = args.micro_batch_size, args.global_batch_size, args.data_parallel_size
    if mbs > 1:
        out.append((f"--micro-batch-size {mbs // 2}", _with(args, micro_batch_size=mbs // 2)))
    if args.recompute_granularity is None:
        out.append(("--recompute-activations", _with(args, recompute_granularity="selective")))
    if args.recompute_granularity != "full":
        out.append(("--recompute-granularity full --recompute-method uniform "
                    "--recompute-num-layers 1",
                    _with(args, recompute_granularity="full", recompute_method="uniform",
                          recompute_num_layers=1)))
    if not args.use_distributed_optimizer and dp > 1:
        out.append(("--use-distributed-optimizer", _with(args, use_distributed_optimizer=True)))
    tp, pp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.context_parallel_size)
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    for flag, attr, size, divides in (
            ("--tensor-model-parallel-size", "tensor_model_parallel_size", 2 * tp,
             args.num_attention_heads % (2 * tp) == 0 and groups % (2 * tp) == 0),
            ("--pipeline-model-parallel-size", "pipeline_model_parallel_size", 2 * pp,
             args.num_layers % (2 * pp) == 0)):
        model_parallel = 2 * tp * pp * cp
        if not divides or args.world_size % model_parallel:
            continue
        new_dp = args.world_size // model_parallel  # the GPUs stay: DP gives them up
        if gbs % (mbs * new_dp):
            continue
        out.append((f"{flag} {size}", _with(args, **{attr: size, "data_parallel_size": new_dp})))
    return out


def memory_knobs(args, runs: WhatRuns) -> tuple[float, list[Knob]]:
    """(this launch's estimate, the knobs that lower it, largest saving first), for its
    validated ``args`` and its choices ``runs``."""
    base = estimate_bytes(args, runs)
    knobs = []
    for flags, changed in _layouts(args):
        try:
            knobs.append(Knob(flags, estimate_bytes(changed, runs)))
        except (NotImplementedError, ZeroDivisionError):
            continue
    knobs = [k for k in knobs if k.saving(base) > 0]
    knobs.sort(key=lambda k: -k.saving(base))
    return base, knobs

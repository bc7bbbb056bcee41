"""The layout a launch plans for, as its arguments give it: how many GPUs, how many of them
data-parallel, how many micro-batches a step sums. Several decisions turn on these (the
graphs, the gradient buffer, gradients written), and a dry run plans for a world other than
its own."""

from __future__ import annotations


def planned_world_size(args) -> int:
    """The world size the run is for: a dry run's ``--dry-run-world-size`` when given; with
    ``--fast-multi-gpu-path`` at least two data-parallel ranks' worth."""
    if getattr(args, "dry_run", False) and getattr(args, "dry_run_world_size", None):
        world = int(args.dry_run_world_size)
    else:
        world = int(getattr(args, "world_size", 1) or 1)
    if getattr(args, "fast_multi_gpu_path", False):
        world = max(world, 2 * model_parallel_size(args))
    return world


def model_parallel_size(args) -> int:
    size = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "context_parallel_size"):
        size *= getattr(args, name, 1) or 1
    return size


def planned_data_parallel_size(args) -> int:
    return max(1, planned_world_size(args) // model_parallel_size(args))


def one_micro_batch_per_step(args) -> bool:
    """Whether each step's gradients come from one micro-batch (no accumulation)."""
    micro = getattr(args, "micro_batch_size", None) or 1
    global_batch = getattr(args, "global_batch_size", None) or micro
    return global_batch == micro and not getattr(args, "rampup_batch_size", None)

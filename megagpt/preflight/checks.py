"""Layout checks that run before megatron's validate_args, each with the numbers in its message.

Megatron asserts most of these too, but deep inside a 1,500-line function, with a bare
``AssertionError`` or after the job has taken its nodes. Here each failure names the
flags, their values and the arithmetic that does not work out.
"""

from __future__ import annotations

from megagpt.errors import UserError


class LayoutError(UserError, ValueError):
    """The parallel layout, batch or model shape cannot run on the given GPU count."""


def model_parallel_size(args) -> int:
    """GPUs per model replica: TP × PP × CP."""
    return (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
            * args.context_parallel_size)


def _layout(args) -> str:
    return (f"TP {args.tensor_model_parallel_size} × PP {args.pipeline_model_parallel_size} "
            f"× CP {args.context_parallel_size}")


def _check_world_size(args, world_size: int) -> list[str]:
    per_replica = model_parallel_size(args)
    if world_size % per_replica == 0:
        return []
    lower = max(per_replica, world_size // per_replica * per_replica)
    return [f"world size {world_size} is not divisible by {_layout(args)} = {per_replica} "
            f"GPUs per model replica ({world_size} / {per_replica} = "
            f"{world_size / per_replica:.2f} replicas); use a multiple of {per_replica} GPUs "
            f"(e.g. {lower} or {lower + per_replica})"]


def _check_shape(args) -> list[str]:
    problems = []
    tp, heads = args.tensor_model_parallel_size, args.num_attention_heads
    if heads % tp:
        problems.append(f"--num-attention-heads {heads} is not divisible by "
                        f"--tensor-model-parallel-size {tp} (each TP rank holds whole heads)")
    if args.group_query_attention and args.num_query_groups % tp:
        problems.append(f"--num-query-groups {args.num_query_groups} is not divisible by "
                        f"--tensor-model-parallel-size {tp}")
    if args.group_query_attention and heads % args.num_query_groups:
        problems.append(f"--num-attention-heads {heads} is not divisible by "
                        f"--num-query-groups {args.num_query_groups}")
    if args.kv_channels is None and args.hidden_size % heads:
        problems.append(f"--hidden-size {args.hidden_size} is not divisible by "
                        f"--num-attention-heads {heads} ({args.hidden_size} / {heads} = "
                        f"{args.hidden_size / heads:.2f}); set --kv-channels or change one")
    pp = args.pipeline_model_parallel_size
    even_split = (args.decoder_first_pipeline_num_layers is None
                  and args.decoder_last_pipeline_num_layers is None
                  and getattr(args, "pipeline_model_parallel_layout", None) is None)
    if even_split and args.num_layers % pp:
        problems.append(f"--num-layers {args.num_layers} is not divisible by "
                        f"--pipeline-model-parallel-size {pp} ({args.num_layers} / {pp} = "
                        f"{args.num_layers / pp:.2f} layers per stage)")
    seq, table = args.seq_length, args.max_position_embeddings
    if seq is not None and table is not None and seq > table:
        problems.append(f"--seq-length {seq} is longer than the position table "
                        f"--max-position-embeddings {table}")
    cp = args.context_parallel_size
    if cp > 1 and seq is not None and seq % (2 * cp):
        problems.append(f"--seq-length {seq} is not divisible by 2 × --context-parallel-size "
                        f"{cp} = {2 * cp} (each CP rank takes two chunks)")
    return problems


def _schedule_batch_sizes(schedule: str) -> list[int]:
    from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

    try:
        parsed = StepBatchsizeNumMicroBatchesCalculator._parse_schedule(schedule, None)
        return [bs for _, bs in parsed]
    except ValueError as exc:
        raise LayoutError(f"--step-batch-size-schedule {schedule!r}: {exc}") from None


def _check_batch(args, world_size: int) -> list[str]:
    per_replica = model_parallel_size(args)
    if world_size % per_replica:
        return []  # the world-size message already says it; DP is undefined
    dp = world_size // per_replica
    mbs = args.micro_batch_size
    per_step = mbs * dp
    explicit_gbs = getattr(args, "_is_global_batch_size_explicitly_specified",
                           args.global_batch_size is not None)
    problems = []
    if args.rampup_batch_size is not None:
        start, incr, samples = args.rampup_batch_size
        problems.append(
            f"--rampup-batch-size {start} {incr} {samples} is ignored by megatron-core 0.19 "
            f"(deprecated): the run would train at the fixed --global-batch-size "
            f"{args.global_batch_size} from step 1. Use --step-batch-size-schedule "
            f"'0:{start} <samples>:<batch> ...' and drop --global-batch-size")
    schedule = getattr(args, "step_batch_size_schedule", None)
    if schedule is not None:
        if explicit_gbs:
            problems.append(
                f"--step-batch-size-schedule {schedule!r} sets the global batch per phase; it "
                f"cannot be combined with a fixed --global-batch-size {args.global_batch_size} "
                f"(drop it; a --config file that sets global-batch-size needs it removed there)")
        for bs in _schedule_batch_sizes(schedule):
            if bs % per_step:
                problems.append(
                    f"--step-batch-size-schedule batch {bs} is not divisible by micro-batch "
                    f"{mbs} × DP {dp} = {per_step} ({bs} / {per_step} = {bs / per_step:.2f} "
                    f"micro-batches per step)")
    gbs = args.global_batch_size
    if gbs is not None and schedule is None and gbs % per_step:
        problems.append(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} × DP {dp} "
            f"= {per_step} ({gbs} / {per_step} = {gbs / per_step:.2f} micro-batches per step; "
            f"DP = {world_size} GPU{'' if world_size == 1 else 's'} / {_layout(args)})")
    return problems


REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "micro_batch_size")
# sizes and counts that must be at least 1 where given (megatron divides by most of them)
POSITIVE = ("num_layers", "hidden_size", "num_attention_heads", "micro_batch_size",
            "global_batch_size", "seq_length", "max_position_embeddings", "train_iters",
            "train_samples", "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "context_parallel_size", "log_interval")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_counts(args) -> list[str]:
    """Sizes and counts below 1, a negative seed, evaluation every 0 iterations."""
    problems = [f"{_flag(name)} {value}: must be at least 1"
                for name in POSITIVE
                if isinstance(value := getattr(args, name, None), int) and value < 1]
    seed = getattr(args, "seed", None)
    if isinstance(seed, int) and seed < 0:
        problems.append(f"--seed {seed}: must be 0 or more (torch's generators take no "
                        "negative seed)")
    eval_iters, interval = getattr(args, "eval_iters", 0), getattr(args, "eval_interval", None)
    if eval_iters and isinstance(interval, int) and interval < 1:
        problems.append(f"--eval-interval {interval}: must be at least 1 with --eval-iters "
                        f"{eval_iters} (or --eval-iters 0: no evaluation)")
    return problems


def check_layout(args, world_size: int) -> None:
    """Raise LayoutError naming every problem of this layout on ``world_size`` GPUs.

    Runs on parsed (not yet validated) megatron args, before ``validate_args``; a run that
    lacks a required size is left to megatron's own "is required" message.
    """
    # counts below 1 first and alone: the arithmetic of the other checks divides by them
    problems = _check_counts(args)
    if not problems:
        problems = _check_world_size(args, world_size)
        if all(getattr(args, name, None) is not None for name in REQUIRED):
            problems += _check_shape(args) + _check_batch(args, world_size)
    if len(problems) == 1:
        raise LayoutError(problems[0])
    if problems:
        raise LayoutError(f"{len(problems)} problems with the launch:\n  - "
                          + "\n  - ".join(problems))

"""``--dry-run``: check a launch and print its plan without a GPU or a process group.

Order: our layout checks (clear numbers) → outputs and tokenizer files → megatron's
validate_args (at the intended world size, with the GPU's arch given rather than asked of
CUDA) → the learning-rate schedule and the data → the plan: layout, batch, parameters,
memory, FLOPs, the fast path's choices with their reasons, time and cost (``cost``, ``step_time``; with ``--search-layouts`` the fastest
layouts, ``layout_search``). A layout that cannot run, or whose memory estimate exceeds the
GPU, exits non-zero with a message that names the numbers. The resolved configuration as YAML
goes to ``--dry-run-yaml FILE`` (``-``: printed after the plan), never in its way.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import logging
import sys
from dataclasses import dataclass

import yaml

from megagpt.log import log
from megagpt.preflight import cost
from megagpt.preflight import estimate as est
from megagpt.preflight.checks import LayoutError, check_layout, model_parallel_size
from megagpt.command_line.arguments import build_tokenizer, validate_arguments
from megagpt.data.tokenizer_files import check_tokenizer_files
from megagpt.gpus import Gpu, resolve_gpu
from megagpt.preflight.data_check import check_data
from megagpt.preflight.launch_path import WhatRuns
from megagpt.preflight.output_check import check_outputs
from megagpt.preflight.schedule_check import check_schedule


class MemoryBudgetError(LayoutError):
    """The memory estimate per GPU is above the GPU's memory."""


def _validate(args, gpu: Gpu) -> None:
    """megatron's validate_args at the planned size; its argument table is kept quiet."""
    with contextlib.redirect_stdout(io.StringIO()):
        validate_arguments(args, device_arch=gpu.arch)


@contextlib.contextmanager
def _quiet_logging():
    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def _vocab_size(args) -> int:
    """The tokenizer's vocabulary size (the tokenizer is built, as the run will build it, on
    a copy of ``args``: megatron's builder pads the vocabulary into the arguments it gets)."""
    try:  # megatron's tokenizer reports its padding at INFO: not part of the plan
        with contextlib.redirect_stdout(io.StringIO()), _quiet_logging():
            return build_tokenizer(copy.copy(args)).vocab_size
    except Exception as exc:  # noqa: BLE001 - any failure to load is about the user's files
        if args.vocab_size is not None:
            return args.vocab_size
        if args.tokenizer_type == "GPT2BPETokenizer":
            return 50257  # GPT-2's BPE; its files are read on the cluster, not here
        raise LayoutError(f"cannot load the tokenizer to size the vocabulary ({exc}); "
                          f"pass --vocab-size for the dry run") from None


def _with_padded_vocab(args, vocab_size: int):
    """The validated ``args`` with megatron's padded vocabulary size, as a new namespace for
    the plan: the dry run writes nothing into the arguments megatron validated."""
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    padded = calculate_padded_vocab_size(
        vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size,
        logging_enabled=False)
    return argparse.Namespace(**{**vars(args), "padded_vocab_size": padded})


def resolved_yaml(args) -> str:
    """Every argument after validation, as YAML (dest names; enums and dtypes as text)."""
    def plain(value):
        if value is None or type(value) in (bool, int, float, str):
            return value
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        return str(value)

    data = {k: plain(v) for k, v in sorted(vars(args).items()) if not k.startswith("_")}
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)


def plan_lines(args, gpu: Gpu, params: est.ParameterCount, memory: est.MemoryEstimate) -> list[str]:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp, dp = args.context_parallel_size, args.data_parallel_size
    mbs, gbs, seq = args.micro_batch_size, args.global_batch_size, args.seq_length
    nmb = est.microbatches_per_step(args)
    tokens = gbs * seq
    flops = est.flops_per_iteration(args)
    lines = [
        "layout:",
        f"  GPUs            {args.world_size} = TP {tp} × PP {pp} × CP {cp} × DP {dp}",
        f"  per replica     {gpus(model_parallel_size(args))}; {dp} data-parallel "
        f"replica{'s' if dp > 1 else ''}",
        "batch:",
        f"  micro-batches   {nmb} per step = global batch {gbs} / (micro-batch {mbs} × DP {dp})",
        f"  tokens/step     {tokens:,} = {gbs} sequences × {seq} tokens",
    ]
    if args.train_iters:
        lines.append(f"  tokens/run      {human_tokens(tokens * args.train_iters)} = "
                     f"{tokens:,} × {args.train_iters:,} iterations")
    lines += [
        "parameters:",
        f"  total           {params.total:,} ({est.human(params.total)}), of which embeddings "
        f"{params.embedding:,} (padded vocab {args.padded_vocab_size})",
    ]
    stages = params.stages
    middle = len(stages) > 3  # stages 1..PP-2 hold the same: show one for all
    for s in (stages[0], stages[1], stages[-1]) if middle else stages:
        many = middle and s is stages[1]
        name = f"stages 1..{len(stages) - 2}" if many else f"stage {s.index}"
        extra = f" incl. tied embedding copy {s.tied_copy:,}" if s.tied_copy else ""
        lines.append(f"  {name:<15} {s.layers} layers, {s.total:,}{' each' if many else ''}"
                     f"{extra}; per TP shard {s.per_tp_rank:,}")
    lines += [
        f"memory per GPU (most loaded rank, {gpu.name} {gpu.memory_gib:.1f} GiB, {gpu.source}):",
        f"  weights         {est.gib(memory.weights)}",
        f"  gradients       {est.gib(memory.gradients)}",
        f"  optimizer       {est.gib(memory.optimizer)}"
        + (f" (distributed over DP {dp})" if args.use_distributed_optimizer else ""),
        f"  activations     {est.gib(memory.activations)} ({memory.activation_formula})",
    ]
    if memory.optimizer_step:
        lines.append(f"  optimizer step  {est.gib(memory.optimizer_step)} "
                     f"({_optimizer_step_parts(memory)}), once the activations are freed (the "
                     f"larger of the two counts)")
    lines += [
        f"  runtime reserve {est.gib(memory.reserve)} (CUDA context, NCCL, allocator)",
        f"  total           {est.gib(memory.total)} of {gpu.memory_gib:.1f} GiB",
        f"  (megatron's own weights + optimizer formula, bf16 rule: "
        f"{est.gib(est.megatron_weight_and_optimizer_bytes(args))})",
        "compute:",
        f"  model FLOPs     {flops:.3e} per iteration (megatron's count), "
        f"{flops / args.world_size:.3e} per GPU",
    ]
    return lines


def _optimizer_step_parts(memory: est.MemoryEstimate) -> str:
    parts = [(memory.gradient_copies, "fp32 gradients"),
             (memory.optimizer_temporaries, "torch AdamW's temporaries")]
    return " + ".join(f"{name} {est.gib(value)}" for value, name in parts if value)


def diagnostics_lines(launch, run: cost.RunEstimate | None) -> list[str]:
    """The collective timeout the launch will use (its ``DIAGNOSTICS`` decision; the others
    are logged above), worked out at the estimated step time."""
    from megagpt.launch.diagnostics import DIAGNOSTICS

    diagnostics = launch[DIAGNOSTICS]
    step = run.step.seconds if run is not None else None
    return ["hangs:", f"  {diagnostics.timeout.describe(step)}"]


def gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def human_tokens(n: int) -> str:
    return est.human(n) + " tokens"


@dataclass(frozen=True)
class Plan:
    """A checked launch and what it costs (args validated at the planned world size)."""

    args: object  # with the padded vocabulary
    runs: WhatRuns  # the launch's choices the estimates read
    gpu: Gpu
    params: est.ParameterCount
    memory: est.MemoryEstimate
    run: cost.RunEstimate | None = None  # None: no speed figures for this GPU

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.gpu.memory_gib * est.GIB

    def memory_error(self) -> "MemoryBudgetError":
        m, gpu = self.memory, self.gpu
        return MemoryBudgetError(
            f"estimated memory per GPU {est.gib(m.total)} (weights {est.gib(m.weights)} "
            f"+ gradients {est.gib(m.gradients)} + optimizer {est.gib(m.optimizer)} "
            f"+ {'activations' if m.activations >= m.optimizer_step else 'optimizer step'} "
            f"{est.gib(max(m.activations, m.optimizer_step))} + reserve {est.gib(m.reserve)}) "
            f"is above the {gpu.name}'s {gpu.memory_gib:.1f} GiB; raise TP/PP, use "
            f"--use-distributed-optimizer, --recompute-activations or a smaller micro-batch"
            + ("; without --fast-disable optimizer the fused AdamW allocates no temporaries"
               if m.optimizer_temporaries else ""))


def make_plan(launch, args=None) -> Plan:
    """Check ``launch`` at the dry run's world size, validate its arguments and estimate the
    costs of what it runs (its choices: ``WhatRuns``).

    ``args``: as the launch wrote them (its world size the dry run's; None: written here,
    with its environment, which megatron's validation reads, for the call alone). Raises LayoutError (a UserError) when the layout cannot run;
    mutates ``args`` the way megatron's validation does, and no further.
    """
    if args is None:
        from megagpt.launch.writer import written_for_the_block

        with written_for_the_block(launch) as args:
            return make_plan(launch, args)
    world_size = args.world_size  # the launch's planned GPUs (--dry-run-world-size)
    gpu = resolve_gpu(args.gpu_type, args.gpu_memory_gb, cpu=args.cpu)
    cost.check_price(args)
    check_layout(args, world_size)
    check_outputs(args)
    check_tokenizer_files(args)
    _validate(args, gpu)
    vocab_size = _vocab_size(args)
    args = _with_padded_vocab(args, vocab_size)
    check_schedule(args)
    check_data(args, vocab_size, log)
    try:
        params = est.count_parameters(args)
    except NotImplementedError as exc:
        raise LayoutError(f"--dry-run: {exc}; this run's layout passed the checks above") from None
    runs = WhatRuns.of(launch)
    memory = est.estimate_memory(args, params, est.microbatches_per_step(args), runs)
    return Plan(args, runs, gpu, params, memory, cost.estimate_run(args, gpu, params, runs))


def run_dry_run(launch, args=None) -> int:
    """Check ``launch`` at its intended size and print the plan, its choices with their
    reasons after the layout; 0 when it can run. ``args``: as ``make_plan`` takes them.

    The plan comes alone (a few dozen lines); the resolved configuration (every megatron
    argument, ~800 lines at 345M) only where ``--dry-run-yaml`` asks for it: written to the
    file it names, or printed after the plan with ``--dry-run-yaml -``.
    """
    plan = make_plan(launch, args)
    args = plan.args
    print("\n".join(plan_lines(plan.args, plan.gpu, plan.params, plan.memory)))
    print("\n".join(launch.describe()))
    print("\n".join(cost.estimate_lines(plan.run, plan.gpu)))
    print("\n".join(diagnostics_lines(launch, plan.run)))
    if getattr(args, "search_layouts", False):
        from megagpt.preflight.layout_search import search_lines

        print("\n".join(search_lines(plan)))
    sys.stdout.flush()
    if not plan.fits:
        raise plan.memory_error()
    print(f"dry run OK: {gpus(args.world_size)}, {est.human(plan.params.total)} parameters, "
          f"{est.gib(plan.memory.total)} per GPU")
    if args.dry_run_yaml == "-":
        print("# resolved configuration")
        print(resolved_yaml(plan.args), end="")
    elif args.dry_run_yaml:
        with open(args.dry_run_yaml, "w", encoding="utf-8") as f:
            f.write(resolved_yaml(plan.args))
        print(f"resolved configuration: {args.dry_run_yaml}")
    return 0

"""``--search-layouts``: every layout of this model, GPU count and global batch that fits the
GPU's memory, ranked by the step-time model.

A layout is TP × PP × DP, the micro-batch, the virtual pipeline stages per rank and the
recompute setting; everything else (model, batch, precision, overlaps, and the launch's
choices: path, loss, optimizer, graphs) stays as launched. Each candidate is the launch's args
with those fields changed, so memory and time come from the same code as the dry run's own
plan.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from megagpt.preflight import cost
from megagpt.preflight import estimate as est
from megagpt.preflight.launch_path import WhatRuns
from megagpt.preflight.step_time import StepEstimate, estimate_step

MICRO_BATCHES = (1, 2, 4, 8)
MAX_VIRTUAL_STAGES = 8
RECOMPUTE = ("none", "selective", "full")
SHOWN = 5
# The search ranks layouts that leave a tenth of the GPU free: PyTorch's caching allocator
# loses memory to fragmentation and transient buffers (NCCL, cuBLAS workspaces, the loss's
# temporaries) that no formula above counts, so a layout estimated at the very edge is not
# one to recommend. The dry run's own check of the launch stays at the full memory.
SEARCH_MEMORY_SHARE = 0.9


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    virtual_stages: int
    recompute: str

    def describe(self) -> str:
        v = f", {self.virtual_stages} virtual stages" if self.virtual_stages > 1 else ""
        return (f"TP {self.tp} × PP {self.pp} × DP {self.dp}, micro-batch {self.micro_batch}{v}, "
                f"recompute {self.recompute}")

    def flags(self) -> str:
        """The megatron flags that launch this layout (DP follows from the GPU count), and
        the recompute flags a launch must leave out for it."""
        flags = [f"--tensor-model-parallel-size {self.tp}",
                 f"--pipeline-model-parallel-size {self.pp}",
                 f"--micro-batch-size {self.micro_batch}"]
        if self.virtual_stages > 1:
            flags.append(f"--num-virtual-stages-per-pipeline-rank {self.virtual_stages}")
        if self.recompute == "full":
            flags.append("--recompute-granularity full --recompute-method uniform "
                         "--recompute-num-layers 1")
        elif self.recompute == "selective":
            flags.append("--recompute-granularity selective")
        else:
            flags.append("(and no --recompute-* flags)")
        return " ".join(flags)


@dataclass(frozen=True)
class Ranked:
    layout: Layout
    step: StepEstimate
    memory: est.MemoryEstimate


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def launch_layout(args) -> Layout:
    return Layout(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.data_parallel_size, args.micro_batch_size,
                  getattr(args, "virtual_pipeline_model_parallel_size", None) or 1,
                  args.recompute_granularity or "none")


def candidate_layouts(args, gpus_per_node: int, recompute=RECOMPUTE):
    """Layouts megatron accepts for this model on ``args.world_size`` GPUs."""
    world, cp = args.world_size, args.context_parallel_size
    heads, layers, gbs = args.num_attention_heads, args.num_layers, args.global_batch_size
    groups = args.num_query_groups if args.group_query_attention else heads
    for tp in _divisors(world // cp):
        if tp > gpus_per_node or heads % tp or groups % tp:
            continue
        for pp in _divisors(world // (cp * tp)):
            if layers % pp:
                continue
            dp = world // (cp * tp * pp)
            for mbs in MICRO_BATCHES:
                if gbs % (mbs * dp):
                    continue
                microbatches = gbs // (mbs * dp)
                virtual = [1]
                if pp > 1 and microbatches >= pp:  # megatron's interleaved schedule's condition
                    virtual += [v for v in _divisors(layers // pp)[1:] if v <= MAX_VIRTUAL_STAGES]
                for v in virtual:
                    for r in recompute:
                        yield Layout(tp, pp, dp, mbs, v, r)


def args_for(args, layout: Layout):
    """The launch's args with ``layout`` in place of its own."""
    a = copy.copy(args)
    a.tensor_model_parallel_size, a.pipeline_model_parallel_size = layout.tp, layout.pp
    a.data_parallel_size, a.micro_batch_size = layout.dp, layout.micro_batch
    a.virtual_pipeline_model_parallel_size = layout.virtual_stages if layout.virtual_stages > 1 \
        else None
    a.recompute_granularity = None if layout.recompute == "none" else layout.recompute
    a.recompute_method = "uniform" if layout.recompute == "full" else None
    a.recompute_num_layers = 1 if layout.recompute == "full" else None
    a.sequence_parallel = layout.tp > 1 and (args.sequence_parallel
                                             or args.tensor_model_parallel_size == 1)
    a.decoder_first_pipeline_num_layers = a.decoder_last_pipeline_num_layers = None
    multiple = args.make_vocab_size_divisible_by * layout.tp
    a.padded_vocab_size = -(-args.padded_vocab_size // multiple) * multiple
    return a


def rank(args, runs: WhatRuns, gpu, layout: Layout) -> Ranked:
    a = args_for(args, layout)
    params = est.count_parameters(a)
    memory = est.estimate_memory(a, params, est.microbatches_per_step(a), runs)
    step = estimate_step(cost.shape_of(a, runs), gpu.spec, params.most_per_gpu,
                         cost.parameter_tensors(a, params))
    return Ranked(layout, step, memory)


def search(args, runs: WhatRuns, gpu, recompute=RECOMPUTE) -> list[Ranked]:
    """Every layout that fits ``gpu``, fastest first (``runs``: the launch's choices, held
    as launched for every layout)."""
    limit = gpu.memory_gib * est.GIB * SEARCH_MEMORY_SHARE
    ranked = [r for layout in candidate_layouts(args, gpu.spec.gpus_per_node, recompute)
              if (r := rank(args, runs, gpu, layout)).memory.total <= limit]
    return sorted(ranked, key=lambda r: r.step.seconds)


def search_lines(plan) -> list[str]:
    """The best layouts, and how the launch's own compares."""
    args, gpu = plan.args, plan.gpu
    if gpu.spec is None:
        return ["layouts: no speed figures for this GPU; pass --gpu-type to rank layouts"]
    ranked = search(args, plan.runs, gpu)
    if not ranked:
        return [f"layouts: none of this model's layouts on {args.world_size} GPUs fits "
                f"{SEARCH_MEMORY_SHARE:.0%} of {gpu.memory_gib:.1f} GiB"]
    lines = [f"layouts (the {min(SHOWN, len(ranked))} fastest of {len(ranked)} that fit "
             f"{SEARCH_MEMORY_SHARE:.0%} of {gpu.memory_gib:.1f} GiB on {args.world_size} "
             f"GPUs):"]
    for i, r in enumerate(ranked[:SHOWN], 1):
        lines.append(f"  {i}. {r.layout.describe()}: {cost.human_duration(r.step.seconds)} per "
                     f"iteration, {est.gib(r.memory.total)} per GPU")
        lines.append(f"     {cost.breakdown(r.step)}")
        lines.append(f"     flags: {r.layout.flags()}")
    own = launch_layout(args)
    best = ranked[0].step.seconds
    if plan.run is not None:
        position = next((i for i, r in enumerate(ranked, 1) if r.layout == own), None)
        if position:
            where = f"rank {position}"
        elif own in set(candidate_layouts(args, gpu.spec.gpus_per_node)):
            where = f"above {SEARCH_MEMORY_SHARE:.0%} of the memory"
        else:
            where = "not among the layouts searched"
        faster = plan.run.step.seconds / best - 1
        lines.append(f"  as launched: {own.describe()}: "
                     f"{cost.human_duration(plan.run.step.seconds)} ({where}); the best is "
                     f"{100 * faster:.1f} % faster" if faster > 0.0005 else
                     f"  as launched: {own.describe()} ({where}): the fastest found")
    return lines

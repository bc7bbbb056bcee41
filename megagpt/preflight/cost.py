"""Time and cost of a launch: its step as ``step_time`` models it, and the whole run.

``shape_of(args, runs)`` reads the launch into a ``StepShape``: from its validated megatron
args the model's sizes, the layout, the schedule, recompute and precision; from its choices
(``launch_path.WhatRuns``) the path the entry takes (Transformer Engine, the fast path or
megatron's local spec), the CUDA graph and the FP8 linears.
``estimate_run`` adds megatron's FLOP count, MFU, the run's wall time, GPU-hours and cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from megagpt.errors import UserError
from megagpt.gpus import Gpu, gpu_type_names
from megagpt.preflight import estimate as est
from megagpt.preflight.launch_path import LOCAL, WhatRuns, fused_softmax, softmax_in_fp32
from megagpt.preflight.step_time import PART_NAMES, StepEstimate, StepShape, estimate_step


class PriceError(UserError, ValueError):
    """--gpu-hour-price is not a price."""


def _grad_bytes(args) -> int:
    return est.bytes_per_parameter(args)[1]


def shape_of(args, runs: WhatRuns) -> StepShape:
    """The step-time model's view of validated args (``padded_vocab_size`` set) as the launch
    runs them (``runs``)."""
    heads = args.num_attention_heads
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    recompute = args.recompute_granularity or "none"
    recompute_layers = None
    if recompute == "full" and getattr(args, "recompute_method", None) == "block":
        recompute_layers = args.recompute_num_layers
    return StepShape(
        hidden=args.hidden_size, heads=heads,
        query_groups=args.num_query_groups if args.group_query_attention else heads,
        head_dim=args.kv_channels or args.hidden_size // heads,
        ffn=args.ffn_hidden_size, layers=args.num_layers, vocab=args.padded_vocab_size,
        seq=args.seq_length, glu=bool(args.swiglu), micro_batch=args.micro_batch_size,
        global_batch=args.global_batch_size, tp=args.tensor_model_parallel_size,
        pp=args.pipeline_model_parallel_size, cp=args.context_parallel_size,
        dp=args.data_parallel_size,
        virtual_stages=getattr(args, "virtual_pipeline_model_parallel_size", None) or 1,
        sequence_parallel=bool(args.sequence_parallel), recompute=recompute,
        recompute_layers=recompute_layers,
        distributed_optimizer=bool(args.use_distributed_optimizer),
        overlap_grad_reduce=bool(args.overlap_grad_reduce),
        overlap_param_gather=bool(args.overlap_param_gather),
        tp_comm_overlap=bool(getattr(args, "tp_comm_overlap", False)),
        precision=precision, fp8=runs.fp8, fp8_linears=runs.fp8_linears,
        path=runs.path, flash_attention=runs.path != LOCAL, fused_softmax=fused_softmax(args),
        softmax_in_fp32=softmax_in_fp32(args), cuda_graph=runs.cuda_graph,
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        grad_bytes=_grad_bytes(args),
    )


def parameter_tensors(args, params: est.ParameterCount) -> int:
    """Parameter tensors on the most loaded GPU (weights and biases; for the host's launches)."""
    per_layer = 6 + (6 if args.add_bias_linear else 0)
    stage = max(params.stages, key=lambda s: s.per_tp_rank)
    return stage.layers * per_layer + 4


def check_price(args) -> None:
    price = getattr(args, "gpu_hour_price", None)
    if price is not None and not price >= 0:  # also refuses NaN
        raise PriceError(f"--gpu-hour-price {price}: must be 0 or more (the price of one GPU "
                         f"for one hour)")


@dataclass(frozen=True)
class RunEstimate:
    """One iteration's time and what follows from it for the run as launched."""

    step: StepEstimate
    flops_per_iteration: float  # megatron's count
    gpus: int
    tokens_per_iteration: int
    peak_tflops: float
    iterations: int | None
    price: float | None

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops_per_iteration / self.step.seconds / self.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu / self.peak_tflops

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.tokens_per_iteration / self.step.seconds / self.gpus

    @property
    def run_seconds(self) -> float | None:
        return None if self.iterations is None else self.iterations * self.step.seconds

    @property
    def gpu_hours(self) -> float | None:
        s = self.run_seconds
        return None if s is None else s * self.gpus / 3600

    @property
    def cost(self) -> float | None:
        h = self.gpu_hours
        return None if h is None or self.price is None else h * self.price


def iterations_of(args) -> int | None:
    if args.train_iters:
        return args.train_iters
    if getattr(args, "train_samples", None):
        return -(-args.train_samples // args.global_batch_size)
    return None


def estimate_run(args, gpu: Gpu, params: est.ParameterCount,
                 runs: WhatRuns) -> RunEstimate | None:
    """The launch's time and cost on ``gpu``; None where the GPU has no performance figures."""
    if gpu.spec is None:
        return None
    shape = shape_of(args, runs)
    step = estimate_step(shape, gpu.spec, params.most_per_gpu, parameter_tensors(args, params))
    return RunEstimate(step, est.flops_per_iteration(args), args.world_size,
                       args.global_batch_size * args.seq_length,
                       gpu.spec.dense_16bit_tflops, iterations_of(args),
                       getattr(args, "gpu_hour_price", None))


def human_duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def breakdown(step: StepEstimate) -> str:
    shown = [f"{name} {100 * step.share(name):.0f} %" for name in PART_NAMES
             if step.parts.get(name, 0.0) > 0.005 * step.seconds]
    return ", ".join(shown)


def estimate_lines(run: RunEstimate | None, gpu: Gpu) -> list[str]:
    """The estimate's lines under the plan."""
    if run is None:
        return [f"time: no speed figures for this GPU; pass --gpu-type (one of "
                f"{', '.join(gpu_type_names())}) for an estimate"]
    spec = gpu.spec
    lines = [
        f"time (estimate on {gpu.name}: {spec.dense_16bit_tflops:g} TFLOP/s dense 16-bit, "
        f"{spec.hbm_gb_s / 1000:g} TB/s HBM, NVLink {spec.nvlink_gb_s:g} GB/s, network "
        f"{spec.network_gb_s:g} GB/s per GPU; docs/several-gpus.md):",
        f"  per iteration   {human_duration(run.step.seconds)}: "
        f"{run.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, "
        f"{run.tflops_per_gpu:.1f} TFLOP/s per GPU, MFU {100 * run.mfu:.1f} %",
        f"  step            {breakdown(run.step)}",
    ]
    if run.iterations is not None:
        gpus = f"{run.gpus:,} GPU" + ("s" if run.gpus != 1 else "")
        # a short run's GPU-hours in two significant figures, not rounded to 0
        hours = (f"{run.gpu_hours:,.0f}" if run.gpu_hours >= 10
                 else f"{run.gpu_hours:.2g}" if run.gpu_hours >= 0.01 else "under 0.01")
        line = (f"  whole run       {run.iterations:,} iterations: "
                f"{human_duration(run.run_seconds)} on {gpus} = {hours} GPU-hours")
        if run.cost is not None:
            line += f", cost {run.cost:,.0f} at {run.price:g} per GPU-hour"
        lines.append(line)
    return lines

"""The settings of a ``--cpu`` run (a step of the launch's resolution, ``adapt``): megatron's
arguments for gloo, fp32 and CPU initialisation, the GPU-only fusions off, what no CPU runs
refused in one line. What CPU mode changes inside megatron while it runs is
``megagpt.cpu_mode``'s.
"""

from __future__ import annotations

from megagpt.cpu_mode import CpuModeError

from .plan import Decision, Label, Reason, Why

# Settings CPU mode cannot honour, with the message that names them (FP8 on a CPU is refused
# before, with the FP8 the launch could run elsewhere: ``fp8.hardware_reason``).
_UNSUPPORTED = (
    ("bf16", "--bf16: bfloat16 training needs a GPU (megatron's mixed-precision optimizer "
             "checks for CUDA tensors); CPU mode trains in fp32"),
    ("fp16", "--fp16: half-precision training needs a GPU; CPU mode trains in fp32"),
    ("use_torch_fsdp2", "--use-torch-fsdp2: megatron builds torch FSDP2's device mesh on CUDA"),
    ("moe_grouped_gemm", "--moe-grouped-gemm: the grouped GEMM kernels need a GPU"),
)


class CpuOptimizer(Label):
    """Which kernels step a CPU run's optimizer (``cpu_mode.active``'s optimizer_fallbacks)."""

    MEGATRONS_FALLBACKS = "megatron's torch fallbacks"  # in place of TE's or apex's
    AS_BOUND = "as megatron bound it"


DEVICE: Decision[str] = Decision("device", str)
CPU_OPTIMIZER: Decision[CpuOptimizer] = Decision("CPU optimizer", CpuOptimizer)

# megatron's arguments of a CPU run
CPU_SETTINGS = {
    "distributed_backend": "gloo",
    "use_cpu_initialization": True,
    # Kernels that exist only on GPUs.
    "gradient_accumulation_fusion": False,
    "masked_softmax_fusion": False,
    # bias_gelu_fusion stays as given: megatron's fused bias-GeLU is the tanh
    # approximation of GeLU, part of the function the model computes (a GPU run's
    # default, GPT-2's activation); in CPU mode it runs eagerly.
    "bias_swiglu_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "no_persist_layer_norm": True,
    "cross_entropy_loss_fusion": False,
}


def adapt(p) -> None:
    """The settings of a ``--cpu`` run (a step of the launch's resolution, over its planner
    ``p``); CpuModeError names the impossible ones."""
    args = p.v
    if not getattr(args, "cpu", False):
        return
    problems = [msg for attr, msg in _UNSUPPORTED if getattr(args, attr, None)]
    if problems:
        raise CpuModeError("CPU mode (--cpu) cannot run with: " + "; ".join(problems))
    for name, value in CPU_SETTINGS.items():
        if hasattr(args, name) and getattr(args, name) != value:
            p.set(name, value)
    if getattr(args, "transformer_impl", "local") != "local":
        p.log("cpu mode: --transformer-impl local (Transformer Engine kernels need a GPU)")
        p.set("transformer_impl", "local")
    p.choose(DEVICE, "CPU", Reason(Why.CPU, "--cpu: gloo, fp32, CPU initialisation, GPU-only "
                                   "fusions off"))
    if p.installed.megatron_fused_optimizer:
        p.choose(CPU_OPTIMIZER, CpuOptimizer.MEGATRONS_FALLBACKS, Reason(
            Why.INSTALLED, "megatron's optimizer bound Transformer Engine's (or apex's) "
            "kernels, which step CUDA memory only"))
    else:
        p.choose(CPU_OPTIMIZER, CpuOptimizer.AS_BOUND, Reason(
            Why.INSTALLED, "megatron's optimizer took its torch fallbacks itself (no "
            "Transformer Engine or apex)"))
    p.log("cpu mode: gloo, fp32, CPU initialisation, GPU-only fusions off")

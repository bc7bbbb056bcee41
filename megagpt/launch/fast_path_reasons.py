"""Why the fast path's gradient pieces are on or off for a launch: one function per piece,
from the arguments as the resolution has decided them so far and the launch's layer path
(``*_unsupported_reason``: None where the piece runs). The fast path's steps (``fast_path``)
ask them in order; the graphs' reasons are ``cuda_graphs``', the optimizer's
``optimizer_kernels``'.
"""

from __future__ import annotations

from typing import Optional

from .layers import LayerPath
from .layout import one_micro_batch_per_step, planned_data_parallel_size


def bf16_grad_buffer_unsupported_reason(args, path: LayerPath,
                                        given: frozenset[str] = frozenset()) -> Optional[str]:
    """Why a bf16 gradient buffer would not equal the fp32 one here, or would not load the
    checkpoint this run resumes (None: it would do both).

    With bf16 parameters every gradient autograd delivers is a bf16 tensor (a parameter used
    twice, like tied embeddings, gets the bf16 sum of its uses). An fp32 buffer that is
    zeroed each step and receives one such gradient — one micro-batch, no data-parallel
    sum — holds exactly the bf16 value widened, so a bf16 buffer holds the same numbers.
    ``path``: the launch's layers; ``given``: its explicit flags (a precision of the
    gradients asked for stays).
    """
    if not getattr(args, "bf16", False):
        return "not bf16"
    if getattr(args, "cpu", False):
        return "CPU mode"
    if path is not LayerPath.FAST:
        return "the fast spec is not used"
    for flag in ("--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32",
                 "--main-grads-dtype"):
        if flag in given:
            return f"{flag} was given"
    if planned_data_parallel_size(args) != 1:
        return "more than one data-parallel rank (gradients are summed across ranks)"
    if not one_micro_batch_per_step(args):
        return "more than one micro-batch per step (gradients are accumulated)"
    if getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False):
        return "FSDP"
    return _float32_buckets_reason(args)


def _float32_buckets_reason(args) -> Optional[str]:
    """Why the distributed optimizer's checkpoints keep float32 gradients: megatron's default
    format keeps its state by gradient bucket and names each bucket by its parameter and
    gradient dtypes, so bf16 buckets load only into bf16 buckets. A resume follows the
    buckets of the checkpoint it loads; a run that saves in that format keeps float32 ones,
    those of the same run on several GPUs and of TE's and megatron's layers, so that its
    checkpoints resume there (on one GPU the distributed optimizer saves no memory: it is
    there for such checkpoints). The numbers are the same either way (one micro-batch, one
    rank)."""
    from megagpt.resilience import checkpoint_guard

    found = checkpoint_guard.bucketed_gradient_buffer(args)
    if found is not None:
        if not found[1].endswith("/float32"):
            return None  # bf16 buckets: resumed as they were saved
        return (f"resuming {found[0]}, whose distributed optimizer keeps its state in buckets "
                "of float32 gradients (megatron's default format names the buckets by dtype)")
    if checkpoint_guard.saves_by_bucket(args):
        return ("the distributed optimizer saves by gradient bucket (megatron's default "
                "format names the buckets by dtype): float32 buckets, as on several GPUs and "
                "under TE's layers, so that its checkpoints resume there")
    return None


def wgrad_fusion_unused_reason(args, path: LayerPath, chunked_loss: bool) -> Optional[str]:
    """Why megatron's gradient-accumulation fusion (apex's ``fused_weight_gradient_mlp_cuda``
    in megatron's own linear layers) has nothing to fuse in this launch (None: some of
    megatron's linears run their own backward): the fast spec's fused layers form their weight
    gradients themselves, and its chunked LM loss (``chunked_loss``) forms the output
    layer's."""
    if path is not LayerPath.FAST or not getattr(args, "fast_spec_fused_layer", True):
        return None
    if (not chunked_loss or (getattr(args, "tensor_model_parallel_size", 1) or 1) != 1
            or getattr(args, "sequence_parallel", False) or getattr(args, "use_mup", False)):
        return None  # megatron's output layer runs (lm_loss.fused_lm_head_unsupported_reason)
    return "the fast spec's fused layers and chunked LM loss form their weight gradients"


def grad_write_unsupported_reason(args, path: LayerPath) -> Optional[str]:
    """Why gradients cannot be written instead of added in this run of layers ``path``
    (None: they can)."""
    if path is not LayerPath.FAST:
        return "the fast spec is not used"
    if planned_data_parallel_size(args) != 1:
        return "more than one data-parallel rank"
    if not one_micro_batch_per_step(args):
        return "more than one micro-batch per step (gradients are accumulated)"
    if getattr(args, "gradient_accumulation_fusion", False):
        return "gradient-accumulation fusion adds into the buffer itself"
    if getattr(args, "use_distributed_optimizer", False):
        return "the distributed optimizer"
    if getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False):
        return "FSDP"
    if getattr(args, "cuda_graph_impl", "none") == "local":
        # the captured backward adds each gradient into main_grad itself, not through the
        # DDP hook that writes instead
        return "per-layer CUDA graphs (megatron's --cuda-graph-impl local)"
    return None

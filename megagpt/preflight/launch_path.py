"""What a launch runs, as its launch and validated arguments fix it: the layers' path
(Transformer Engine's, the entry's fast path or megatron's local spec: the launch's ``layers``
choice, ``planned``) and, on megatron's unfused attention, which softmax kernel. The step-time
model (``cost``) and the memory model (``estimate``) both read it.
"""

from __future__ import annotations


def launch_path(args) -> str:
    """'te' (Transformer Engine), 'fast' (the entry's fast path) or 'local' (megatron's)."""
    planned = getattr(args, "_planned_path", None)  # the launch's (planned), the search's
    if planned is not None:
        return planned
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        return "te"
    from megagpt.launch.layer_path import fast_path_selected

    return "fast" if fast_path_selected(args) else "local"


def planned(args, launch):
    """A copy of ``args`` whose estimates take the launch's layers (its ``layers`` choice),
    not a path derived again from the arguments."""
    import copy

    from megagpt.launch.fast_path import LAYERS
    from megagpt.launch.layer_path import FAST

    a = copy.copy(args)
    a._planned_path = ("te" if args.transformer_impl == "transformer_engine"
                       else "fast" if launch.value(LAYERS) == FAST else "local")
    return a


def fused_softmax(args) -> bool:
    """Whether megatron's unfused attention runs its compiled scale-mask-softmax kernel, by the
    conditions of ``FusedScaleMaskSoftmax.is_kernel_available`` that the launch fixes: the
    fusion on (megagpt.compat turns it off where the kernels are not installed), 16-bit scores,
    16 < s ≤ 4096, s and micro-batch × heads per TP rank multiples of 4 (its rows-per-block
    condition, read from the compiled kernel, is taken as met). Otherwise torch's
    fallback (``forward_torch_softmax``) runs mask, softmax and cast as separate passes."""
    heads_per_rank = args.num_attention_heads // args.tensor_model_parallel_size
    return (bool(getattr(args, "masked_softmax_fusion", False)) and (args.fp16 or args.bf16)
            and 16 < args.seq_length <= 4096 and args.seq_length % 4 == 0
            and args.micro_batch_size * heads_per_rank % 4 == 0)


def softmax_in_fp32(args) -> bool:
    """The scores' softmax in fp32: asked for, or forced by query-key layer scaling (as
    ``TransformerConfig.__post_init__`` does)."""
    return bool(getattr(args, "attention_softmax_in_fp32", False)
                or getattr(args, "apply_query_key_layer_scaling", False))


def fp8_linears(args, path: str) -> bool:
    """Whether the layers' linears run in FP8 on ``path``: TE's under ``--fp8-format``, the
    fast spec's where the launch gave it the format (``fast_fp8``)."""
    if path == "te":
        return getattr(args, "fp8", None) is not None
    return path == "fast" and bool(getattr(args, "fast_fp8", None))

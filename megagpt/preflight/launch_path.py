"""What a launch runs, as its ``Launch`` decided it, for the dry run's models: the layers'
path (Transformer Engine's, the entry's fast path or megatron's local spec), the loss, the
optimizer, the CUDA graph and the FP8 linears (``WhatRuns.of``); and, on megatron's unfused
attention, which softmax kernel (from the validated arguments, which megatron decides). The
step-time model (``cost``) and the memory model (``estimate``) both take a ``WhatRuns``
explicitly, so neither derives a choice again from the arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from megagpt.fast_spec.fp8 import ALL_LINEARS, Fp8Recipe
from megagpt.launch import fast_path as chosen
from megagpt.launch.cuda_graphs import CUDA_GRAPH, CudaGraph
from megagpt.launch.fp8 import FP8
from megagpt.launch.layers import LAYERS, TRANSFORMER_ENGINE_IMPL, LayerPath
from megagpt.launch.optimizer_kernels import OPTIMIZER, OptimizerKernels

# the layers' paths as the models tell them apart
TE, FAST, LOCAL = "te", "fast", "local"


@dataclass(frozen=True)
class WhatRuns:
    """The launch's choices that the dry run's time and memory models read."""

    path: str  # TE, FAST or LOCAL
    chunked_loss: bool  # the chunked LM-head cross entropy (no [tokens, vocab] logits kept)
    optimizer: OptimizerKernels  # the launch's ``OPTIMIZER`` decision
    cuda_graph: bool  # a CUDA graph: of the iteration, per layer, or megatron's TE graphs
    fp8: bool  # the layers' linears in FP8
    fp8_linears: tuple = ALL_LINEARS  # which of them (the fast spec's recipe; TE: all four)
    # the fast spec's FP8 weights written by the optimizer (persistent copies, none per layer)
    fp8_weights_written: bool = False

    @classmethod
    def of(cls, launch) -> "WhatRuns":
        # TE's modules under an MoE block or a user's spec are still TE's kernels
        te = launch.arg("transformer_impl") == TRANSFORMER_ENGINE_IMPL
        path = TE if te else FAST if launch[LAYERS] is LayerPath.FAST else LOCAL
        fp8 = launch[FP8]  # None, TE's or the fast spec's recipe
        return cls(
            path=path,
            chunked_loss=launch[chosen.LM_LOSS] is chosen.LmLoss.CHUNKED,
            optimizer=launch[OPTIMIZER],
            cuda_graph=launch[CUDA_GRAPH] is not CudaGraph.NONE,
            fp8=fp8 is not None and path != LOCAL,
            fp8_linears=fp8.linears if isinstance(fp8, Fp8Recipe) else ALL_LINEARS,
            fp8_weights_written=isinstance(fp8, Fp8Recipe) and fp8.weights_written)

    @property
    def fused_adamw(self) -> bool:
        """torch's fused AdamW steps in place of megatron's Adam (no temporaries)."""
        return self.optimizer.fused

    @property
    def flat_step(self) -> bool:
        """The flat AdamW step reads the 16-bit gradient buffer in place (no fp32 copies)."""
        return self.optimizer is OptimizerKernels.FLAT_ADAMW


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



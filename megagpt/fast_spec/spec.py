"""The fast GPT layer spec used when Transformer Engine is not in use.

It is megatron's local spec (``get_gpt_layer_local_submodules``: torch norms, megatron's
parallel linears, bias-GeLU and bias-dropout-add fusions) with three changes:

1. core attention is ``SDPADotProductAttention`` (torch ``scaled_dot_product_attention``:
   flash / cuDNN / memory-efficient kernels; no [b, heads, s, s] score tensor);
2. the layer class is ``FastTransformerLayer``, which runs a dense pre-norm layer as one
   function over the same parameters, ``torch.compile``'d on one tensor-parallel rank
   (``--fast-disable fused-layer`` keeps megatron's ``TransformerLayer``;
   ``--fast-compile off`` runs that function eagerly);
3. the norms, the decoder block's final one too, are ``TorchNorm``: torch's, as megatron's
   ``WrappedTorchNorm`` builds them, but usable under sequence parallelism, which megatron's
   refuses (``fast_decoder_block_spec`` gives the block).

Parameters, their names and the checkpoint layout are those of the local spec, so a
checkpoint moves freely between ``--no-fast-spec`` and the fast spec.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import TransformerLayer

from megagpt.flags import megatron_local_spec_asked

from .attention import SDPADotProductAttention
from .layer import FastTransformerLayer, FusedLayerOptions
from .norm import TorchNorm


class SDPAMaskedDotProductAttention(SDPADotProductAttention):
    """SDPA core attention that applies the attention mask it is given (document masks)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("honour_attention_mask", True)
        super().__init__(*args, **kwargs)


def _get(args, name, default=None):
    value = getattr(args, name, default)
    return default if value is None and default is not None else value


def fast_spec_unsupported_reason(args) -> Optional[str]:
    """Why the fast spec cannot be used for this run (None if it can).

    ``args`` is megatron's parsed argument namespace (or anything with the same names).
    """
    if not _get(args, "fast_spec", True):
        return "disabled by --no-fast-spec"
    return fast_spec_uncovered_reason(args)


def fast_spec_uncovered_reason(args) -> Optional[str]:
    """What in this run the fast spec's layers do not cover, whether or not ``--no-fast-spec``
    is given (None: they cover it all). The FP8 they do not run is the launch's to say
    (``megagpt.launch.fp8``)."""
    if (_get(args, "context_parallel_size", 1) or 1) > 1:
        return (
            "context parallelism (CP > 1) needs Transformer Engine's attention; "
            "SDPA core attention has no CP ring exchange"
        )
    if _get(args, "multi_latent_attention", False):
        return "multi-latent attention is not covered by the fast spec"
    if _get(args, "softmax_type", "vanilla") not in ("vanilla", None):
        return f"--softmax-type {args.softmax_type} (SDPA has no softmax offset)"
    if _get(args, "window_size", None) is not None:
        return "sliding-window attention (--window-size)"
    if _get(args, "use_kitchen", False):
        return "--use-kitchen"
    if _get(args, "fp4", None):
        return "FP4 training needs Transformer Engine"
    if _get(args, "layernorm_zero_centered_gamma", False):
        # megatron's WrappedTorchNorm asserts on it; apex's FusedLayerNorm (megatron's local
        # spec) and TE's norms have it
        return "--apply-layernorm-1p: torch's norms have no zero-centred gamma"
    if megatron_local_spec_asked(args):
        return "--spec local asks for megatron's local spec"
    if _get(args, "spec", None):
        return "a user layer spec was given with --spec"
    if _get(args, "heterogeneous_layers_config_path", None) or _get(
        args, "heterogeneous_layers_config_encoded_json", None
    ):
        return "heterogeneous layer configs"
    if _get(args, "experimental_attention_variant", None):
        return f"--experimental-attention-variant {args.experimental_attention_variant}"
    return None


def get_fast_gpt_layer_spec(args, fused: Optional[FusedLayerOptions]) -> ModuleSpec:
    """The fast layer spec for megatron's parsed ``args`` (see module docstring).

    Reads: num_experts, moe_grouped_gemm, qk_layernorm, qk_l2_norm, normalization,
    reset_attention_mask. ``fused``: how the fused layers run (``FusedLayerOptions``, as the
    launch decided them); None builds megatron's ``TransformerLayer`` with the fast spec's
    attention and norms (``--fast-disable fused-layer``).
    """
    reason = fast_spec_unsupported_reason(args)
    if reason is not None:
        raise ValueError(f"fast spec cannot be used: {reason}")
    submodules = get_gpt_layer_local_submodules(
        num_experts=_get(args, "num_experts", None),
        moe_grouped_gemm=bool(_get(args, "moe_grouped_gemm", False)),
        qk_layernorm=bool(_get(args, "qk_layernorm", False)),
        multi_latent_attention=False,
        normalization=_get(args, "normalization", "LayerNorm"),
        qk_l2_norm=bool(_get(args, "qk_l2_norm", False)),
    )
    core = (
        SDPAMaskedDotProductAttention
        if _get(args, "reset_attention_mask", False)
        else SDPADotProductAttention
    )
    submodules.self_attention.submodules.core_attention = core
    # torch's norms, marked for sequence parallelism where it is on (megatron's refuse it)
    submodules.input_layernorm = TorchNorm
    submodules.pre_mlp_layernorm = TorchNorm

    if fused is None:
        return ModuleSpec(module=TransformerLayer, submodules=submodules)
    return ModuleSpec(module=FastTransformerLayer, submodules=submodules,
                      params={"fused_options": fused})


def fast_decoder_block_spec(layer_spec: ModuleSpec, config, vp_stage=None
                            ) -> TransformerBlockSubmodules:
    """The decoder block for ``layer_spec``: this stage's layers and a final norm that, like
    the layers' own, serves sequence parallelism (megatron's block would take its
    ``WrappedTorchNorm``, which refuses it)."""
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * layers, layer_norm=TorchNorm)

"""Which transformer layer spec a GPT run uses, and why.

Order of preference:
  1. ``--spec MODULE FUNCTION`` given by the user: megatron imports it, we stay out of the way
     (``--spec local``, megatron's name for its local spec, is 5.);
  2. Transformer Engine's spec when TE is installed and ``--transformer-impl transformer_engine``
     (given, or chosen by ``megagpt.layer_impl`` for what only TE runs or where TE is faster);
  3. with ``--num-experts``: megatron's MoE decoder-block spec (TE or local modules);
  4. this project's fast spec (``megagpt.fast_spec``) unless ``--no-fast-spec`` or the run
     needs something it does not support (the reason is logged);
  5. megatron's local spec.

``choose_layer_spec`` decides once from the arguments; ``layer_spec_builder`` returns the
callable that ``GPTModelConfig.transformer_layer_spec`` holds, which megatron's
``GPTModelBuilder`` calls per model chunk (with ``vp_stage`` under virtual pipelining).
``gpt_model_config`` puts the two into megatron's model config: training and inference both
build their model from it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from megagpt.fast_spec import layer_path
from megagpt.fast_spec.spec import fast_decoder_block_spec, get_fast_gpt_layer_spec

# the layer paths, as megagpt.fast_spec.layer_path names them
TRANSFORMER_ENGINE = layer_path.TRANSFORMER_ENGINE
MOE_BLOCK = layer_path.MOE_BLOCK
FAST = layer_path.FAST
LOCAL = layer_path.LOCAL
USER_SPEC = layer_path.USER_SPEC


@dataclass(frozen=True)
class LayerSpecChoice:
    path: str  # one of the constants above
    reason: str  # one line for the log: why this path ran

    def describe(self) -> str:
        return f"layer spec: {self.path} ({self.reason})"


def choose_layer_spec(args) -> LayerSpecChoice:
    """Decide the layer-spec path for this run from its (adapted) arguments: the plan's
    ``layers`` choice (``megagpt.fast_spec.layer_path``)."""
    return LayerSpecChoice(*layer_path.layer_path(args))


def layer_spec_builder(choice: LayerSpecChoice, args) -> Callable | None:
    """The value for ``GPTModelConfig.transformer_layer_spec`` (None: keep megatron's)."""
    if choice.path == USER_SPEC:
        return None  # gpt_config_from_args already imported the user's spec
    if choice.path == FAST:
        spec = get_fast_gpt_layer_spec(args)
        return lambda config, vp_stage=None: fast_decoder_block_spec(
            spec, config.transformer, vp_stage)

    def build(config, vp_stage=None):
        t = config.transformer
        if choice.path == MOE_BLOCK:
            return get_gpt_decoder_block_spec(
                t, use_transformer_engine=t.transformer_impl == "transformer_engine",
                normalization=t.normalization, qk_l2_norm=t.qk_l2_norm, vp_stage=vp_stage)
        if choice.path == TRANSFORMER_ENGINE:
            return get_gpt_layer_with_transformer_engine_spec(
                t.num_moe_experts, t.moe_grouped_gemm, t.qk_layernorm,
                t.multi_latent_attention, qk_l2_norm=t.qk_l2_norm)
        layer = get_gpt_layer_local_spec(
            t.num_moe_experts, t.moe_grouped_gemm, t.qk_layernorm,
            t.multi_latent_attention, normalization=t.normalization)
        if getattr(args, "cpu", False):
            layer = with_torch_norms(layer)
        return local_decoder_block_spec(layer, t, vp_stage)

    return build


def with_torch_norms(layer_spec):
    """megatron's local layer spec with torch's norms in place of apex's FusedLayerNorm, which
    megatron's local spec takes wherever apex imports and whose kernels take CUDA tensors only:
    a ``--cpu`` run of the local spec (training, or generating from a checkpoint) on a machine
    with apex installed stopped in its first norm ("input must be a CUDA tensor"). Both have
    the same parameters (weight, bias), so the checkpoint is the same."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    attention = getattr(layer_spec.submodules.self_attention, "submodules", None)
    for owner, name in ((layer_spec.submodules, "input_layernorm"),
                        (layer_spec.submodules, "pre_mlp_layernorm"),
                        (attention, "q_layernorm"), (attention, "k_layernorm")):
        if getattr(owner, name, None) is FusedLayerNorm:
            setattr(owner, name, WrappedTorchNorm)
    return layer_spec


def local_decoder_block_spec(layer_spec, config, vp_stage=None):
    """The decoder block of megatron's local layers with their own norm as its final norm.
    Given a layer spec, megatron's block takes TE's norm for the final one wherever TE
    imports, so a local-spec model would still need TE's kernels: a ``--cpu`` run (training
    or generating) on a machine with TE installed stopped in that norm."""
    norm = layer_spec.submodules.input_layernorm
    if norm is IdentityOp:
        return layer_spec  # no norm of its own to reuse: megatron's block decides
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=norm)


def gpt_model_config(args):
    """(megatron's ``GPTModelConfig`` for ``args`` with this run's layer spec, the
    ``LayerSpecChoice``): what ``pretrain_gpt.build_configs`` and
    ``megagpt.inference.loading.build_model`` build the model from."""
    from megatron.training.argument_utils import gpt_config_from_args

    choice = choose_layer_spec(args)
    if layer_path.megatron_local_spec_asked(args):
        # megatron's gpt_config_from_args would import "local" as a module; the local spec
        # is this module's to build (layer_spec_builder)
        args = argparse.Namespace(**{**vars(args), "spec": None})
    model_config = gpt_config_from_args(args)
    spec = layer_spec_builder(choice, args)
    if spec is not None:
        model_config.transformer_layer_spec = spec
    return model_config, choice

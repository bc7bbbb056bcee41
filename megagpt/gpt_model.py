"""The GPT model a launch builds: megatron's ``GPTModelConfig`` with the launch's layer spec,
one stage of it, and the output processor of its last stage.

The layers are the launch's ``LAYERS`` decision (``megagpt.launch.layers.LayerPath``):

  1. ``--spec MODULE FUNCTION`` given by the user: megatron imports it, we stay out of the way
     (``--spec local``, megatron's name for its local spec, is 5.);
  2. Transformer Engine's spec (``--transformer-impl transformer_engine``, given or chosen by
     the launch for what only TE runs or where TE is faster: ``megagpt.launch.layers``);
  3. with ``--num-experts``: megatron's MoE decoder-block spec (TE or local modules);
  4. this project's fast spec (``megagpt.fast_spec``), its fused layer built with the launch's
     ``fused layer``, ``compile``, ``hash dropout`` and ``FP8`` decisions;
  5. megatron's local spec.

``gpt_model_config(args, launch)`` puts the layer spec into megatron's model config: training
(``megatron.training.pretrain`` builds its model from it) and inference alike build from it.
``build_stage`` is megatron's ``get_model`` contract for one stage; ``output_processor`` is
the launch's ``LM loss`` decision as ``GPTModel.forward``'s ``output_processor``.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from typing import Callable, Optional

from megagpt.flags import megatron_local_spec_asked
from megagpt.launch import fast_path as chosen
from megagpt.launch.cuda_graphs import CUDA_GRAPH
from megagpt.launch.fp8 import FP8
from megagpt.launch.layers import LAYERS, LayerPath
from megagpt.launch.optimizer_kernels import ASYNC_STEP, OPTIMIZER, OptimizerKernels


@dataclass(frozen=True)
class LayerSpecChoice:
    path: LayerPath
    reason: object  # the launch's ``plan.Reason``: why this path runs

    def describe(self) -> str:
        return f"layer spec: {self.path} ({self.reason})"

    @classmethod
    def of(cls, launch) -> "LayerSpecChoice":
        """The launch's ``LAYERS`` decision."""
        layers = launch.choice(LAYERS)
        return cls(layers.value, layers.reason)


def fused_layer_options(launch):
    """How the fast spec's fused layers run, as the launch chose (None: its layers are
    megatron's ``TransformerLayer``)."""
    from megagpt.fast_spec.layer import FusedLayerOptions

    if not launch[chosen.FUSED_LAYER]:
        return None
    # the fused layer is the fast spec's, whose FP8 is an Fp8Recipe (TE's FP8 is TE's layers')
    return FusedLayerOptions.make(compile=launch[chosen.COMPILE],
                                  hash_dropout=launch[chosen.HASH_DROPOUT], fp8=launch[FP8])


def layer_spec_builder(layers: LayerSpecChoice, args, fused=None) -> Callable | None:
    """The value for ``GPTModelConfig.transformer_layer_spec`` (None: keep megatron's).
    ``fused``: the fast spec's ``FusedLayerOptions`` (``fused_layer_options``)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if layers.path is LayerPath.USER_SPEC:
        return None  # gpt_config_from_args already imported the user's spec
    if layers.path is LayerPath.FAST:
        from megagpt.fast_spec.spec import fast_decoder_block_spec, get_fast_gpt_layer_spec

        spec = get_fast_gpt_layer_spec(args, fused)
        return lambda config, vp_stage=None: fast_decoder_block_spec(
            spec, config.transformer, vp_stage)

    def build(config, vp_stage=None):
        t = config.transformer
        if layers.path is LayerPath.MOE_BLOCK:
            return get_gpt_decoder_block_spec(
                t, use_transformer_engine=t.transformer_impl == "transformer_engine",
                normalization=t.normalization, qk_l2_norm=t.qk_l2_norm, vp_stage=vp_stage)
        if layers.path is LayerPath.TRANSFORMER_ENGINE:
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
    the same parameters (weight, bias), so the checkpoint is the same. ``TorchNorm`` (megatron's
    ``WrappedTorchNorm`` without its refusals) because a checkpoint saved where apex is
    installed carries ``persist_layer_norm``, which ``WrappedTorchNorm`` asserts on."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm

    from megagpt.fast_spec.norm import TorchNorm

    attention = getattr(layer_spec.submodules.self_attention, "submodules", None)
    for owner, name in ((layer_spec.submodules, "input_layernorm"),
                        (layer_spec.submodules, "pre_mlp_layernorm"),
                        (attention, "q_layernorm"), (attention, "k_layernorm")):
        if getattr(owner, name, None) is FusedLayerNorm:
            setattr(owner, name, TorchNorm)
    return layer_spec


def local_decoder_block_spec(layer_spec, config, vp_stage=None):
    """The decoder block of megatron's local layers with their own norm as its final norm.
    Given a layer spec, megatron's block takes TE's norm for the final one wherever TE
    imports, so a local-spec model would still need TE's kernels: a ``--cpu`` run (training
    or generating) on a machine with TE installed stopped in that norm."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    norm = layer_spec.submodules.input_layernorm
    if norm is IdentityOp:
        return layer_spec  # no norm of its own to reuse: megatron's block decides
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=norm)


def gpt_model_config(args, launch):
    """(megatron's ``GPTModelConfig`` for the validated ``args`` with the launch's layer spec,
    the launch's ``LayerSpecChoice``)."""
    from megatron.training.argument_utils import gpt_config_from_args

    layers = LayerSpecChoice.of(launch)
    if megatron_local_spec_asked(args):
        # megatron's gpt_config_from_args would import "local" as a module; the local spec
        # is this module's to build (layer_spec_builder)
        args = argparse.Namespace(**{**vars(args), "spec": None})
    model_config = gpt_config_from_args(args)
    spec = layer_spec_builder(layers, args, fused_layer_options(launch))
    if spec is not None:
        model_config.transformer_layer_spec = spec
    return model_config, layers


def build_stage(model_config, pre_process: bool = True, post_process: bool = True,
                vp_stage: Optional[int] = None, pg_collection=None):
    """One stage of the GPT model described by ``model_config`` (megatron's ``GPTModel``,
    weights as megatron initialises them), in the model-parallel groups of ``pg_collection``
    (default: megatron's parallel state)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder

    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return GPTModelBuilder(model_config).build_model(
        pg_collection, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


def output_processor(launch) -> Optional[Callable]:
    """``GPTModel.forward``'s ``output_processor`` for the launch's ``LM loss`` choice: the
    chunked LM-head cross entropy (``fast_spec.lm_loss.fused_lm_head_loss``) with its kernels
    compiled as the launch's ``compile`` choice says; None keeps megatron's output layer and
    loss."""
    if launch[chosen.LM_LOSS] is not chosen.LmLoss.CHUNKED:
        return None
    from megagpt.fast_spec.lm_loss import fused_lm_head_loss

    return functools.partial(fused_lm_head_loss, compile_kernels=launch[chosen.COMPILE],
                             grad_in_forward=launch[chosen.LM_GRAD_IN_FORWARD])


def describe(launch) -> str:
    """One line for the log: the launch's model path and, on the fast spec, its pieces."""
    layers = LayerSpecChoice.of(launch)
    if layers.path is not LayerPath.FAST:
        return layers.describe()
    parts = ["SDPA core attention"]
    if launch[chosen.FUSED_LAYER]:
        parts.append("fused dense layer (" + ("torch.compile" if launch[chosen.COMPILE]
                                              else "eager") + ")")
    if launch[chosen.LM_LOSS] is chosen.LmLoss.CHUNKED:
        grad = ", gradients formed in forward" if launch[chosen.LM_GRAD_IN_FORWARD] else ""
        parts.append(f"chunked LM-head cross entropy{grad}")
    graph = launch[CUDA_GRAPH]
    if graph.captures:
        parts.append(f"CUDA graph {graph}")
    if launch[OPTIMIZER] is not OptimizerKernels.MEGATRONS:
        parts.append(str(launch[OPTIMIZER]))
    if launch[ASYNC_STEP]:
        parts.append("no host sync inside the step")
    if launch[chosen.BF16_GRAD_BUFFER]:
        parts.append("bf16 gradient buffer")
    if launch[chosen.GRAD_WRITE]:
        parts.append("gradients written into the buffer, not zeroed and added")
    return f"{layers.describe()}; fast spec: " + ", ".join(parts)

"""Which layer spec a GPT run uses, as its launch chose it, in megatron's model config.

The choice is the launch's (``megagpt.launch``: its ``layers`` choice, made once, with its
reason); ``megagpt.gpt_model`` builds each path: megatron's Transformer Engine spec, its MoE
block, this project's fast spec, megatron's local spec, or a user's ``--spec``. Training and
inference both build their model from the ``GPTModelConfig`` this returns.
"""

from __future__ import annotations

from megagpt.gpt_model import LayerSpecChoice, layer_spec_builder, output_processor
from megagpt.launch.layers import LayerPath


def gpt_model_config(args, launch):
    """(megatron's ``GPTModelConfig`` for the validated ``args`` with the launch's layer spec,
    the ``LayerSpecChoice``)."""
    from megagpt.gpt_model import gpt_model_config as model_config_of

    return model_config_of(args, launch)


__all__ = ["LayerPath", "LayerSpecChoice", "gpt_model_config", "layer_spec_builder",
           "output_processor"]

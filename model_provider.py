"""Build one GPT model stage from a ``GPTModelConfig`` (megatron's ``get_model`` contract).

``megatron.training.pretrain`` builds the model itself from the container's
``GPTModelConfig`` through ``GPTModelBuilder``; this function is the same build for
callers that want a stage by hand (the minimal training loop in examples/, tests,
tools) or megatron's ``model_provider_func`` route. The build is ``megagpt.gpt_model``'s.
"""

from __future__ import annotations

from megagpt.gpt_model import build_stage


def model_provider(model_config, pre_process: bool = True, post_process: bool = True,
                   vp_stage: int | None = None, config=None, pg_collection=None,
                   record_memory_history: bool = False):
    """One stage of the GPT model described by ``model_config``.

    ``config`` (a TransformerConfig) overrides ``model_config.transformer`` when megatron
    passes one. ``record_memory_history`` starts the CUDA allocator's history before any
    weight is allocated, so a later memory snapshot shows where every byte came from.
    """
    if record_memory_history:
        import torch

        if torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(max_entries=100_000)
    if config is not None:
        model_config.transformer = config
    return build_stage(model_config, pre_process, post_process, vp_stage, pg_collection)

"""Build one GPT model stage from a ``GPTModelConfig`` (megatron's ``get_model`` contract).

``megatron.training.pretrain`` builds the model itself from the container's
``GPTModelConfig`` through ``GPTModelBuilder``; this function is the same build for
callers that want a stage by hand (the minimal training loop in examples/, tests,
tools) or megatron's ``model_provider_func`` route.
"""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig


def model_provider(
    model_config: GPTModelConfig,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    config=None,
    pg_collection: ProcessGroupCollection | None = None,
    record_memory_history: bool = False,
) -> GPTModel:
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
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    return GPTModelBuilder(model_config).build_model(
        pg_collection, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)

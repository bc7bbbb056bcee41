"""megagpt: the GPT pretraining entry around the megatron-core wheel.

Modules, one concern each; nothing here imports the top-level entry files
(pretrain_gpt.py, gpt_builders.py, model_provider.py).
"""

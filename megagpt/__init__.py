"""megagpt: the GPT pretraining entry around the megatron-core wheel.

Modules, one concern each; nothing here imports the top-level entry files
(pretrain_gpt.py, gpt_builders.py, model_provider.py).

Importing the package makes Transformer Engine run on torch's own cuDNN (``megagpt.te_cudnn``):
it has to happen before megatron first imports TE, and every entry and tool imports this
package first.
"""

from megagpt.te_cudnn import use_torchs_cudnn_for_te as _use_torchs_cudnn_for_te

_use_torchs_cudnn_for_te()

"""torch's LayerNorm / RMSNorm for megatron layers, sequence parallelism included.

megatron's ``WrappedTorchNorm`` (its norm without Transformer Engine or apex) refuses
``--sequence-parallel`` with an assertion deep in model building. The reason is
bookkeeping, not arithmetic: under sequence parallelism each tensor-parallel rank normalises
its own slice of the sequence, so a norm's weight gradient is a partial sum that megatron's
``finalize_model_grads`` must all-reduce across the ranks, and it does so for parameters
marked ``sequence_parallel`` — which TE's and apex's norms mark and torch's do not. This norm
builds the same torch module and marks its parameters.
"""

from __future__ import annotations

import copy

from megatron.core.transformer.torch_norm import WrappedTorchNorm


class TorchNorm:
    """``WrappedTorchNorm``'s torch module, usable under sequence parallelism."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm"):
        if not config.sequence_parallel:
            return WrappedTorchNorm(config, hidden_size, eps, persist_layer_norm,
                                    zero_centered_gamma, normalization)
        unsplit = copy.copy(config)
        unsplit.sequence_parallel = False  # what WrappedTorchNorm checks; the module is the same
        norm = WrappedTorchNorm(unsplit, hidden_size, eps, persist_layer_norm,
                                zero_centered_gamma, normalization)
        for param in norm.parameters():
            # summed across the tensor-parallel ranks by megatron's finalize_model_grads
            setattr(param, "sequence_parallel", True)
        return norm

"""torch's LayerNorm / RMSNorm for megatron layers, sequence parallelism included.

megatron's ``WrappedTorchNorm`` (its norm without Transformer Engine or apex) refuses two
settings with an assertion deep in model building, neither for a reason of arithmetic:

- ``--sequence-parallel``: each tensor-parallel rank normalises its own slice of the
  sequence, so a norm's weight gradient is a partial sum that megatron's
  ``finalize_model_grads`` must all-reduce across the ranks, and it does so for parameters
  marked ``sequence_parallel`` — which TE's and apex's norms mark and torch's do not. This
  norm builds the same torch module and marks its parameters.
- ``persist_layer_norm``: the choice of apex's persistent kernel for megatron's
  ``FusedLayerNorm``, on by default wherever apex is installed. torch's norm has one kernel
  and the same parameters; the flag says nothing about it, so it is cleared for the check.
  (With apex installed every fast-spec launch stopped here at model building.)
"""

from __future__ import annotations

import copy

from megatron.core.transformer.torch_norm import WrappedTorchNorm


class TorchNorm:
    """``WrappedTorchNorm``'s torch module, usable under sequence parallelism and whatever
    ``persist_layer_norm`` says."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm"):
        checked = config
        if config.sequence_parallel or config.persist_layer_norm:
            checked = copy.copy(config)
            # what WrappedTorchNorm asserts on; the module it builds is the same
            checked.sequence_parallel = False
            checked.persist_layer_norm = False
        norm = WrappedTorchNorm(checked, hidden_size, eps, False, zero_centered_gamma,
                                normalization)
        if config.sequence_parallel:
            for param in norm.parameters():
                # summed across the tensor-parallel ranks by megatron's finalize_model_grads
                setattr(param, "sequence_parallel", True)
        return norm

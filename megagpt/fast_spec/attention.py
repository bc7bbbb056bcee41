"""Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

``SDPADotProductAttention`` is a drop-in for megatron's local ``DotProductAttention``
(same constructor and forward signature, same input/output layouts): queries, keys and
values arrive as ``[sq, b, heads, head_dim]`` and the result leaves as ``[sq, b, heads *
head_dim]``. Torch picks the kernel (flash, cuDNN, memory-efficient, or the math
fallback on CPU), so the ``[b, heads, sq, sk]`` score matrix is never materialised;
megatron's ``--attention-backend`` narrows the choice (``attention_backend``).

Semantics kept from the local implementation:
- softmax scale ``1/sqrt(head_dim)`` unless ``softmax_scale`` is given; with
  ``apply_query_key_layer_scaling`` the local path divides by the layer number before
  the matmul and multiplies it back inside the softmax, so the net scale is the same.
- causal mask type: the attention mask tensor is ignored (as TE's causal attention does)
  unless the spec asks to honour it (``honour_attention_mask=True``, used with
  ``--reset-attention-mask`` where the mask carries document boundaries). A boolean
  mask uses megatron's convention: True means "masked out".
- attention dropout is drawn inside the model-parallel RNG tracker, as the local path does
  when sequence parallelism is off.
- grouped-query attention: key/value heads are shared by ``heads / groups`` query heads.

Not supported (``fast_spec_unsupported_reason`` keeps such runs on the local spec):
context parallelism, packed sequences (THD), attention bias, sliding windows, and
softmax types other than "vanilla".
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from .sdpa_kernels import sdpa_kernels_for


def sdpa_kernels_only(kernels: Optional[tuple]):
    """A context in which SDPA picks only among ``kernels`` (None: among all); it also holds
    inside ``torch.compile``d code and CUDA graph captures, which keep the kernel picked."""
    return contextlib.nullcontext() if kernels is None else sdpa_kernel(list(kernels))


def sdpa_unsupported_reason(config: TransformerConfig) -> Optional[str]:
    """Why SDPA core attention cannot replace the local one for this config (None if it can)."""
    if getattr(config, "context_parallel_size", 1) != 1:
        return "context parallelism needs TE's attention (SDPA core attention has no CP ring)"
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        return f"softmax_type={config.softmax_type!r} (SDPA has no softmax offset)"
    if getattr(config, "window_size", None) is not None:
        return "sliding-window attention"
    return None


class SDPADotProductAttention(MegatronModule):
    """Megatron ``DotProductAttention`` replacement built on torch SDPA."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        honour_attention_mask: bool = False,
    ):
        super().__init__(config=config)
        self.config: TransformerConfig = config
        reason = sdpa_unsupported_reason(config)
        if reason is not None:
            raise ValueError(f"SDPADotProductAttention: unsupported configuration: {reason}")

        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.honour_attention_mask = honour_attention_mask

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        world_size = pg_collection.tp.size()

        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)

        # Net scale of the local path (layer scaling cancels out, see module docstring).
        if softmax_scale is None:
            self.softmax_scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        else:
            self.softmax_scale = softmax_scale

        self.attention_dropout_p = float(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        # --attention-backend: the SDPA kernels this attention may use (None: torch picks)
        self.sdpa_kernels = sdpa_kernels_for(getattr(config, "attention_backend", None))

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        assert packed_seq_params is None, "packed sequences are not supported by SDPA attention"
        assert attention_bias is None, "attention bias is not supported by SDPA attention"
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type

        sq, b = query.size(0), query.size(1)
        sk = key.size(0)
        # [s, b, n, d] -> [b, n, s, d] (views; SDPA accepts strided inputs)
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        n_q, n_kv = q.size(1), k.size(1)
        gqa = n_q != n_kv

        attn_mask = None
        is_causal = False
        if mask_type == AttnMaskType.causal and not (
            self.honour_attention_mask and attention_mask is not None
        ):
            # sq == 1 with a KV cache: attend to everything (as the local path does).
            is_causal = sq > 1
            if is_causal and sq != sk:
                raise ValueError("causal SDPA attention needs sq == sk")
        elif attention_mask is not None:
            # megatron: True = masked out; SDPA: True = may attend.
            attn_mask = ~attention_mask if attention_mask.dtype == torch.bool else attention_mask

        dropout_p = self.attention_dropout_p if self.training else 0.0

        def _attend():
            with sdpa_kernels_only(self.sdpa_kernels):
                return _sdpa()

        def _sdpa():
            kk, vv = k, v
            kwargs = {}
            if gqa:
                if _HAS_ENABLE_GQA:
                    kwargs["enable_gqa"] = True
                else:  # pragma: no cover - old torch
                    rep = n_q // n_kv
                    kk = k.repeat_interleave(rep, dim=1)
                    vv = v.repeat_interleave(rep, dim=1)
            return F.scaled_dot_product_attention(
                q,
                kk,
                vv,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
                **kwargs,
            )

        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = _attend()
        else:
            out = _attend()

        # [b, n, sq, d] -> [sq, b, n*d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def _has_enable_gqa() -> bool:
    import inspect

    try:
        return "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):
        # builtins without a signature: probe it
        try:
            x = torch.zeros(1, 2, 1, 4)
            y = torch.zeros(1, 1, 1, 4)
            F.scaled_dot_product_attention(x, y, y, enable_gqa=True)
            return True
        except TypeError:
            return False


_HAS_ENABLE_GQA = _has_enable_gqa()

"""What a built megatron GPT computes, named in the terms its readers need.

The KV decoder re-implements the forward pass over the same weights and the Hugging Face
export maps it onto a transformers class; both need the same facts (norm, positions,
activation, heads, biases, ties) and both must refuse what they do not reproduce.
``Architecture.of(model)`` reads them from the model's ``TransformerConfig``; ``unsupported``
lists, one phrase each naming megatron's flag, the features neither of them covers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megagpt.model_math import activation_name

MEGATRON_ROPE_SCALING_FACTOR = 8.0


@dataclass(frozen=True)
class Architecture:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_query_groups: int
    kv_channels: int
    normalization: str  # "LayerNorm" | "RMSNorm"
    norm_epsilon: float
    position: str  # "learned_absolute" | "rope" | "none" | ...
    rotary_base: float
    rotary_percent: float
    rope_scaling: bool
    rope_scaling_factor: float
    activation: str | None  # megagpt.model_math's name
    gated: bool  # gated linear unit: act(x W_gate) * (x W_up)
    linear_bias: bool  # bias on the projection, fc1 and fc2
    qkv_bias: bool
    tied: bool  # the output layer is the word embedding
    padded_vocab_size: int
    max_position_embeddings: int
    softmax_scale: float
    hidden_dropout: float
    attention_dropout: float
    unsupported: tuple[str, ...]

    @classmethod
    def of(cls, model) -> "Architecture":
        c = model.config
        kv = c.kv_channels
        return cls(
            num_layers=c.num_layers, hidden_size=c.hidden_size,
            ffn_hidden_size=c.ffn_hidden_size, num_heads=c.num_attention_heads,
            num_query_groups=c.num_query_groups or c.num_attention_heads, kv_channels=kv,
            normalization=c.normalization, norm_epsilon=float(c.layernorm_epsilon),
            position=model.position_embedding_type,
            rotary_base=float(getattr(model, "rotary_base", 10000)),
            rotary_percent=float(getattr(model, "rotary_percent", 1.0)),
            rope_scaling=bool(getattr(model, "rotary_scaling", False)),
            rope_scaling_factor=_rope_scaling_factor(model),
            activation=activation_name(c), gated=bool(c.gated_linear_unit),
            linear_bias=bool(c.add_bias_linear), qkv_bias=bool(c.add_qkv_bias),
            tied=bool(model.share_embeddings_and_output_weights),
            padded_vocab_size=int(model.vocab_size),
            max_position_embeddings=int(model.max_position_embeddings),
            softmax_scale=float(c.softmax_scale or 1.0 / math.sqrt(kv)),
            hidden_dropout=float(c.hidden_dropout), attention_dropout=float(c.attention_dropout),
            unsupported=tuple(_unsupported(model, c)),
        )

    @property
    def default_softmax_scale(self) -> bool:
        return math.isclose(self.softmax_scale, 1.0 / math.sqrt(self.kv_channels), rel_tol=1e-9)


def _rope_scaling_factor(model) -> float:
    """The llama3 RoPE scaling factor of the model's frequencies (GPTModel does not keep it;
    megatron-core 0.19's builder always passes 8): 8 when megatron's scaling with 8 gives
    them, NaN when it does not (``unsupported`` then names it)."""
    rope = getattr(model, "rotary_pos_emb", None)
    if not getattr(model, "rotary_scaling", False) or rope is None:
        return 1.0
    dim = rope.inv_freq.numel() * 2
    unscaled = 1.0 / (model.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    expected = type(rope)._apply_scaling(rope, unscaled, factor=MEGATRON_ROPE_SCALING_FACTOR)
    same = torch.allclose(expected, rope.inv_freq.float().cpu(), rtol=1e-6, atol=0)
    return MEGATRON_ROPE_SCALING_FACTOR if same else float("nan")


def _unsupported(model, c):
    """Features of the model that neither the KV decoder nor the export reproduces."""
    checks = (
        (c.num_moe_experts, "mixture of experts (--num-experts)"),
        (c.multi_latent_attention, "multi-latent attention (--multi-latent-attention)"),
        (c.qk_layernorm, "q/k layer norms (--qk-layernorm)"),
        (getattr(c, "qk_l2_norm", False), "q/k L2 norms (--qk-l2-norm)"),
        (c.mtp_num_layers, "multi-token prediction layers (--mtp-num-layers)"),
        (c.apply_residual_connection_post_layernorm,
         "the residual taken after the norm (--apply-residual-connection-post-layernorm)"),
        (c.layernorm_zero_centered_gamma, "zero-centred norm weights (--apply-layernorm-1p)"),
        (getattr(c, "use_mup", False), "MuP scaling (--use-mup)"),
        (getattr(c, "softmax_type", "vanilla") not in ("vanilla", None),
         f"--softmax-type {getattr(c, 'softmax_type', None)}"),
        (c.window_size is not None, "sliding-window attention (--window-size)"),
        (getattr(c, "attention_output_gate", False), "a gated attention output"),
        (getattr(c, "experimental_attention_variant", None),
         f"--experimental-attention-variant {getattr(c, 'experimental_attention_variant', None)}"),
        (getattr(c, "heterogeneous_block_specs", False), "heterogeneous layers"),
        (getattr(c, "is_hybrid_model", False), "a hybrid (Mamba) model"),
        (getattr(c, "activation_func_clamp_value", None) is not None,
         "a clamped activation (--activation-func-clamp-value)"),
        (getattr(c, "glu_linear_offset", 0.0) not in (0, 0.0, None),
         "an offset GLU (--glu-linear-offset)"),
        (getattr(c, "no_rope_freq", None), "layers without RoPE (--no-rope-freq)"),
        (model.position_embedding_type not in ("learned_absolute", "rope", "none"),
         f"--position-embedding-type {model.position_embedding_type}"),
        (model.position_embedding_type == "rope" and c.rotary_interleaved,
         "interleaved rotary embeddings (--rotary-interleaved)"),
        (model.position_embedding_type == "rope"
         and getattr(getattr(model, "rotary_pos_emb", None), "seq_len_interpolation_factor",
                     None),
         "interpolated rotary positions (--rotary-seq-len-interpolation-factor)"),
        (c.normalization not in ("LayerNorm", "RMSNorm"), f"--normalization {c.normalization}"),
        (math.isnan(_rope_scaling_factor(model)), "RoPE scaling other than megatron's llama3 "
                                                  "scaling with factor 8"),
        (activation_name(c) is None, f"the activation {getattr(c.activation_func, '__name__', c.activation_func)}"),
    )
    return [what for flagged, what in checks if flagged]

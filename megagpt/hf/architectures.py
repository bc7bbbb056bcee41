"""Which transformers class a megatron GPT is, and which megatron flags a transformers model is.

Two classes, both ways:

``GPT2LMHeadModel``   learned absolute positions, LayerNorm, a plain (not gated) MLP, biases
                      on every linear layer, multi-head attention, head size = hidden / heads;
                      tied or untied output.
``LlamaForCausalLM``  RoPE over the whole head, RMSNorm, a gated MLP (SwiGLU), grouped-query
                      attention; untied or tied output; no biases, or biases that transformers'
                      ``attention_bias`` / ``mlp_bias`` express.

Anything else is refused in one line naming the feature (``ConversionError``), before any
weight is read or written.
"""

from __future__ import annotations

from megagpt import model_math
from megagpt.errors import UserError
from megagpt.inference.architecture import MEGATRON_ROPE_SCALING_FACTOR, Architecture

GPT2 = "GPT2LMHeadModel"
LLAMA = "LlamaForCausalLM"

# megatron's activation -> transformers' ACT2FN name, and back
_HF_ACTIVATION = {model_math.GELU: "gelu", model_math.GELU_TANH: "gelu_new",
                  model_math.SILU: "silu", model_math.RELU: "relu",
                  model_math.SQUARED_RELU: "relu2", model_math.QUICK_GELU: "quick_gelu"}
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")

# megatron applies llama3 RoPE scaling with these constants (RotaryEmbedding._apply_scaling)
LLAMA3_LOW_FREQ, LLAMA3_HIGH_FREQ, LLAMA3_ORIGINAL_POSITIONS = 1.0, 4.0, 8192


class ConversionError(UserError, ValueError):
    """A model transformers cannot express here, or a folder this tool cannot read."""


# ---------------------------------------------------------------------------
# megatron -> transformers
# ---------------------------------------------------------------------------

def _gpt2_gap(a: Architecture) -> str | None:
    if a.normalization != "LayerNorm":
        return f"LayerNorm, not {a.normalization}"
    if a.gated:
        return "a plain MLP, not a gated one (--swiglu)"
    if not (a.linear_bias and a.qkv_bias):
        return "biases on every linear layer (no --disable-bias-linear)"
    if a.num_query_groups != a.num_heads:
        return "multi-head attention, not grouped-query attention (--group-query-attention)"
    if a.kv_channels * a.num_heads != a.hidden_size:
        return (f"a head size of hidden / heads ({a.hidden_size // a.num_heads}), not "
                f"--kv-channels {a.kv_channels}")
    return None


def _llama_gap(a: Architecture) -> str | None:
    if a.normalization != "RMSNorm":
        return f"RMSNorm, not {a.normalization}"
    if not a.gated:
        return "a gated MLP (--swiglu)"
    if a.rotary_percent != 1.0:
        return f"RoPE over the whole head, not --rotary-percent {a.rotary_percent:g}"
    if a.hidden_size % a.num_heads:
        return f"a hidden size divisible by the {a.num_heads} heads"
    if a.qkv_bias != a.linear_bias:
        return "biases on every linear layer or on none (transformers' attention_bias covers " \
               "q/k/v and the output projection together)"
    return None


def transformers_class(a: Architecture) -> str:
    """GPT2 or LLAMA for ``a``, or ConversionError naming what has no equivalent."""
    if a.unsupported:
        raise ConversionError(f"no transformers equivalent for {a.unsupported[0]}")
    if not a.default_softmax_scale:
        raise ConversionError(f"no transformers equivalent for the attention scale "
                              f"{a.softmax_scale:g} (--softmax-scale; transformers uses "
                              f"1/sqrt(head size))")
    if a.position == "learned_absolute":
        target, gap = GPT2, _gpt2_gap(a)
        why = "learned absolute positions"
    elif a.position == "rope":
        target, gap = LLAMA, _llama_gap(a)
        why = "RoPE"
    else:
        raise ConversionError(f"no transformers equivalent for --position-embedding-type "
                              f"{a.position}")
    if gap is not None:
        raise ConversionError(f"no transformers equivalent: with {why} the export is {target}, "
                              f"which needs {gap}")
    return target


def transformers_config(a: Architecture, target: str, vocab_size: int, bos: int, eos: int,
                        dtype: str):
    """The transformers config object for ``a`` (``target`` from ``transformers_class``)."""
    from transformers import GPT2Config, LlamaConfig

    common = dict(vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos,
                  tie_word_embeddings=a.tied, dtype=dtype, architectures=[target])
    if target == GPT2:
        return GPT2Config(
            n_positions=a.max_position_embeddings, n_embd=a.hidden_size, n_layer=a.num_layers,
            n_head=a.num_heads, n_inner=a.ffn_hidden_size,
            activation_function=_HF_ACTIVATION[a.activation], layer_norm_epsilon=a.norm_epsilon,
            resid_pdrop=a.hidden_dropout, embd_pdrop=a.hidden_dropout,
            attn_pdrop=a.attention_dropout, **common)
    rope = {"rope_type": "default", "rope_theta": a.rotary_base}
    if a.rope_scaling:
        rope = {"rope_type": "llama3", "rope_theta": a.rotary_base,
                "factor": a.rope_scaling_factor, "low_freq_factor": LLAMA3_LOW_FREQ,
                "high_freq_factor": LLAMA3_HIGH_FREQ,
                "original_max_position_embeddings": LLAMA3_ORIGINAL_POSITIONS}
    act = _HF_ACTIVATION[a.activation]
    return LlamaConfig(
        hidden_size=a.hidden_size, intermediate_size=a.ffn_hidden_size,
        num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_query_groups, head_dim=a.kv_channels,
        max_position_embeddings=a.max_position_embeddings, rms_norm_eps=a.norm_epsilon,
        rope_parameters=rope, hidden_act="gelu_pytorch_tanh" if act == "gelu_new" else act,
        attention_bias=a.qkv_bias, mlp_bias=a.linear_bias,
        attention_dropout=a.attention_dropout, **common)


# ---------------------------------------------------------------------------
# transformers -> megatron
# ---------------------------------------------------------------------------

def _rope(config: dict) -> tuple[float, dict]:
    """(theta, scaling) from a transformers 5 ``rope_parameters`` or a 4.x config."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    return float(theta), merged


def _gpt2_flags(c: dict) -> dict:
    act = c.get("activation_function", "gelu_new")
    if act not in _TANH_GELUS and act != "gelu":
        raise ConversionError(f"GPT-2 activation_function {act!r}: megatron's GPT-2 has GeLU "
                              "(exact, or the tanh approximation)")
    for key, why in (("scale_attn_by_inverse_layer_idx", "attention scaled by 1/layer"),
                     ("add_cross_attention", "cross-attention")):
        if c.get(key):
            raise ConversionError(f"GPT-2 {key}: megatron has no {why}")
    if c.get("scale_attn_weights") is False:
        raise ConversionError("GPT-2 scale_attn_weights false: megatron always scales "
                              "attention by 1/sqrt(head size)")
    hidden = c["n_embd"]
    flags = {
        "num-layers": c["n_layer"], "hidden-size": hidden, "num-attention-heads": c["n_head"],
        "ffn-hidden-size": c.get("n_inner") or 4 * hidden,
        "max-position-embeddings": c["n_positions"], "seq-length": c["n_positions"],
        "position-embedding-type": "learned_absolute", "normalization": "LayerNorm",
        "norm-epsilon": c.get("layer_norm_epsilon", 1e-5),
        "hidden-dropout": c.get("resid_pdrop", 0.1), "attention-dropout": c.get("attn_pdrop", 0.1),
    }
    # megatron's bias-GeLU fusion is the tanh approximation; exact GeLU needs it off
    if act == "gelu":
        flags["no-bias-gelu-fusion"] = True
    if not c.get("tie_word_embeddings", True):
        flags["untie-embeddings-and-output-weights"] = True
    return flags


def _llama_flags(c: dict) -> dict:
    if c.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"Llama hidden_act {c.get('hidden_act')!r}: megatron's gated MLP "
                              "here is SwiGLU (silu)")
    if (c.get("pretraining_tp") or 1) != 1:
        raise ConversionError(f"Llama pretraining_tp {c['pretraining_tp']}: not supported")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise ConversionError("Llama with attention_bias / mlp_bias: not supported (megatron's "
                              "--add-qkv-bias covers q/k/v only)")
    theta, rope = _rope(c)
    if theta != int(theta):
        raise ConversionError(f"Llama rope_theta {theta}: megatron's --rotary-base is an integer")
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    groups = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    flags = {
        "num-layers": c["num_hidden_layers"], "hidden-size": hidden,
        "num-attention-heads": heads, "ffn-hidden-size": c["intermediate_size"],
        "max-position-embeddings": c["max_position_embeddings"],
        "seq-length": c["max_position_embeddings"],
        "position-embedding-type": "rope", "rotary-base": int(theta),
        "normalization": "RMSNorm", "norm-epsilon": c.get("rms_norm_eps", 1e-6),
        "swiglu": True, "disable-bias-linear": True,
        "hidden-dropout": 0.0, "attention-dropout": c.get("attention_dropout", 0.0) or 0.0,
    }
    if groups != heads:
        flags["group-query-attention"] = True
        flags["num-query-groups"] = groups
    if head_dim * heads != hidden:
        flags["kv-channels"] = head_dim
    if not c.get("tie_word_embeddings", False):
        flags["untie-embeddings-and-output-weights"] = True
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "llama3":
        constants = (rope.get("low_freq_factor"), rope.get("high_freq_factor"),
                     rope.get("original_max_position_embeddings"))
        if tuple(map(float, constants)) != (LLAMA3_LOW_FREQ, LLAMA3_HIGH_FREQ,
                                            float(LLAMA3_ORIGINAL_POSITIONS)):
            raise ConversionError(f"Llama llama3 RoPE scaling with {constants}: megatron applies "
                                  f"(1, 4, 8192)")
        factor = float(rope.get("factor", 8.0))
        if factor != MEGATRON_ROPE_SCALING_FACTOR:
            # megatron-core 0.19's gpt_config_from_args does not pass --rope-scaling-factor on:
            # its GPTModelConfig keeps the default 8 whatever the flag says
            raise ConversionError(f"Llama llama3 RoPE scaling factor {factor:g}: megatron-core "
                                  f"0.19 builds every scaled RoPE with factor 8")
        flags["use-rope-scaling"] = True
    elif kind != "default":
        raise ConversionError(f"Llama rope_type {kind!r}: not supported (default and llama3 are)")
    return flags


def megatron_flags(config: dict, where: str) -> tuple[str, dict]:
    """(transformers class, megatron model flags) for a transformers ``config.json``."""
    kind = config.get("model_type")
    try:
        if kind == "gpt2":
            return GPT2, _gpt2_flags(config)
        if kind == "llama":
            return LLAMA, _llama_flags(config)
    except KeyError as exc:
        raise ConversionError(f"{where}: config.json has no {exc.args[0]!r}") from None
    raise ConversionError(f"{where}: model_type {kind!r} is not supported (gpt2 and llama are)")


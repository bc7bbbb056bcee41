"""Tensor names and layouts between megatron's GPT (local spec) and transformers' classes.

Layouts that differ:

- megatron's ``linear_qkv`` interleaves per query group: for each group its query heads, then
  one key head and one value head (``[groups, heads/groups + 2, head_dim, hidden]``);
  transformers keeps all queries, then all keys, then all values.
- GPT-2's ``Conv1D`` stores weights as ``[in, out]``: the transpose of a linear layer's.
- megatron's gated ``linear_fc1`` is ``[gate; up]`` stacked (SwiGLU takes the first half
  through SiLU); Llama has ``gate_proj`` and ``up_proj``.
- megatron pads the vocabulary with rows that are no token: the export drops them; the
  import fills them with the mean of the real rows, whose logit is about the average one,
  far below the likely tokens' (zeros would give every padding row logit 0, far above the
  typical logit of a trained GPT-2).

Both directions work on plain ``{name: tensor}`` dicts; the tests check that one is the
other's inverse bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megagpt.hf.architectures import GPT2, LLAMA, ConversionError
from megagpt.inference.architecture import Architecture

LAYER = "decoder.layers.{}."


def split_qkv(t: Tensor, a: Architecture) -> tuple[Tensor, Tensor, Tensor]:
    """megatron's fused q/k/v (weight [rows, hidden] or bias [rows]) -> q, k, v."""
    per_group = a.num_heads // a.num_query_groups
    rest = t.shape[1:]
    grouped = t.reshape(a.num_query_groups, per_group + 2, a.kv_channels, *rest)
    q = grouped[:, :per_group].reshape(a.num_heads * a.kv_channels, *rest)
    k = grouped[:, per_group].reshape(a.num_query_groups * a.kv_channels, *rest)
    v = grouped[:, per_group + 1].reshape(a.num_query_groups * a.kv_channels, *rest)
    return q, k, v


def join_qkv(q: Tensor, k: Tensor, v: Tensor, a: Architecture) -> Tensor:
    """The inverse of ``split_qkv``."""
    per_group, d, groups = a.num_heads // a.num_query_groups, a.kv_channels, a.num_query_groups
    rest = q.shape[1:]
    parts = [q.reshape(groups, per_group, d, *rest), k.reshape(groups, 1, d, *rest),
             v.reshape(groups, 1, d, *rest)]
    return torch.cat(parts, dim=1).reshape(groups * (per_group + 2) * d, *rest)


# ---------------------------------------------------------------------------
# megatron -> transformers
# ---------------------------------------------------------------------------

def _norm(out: dict, hf: str, sd: dict, mg: str) -> None:
    out[hf + ".weight"] = sd[mg + ".weight"]
    if sd.get(mg + ".bias") is not None:
        out[hf + ".bias"] = sd[mg + ".bias"]


def _gpt2(sd: dict, a: Architecture, vocab: int) -> dict:
    out = {"transformer.wte.weight": sd["embedding.word_embeddings.weight"][:vocab],
           "transformer.wpe.weight": sd["embedding.position_embeddings.weight"]}
    for i in range(a.num_layers):
        mg, hf = LAYER.format(i), f"transformer.h.{i}."
        _norm(out, hf + "ln_1", sd, mg + "input_layernorm")
        _norm(out, hf + "ln_2", sd, mg + "pre_mlp_layernorm")
        out[hf + "attn.c_attn.weight"] = torch.cat(
            split_qkv(sd[mg + "self_attention.linear_qkv.weight"], a)).t()
        out[hf + "attn.c_attn.bias"] = torch.cat(
            split_qkv(sd[mg + "self_attention.linear_qkv.bias"], a))
        out[hf + "attn.c_proj.weight"] = sd[mg + "self_attention.linear_proj.weight"].t()
        out[hf + "attn.c_proj.bias"] = sd[mg + "self_attention.linear_proj.bias"]
        out[hf + "mlp.c_fc.weight"] = sd[mg + "mlp.linear_fc1.weight"].t()
        out[hf + "mlp.c_fc.bias"] = sd[mg + "mlp.linear_fc1.bias"]
        out[hf + "mlp.c_proj.weight"] = sd[mg + "mlp.linear_fc2.weight"].t()
        out[hf + "mlp.c_proj.bias"] = sd[mg + "mlp.linear_fc2.bias"]
    _norm(out, "transformer.ln_f", sd, "decoder.final_layernorm")
    if not a.tied:
        out["lm_head.weight"] = sd["output_layer.weight"][:vocab]
    return out


def _linear(out: dict, hf: str, weight: Tensor, bias: Tensor | None) -> None:
    out[hf + ".weight"] = weight
    if bias is not None:
        out[hf + ".bias"] = bias


def _llama(sd: dict, a: Architecture, vocab: int) -> dict:
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"][:vocab]}
    for i in range(a.num_layers):
        mg, hf = LAYER.format(i), f"model.layers.{i}."
        out[hf + "input_layernorm.weight"] = sd[mg + "input_layernorm.weight"]
        out[hf + "post_attention_layernorm.weight"] = sd[mg + "pre_mlp_layernorm.weight"]
        q, k, v = split_qkv(sd[mg + "self_attention.linear_qkv.weight"], a)
        qkv_bias = sd.get(mg + "self_attention.linear_qkv.bias")
        qb, kb, vb = split_qkv(qkv_bias, a) if qkv_bias is not None else (None, None, None)
        _linear(out, hf + "self_attn.q_proj", q, qb)
        _linear(out, hf + "self_attn.k_proj", k, kb)
        _linear(out, hf + "self_attn.v_proj", v, vb)
        _linear(out, hf + "self_attn.o_proj", sd[mg + "self_attention.linear_proj.weight"],
                sd.get(mg + "self_attention.linear_proj.bias"))
        gate, up = torch.chunk(sd[mg + "mlp.linear_fc1.weight"], 2, dim=0)
        fc1_bias = sd.get(mg + "mlp.linear_fc1.bias")
        gate_b, up_b = torch.chunk(fc1_bias, 2) if fc1_bias is not None else (None, None)
        _linear(out, hf + "mlp.gate_proj", gate, gate_b)
        _linear(out, hf + "mlp.up_proj", up, up_b)
        _linear(out, hf + "mlp.down_proj", sd[mg + "mlp.linear_fc2.weight"],
                sd.get(mg + "mlp.linear_fc2.bias"))
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    if not a.tied:
        out["lm_head.weight"] = sd["output_layer.weight"][:vocab]
    return out


def to_transformers(state_dict: dict, a: Architecture, target: str, vocab: int,
                    dtype: torch.dtype) -> dict:
    """The transformers tensors (contiguous, ``dtype``) of a megatron model's state dict."""
    sd = {k: v for k, v in state_dict.items() if not k.endswith("_extra_state")}
    out = _gpt2(sd, a, vocab) if target == GPT2 else _llama(sd, a, vocab)
    return {k: v.detach().to(dtype).contiguous() for k, v in out.items()}


# ---------------------------------------------------------------------------
# transformers -> megatron
# ---------------------------------------------------------------------------

def _rows(t: Tensor, rows: int, vocab: int) -> Tensor:
    """``t``'s first ``rows`` rows; rows it lacks are the mean of its first ``vocab`` rows."""
    if t.shape[0] >= rows:
        return t[:rows]
    fill = t[:vocab].mean(dim=0, keepdim=True).expand(rows - t.shape[0], -1)
    return torch.cat([t, fill.to(t.dtype)])


def _take(hf: dict, name: str, where: str) -> Tensor:
    if name not in hf:
        raise ConversionError(f"{where}: the weights have no {name}")
    return hf[name]


def _gpt2_names(hf: dict) -> dict:
    """Hub GPT-2 folders name the body ``h.0...``; GPT2LMHeadModel saves ``transformer.h.0``."""
    return {(k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k): v
            for k, v in hf.items()}


def from_transformers(hf: dict, a: Architecture, target: str, rows: int, vocab: int,
                      where: str) -> dict:
    """megatron state-dict tensors from a transformers model's (``rows``: megatron's padded
    vocabulary; ``vocab``: the tokenizer's tokens)."""
    t = lambda name: _take(hf, name, where)  # noqa: E731
    sd: dict = {}
    if target == GPT2:
        hf = _gpt2_names(hf)
        sd["embedding.word_embeddings.weight"] = _rows(t("transformer.wte.weight"), rows, vocab)
        sd["embedding.position_embeddings.weight"] = t("transformer.wpe.weight")
        for i in range(a.num_layers):
            mg, h = LAYER.format(i), f"transformer.h.{i}."
            for src, dst in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
                sd[mg + dst + ".weight"] = t(h + src + ".weight")
                sd[mg + dst + ".bias"] = t(h + src + ".bias")
            qkv_w = t(h + "attn.c_attn.weight").t()
            qkv_b = t(h + "attn.c_attn.bias")
            size = a.num_heads * a.kv_channels
            sd[mg + "self_attention.linear_qkv.weight"] = join_qkv(*torch.split(qkv_w, size), a)
            sd[mg + "self_attention.linear_qkv.bias"] = join_qkv(*torch.split(qkv_b, size), a)
            sd[mg + "self_attention.linear_proj.weight"] = t(h + "attn.c_proj.weight").t()
            sd[mg + "self_attention.linear_proj.bias"] = t(h + "attn.c_proj.bias")
            sd[mg + "mlp.linear_fc1.weight"] = t(h + "mlp.c_fc.weight").t()
            sd[mg + "mlp.linear_fc1.bias"] = t(h + "mlp.c_fc.bias")
            sd[mg + "mlp.linear_fc2.weight"] = t(h + "mlp.c_proj.weight").t()
            sd[mg + "mlp.linear_fc2.bias"] = t(h + "mlp.c_proj.bias")
        sd["decoder.final_layernorm.weight"] = t("transformer.ln_f.weight")
        sd["decoder.final_layernorm.bias"] = t("transformer.ln_f.bias")
        if not a.tied:
            sd["output_layer.weight"] = _rows(t("lm_head.weight"), rows, vocab)
    elif target == LLAMA:
        sd["embedding.word_embeddings.weight"] = _rows(t("model.embed_tokens.weight"), rows,
                                                       vocab)
        for i in range(a.num_layers):
            mg, h = LAYER.format(i), f"model.layers.{i}."
            sd[mg + "input_layernorm.weight"] = t(h + "input_layernorm.weight")
            sd[mg + "pre_mlp_layernorm.weight"] = t(h + "post_attention_layernorm.weight")
            sd[mg + "self_attention.linear_qkv.weight"] = join_qkv(
                t(h + "self_attn.q_proj.weight"), t(h + "self_attn.k_proj.weight"),
                t(h + "self_attn.v_proj.weight"), a)
            sd[mg + "self_attention.linear_proj.weight"] = t(h + "self_attn.o_proj.weight")
            sd[mg + "mlp.linear_fc1.weight"] = torch.cat(
                [t(h + "mlp.gate_proj.weight"), t(h + "mlp.up_proj.weight")])
            sd[mg + "mlp.linear_fc2.weight"] = t(h + "mlp.down_proj.weight")
        sd["decoder.final_layernorm.weight"] = t("model.norm.weight")
        if not a.tied:
            sd["output_layer.weight"] = _rows(t("lm_head.weight"), rows, vocab)
    return sd

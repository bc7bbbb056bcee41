"""The math of a dense GPT layer that the fused training layer and the KV decoder share.

``fast_spec.layer`` computes a layer for training and ``inference.kv_decoder`` a decode step
over the same megatron parameters; both write the layer out in torch operations instead of
calling megatron's modules. What they share is here, once: megatron's activations by name
(and which name a megatron config's MLP computes), the pre-norm, megatron's fused QKV layout
and the rotary embedding's rotation. Each function is the same torch operations in the same
order as megatron's own, so results are bit for bit those of the code it replaced, and the
compiled graphs are unchanged (dynamo inlines the calls).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

# megatron's activation functions, by the names the fused layer, the KV decoder and the
# Hugging Face conversion use for them
GELU, GELU_TANH, SILU, RELU, SQUARED_RELU, QUICK_GELU = (
    "gelu", "gelu_tanh", "silu", "relu", "squared_relu", "quick_gelu")
# the fused layer's name for SiLU gating (megatron's --swiglu): fc1's output holds both halves
SWIGLU = "swiglu"


def activation_name(config) -> str | None:
    """The MLP's activation as megatron's ``MLP.forward`` applies it (None: unknown).

    megatron's bias-GeLU and bias-GeGLU fusions compute the tanh approximation of GeLU; its
    unfused path applies ``activation_func`` (exact GeLU)."""
    from megatron.core.activations import quick_gelu, squared_relu

    fn = config.activation_func
    if fn is F.gelu:
        return GELU_TANH if config.bias_activation_fusion else GELU
    named = {F.silu: SILU, F.relu: RELU, squared_relu: SQUARED_RELU, quick_gelu: QUICK_GELU}
    return named.get(fn)


def activation(x: Tensor, name: str) -> Tensor:
    """The activation ``name`` of ``x`` (``SWIGLU``: of both halves of ``x``, gated)."""
    if name == GELU:
        return F.gelu(x)
    if name == GELU_TANH:
        return F.gelu(x, approximate="tanh")
    if name == SILU:
        return F.silu(x)
    if name == RELU:
        return F.relu(x)
    if name == SQUARED_RELU:  # megatron.core.activations.squared_relu
        return torch.pow(F.relu(x), 2)
    if name == QUICK_GELU:  # megatron.core.activations.quick_gelu
        return x * torch.sigmoid(1.702 * x)
    if name == SWIGLU:
        return gated(x, SILU)
    raise ValueError(f"activation {name!r}")


def gated(x: Tensor, name: str) -> Tensor:
    """megatron's gated linear unit over fc1's output ``x``: the activation of its first
    half times its second half."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return activation(gate, name) * up


def norm(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float, rms: bool) -> Tensor:
    """LayerNorm or RMSNorm over the last dimension, as torch's norm modules (megatron's
    ``WrappedTorchNorm``) compute them."""
    if rms:
        return F.rms_norm(x, (x.size(-1),), weight, eps)
    return F.layer_norm(x, (x.size(-1),), weight, bias, eps)


def split_qkv(qkv: Tensor, groups: int, q_per_group: int, head_dim: int):
    """Queries, keys and values from the QKV linear's output ``qkv`` ([s, b, ...]) in
    megatron's fused layout: per query group its ``q_per_group`` query heads, then one key
    head and one value head. Returns q [s, b, groups * q_per_group, head_dim] and k, v
    [s, b, groups, head_dim]. (The KV decoder views the same layout as [..., groups,
    q_per_group + 2, head_dim], so that one scatter writes a group's key and value.)"""
    s, b = qkv.shape[0], qkv.shape[1]
    qkv = qkv.view(s, b, groups, (q_per_group + 2) * head_dim)
    q, k, v = torch.split(qkv, [q_per_group * head_dim, head_dim, head_dim], dim=-1)
    return q.reshape(s, b, groups * q_per_group, head_dim), k, v


def rotary_from_freqs(t: Tensor, freqs: Tensor, interleaved: bool, mscale: float) -> Tensor:
    """megatron's rotary embedding of ``t`` ([s, b, heads, d]) for the angles ``freqs``
    ([s, 1, 1, rotary dim]), cosines and sines taken per call: its own function, so that
    training computes exactly what megatron's attention does."""
    # imported here: the inference and conversion tools import this module without megatron
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved, mscale=mscale)


def rotate_half(x: Tensor) -> Tensor:
    """megatron's non-interleaved half rotation: [x1, x2] -> [-x2, x1]."""
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """megatron's non-interleaved rotary embedding (``rotary_from_freqs`` with mscale 1) from
    cosines and sines already in ``t``'s dtype and broadcastable to it: the first rotary-dim
    channels of ``t`` rotated, the rest passed through."""
    rot = cos.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    t_rot = t_rot * cos + rotate_half(t_rot) * sin
    return torch.cat((t_rot, t_pass), dim=-1) if t_pass.shape[-1] else t_rot

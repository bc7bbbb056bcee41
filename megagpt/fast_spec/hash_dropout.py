"""Residual dropout whose mask is a hash of the element's index and a seed.

Compiled, ``F.dropout`` draws one Philox number (10 rounds) per element inside the kernel
that applies it, and saves the mask for the backward. At the 345M shape those draws are
most of what the two residual dropouts of a layer cost: the two forward kernels that apply
them take 23.5 and 20.4 µs more than without dropout (bench/notes/dropout.md).

Here the mask is ``keep = mix(mix(index ^ seed) + seed) & 0xFFFF >= p · 65536``, where
``mix`` is Wellons' ``lowbias32`` 32-bit integer hash and ``index`` the element's position
in the tensor: about a dozen integer operations per element, written as torch operations
that inductor fuses into the kernel around them (the index is an ``arange`` it never
materialises), and cheap enough that the backward may recompute the mask rather than read
a stored one. ``p`` is honoured to 1/65536 (0.1 keeps 58,982 of 65,536 values: 0.899994).
One seed per dropout per step comes from torch's generator of the tensor's device, drawn
where the layer runs: a seeded run draws the same masks, and a checkpoint's RNG state
continues them on resume.

The fast spec uses it where the fused layer is compiled (one tensor-parallel rank); eager
layers (CPU mode, tensor parallelism) keep ``F.dropout``. ``--fast-disable hash-dropout`` keeps
``F.dropout`` everywhere.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# logical right shifts of int32 values (torch's >> is arithmetic): shift, then mask
_LOW16, _LOW17 = 0xFFFF, 0x1FFFF
# lowbias32's multipliers, the second as the int32 with its bits
_M1, _M2 = 0x7FEB352D, 0x846CA68B - (1 << 32)
MAX_ELEMENTS = (1 << 31) - 1  # indices are int32


def _mix(x: Tensor) -> Tensor:
    """lowbias32 on int32 values: multiplies wrap, as the hash's uint32 arithmetic does."""
    x = x ^ ((x >> 16) & _LOW16)
    x = x * _M1
    x = x ^ ((x >> 15) & _LOW17)
    x = x * _M2
    return x ^ ((x >> 16) & _LOW16)


def draw_seeds(count: int, device: torch.device) -> Tensor:
    """``count`` int32 seeds from torch's generator of ``device`` (graph-safe on CUDA)."""
    return torch.randint(-(1 << 31), (1 << 31) - 1, (count,), device=device,
                         dtype=torch.int32)


def keep_mask(shape, p: float, seed: Tensor) -> Tensor:
    """Bool mask of ``shape``: True for the elements that dropout at rate ``p`` keeps."""
    n = math.prod(shape)
    if not usable(shape):
        raise ValueError(f"hash dropout indexes elements as int32: {n} elements")
    index = torch.arange(n, device=seed.device, dtype=torch.int32).view(shape)
    bits = _mix(_mix(index ^ seed) + seed)
    return (bits & _LOW16) >= int(round(p * 65536))


def dropout(x: Tensor, p: float, seed: Tensor) -> Tensor:
    """``x`` with the elements ``keep_mask`` drops zeroed, the rest scaled by 1 / (1 - p)."""
    if p <= 0.0:
        return x
    return x * keep_mask(x.shape, p, seed) * (1.0 / (1.0 - p))


def usable(shape) -> bool:
    """Whether a tensor of ``shape`` can take a hash mask (int32 element indices)."""
    return math.prod(shape) <= MAX_ELEMENTS

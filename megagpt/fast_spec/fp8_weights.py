"""The FP8 copies of a fused layer's weights that the optimizer writes (delayed scaling,
``Fp8Recipe.weights_written``).

Under delayed scaling a weight's scale comes from the layer's amax history before its
forward starts, so the forward's cast of the weight (both layouts its GEMMs read, row-major
``w8`` [N, K] and transposed ``w8_t`` [K, N], and the amax it records) can be made by what
writes the weight: the flat AdamW step (``megagpt.train_step.flat_adam_fp8``), in the pass
that writes the bf16 weight. The forward then reads the copies and casts only its
activations and gradients.

The copies equal the forward's own cast only for the forward right after they are written:
every forward records into the history and so moves the scales the next one reads.
``LayerCopies`` keeps that account for one layer:

- each forward leaves ``next_scales``, the weights' scales the next forward will read
  (``fp8.next_weight_scales``: the same arithmetic, in the same compiled function, as that
  forward's own);
- the optimizer casts each weight by them and marks the copies fresh;
- a training forward of a layer past its first reads them while they are fresh, and
  always while a CUDA graph is being captured (each replay of a training graph follows an
  optimizer step); any forward of the fused layer leaves them stale;
- back in training after evaluation, and after a state dict is loaded, the layer casts them
  afresh itself (``refresh``), so that a replayed training graph, which reads them whatever
  the flags say, reads what its own cast would have given.

The optimizer allocates the buffers once and writes them in place, so a captured graph that
reads or writes them stays valid. None of this is in the state dict: checkpoints are the
bf16 model's, and a resumed run's first forward casts its weights itself.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import fp8_cast
from .fp8 import LINEARS

# the attribute of a weight Parameter naming the copies that hold it: (LayerCopies, linear)
MARK = "_megagpt_fp8_copies"


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class LayerCopies:
    """One fused layer's FP8 weight copies: views of the optimizer's buffers once it has
    bound them (``bind``), with the flags that say when the forward may read them."""

    def __init__(self, linears: tuple):
        self.linears = tuple(linears)
        self.w8: list[Optional[Tensor]] = [None] * LINEARS
        self.w8_t: list[Optional[Tensor]] = [None] * LINEARS
        # [LINEARS] float32 each: the scales the copies were cast by, the weights' amaxes,
        # and the scales the next forward will read (written by each forward)
        self.scales: Optional[Tensor] = None
        self.amax: Optional[Tensor] = None
        self.next_scales: Optional[Tensor] = None
        # a forward has written next_scales since the buffers were bound
        self.scales_ready = False
        # the copies equal the cast the next forward would make
        self.fresh = False

    @property
    def bound(self) -> bool:
        return self.next_scales is not None

    def bind(self, w8: dict, w8_t: dict, scales: Tensor, amax: Tensor,
             next_scales: Tensor) -> None:
        """Take the optimizer's buffers: ``w8`` / ``w8_t`` by linear, and this layer's
        [LINEARS] views of the scales, amaxes and next scales."""
        if set(w8) != set(self.linears) or set(w8_t) != set(self.linears):
            raise ValueError(f"FP8 copies for linears {sorted(w8)}, the layer's are "
                             f"{self.linears}")
        for linear in self.linears:
            self.w8[linear], self.w8_t[linear] = w8[linear], w8_t[linear]
        self.scales, self.amax, self.next_scales = scales, amax, next_scales
        self.scales_ready = self.fresh = False

    def readable(self, warm: bool, training: bool) -> bool:
        """Whether this forward reads the copies: a training forward after the layer's first
        (whose scales the optimizer cast by), while they are fresh or while a graph that
        replays after each optimizer step is captured."""
        return self.bound and warm and training and (self.fresh or capturing())

    def forward_inputs(self) -> tuple:
        """The copies as ``fused_layer_forward`` takes them (``Fp8Step.weights``)."""
        return tuple(self.w8), tuple(self.w8_t), self.scales, self.amax

    def forward_done(self) -> None:
        """A fused forward ran: it left next_scales and moved the history on."""
        self.scales_ready = True
        self.fresh = False

    def written(self) -> None:
        """The optimizer has cast every weight by next_scales."""
        if self.scales_ready:
            self.fresh = True

    @torch.no_grad()
    def refresh(self, weights: dict) -> None:
        """Cast ``weights`` (by linear) into the copies by next_scales, as the optimizer
        does, where a forward has left them (else nothing: the next forward casts)."""
        if not (self.bound and self.scales_ready):
            return
        for linear in self.linears:
            scale = self.next_scales[linear:linear + 1]
            q, q_t, amax = fp8_cast.cast_transpose(weights[linear].detach(), scale,
                                                   torch.float8_e4m3fn, True)
            self.w8[linear].copy_(q)
            self.w8_t[linear].copy_(q_t)
            self.amax[linear:linear + 1].copy_(amax)
        self.scales.copy_(self.next_scales)
        self.fresh = True


def mark(weight: Tensor, copies: LayerCopies, linear: int) -> None:
    """Say that ``copies`` hold ``weight``'s FP8 copies for ``linear`` (the optimizer that
    steps ``weight`` finds them so)."""
    setattr(weight, MARK, (copies, linear))


def marked(param: Tensor) -> Optional[tuple]:
    """(LayerCopies, linear) of a weight ``mark`` marked, else None."""
    return getattr(param, MARK, None)

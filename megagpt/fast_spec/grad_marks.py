"""The marks on a parameter by which the fused layer's weight GEMMs write its gradient
straight into megatron's buffer (``main_grad``) instead of handing it to autograd.

The step that writes gradients rather than zeroing the buffer and adding
(``megagpt.train_step.grad_write``) opens each step on every parameter of a DDP it serves
(``open_step``); a GEMM that may write a weight's gradient (``gemm_may_write``) marks it
written (``mark_written_by_gemm``), so that megatron's hook neither adds the placeholder
nor takes it for an accumulation; the step's hook tells a written gradient from one added
by something else (``written_by_gemm``). The marks live here, beside the layer that leaves
them, and the step reads them.
"""

from __future__ import annotations

_WRITING = "_megagpt_grad_write"  # this step's gradients are written, not added
_WRITTEN = "_megagpt_main_grad_written"  # a GEMM wrote this step's gradient already


def open_step(param, writing: bool) -> None:
    """A step starts for ``param``: its gradient is written this step (``writing``), and none
    is there yet."""
    setattr(param, _WRITING, writing)
    setattr(param, _WRITTEN, False)


def gemm_may_write(param) -> bool:
    """Whether a GEMM may write this step's gradient of ``param`` straight into its
    ``main_grad``: its DDP is writing this step, and no gradient of ``param`` is there yet."""
    return getattr(param, _WRITING, False) and not getattr(param, _WRITTEN, False)


def mark_written_by_gemm(param) -> None:
    """``param.main_grad`` receives this step's gradient from a GEMM that writes it (the
    fused layer); megatron's hook must neither add the placeholder nor take it for an
    accumulation."""
    param.grad_added_to_main_grad = True
    setattr(param, _WRITTEN, True)


def written_by_gemm(param) -> bool:
    """Whether a GEMM wrote this step's gradient of ``param``."""
    return getattr(param, _WRITTEN, False)

"""Divergence: NaN or Inf in the loss or the gradients stops the run at that iteration.

Megatron checks both when ``--check-for-nan-in-loss-and-grad`` is on (its default): the
loss in ``pretrain_gpt.loss_func``, the gradient norm in the optimizer, each through the
rerun state machine. What happens next depends on ``--rerun-mode``:

``validate_results`` (megatron's default)
    the step is rerun in place; if the fault reproduces, megatron *saves a new checkpoint*
    (the tracker moves to it) and exits with status 16, asking for a rerun on another GPU
    to tell hardware faults from real divergence. It does not validate the first
    iteration after each start.
``disabled`` (this entry's default unless ``--rerun-mode`` is given)
    every iteration is checked; the first fault raises, nothing is saved, and the last
    good checkpoint stays the newest one.

This module turns the raised error into one line naming the iteration, what was found,
and the checkpoint a relaunch resumes from. To step over a bad batch, relaunch with
megatron's ``--iterations-to-skip N`` (its batch is read and dropped).
"""

from __future__ import annotations

import functools
import math
import re
from typing import Callable

from megagpt.compat import explicit_flags
from megagpt.errors import UserError

# megatron/core/rerun_state_machine.py, validate_result() with reruns disabled:
#   f"Rank {rank}, node {node}, device {device}, iteration {n}: Unexpected result {result} "
#   f"(message='{message}')"
_FAULT = re.compile(r"iteration #?(\d+): Unexpected result (\S+) \(message='([^']*)'\)")


class DivergenceError(UserError, RuntimeError):
    """The loss or the gradients became NaN or Inf; the message names the iteration."""


def apply_defaults(args, argv, log: Callable[[str], None]) -> None:
    """Stop on the first fault without saving, unless the user chose a rerun mode."""
    if not args.check_for_nan_in_loss_and_grad:
        if "--no-check-for-nan-in-loss-and-grad" in explicit_flags(argv or []):
            log("divergence: NaN/Inf checks are off (--no-check-for-nan-in-loss-and-grad)")
        else:
            # The fast path's CUDA graph cannot hold megatron's in-step checks; the gradient
            # norm, computed after the graph, is checked instead (grad_norm_guard).
            log("divergence: NaN/Inf in the gradient norm stops the run at that iteration "
                "(checked after each step; megatron's in-step checks are off)")
        return
    if "--rerun-mode" in explicit_flags(argv or []) or args.rerun_mode != "validate_results":
        return
    args.rerun_mode = "disabled"
    log("divergence: NaN/Inf in the loss or gradients stops the run at that iteration; "
        "no checkpoint is written (--rerun-mode disabled)")


def fault_of(exc: BaseException) -> tuple[str, str] | None:
    """(result, what was checked) if ``exc`` is megatron's result-validation error."""
    match = _FAULT.search(str(exc))
    if not isinstance(exc, RuntimeError) or match is None:
        return None
    return match.group(2), match.group(3)


def divergence_error(exc: BaseException, args, resume_hint: str) -> DivergenceError | None:
    """The one-line error for a fault, or None if ``exc`` is something else.

    The iteration is the training log's number (``args.curr_iteration`` + 1, the one
    ``--iterations-to-skip`` takes); megatron's own message counts one higher after a
    (re)start, because ``train`` sets the state machine's 0-based counter to the
    iteration already done and the first step increments it again.
    """
    fault = fault_of(exc)
    if fault is None:
        return None
    result, what = fault
    iteration = int(getattr(args, "curr_iteration", 0)) + 1
    return DivergenceError(
        f"divergence at iteration {iteration}: {result} ({what}); the run stopped without "
        f"saving. {resume_hint} To step over that batch, relaunch with "
        f"--iterations-to-skip {iteration}.")


def needs_grad_norm_guard(args, argv) -> bool:
    """Megatron's checks are off, but not because the user asked: check after each step."""
    return (not args.check_for_nan_in_loss_and_grad
            and "--no-check-for-nan-in-loss-and-grad" not in explicit_flags(argv or []))


def grad_norm_guard(train_step, resume_hint: Callable[[], str]):
    """Wrap megatron's ``train_step``: a NaN or Inf gradient norm raises DivergenceError.

    A NaN or Inf anywhere in the loss reaches every gradient, so the norm the optimizer
    computes (already on the host: it decides the clipping) reveals it at no extra cost.
    The step's update has been applied in memory by then; the run stops before any later
    save, so the newest checkpoint on disk is the last good one.
    """
    @functools.wraps(train_step)
    def wrapper(*args, **kwargs):
        result = train_step(*args, **kwargs)
        grad_norm = result[5]
        if grad_norm is not None and not math.isfinite(grad_norm):
            iteration = int(kwargs.get("iteration") or 0) + 1
            raise DivergenceError(
                f"divergence at iteration {iteration}: gradient norm {grad_norm}; the run "
                f"stopped without saving. {resume_hint()} To step over that batch, relaunch "
                f"with --iterations-to-skip {iteration}.")
        return result

    return wrapper

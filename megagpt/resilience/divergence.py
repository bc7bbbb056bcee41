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

import torch

from megagpt.errors import UserError
from megagpt.megatron_change import TRAINING, WRAPS, Change

# megatron/core/rerun_state_machine.py, validate_result() with reruns disabled:
#   f"Rank {rank}, node {node}, device {device}, iteration {n}: Unexpected result {result} "
#   f"(message='{message}')"
_FAULT = re.compile(r"iteration #?(\d+): Unexpected result (\S+) \(message='([^']*)'\)")


# What pretrain_gpt.loss_func adds to its check's message when the model is in eval mode.
EVALUATION_FAULT = " during evaluation"


class DivergenceError(UserError, RuntimeError):
    """The loss or the gradients became NaN or Inf; the message names the iteration."""


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
    iteration already done and the first step increments it again. A fault found while
    evaluating is the evaluation's: no batch to skip, and the iteration is the one whose
    weights were evaluated (``evaluation_iteration``).
    """
    fault = fault_of(exc)
    if fault is None:
        return None
    result, what = fault
    if what.endswith(EVALUATION_FAULT):
        return DivergenceError(
            f"the validation loss is {result} at iteration {evaluation_iteration(args)} "
            f"({what}): the weights trained so far give a loss that is not finite on the "
            f"validation data; the run stopped. {resume_hint}")
    iteration = int(getattr(args, "curr_iteration", 0)) + 1
    return DivergenceError(
        f"divergence at iteration {iteration}: {result} ({what}); the run stopped without "
        f"saving. {resume_hint} To step over that batch, relaunch with "
        f"--iterations-to-skip {iteration}.")


def evaluation_iteration(args) -> int:
    """The iteration whose weights an evaluation ran on: the iterations done in this
    launch (megatron sets ``curr_iteration`` before each step, and to 0 before training),
    or the loaded checkpoint's when this launch trained none (its final evaluation of a
    run that had finished)."""
    done = int(getattr(args, "curr_iteration", 0) or 0) + 1
    return max(done, int(getattr(args, "iteration", 0) or 0))


class NormInFlight:
    """A gradient norm on its way from the GPU to the host, read without draining the queue.

    ``float(norm)`` of a CUDA tensor waits for *everything* queued on the stream so far. Read
    one iteration late, that is also the next iteration, which the host has already queued:
    the queue drains, and the GPU idles while the host runs the loop, the logging and the
    data loader before it queues the iteration after. So the norm is copied into pinned host
    memory right behind the step that computes it, and an event recorded after that copy is
    what the read waits for: that step, not what follows it. (The gain measured within
    run-to-run noise: megatron's step itself keeps the host close behind the GPU; figures:
    bench/notes/fast-path.md, "Asynchronous step".)
    """

    def __init__(self, norm):
        self.event = None
        if isinstance(norm, torch.Tensor) and norm.is_cuda:
            self.host = torch.empty(norm.shape, dtype=norm.dtype, pin_memory=True)
            self.host.copy_(norm.detach(), non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = norm

    def value(self) -> float:
        if self.event is not None:
            self.event.synchronize()
        return float(self.host)


# What ``GradNormGuard``'s wrappers change in megatron, in the order they are installed.
TRAIN_STEP = Change(
    TRAINING + "train_step", WRAPS, __name__,
    does="a NaN or Inf gradient norm stops the run, read one iteration late",
    why="megatron's in-step NaN checks are off (the CUDA graphs); read late, the check never "
        "idles the GPU",
    fingerprint="1823abf71532")
SAVE_CHECKPOINT = Change(
    TRAINING + "save_checkpoint", WRAPS, __name__,
    does="checks every gradient norm still on its way from the GPU before a save",
    why="a diverged model is never saved; outside the snapshot's wrapper (no snapshot of a "
        "save that is refused)",
    fingerprint="42e813b3aa30", outside=("megagpt.resilience.config_snapshot",))
MEGATRON_CHANGES = (TRAIN_STEP, SAVE_CHECKPOINT)


class GradNormGuard:
    """Stop a run whose gradient norm is NaN or Inf, for runs whose in-step checks are off.

    A NaN or Inf anywhere in the loss reaches every gradient, so the norm the optimizer
    computes reveals it. ``train_step`` wraps megatron's ``train_step`` (the norm is the 6th
    of its results); ``save_checkpoint`` wraps megatron's ``save_checkpoint``.

    A norm already on the host (a float) is checked at once. A norm kept on the GPU (the
    fast path's asynchronous step, ``train_step.async_step``) is checked one iteration late,
    when the GPU is already busy with the next iteration, so the check never idles it —
    and every pending norm is checked before a checkpoint is written, so a diverged model
    is never saved. The update of the failing step has been applied in memory; the newest
    checkpoint on disk stays the last good one.
    """

    def __init__(self, resume_hint: Callable[[], str], final_iteration: int | None = None):
        self.resume_hint = resume_hint
        self.final_iteration = final_iteration
        self.pending: list[tuple[int, object]] = []

    def _raise(self, iteration: int, value) -> None:
        raise DivergenceError(
            f"divergence at iteration {iteration}: gradient norm {value}; the run stopped "
            f"without saving. {self.resume_hint()} To step over that batch, relaunch with "
            f"--iterations-to-skip {iteration}.")

    def check_pending(self, keep_last: int = 0) -> None:
        """Read back (and check) every pending norm but the newest ``keep_last``."""
        while len(self.pending) > keep_last:
            iteration, norm = self.pending.pop(0)
            value = norm.value()
            if not math.isfinite(value):
                self.pending.clear()
                self._raise(iteration, value)

    def train_step(self, train_step):
        @functools.wraps(train_step)
        def wrapper(*args, **kwargs):
            result = train_step(*args, **kwargs)
            grad_norm = result[5]
            iteration = int(kwargs.get("iteration") or 0) + 1
            if grad_norm is None:
                return result
            if isinstance(grad_norm, (int, float)):
                if not math.isfinite(grad_norm):
                    self._raise(iteration, grad_norm)
                return result
            self.pending.append((iteration, NormInFlight(grad_norm)))
            last = self.final_iteration is not None and iteration >= self.final_iteration
            self.check_pending(keep_last=0 if last else 1)
            return result

        return wrapper

    def save_checkpoint(self, save_checkpoint):
        @functools.wraps(save_checkpoint)
        def wrapper(*args, **kwargs):
            self.check_pending()
            return save_checkpoint(*args, **kwargs)

        return wrapper


def grad_norm_guard(train_step, resume_hint: Callable[[], str]):
    """``GradNormGuard(resume_hint).train_step(train_step)``: the guard without save checks."""
    return GradNormGuard(resume_hint).train_step(train_step)

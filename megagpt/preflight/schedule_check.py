"""The learning-rate schedule, checked by megatron's own scheduler before the model is built.

Megatron builds its ``OptimizerParamScheduler`` after the model and the optimizer, and its
checks are bare assertions (``assert self.lr_warmup_steps < self.lr_decay_steps``): a launch
with ``--lr-warmup-iters 5 --lr-decay-iters 1`` spends the whole start-up and then stops with
``AssertionError`` and no message. Here the same function megatron calls,
``megatron.training.training.get_optimizer_param_scheduler``, runs on a copy of the arguments
with a stand-in optimizer (the scheduler only writes ``lr`` and ``weight_decay`` into its
parameter groups), at the first and the last step, and a failed check becomes one line in
terms of the flags.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import types

from megagpt.errors import UserError
from megagpt.megatron_change import REPLACES, Change
from megagpt.megatron_errors import failed_condition

# The scheduler's fields, in the flags that set them.
SCHEDULE_TERMS = {
    "lr_warmup_steps": ("warm-up", "--lr-warmup-iters / --lr-warmup-samples / --lr-warmup-fraction"),
    "lr_decay_steps": ("decay", "--lr-decay-iters / --lr-decay-samples, else --train-iters"),
    "wsd_decay_steps": ("WSD decay", "--lr-wsd-decay-iters / --lr-wsd-decay-samples"),
    "max_lr": ("peak learning rate", "--lr"),
    "min_lr": ("minimum learning rate", "--min-lr"),
    "init_lr": ("initial learning rate", "--lr-warmup-init"),
    "start_wd": ("starting weight decay", "--start-weight-decay"),
    "end_wd": ("final weight decay", "--end-weight-decay"),
}


class ScheduleError(UserError, ValueError):
    """The learning-rate or weight-decay schedule cannot run; the message names the flags."""


GLOBAL_ARGS = Change(
    "megatron.training.global_vars._GLOBAL_ARGS", REPLACES, __name__,
    does="the launch's arguments (or a copy) as megatron's global arguments",
    why="megatron's scheduler and sample counts read the run's arguments with get_args; the "
        "preflight runs them before megatron's globals are set, or without disturbing them",
    when="around the preflight's schedule and sample-count checks (global_args), undone after",
    fingerprint="de64d38ea9a5")
MEGATRON_CHANGES = (GLOBAL_ARGS,)


@contextlib.contextmanager
def global_args(args):
    """megatron's global args are ``args`` inside (its functions read them with get_args)."""
    from megatron.training import global_vars

    from megagpt import megatron_wrappers

    with megatron_wrappers.wrapped(global_vars, [("_GLOBAL_ARGS", __name__,
                                                  megatron_wrappers.replacing(args))]):
        yield


@contextlib.contextmanager
def _quiet():
    """The trial scheduler's log lines would repeat the real one's."""
    logger = logging.getLogger("megatron.core.optimizer_param_scheduler")
    saved = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(None):
            yield
    finally:
        logger.setLevel(saved)


def _batch_calculator_ready() -> bool:
    from megatron.core import num_microbatches_calculator as calculator

    return calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None


def _scheduler_frame_self(exc: BaseException):
    tb, found = exc.__traceback__, None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if type(candidate).__name__ == "OptimizerParamScheduler":
            found = candidate
        tb = tb.tb_next
    return found


def _describe(condition: str, scheduler, args) -> str:
    unit = "iterations" if args.train_iters else "samples"
    per_unit = args.global_batch_size if args.train_iters else 1
    parts = []
    for name, (what, flags) in SCHEDULE_TERMS.items():
        if name not in condition:
            continue
        value = getattr(scheduler, name, None) if scheduler is not None else None
        if name.endswith("_steps") and isinstance(value, (int, float)) and per_unit:
            value = f"{value / per_unit:g} {unit}"
        parts.append(f"the {what} is {value} ({flags})")
    text = condition.replace("self.", "")
    return f"megatron requires {text}, but " + " and ".join(parts) if parts else \
        f"megatron requires {text}"


def check_schedule(args) -> None:
    """Raise ScheduleError when megatron's scheduler would refuse this run's schedule."""
    from megatron.training.training import get_optimizer_param_scheduler

    if getattr(args, "skip_train", False) or not (args.train_iters or args.train_samples):
        return
    if not args.train_iters and getattr(args, "step_batch_size_schedule", None) \
            and not _batch_calculator_ready():
        return  # a dry run: megatron's batch-size calculator is not set up to count iterations
    run_args = copy.copy(args)  # megatron fills in lr_decay_iters / train_iters on its args
    optimizer = types.SimpleNamespace(param_groups=[{}])
    try:
        with global_args(run_args), _quiet():
            scheduler = get_optimizer_param_scheduler(optimizer)
            scheduler.step(max(int(scheduler.lr_decay_steps), int(scheduler.wd_incr_steps)))
    except AssertionError as exc:
        condition = failed_condition(exc)
        if not condition:
            raise ScheduleError(f"learning-rate schedule: {exc}") from None
        message = str(exc).strip()
        detail = _describe(condition, _scheduler_frame_self(exc), run_args)
        raise ScheduleError(f"learning-rate schedule: {message + '; ' if message else ''}"
                            f"{detail}") from None
    except (ValueError, ZeroDivisionError) as exc:
        raise ScheduleError(f"learning-rate schedule: {exc}") from None

"""When a run hangs, slows down or runs out of memory: one line that says where.

The launch's resolution decides (``megagpt.launch.diagnostics``: its ``DIAGNOSTICS`` decision)
what a launch records (torch's flight recorder into the run's folder, megatron's memory
snapshot path) and the policies below; ``--dry-run`` shows the collective timeout it will use.

``active(args, plan)`` is a context manager around ``megatron.training.pretrain`` that installs the
training-time parts, each a wrapper of one function of ``megatron.training.training``
(through ``megagpt.megatron_wrappers``, listed in ``megagpt.megatron_ledger``), undone on
exit:

``timeouts``
    the collective timeout tightened after the warm-up iterations, relaxed during saves;
``stragglers``
    each rank's compute and waiting on the step that ends a log interval, gathered at the
    log interval; rank 0 names the slow ranks in a line of its own;
``collective_failure`` (with ``flight_recorder`` and ``hangs``)
    a failed or timed-out collective becomes one ``error:`` line naming the ranks that did
    not join, the collective, its group and its sequence number, read from the dumps;
    ``on_sigterm`` does the same when a launcher's SIGTERM finds the rank stuck in one;
``out_of_memory``
    CUDA out of memory becomes one ``error:`` line: the peak, the dry run's estimate for
    this launch and the knobs that lower it.

docs/debugging.md describes the behaviour, the flags and how to read a dump or a snapshot.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import time

from megagpt import megatron_wrappers
from megagpt.diagnostics import (collective_failure, hangs, on_sigterm, out_of_memory,
                                 stragglers, timeouts)
from megagpt.diagnostics.settings import DiagnosticsPlan, plan_diagnostics
from megagpt.log import log
from megagpt.megatron_change import TRAINING, WRAPS, Change

__all__ = ["active", "plan_diagnostics"]


def _failure_reporter(args, plan: DiagnosticsPlan, launched_at: float
                      ) -> collective_failure.FailureReporter:
    from megagpt.resilience.checkpoint_guard import resume_hint

    def relaunch() -> str:
        hint = resume_hint(args)
        resumes = args.load and os.path.realpath(args.load) == os.path.realpath(args.save or "")
        return hint + (" The same command resumes from it." if resumes and "untouched" in hint
                       else "")

    return collective_failure.FailureReporter(plan.dump_prefix, launched_at,
                                              int(os.environ.get("RANK", "0")),
                                              int(os.environ.get("WORLD_SIZE", "1")),
                                              args.distributed_backend, resume_hint=relaunch)


POST_TRAINING_STEP_CALLBACKS = Change(
    TRAINING + "post_training_step_callbacks", WRAPS, __name__,
    does="after every iteration, the collective timeout's warm-up and, at the log interval, "
         "the straggler report's all-gather",
    why="megatron runs it after every iteration with its count, on every rank",
    fingerprint="5cc914494319")
MEGATRON_CHANGES = (POST_TRAINING_STEP_CALLBACKS,)


def _after_each_iteration(callbacks, timeout: timeouts.CollectiveTimeout,
                          report_at_log_interval):
    """Wrap megatron's ``post_training_step_callbacks`` (run after every iteration, with the
    iteration count): the timeout's warm-up, and the straggler report at the log interval."""
    signature = inspect.signature(callbacks)

    @functools.wraps(callbacks)
    def wrapper(*args, **kwargs):
        result = callbacks(*args, **kwargs)
        iteration = signature.bind(*args, **kwargs).arguments["iteration"]
        timeout.iteration_done(iteration)
        report_at_log_interval(iteration)
        return result

    wrapper._megagpt_original = callbacks
    return wrapper


def _relaxed_while_saving(timeout: timeouts.CollectiveTimeout):
    def wrap(save_checkpoint):
        @functools.wraps(save_checkpoint)
        def wrapper(*args, **kwargs):
            with timeout.relaxed():
                return save_checkpoint(*args, **kwargs)

        wrapper._megagpt_original = save_checkpoint
        return wrapper

    return wrap


class _StragglerReportAtLogInterval:
    """The straggler report, made at the first log interval (the process groups exist then)."""

    def __init__(self, args, plan: DiagnosticsPlan, clock: stragglers.StepClock):
        self.args, self.plan, self.clock = args, plan, clock
        self.report: stragglers.StragglerReport | None = None
        self.first_iteration: int | None = None

    def __call__(self, iteration: int) -> None:
        import torch.distributed as dist

        if self.first_iteration is None:
            self.first_iteration = iteration
        if not self.plan.stragglers.enabled or iteration % self.args.log_interval:
            return
        # the warm-up iterations (compilation, first reads) say nothing about a rank's speed
        if iteration - self.first_iteration + 1 <= self.plan.timeout.warmup_iterations:
            return
        if not dist.is_initialized():
            return
        if self.report is None:
            self.report = stragglers.StragglerReport(self.plan.stragglers, self.clock, log,
                                                     rank=dist.get_rank())
        self.report.log_interval_done(iteration)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def active(args, plan: DiagnosticsPlan, memory_knobs=None):
    """The training-time diagnostics for the duration of ``pretrain`` (see the docstring):
    ``plan``, the launch's ``diagnostics`` choice; ``memory_knobs(args)``, the dry run's
    estimate and what lowers it, for the out-of-memory line (the entry's
    ``megagpt.preflight.memory_knobs.memory_knobs``; None: the line names neither)."""
    import megatron.training.training as mtraining
    launched_at = time.time() - 1.0  # a file system's mtime may be rounded down to the second
    reporter = _failure_reporter(args, plan, launched_at)
    watcher = None
    if plan.dump_prefix is not None and args.distributed_backend == "nccl":
        # torch's watchdog writes the dumps itself, into a folder it does not create
        os.makedirs(plan.dump_folder, exist_ok=True)
        watcher = collective_failure.DumpWatcher(reporter, _to_stderr).start()
    timeout = timeouts.CollectiveTimeout(plan.timeout, log)
    sigterm = None
    if plan.dump_prefix is not None:
        sigterm = on_sigterm.SigtermWatcher(reporter, _to_stderr, lambda: timeout.in_save)
        sigterm.install()
    clock = stragglers.StepClock(args.log_interval)
    report = _StragglerReportAtLogInterval(args, plan, clock)
    # (megatron function, owner, wrapper), installed in this order over what the launch's
    # context installed before (megagpt.launch.megatron_changes); each is built again whenever
    # another owner's wrapper of the same function comes or goes: the state lives in clock,
    # timeout and report, not in the wrappers
    wrappers = [
        ("train_step", stragglers.__name__, clock.timing_train_step),
        ("finalize_model_grads", stragglers.__name__, clock.timing_gradient_collectives),
        ("post_training_step_callbacks", __name__,
         lambda fn: _after_each_iteration(fn, timeout, report)),
        ("save_checkpoint", timeouts.__name__, _relaxed_while_saving(timeout)),
    ]
    try:
        with megatron_wrappers.wrapped(mtraining, wrappers):
            yield
    except Exception as exc:  # not SystemExit: megatron's own exits (preemption) are its say
        if out_of_memory.is_out_of_memory(exc):
            raise out_of_memory.out_of_memory_error(exc, args, memory_knobs) from None
        terminated = (collective_failure.termination_consequence(exc)
                      if sigterm is not None else None)
        if terminated is not None and sigterm.received_within(
                0.0 if collective_failure.is_collective_failure(terminated)
                else on_sigterm.CATCH_UP_S):
            ended = reporter.exception_for_termination(terminated)
            if isinstance(ended, SystemExit):
                # the exit SIGTERM would have been, with what ended it said in one line
                _to_stderr(f"[megagpt] SIGTERM: this rank leaves with status {ended.code} "
                           f"after {type(terminated).__name__}: "
                           f"{hangs.failure_cause(terminated)}")
            raise ended from None
        if collective_failure.is_collective_failure(exc):
            raise reporter.exception_for(exc) from None
        raise
    finally:
        if watcher is not None:
            watcher.stop()
        if sigterm is not None:
            sigterm.remove()

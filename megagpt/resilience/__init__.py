"""Resume and faults: a run survives preemption, crashes and bad checkpoints.

What ``pretrain_gpt`` uses:

steps of the launch's resolution (``megagpt.launch.resilience``), before megatron validates
    the asynchronous writer (``choose_writer``), the exit-signal handler when ``--save`` is
    given (``choose_exit_signal_handler``) and the rerun mode (``choose_rerun_mode``);
``checkpoint_guard.prepare_load(args, given, log)``
    once megatron has validated the arguments: the checks of ``--load`` and the checkpoint to
    resume from (the launch's one post-validation step writes what it returns); raises
    ``UserError`` subclasses with a one-line message naming the problem and the path;
``interrupt.saving_on_ctrl_c(args, log)``
    around ``pretrain`` once megatron's globals are set: Ctrl-C as megatron's exit signal
    where the run saves (``interrupt``);
``active(args, load_earlier, container, grad_norm_guard)``
    a context manager around ``megatron.training.pretrain`` that installs the contained
    adaptations of megatron's training loop: resume fidelity (``fidelity``), the file
    system's save errors as one-line messages (``checkpoint_guard``), the resolved
    configuration beside every checkpoint (``config_snapshot``), load errors as one-line
    messages (``checkpoint_guard``), checksums of every checkpoint file recorded at save and
    checked before a load, and the loaded weights checked (``checkpoint_integrity``), a bf16/fp16 checkpoint resumed in fp32
    (``precision_change``), an optimizer checkpoint of another install's inner optimizer
    (``optimizer_groups``), and with the gradient-norm guard the divergence checks
    (``divergence``). Each wraps one function of megatron (``megatron.training.training``'s,
    or its optimizers' ``load_state_dict``) through ``megagpt.megatron_wrappers``, in the order
    listed (the first innermost), and is undone on exit. Inside it, processes forked while
    megatron's exit-signal handler holds SIGTERM (the data-loader workers) keep the signal
    blocked (``preemption``), and torch's handler of a worker's death raises once
    (``worker_deaths``). The launch's one context of megatron changes enters it
    (``megagpt.launch.megatron_changes``).

docs/resume.md describes the behaviour, bench/notes/resume.md the rules and why.
"""

from __future__ import annotations

import contextlib

from megagpt import megatron_wrappers
from megagpt.log import log
from megagpt.resilience import (checkpoint_guard, checkpoint_integrity, config_snapshot,
                                divergence, fidelity, optimizer_groups, precision_change,
                                preemption, worker_deaths)


@contextlib.contextmanager
def active(args, load_earlier: checkpoint_integrity.LoadEarlier, container=None,
           grad_norm_guard: bool = False, ckpt_step_given: bool = False):
    """Install the training-loop adaptations for the duration of ``pretrain``.
    ``load_earlier(args, iteration)``: points megatron's load at an earlier checkpoint where
    the one to load is damaged (the launch's ``writer.load_earlier``).
    ``grad_norm_guard``: megatron's in-step NaN checks are off for the launch's CUDA graphs,
    and the gradient norm is checked after each step instead (the launch's ``NaN check``).
    ``ckpt_step_given``: ``--ckpt-step`` is among the launch's explicit flags (a damaged
    checkpoint asked for is an error, not a fallback)."""
    import megatron.training.training as mtraining

    wrappers = [  # (megatron function, owner, wrapper); the first innermost
        ("training_log", fidelity.__name__, fidelity.first_log_boundary_resets),
        ("build_train_valid_test_data_iterators", fidelity.__name__,
         fidelity.without_drawing_random_numbers),
        ("build_train_valid_test_data_iterators", worker_deaths.__name__,
         worker_deaths.after_building_iterators),
        ("save_checkpoint", checkpoint_guard.__name__,
         lambda fn: checkpoint_guard.one_line_save_errors(fn, args)),
        ("save_checkpoint", config_snapshot.__name__,
         lambda fn: config_snapshot.writing_snapshot(fn, args, container)),
        ("load_checkpoint", checkpoint_guard.__name__,
         lambda fn: checkpoint_guard.one_line_load_errors(fn, args)),
        ("save_checkpoint", checkpoint_integrity.__name__,
         lambda fn: checkpoint_integrity.recording_checksums(fn, args, log)),
        ("load_checkpoint", checkpoint_integrity.__name__,
         lambda fn: checkpoint_integrity.verifying_checksums(fn, args, log, load_earlier,
                                                             ckpt_step_given)),
    ]
    if grad_norm_guard:
        guard = divergence.GradNormGuard(lambda: checkpoint_guard.resume_hint(args),
                                         final_iteration=getattr(args, "train_iters", None))
        wrappers += [("train_step", divergence.__name__, guard.train_step),
                     ("save_checkpoint", divergence.__name__, guard.save_checkpoint)]
    from megatron.core.optimizer.optimizer import FP32Optimizer

    optimizer_wrappers = [  # (class, name, owner, wrapper); the first innermost
        (FP32Optimizer, "load_state_dict", precision_change.__name__,
         precision_change.reading_mixed_precision_checkpoints),
        *((loader, "load_state_dict", optimizer_groups.__name__,
           optimizer_groups.keeping_the_running_settings)
          for loader in optimizer_groups.loader_classes())]
    try:
        with megatron_wrappers.wrapped(mtraining, wrappers), \
                megatron_wrappers.wrapped_all(optimizer_wrappers), \
                preemption.workers_keep_running_through_sigterm():
            yield
    except BaseException as exc:
        _stop_data_workers()
        error = divergence.divergence_error(exc, args, checkpoint_guard.resume_hint(args))
        if error is None:
            raise
        raise error from None


def _stop_data_workers() -> None:
    """Kill the data-loader workers of a run that is leaving with an exception.

    With ``--exit-signal-handler`` the workers ignore SIGTERM (megatron installs the handler
    in them too), which is what ``multiprocessing`` sends its daemon children at interpreter
    exit, and then waits for: a run that failed would hang instead of exiting.
    """
    import multiprocessing
    import signal

    children = [child for child in multiprocessing.active_children() if child.daemon]
    if not children:
        return
    # torch's SIGCHLD handler would raise "DataLoader worker ... is killed" for each one.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout=5)

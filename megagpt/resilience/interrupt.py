"""Ctrl-C saves and exits, as SIGTERM does; a second Ctrl-C exits at once.

Python's answer to Ctrl-C (SIGINT) is a ``KeyboardInterrupt`` raised wherever the trainer
happens to be: a traceback of megatron's loop, exit status 130, and the work since the last
checkpoint lost. Where the run saves (``--save``, so megatron's exit-signal handler is on:
``preemption``), the first Ctrl-C of a run that has started training is taken as that
signal instead: the ranks finish the iteration, save a checkpoint and leave (megatron's
``checkpoint_and_decide_exit``), and the entry exits with status 130, as an interrupted
program does, so that a script running it stops too. A second Ctrl-C exits at once without
saving (the checkpoint being written is then partial, which ``checkpoint_guard`` sets aside
on the next launch).

Details:

* Before training starts (building the model and the data, loading) there is nothing to
  save: Ctrl-C interrupts at once, and the entry says so in one line.
* A terminal sends Ctrl-C to the whole foreground process group: the data-loader workers
  (forked with this handler) ignore it and end with the trainer; under torchrun each rank
  gets it twice (the terminal's and torchrun's forwarded copy, within milliseconds), so a
  second press counts only ``SECOND_PRESS_AFTER`` seconds after the first.
* Without ``--save`` Ctrl-C interrupts at once, and the entry says that nothing was saved.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import time
from typing import Callable

# Seconds after the first press before a second one exits at once (see the module docstring).
SECOND_PRESS_AFTER = 0.5
EXIT_STATUS = 128 + signal.SIGINT  # what a shell reports for a program stopped by Ctrl-C


class CtrlC:
    """The SIGINT handler of one training process."""

    def __init__(self, args, log: Callable[[str], None]):
        self.args = args
        self.log = log
        self.pid = os.getpid()
        self.first_press: float | None = None

    @property
    def pressed(self) -> bool:
        return self.first_press is not None

    def training_started(self) -> bool:
        # megatron sets it (to 0) just before its training loop, and before each iteration
        return hasattr(self.args, "curr_iteration")

    def __call__(self, signum, frame) -> None:
        if os.getpid() != self.pid:
            return  # a forked data-loader worker: it ends with the trainer
        now = time.monotonic()
        if self.first_press is None:
            if not self.training_started():
                raise KeyboardInterrupt
            self.first_press = now
            _megatrons_signal_handler()._signal_received = True
            self.log("Ctrl-C: saving a checkpoint after this iteration, then exiting "
                     "(Ctrl-C again to exit at once, without saving)")
            return
        if now - self.first_press < SECOND_PRESS_AFTER:
            return  # the same press, forwarded by torchrun
        print("\n[megagpt] Ctrl-C again: exiting now, without saving", file=sys.stderr,
              flush=True)
        # the save's helper processes (megatron's checkpoint writer starts a multiprocessing
        # manager) end with it: left running they outlive the trainer, and their pipe to it
        # breaks with a traceback
        for child in multiprocessing.active_children():
            child.kill()
        os._exit(EXIT_STATUS)


def _megatrons_signal_handler():
    from megatron.training import global_vars

    return global_vars._GLOBAL_SIGNAL_HANDLER


_ACTIVE: CtrlC | None = None


def install(args, log: Callable[[str], None]) -> CtrlC | None:
    """Take Ctrl-C as megatron's exit signal where the run saves (after megatron's handler
    is installed: ``--exit-signal-handler``, which ``preemption`` turns on with ``--save``);
    None where Ctrl-C keeps its meaning."""
    global _ACTIVE
    if not (getattr(args, "save", None) and getattr(args, "exit_signal_handler", False)
            and _megatrons_signal_handler() is not None):
        return None
    if getattr(args, "exit_signal", None) == signal.SIGINT:
        return None  # megatron's handler takes it already
    _ACTIVE = CtrlC(args, log)
    signal.signal(signal.SIGINT, _ACTIVE)
    return _ACTIVE


@contextlib.contextmanager
def saving_on_ctrl_c(args, log: Callable[[str], None]):
    """Ctrl-C as megatron's exit signal for the duration of the block (``install``; once
    megatron's globals, its signal handler among them, are set), the SIGINT handler before
    it back on exit. ``pressed()`` still answers afterwards."""
    previous = signal.getsignal(signal.SIGINT)
    handler = install(args, log)
    try:
        yield handler
    finally:
        if handler is not None:
            signal.signal(signal.SIGINT, previous)


def pressed() -> bool:
    """Whether Ctrl-C asked this run to save and exit."""
    return _ACTIVE is not None and _ACTIVE.pressed


def interrupted_line(args) -> str:
    """What the entry says when Ctrl-C stopped the run at once."""
    if args is None or not hasattr(args, "curr_iteration"):
        return "interrupted (Ctrl-C) before training started; nothing to save"
    done = int(getattr(args, "curr_iteration", 0) or 0)
    if not args.save:
        return f"interrupted (Ctrl-C) after {done} iterations; nothing saved (no --save)"
    return f"interrupted (Ctrl-C) after {done} iterations; nothing saved since the last checkpoint"

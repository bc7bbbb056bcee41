"""Faults done to real processes from outside, as a machine or a scheduler does them: find a
rank's worker under torchrun, stop it (SIGSTOP), slow it (stopped part of every few
milliseconds), kill it."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import psutil


def rank_process(launcher: subprocess.Popen, rank: int, timeout: float = 60) -> psutil.Process:
    """The worker of ``rank`` started by a torchrun that ``launcher`` is or started: a
    descendant with that RANK whose parent is torchrun (the worker's own data-loader
    processes carry the same RANK)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            descendants = psutil.Process(launcher.pid).children(recursive=True)
        except psutil.Error:
            break  # the launcher is gone
        for child in descendants:
            try:
                launcher_line = " ".join(child.parent().cmdline())
                if child.environ().get("RANK") == str(rank) and (
                        "torchrun" in launcher_line or "torch.distributed.run" in launcher_line):
                    return child
            except psutil.Error:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} under torchrun")


class DutyCycle:
    """Stop a process for ``stopped_s`` of every ``period_s`` (SIGSTOP / SIGCONT): a rank that
    runs at a fraction of its speed, whatever it runs."""

    def __init__(self, process: psutil.Process, stopped_s: float = 0.025,
                 period_s: float = 0.05):
        self.process, self.stopped_s, self.period_s = process, stopped_s, period_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            while not self.done.is_set():
                self.process.send_signal(signal.SIGSTOP)
                time.sleep(self.stopped_s)
                self.process.send_signal(signal.SIGCONT)
                time.sleep(self.period_s - self.stopped_s)
        except psutil.Error:
            pass

    def __enter__(self) -> "DutyCycle":
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        try:
            self.process.send_signal(signal.SIGCONT)
        except psutil.Error:
            pass

"""Preemption: SIGTERM saves a checkpoint and exits 0; the same command continues.

Real processes: the signal is sent to the training process (or, under torchrun, to the
whole process group, as SLURM does) once the log shows a few iterations.
"""

import os
import re
import signal
from argparse import Namespace

import pytest

from helpers import TINY_MODEL, parse_losses, start_entry, wait_for_log
from megagpt.resilience import checkpoint_guard as guard
from megagpt.resilience import preemption

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _preempt(command, tmp_path, name, nproc=1, after_iteration=r"\d+"):
    """Start, wait for a logged iteration, SIGTERM the process group; (status, log text)."""
    log = tmp_path / f"{name}.log"
    proc = start_entry(command, tmp_path, log, nproc=nproc)
    try:
        wait_for_log(log, rf"iteration\s+{after_iteration}/", proc)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, log.read_text()


def _saved_at(text):
    return int(re.findall(r"successfully saved checkpoint from iteration\s+(\d+)", text)[-1])


@pytest.mark.slow
def test_sigterm_saves_and_the_same_command_continues(tmp_path):
    ckpt = tmp_path / "ckpt"
    command = TINY_MODEL + NO_DROPOUT + ["--train-iters", "1000", "--save", str(ckpt),
                                         "--load", str(ckpt), "--save-interval", "1000"]
    status, text = _preempt(command, tmp_path, "first", after_iteration="3")
    assert status == 0, text[-3000:]
    assert "exiting program after receiving SIGTERM" in text
    stopped = max(parse_losses(text))
    assert stopped >= 3 and _saved_at(text) == stopped
    assert guard.read_tracker(str(ckpt)) == stopped
    assert guard.incompleteness(guard.iteration_dir(str(ckpt), stopped)) is None

    status, text = _preempt(command, tmp_path, "second", after_iteration=str(stopped + 1))
    assert status == 0, text[-3000:]
    assert min(parse_losses(text)) == stopped + 1  # continued, nothing lost or repeated
    assert guard.read_tracker(str(ckpt)) == max(parse_losses(text))


@pytest.mark.slow
def test_sigterm_under_torchrun_saves_on_every_rank(tmp_path):
    ckpt = tmp_path / "ckpt"
    command = TINY_MODEL + NO_DROPOUT + ["--train-iters", "1000", "--save", str(ckpt),
                                         "--save-interval", "1000"]
    status, text = _preempt(command, tmp_path, "torchrun", nproc=2, after_iteration="2")
    # torchrun itself reports the signal (status 1); its workers saved and left cleanly.
    assert "exiting program after receiving SIGTERM" in text, text[-3000:]
    assert "ChildFailedError" not in text, text[-3000:]
    stopped = guard.read_tracker(str(ckpt))
    assert stopped == max(parse_losses(text))
    assert guard.incompleteness(guard.iteration_dir(str(ckpt), stopped)) is None


def test_signal_handler_is_on_whenever_the_run_saves():
    from megagpt.launch.planner import Planner

    def decided(save):
        p = Planner(Namespace(save=save, exit_signal_handler=False, exit_signal=signal.SIGTERM),
                    frozenset(), None)
        preemption.choose_exit_signal_handler(p)
        return p.v, p.lines

    args, lines = decided("/ckpt")
    assert args.exit_signal_handler and "SIGTERM saves a checkpoint to /ckpt" in lines[0]
    args, lines = decided(None)
    assert not args.exit_signal_handler and lines == []

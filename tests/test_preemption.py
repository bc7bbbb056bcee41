"""Preemption: SIGTERM saves a checkpoint and exits 0, Ctrl-C saves and exits 130; the same
command continues.

Real processes: the signal is sent to the training process (or, under torchrun, to the
whole process group, as SLURM does) once the log shows a few iterations.
"""

import contextlib
import os
import re
import signal
import textwrap
import time
from argparse import Namespace

import pytest

from helpers import TINY_MODEL, parse_losses, start_entry, wait_for_log
from megagpt.resilience import checkpoint_guard as guard
from megagpt.resilience import interrupt, preemption

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _preempt(command, tmp_path, name, nproc=1, after_iteration=r"\d+", before_signal=None):
    """Start, wait for a logged iteration, SIGTERM the process group (``before_signal()``
    called just before); (status, log text)."""
    log = tmp_path / f"{name}.log"
    proc = start_entry(command, tmp_path, log, nproc=nproc)
    try:
        wait_for_log(log, rf"iteration\s+{after_iteration}/", proc)
        if before_signal is not None:
            before_signal()
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


@pytest.mark.slow
def test_ctrl_c_saves_like_sigterm_and_a_second_ctrl_c_exits_at_once(tmp_path):
    """Ctrl-C reaches the whole foreground process group (trainer and data-loader workers),
    as a terminal sends it. The first saves after the iteration and exits 130, and the same
    command continues; pressed twice, the run exits at once during the save (the first save
    of a process takes seconds: it starts megatron's writer manager), saving nothing."""
    ckpt = tmp_path / "ckpt"
    command = TINY_MODEL + NO_DROPOUT + ["--train-iters", "1000", "--save", str(ckpt),
                                         "--load", str(ckpt), "--save-interval", "1000"]
    log = tmp_path / "first.log"
    proc = start_entry(command, tmp_path, log)
    try:
        wait_for_log(log, r"iteration\s+3/", proc)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert proc.returncode == 130, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "[megagpt] Ctrl-C: saving a checkpoint after this iteration" in text
    assert "stopped by Ctrl-C after saving a checkpoint" in text
    stopped = max(parse_losses(text))
    assert _saved_at(text) == stopped and guard.read_tracker(str(ckpt)) == stopped
    assert guard.incompleteness(guard.iteration_dir(str(ckpt), stopped)) is None

    log = tmp_path / "second.log"
    proc = start_entry(command, tmp_path, log)
    try:
        wait_for_log(log, rf"iteration\s+{stopped + 2}/", proc)
        os.killpg(proc.pid, signal.SIGINT)
        wait_for_log(log, r"saving checkpoint at iteration", proc)
        time.sleep(1.5 * interrupt.SECOND_PRESS_AFTER)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert min(parse_losses(text)) == stopped + 1, text[-3000:]  # it had resumed
    assert proc.returncode == 130, text[-3000:]
    assert "Ctrl-C again: exiting now, without saving" in text
    assert "successfully saved checkpoint" not in text
    # the trainer leaves without a traceback; a helper process megatron's save was starting
    # (its multiprocessing manager, or a spawned process re-importing the entry) gets the
    # terminal's Ctrl-C too, and may print its own interruption before the trainer ends it:
    # a traceback that starts in multiprocessing's start-up or in an import it was running
    helper_starts = ('File "<string>", line 1, in <module>', "<frozen importlib._bootstrap",
                     "multiprocessing/process.py")
    for traceback in text.split("Traceback (most recent call last):")[1:]:
        first_frame = traceback.lstrip().split("\n", 1)[0]
        assert any(start in first_frame for start in helper_starts), traceback[:500]
    assert guard.read_tracker(str(ckpt)) == stopped  # the last complete save stands


def test_ctrl_c_before_training_or_without_save_interrupts_at_once_in_one_line(tmp_path):
    """No checkpoint to write: the line says so (the handler is megatron's SIGTERM one only
    where the run saves)."""
    from megagpt.resilience.interrupt import interrupted_line

    started = Namespace(save=None, curr_iteration=7)
    assert interrupted_line(started) == ("interrupted (Ctrl-C) after 7 iterations; nothing "
                                         "saved (no --save)")
    assert "before training started" in interrupted_line(Namespace(save="/c"))
    assert interrupt.install(Namespace(save=None, exit_signal_handler=False,
                                       exit_signal=signal.SIGTERM), print) is None
    handler = interrupt.CtrlC(Namespace(save="/c"), print)
    with pytest.raises(KeyboardInterrupt):  # before the training loop: at once
        handler(signal.SIGINT, None)


def test_signal_handler_is_on_whenever_the_run_saves():
    from megagpt.launch import resilience
    from megagpt.launch.planner import Planner

    def decided(save):
        p = Planner(Namespace(save=save, exit_signal_handler=False, exit_signal=signal.SIGTERM),
                    frozenset(), None)
        resilience.choose_exit_signal_handler(p)
        return p.v, p.lines

    args, lines = decided("/ckpt")
    assert args.exit_signal_handler and "SIGTERM saves a checkpoint to /ckpt" in lines[0]
    args, lines = decided(None)
    assert not args.exit_signal_handler and lines == []


@pytest.mark.slow
def test_a_save_that_fails_after_sigterm_says_why(tmp_path):
    """One process, so no launcher is ending a peer: an error in the save SIGTERM asked
    for is this run's own, and is said (not the quiet exit of a rank ended with the others)."""
    ckpt = tmp_path / "ckpt"
    command = TINY_MODEL + NO_DROPOUT + ["--train-iters", "1000", "--save", str(ckpt),
                                         "--save-interval", "1000"]

    def save_folder_becomes_a_file():  # it cannot be written, whoever runs the test
        if ckpt.exists():
            ckpt.rename(tmp_path / "ckpt.before")
        ckpt.write_text("not a folder\n")

    status, text = _preempt(command, tmp_path, "run", after_iteration="2",
                            before_signal=save_folder_becomes_a_file)
    assert status not in (0, 128 + signal.SIGTERM), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert "error: cannot save the checkpoint of iteration" in text, text[-3000:]
    assert f"to {ckpt}: NotADirectoryError" in text, text[-3000:]


def _start_like_a_torch_data_loader_worker_then_wait(ready):
    from torch.utils.data._utils import signal_handling

    signal_handling._set_worker_signal_handlers()  # the first thing torch's worker loop does
    ready.set()
    time.sleep(60)


def test_a_worker_forked_in_a_run_that_saves_outlives_a_sigterm_before_its_init():
    """torch's worker loop installs a SIGTERM handler that ends the worker before megatron's
    worker_init_fn installs megatron's; a SIGTERM to the process group in between (a
    preemption while the workers start) killed the worker, and the trainer then stopped in
    the middle of its save. Forked while megatron's handler holds SIGTERM, the worker keeps
    the signal blocked."""
    import multiprocessing

    from megatron.training.dist_signal_handler import DistributedSignalHandler

    megatrons = DistributedSignalHandler(signal.SIGTERM).__enter__()
    ctx = multiprocessing.get_context("fork")
    try:
        outcomes = {}
        for keeping in (False, True):
            with preemption.workers_keep_running_through_sigterm() if keeping \
                    else contextlib.nullcontext():
                ready = ctx.Event()
                worker = ctx.Process(target=_start_like_a_torch_data_loader_worker_then_wait,
                                     args=(ready,), daemon=True)
                worker.start()
            try:
                assert ready.wait(60)
                os.kill(worker.pid, signal.SIGTERM)
                worker.join(timeout=2)
                outcomes[keeping] = worker.is_alive()
            finally:
                worker.kill()
                worker.join()
    finally:
        megatrons.release()
    assert outcomes == {False: False, True: True}


@pytest.mark.slow
def test_a_worker_killed_after_sigterm_ends_the_run_with_one_line_saying_so(tmp_path):
    """A data-loader worker killed outright after the SIGTERM (the kernel's out-of-memory
    killer, say) ends the rank as SIGTERM would, status 143, with a line naming it."""
    import subprocess

    ckpt = tmp_path / "ckpt"
    command = TINY_MODEL + NO_DROPOUT + ["--train-iters", "1000", "--save", str(ckpt),
                                         "--save-interval", "1000"]
    log = tmp_path / "run.log"
    proc = start_entry(command, tmp_path, log)
    try:
        wait_for_log(log, r"iteration\s+2/", proc)
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                 text=True).stdout.split()
        assert workers, "no data-loader workers"
        os.kill(proc.pid, signal.SIGTERM)
        for pid in workers:
            os.kill(int(pid), signal.SIGKILL)
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert "[megagpt] SIGTERM: this rank leaves with status 143 after RuntimeError: " \
           "DataLoader worker" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


DEATHS_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from torch.utils.data import DataLoader
    from megagpt.resilience import worker_deaths

    # megatron's training and validation loaders, each with its workers
    loaders = [iter(DataLoader(list(range(64)), batch_size=1, num_workers=2,
                               multiprocessing_context="fork")) for _ in range(2)]
    for batches in loaders:
        next(batches)  # the workers run, and torch's SIGCHLD handler is installed
    if sys.argv[1] == "once":
        assert worker_deaths.raise_worker_deaths_once()
        assert not worker_deaths.raise_worker_deaths_once()  # already ours
    for worker in [w for batches in loaders for w in batches._workers]:
        os.kill(worker.pid, signal.SIGKILL)  # all, as by the out-of-memory killer
    try:
        time.sleep(5)
        print("their deaths raised nothing", flush=True)
    except RuntimeError as exc:
        print("raised:", exc, flush=True)
    os.kill(os.getpid(), signal.SIGCHLD)  # any later child's end, as the run leaves
    time.sleep(1)
    print("the next SIGCHLD raised nothing", flush=True)
""")


@pytest.mark.parametrize("once", [True, False], ids=["raising-once", "torchs-own"])
def test_a_dead_workers_error_is_raised_once_not_on_every_sigchld_after(once):
    """torch's SIGCHLD handler raises once for each DataLoader whose workers died, one on each
    SIGCHLD, at whatever line the leaving run has reached; the entry's raises once."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", DEATHS_SCRIPT, "once" if once else "torch"],
                          capture_output=True, text=True, timeout=120)
    if once:
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        assert re.search(r"raised: DataLoader worker \(pid \d+\) is killed by signal: "
                         r"Killed", proc.stdout), proc.stdout
        assert "the next SIGCHLD raised nothing" in proc.stdout
    else:  # what the entry's handler is for: the other loader's, raised on a later line
        said = proc.stdout + proc.stderr
        assert proc.returncode == 1, said[-3000:]
        assert said.count("is killed by signal: Killed") == 2, said[-3000:]

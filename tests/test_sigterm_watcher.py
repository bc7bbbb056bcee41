"""The SIGTERM watcher (megagpt.diagnostics.on_sigterm) against megatron's own exit-signal
handler, in a process of its own each (the watcher may end the process, as SIGTERM's
default would)."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from megagpt.diagnostics.collective_failure import FailureReporter
    from megagpt.diagnostics.on_sigterm import SigtermWatcher

    reporter = FailureReporter(dump_prefix={dump_prefix!r}, launched_at=time.time(), rank=0,
                               world_size=1, backend="gloo")
    watcher = SigtermWatcher(reporter, print, in_save=lambda: False, stuck_s=0.2).install()
    if {megatron_takes_it}:
        # what megatron's initialize does under --exit-signal-handler, after the watcher
        from megatron.training.dist_signal_handler import DistributedSignalHandler
        handler = DistributedSignalHandler(signal.SIGTERM).__enter__()
    os.kill(os.getpid(), signal.SIGTERM)
    # longer than the watcher's look for a stuck collective; where it is to end the process,
    # long enough for its thread on a loaded host (it looks into torch's flight recorder)
    time.sleep({wait_s})
    if {megatron_takes_it}:
        print("megatron saw it:", handler._signal_received, flush=True)
        handler.release()
    watcher.remove()
    print("still running", flush=True)
""")


def _run(dump_prefix, megatron_takes_it):
    script = SCRIPT.format(dump_prefix=dump_prefix, megatron_takes_it=megatron_takes_it,
                           wait_s=2.0 if megatron_takes_it else 60.0)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)


def test_sigterm_goes_to_megatrons_handler_installed_after_the_watcher(tmp_path):
    """megatron's handler (--exit-signal-handler, on whenever --save is given) comes after the
    watcher: the signal is its to act on at the end of the iteration (save, then exit 0).
    The watcher had taken the default as its own at install and ended every preempted rank
    with 143 a moment after SIGTERM, during or before megatron's save."""
    proc = _run(str(tmp_path / "fr_"), megatron_takes_it=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "megatron saw it: True" in proc.stdout and "still running" in proc.stdout


@pytest.mark.parametrize("dump", [True, False], ids=["recorder-on", "recorder-off"])
def test_without_megatrons_handler_sigterm_still_ends_the_rank(tmp_path, dump):
    """No one else handles SIGTERM: the rank ends as the default action would (143), after
    the watcher's look for a stuck collective."""
    proc = _run(str(tmp_path / "fr_") if dump else None, megatron_takes_it=False)
    assert proc.returncode == 128 + 15, proc.stdout + proc.stderr[-2000:]
    assert "still running" not in proc.stdout


CATCH_UP_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from megagpt.diagnostics.collective_failure import FailureReporter
    from megagpt.diagnostics.on_sigterm import CATCH_UP_S, SigtermWatcher
    from megatron.training.dist_signal_handler import DistributedSignalHandler

    reporter = FailureReporter(dump_prefix=None, launched_at=time.time(), rank=0,
                               world_size=1, backend="gloo")
    watcher = SigtermWatcher(reporter, print, in_save=lambda: False).install()
    handler = DistributedSignalHandler(signal.SIGTERM).__enter__()
    # the main thread keeps the interpreter's lock for as long as it does not block, as a
    # training step's Python does between two kernels: the thread cannot read the socket
    sys.setswitchinterval(30)
    os.kill(os.getpid(), signal.SIGTERM)
    at_once = watcher.received
    caught_up = watcher.received_within(CATCH_UP_S)
    sys.setswitchinterval(0.005)
    print("at once:", at_once, "caught up:", caught_up, "megatron:", handler._signal_received,
          flush=True)
    handler.release()
    watcher.remove()
""")


def test_a_sigterm_on_the_socket_is_read_before_an_error_it_caused_is_judged():
    """An error a SIGTERM caused in the main thread (a data-loader worker killed with the rank)
    can reach the diagnostics before the watcher's thread has read the signal: the main
    thread holds the interpreter's lock. ``received_within`` lets the thread catch up."""
    proc = subprocess.run([sys.executable, "-c", CATCH_UP_SCRIPT], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "at once: False caught up: True megatron: True" in proc.stdout, proc.stdout

"""The full-iteration CUDA graph's capture under a deadline (megagpt.train_step.capture_watchdog):
a capture that does not finish stops the run with one line naming its rank."""

from __future__ import annotations

import io
import threading
import time

import pytest


def test_a_call_that_finishes_in_time_returns_its_value():
    from megagpt.train_step.capture_watchdog import run_with_deadline

    exits = []
    assert run_with_deadline(lambda: 42, 5.0, "the capture", 0, exit_fn=exits.append) == 42
    time.sleep(0.05)
    assert exits == []


def test_a_call_past_its_deadline_names_the_rank_and_exits():
    from megagpt.train_step.capture_watchdog import EXIT_STATUS, run_with_deadline

    exited = threading.Event()
    codes, out = [], io.StringIO()

    def exit_fn(code):
        codes.append(code)
        exited.set()

    def stuck():  # a collective waiting for a peer that never comes
        assert exited.wait(10)
        return "released"

    assert run_with_deadline(stuck, 0.2, "the full-iteration CUDA graph capture (training)", 3,
                             exit_fn=exit_fn, stream=out) == "released"
    assert codes == [EXIT_STATUS]
    line = out.getvalue().strip()
    assert line.startswith("error: rank 3: the full-iteration CUDA graph capture (training) "
                           "did not finish within 0.2 s")
    assert "--fast-cuda-graph-capture-timeout" in line and len(line.splitlines()) == 1


def test_an_exception_passes_through_and_disarms_the_watch():
    from megagpt.train_step.capture_watchdog import run_with_deadline

    exits = []

    def fails():
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        run_with_deadline(fails, 0.1, "the capture", 0, exit_fn=exits.append)
    time.sleep(0.3)
    assert exits == []


def test_only_the_capturing_iteration_is_watched(monkeypatch):
    """megatron's wrapper captures at iteration ``cuda_graph_warmup_steps``: that call runs
    under the deadline, the warm-up and replay calls do not. (megatron's own __call__ needs a
    GPU; here it is stood in for by one that records which call ran under a watch.)"""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    from megagpt import megatron_wrappers
    from megagpt.train_step import capture_watchdog

    watched = []

    def inner(self, *args, **kwargs):
        watched.append(any(t.name == "megagpt-capture-watchdog" for t in threading.enumerate()))
        FullCudaGraphWrapper.curr_iteration["training"] += 1
        return "result"

    monkeypatch.setattr(FullCudaGraphWrapper, "__call__", inner)  # megatron's, stood in for
    monkeypatch.setattr(FullCudaGraphWrapper, "curr_iteration",
                        {"training": 0, "validation": 0})
    with capture_watchdog.deadline(0.2):  # off before monkeypatch puts megatron's back
        wrapper = object.__new__(FullCudaGraphWrapper)
        wrapper.cuda_graph_warmup_steps = 2
        for _ in range(4):
            assert wrapper(forward_only=False) == "result"
    assert megatron_wrappers.installed(FullCudaGraphWrapper, "__call__") == []
    assert watched == [False, False, True, False]


def test_the_deadline_is_undone_on_exit():
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    from megagpt import megatron_wrappers
    from megagpt.train_step import capture_watchdog

    original = FullCudaGraphWrapper.__call__
    with capture_watchdog.deadline(0.2):
        assert FullCudaGraphWrapper.__call__ is not original
        assert megatron_wrappers.original(FullCudaGraphWrapper, "__call__") is original
        assert megatron_wrappers.installed(FullCudaGraphWrapper, "__call__") == [
            capture_watchdog.__name__]
    assert FullCudaGraphWrapper.__call__ is original


GPU_TINY = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
    "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "2",
    "--global-batch-size", "2", "--train-iters", "8", "--lr", "1e-4", "--bf16",
    "--log-interval", "1", "--eval-iters", "0", "--transformer-impl", "local",
]


@pytest.mark.gpu
def test_gpu_a_capture_past_its_deadline_stops_the_run(tmp_path):
    """On one GPU the default path captures the full-iteration graph; with a deadline no
    capture can meet, the run stops with the watchdog's line instead of finishing."""
    from helpers import run_entry

    ok = run_entry(GPU_TINY, cwd=tmp_path, timeout=400)
    assert ok.returncode == 0, ok.stdout[-3000:]
    assert "capture must finish within 300 s" in ok.stdout
    stuck = run_entry([*GPU_TINY, "--fast-cuda-graph-capture-timeout", "0.001"], cwd=tmp_path,
                      timeout=400)
    assert stuck.returncode == 3, stuck.stdout[-3000:]
    assert "error: rank 0: the full-iteration CUDA graph capture (training) did not finish " \
           "within 0.001 s" in stuck.stdout

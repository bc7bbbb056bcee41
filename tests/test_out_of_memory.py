"""CUDA out of memory in training, as one line: the peak, the dry run's estimate for this
launch, and the knobs that lower it, largest saving first. On the CPU: the knobs (the dry
run's own estimate of each changed launch) and the line as training raises it; on a GPU: a
launch made too big on purpose, with and without megatron's memory snapshot."""

import contextlib
import io
import re

import pytest
import torch

from helpers import run_entry
from megagpt.launch import resolve
from megagpt.diagnostics import out_of_memory as oom
from megagpt.preflight import make_plan, memory_knobs

# The 1.3B shape of bench/benchmarks.md (24 x 2048 x 16, sequence 2048), bf16, on 8 GPUs
SHAPE_13B = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
             "--seq-length", "2048", "--max-position-embeddings", "2048", "--bf16",
             "--mock-data", "--lr", "1e-4", "--train-iters", "10"]


def validated(*flags, world_size=8):
    """The launch's plan: its arguments as training sees them (validated at its world size)
    and its choices."""
    launch = resolve([*flags, "--dry-run", "--dry-run-world-size", str(world_size),
                      "--gpu-type", "H200"])
    with contextlib.redirect_stdout(io.StringIO()):
        return make_plan(launch)


def test_the_knobs_are_the_dry_runs_estimates_of_the_changed_launch_largest_first():
    plan = validated(*SHAPE_13B, "--micro-batch-size", "8", "--global-batch-size", "64")
    base, knobs = memory_knobs.memory_knobs(plan.args, plan.runs)
    assert base == pytest.approx(memory_knobs.estimate_bytes(plan.args, plan.runs))
    flags = [k.flags for k in knobs]
    assert flags[0] == "--recompute-granularity full --recompute-method uniform " \
                       "--recompute-num-layers 1", flags  # activations dominate at mb 8
    assert set(flags) >= {"--micro-batch-size 4", "--use-distributed-optimizer",
                          "--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2"}
    savings = [k.saving(base) for k in knobs]
    assert savings == sorted(savings, reverse=True) and all(s > 0 for s in savings)
    # each is the estimate of the launch with that change, as the dry run would give it
    half = validated(*SHAPE_13B, "--micro-batch-size", "4", "--global-batch-size", "64")
    assert dict((k.flags, k.estimate_bytes) for k in knobs)["--micro-batch-size 4"] == \
        pytest.approx(memory_knobs.estimate_bytes(half.args, half.runs))

    # layouts that do not fit the GPUs are not offered (TP 8 × PP 2 on 8 GPUs), and where
    # nothing is left the line says so
    wide = validated(*SHAPE_13B, "--micro-batch-size", "1", "--global-batch-size", "8",
                     "--tensor-model-parallel-size", "8", "--use-distributed-optimizer",
                     "--recompute-granularity", "full", "--recompute-method", "uniform")
    assert memory_knobs.memory_knobs(wide.args, wide.runs)[1] == []
    line = oom.describe(torch.OutOfMemoryError("CUDA out of memory."), wide.args, 0, None,
                        2**30, None, memory_knobs.estimate_bytes(wide.args, wide.runs), [], None)
    assert "nothing the entry can change lowers the estimate on 8 GPUs: more GPUs" in line


OOM_MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
               "139.81 GiB of which 1.06 GiB is free. Of the allocated memory 130.12 GiB is "
               "allocated by PyTorch")


def test_the_line_names_peak_estimate_knobs_and_the_snapshot():
    plan = validated(*SHAPE_13B, "--micro-batch-size", "8", "--global-batch-size", "64")
    args = plan.args
    estimate, knobs = memory_knobs.memory_knobs(args, plan.runs)
    line = oom.describe(torch.OutOfMemoryError(OOM_MESSAGE), args, rank=3, iteration=0,
                        peak_bytes=130.5 * 2**30, capacity_bytes=139.81 * 2**30,
                        estimate=estimate, knobs=knobs, snapshot=None)
    assert line.startswith("CUDA out of memory at iteration 1 on rank 3: 130.50 GiB allocated "
                           "at the peak + the 2.00 GiB it asked for of 139.81 GiB; the dry "
                           f"run's estimate for this launch is {estimate / 2**30:.2f} GiB per "
                           "GPU"), line
    assert re.search(r"lower it with --recompute-granularity full --recompute-method uniform "
                     r"--recompute-num-layers 1 \(→ \d+\.\d\d GiB\), ", line), line
    assert line.endswith("--record-memory-history writes a snapshot of what was allocated at "
                         "the failure (torch's memory viewer reads it)")
    assert "\n" not in line


def test_training_that_runs_out_of_memory_stops_with_the_line(tmp_path):
    """diagnostics.active, as around pretrain: torch's error (also wrapped, as a compiled
    region raises it) becomes the entry's one-line error."""
    from functools import partial

    from megagpt import diagnostics
    from megagpt.diagnostics.settings import plan_diagnostics
    from megagpt.errors import UserError

    plan = validated(*SHAPE_13B, "--micro-batch-size", "8", "--global-batch-size", "64",
                     "--save", str(tmp_path), "--save-interval", "5")
    args = plan.args
    args.curr_iteration = 41
    knobs = partial(memory_knobs.memory_knobs, runs=plan.runs)  # as the entry hands it in
    for raised in (torch.OutOfMemoryError(OOM_MESSAGE),
                   RuntimeError("compiled region failed")):
        with pytest.raises(oom.OutOfMemory) as caught:
            with diagnostics.active(args, plan_diagnostics(args), knobs):
                if isinstance(raised, torch.OutOfMemoryError):
                    raise raised
                try:
                    raise torch.OutOfMemoryError(OOM_MESSAGE)
                except torch.OutOfMemoryError as cause:
                    raise raised from cause
        assert isinstance(caught.value, UserError)
        assert str(caught.value).startswith("CUDA out of memory at iteration 42 on rank 0")
        assert "lower it with --recompute-granularity full" in str(caught.value)


# ---------------------------------------------------------------------------
# On a GPU: a launch too big for it
# ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("history", [False, True], ids=["plain", "record-memory-history"])
def test_a_launch_too_big_for_the_gpu_stops_with_one_line(tmp_path, history):
    """The 1.3B shape at micro-batch 64: some 240 GiB per GPU by the dry run's count, on a
    GPU of 80-141 GiB."""
    flags = SHAPE_13B + ["--micro-batch-size", "64", "--global-batch-size", "64",
                         "--log-interval", "1", "--eval-iters", "0", "--train-iters", "3",
                         "--save", str(tmp_path / "ckpt"), "--save-interval", "100",
                         "--fast-compile", "off"]  # fails in its first forward, not after compiling
    if history:
        flags.append("--record-memory-history")
    out = run_entry(flags, cwd=tmp_path, timeout=600)
    text = out.stdout
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert out.returncode == 2 and len(errors) == 1, text[-4000:]
    (line,) = errors
    assert re.match(r"error: CUDA out of memory at iteration 1 on rank 0: \d+\.\d\d GiB "
                    r"allocated at the peak", line), line
    assert "the dry run's estimate for this launch is" in line
    assert "lower it with --recompute-granularity full" in line
    assert "--micro-batch-size 32" in line
    if history:
        snapshot = tmp_path / "ckpt" / "memory_snapshot_oom_rank-0.pickle"
        assert f"memory snapshot: {snapshot}" in line
        assert snapshot.stat().st_size > 0
    else:
        assert "--record-memory-history writes a snapshot" in line

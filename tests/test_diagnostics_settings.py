"""What a launch records for hangs and slow ranks, decided once from the parsed arguments:
the flight recorder's dumps in the run's folder, the collective timeout's policy (and its
value at the dry run's estimated step), the straggler report's threshold; the bad values
and megatron's ``--log-straggler`` as one ``error:`` line."""

import contextlib
import io
import os
import time

import pytest

import pretrain_gpt
from megagpt.launch import parse_arguments
from megagpt.diagnostics.settings import TimeoutPolicy, plan_diagnostics
from megagpt.diagnostics.timeouts import CollectiveTimeout

TINY = ["--cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "2", "--vocab-size", "512", "--lr", "1e-3", "--train-iters", "2"]


def parsed(*extra, environ=None):
    with contextlib.redirect_stdout(io.StringIO()):
        return parse_arguments([*TINY, *extra])


def test_the_recorder_dumps_into_the_runs_folder_with_python_frames(tmp_path):
    args = parsed("--save", str(tmp_path / "ckpt"), "--save-interval", "2")
    assert args.flight_recorder_dump_path == str(tmp_path / "ckpt" / "flight_recorder" / "rank_")
    assert args.flight_recorder_include_stack_trace  # the line names the calling frame
    plan = plan_diagnostics(args)  # asked again of the applied arguments: the same plan
    assert plan.dump_folder == str(tmp_path / "ckpt" / "flight_recorder")
    assert plan.timeout == TimeoutPolicy(600.0, 3, 120.0)
    assert plan.stragglers.threshold == pytest.approx(0.10) and plan.stragglers.window == 5

    assert parsed().flight_recorder_dump_path == os.path.join(".", "flight_recorder", "rank_")
    assert parsed("--no-flight-recorder").flight_recorder_dump_path is None
    # megatron's own flag: a directory gets megatron's prefix in it
    assert parsed("--flight-recorder-dump-path", str(tmp_path)).flight_recorder_dump_path == \
        str(tmp_path / "_dump_")


def test_the_environment_comes_first_as_megatron_has_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "mine_"))
    args = parsed()
    assert args.flight_recorder_dump_path is None  # megatron reads the variable itself
    assert plan_diagnostics(args).dump_prefix == str(tmp_path / "mine_")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")
    assert plan_diagnostics(args).dump_prefix is None


def test_the_collective_timeout_policy_from_the_flags():
    assert plan_diagnostics(parsed("--collective-timeout", "90")).timeout.fixed_s == 90
    off = plan_diagnostics(parsed("--collective-timeout", "off")).timeout
    assert not off.tightens and off.describe() == (
        "collective timeout: 10 min (--distributed-timeout-minutes) throughout")
    megatrons = plan_diagnostics(parsed("--distributed-timeout-seconds-after-init", "300"))
    assert not megatrons.timeout.tightens  # megatron applies its own after iteration 1
    auto = TimeoutPolicy(600.0, 3, 120.0)
    assert auto.after_warmup([0.5, 2.0]) == 120.0 and auto.after_warmup([30.0]) == 300.0
    assert auto.describe(0.35) == (
        "collective timeout: 10 min (--distributed-timeout-minutes) for the first 3 iterations "
        "of each launch, then max(120 s, 10 × the slowest warm step after the first) = 120 s "
        "at the estimated 0.35 s step")


@pytest.mark.parametrize("flags, message", [
    (["--collective-timeout", "soon"],
     "error: --collective-timeout soon: auto, off or a number of seconds above 0"),
    (["--collective-timeout-floor", "0"],
     "error: --collective-timeout-floor 0: a number of seconds above 0"),
    (["--collective-timeout-warmup-iters", "0"], "error: --collective-timeout-warmup-iters 0: "
     "at least 1"),
    (["--collective-timeout", "60", "--distributed-timeout-seconds-after-init", "60"],
     "error: --collective-timeout 60 and megatron's --distributed-timeout-seconds-after-init 60 "
     "both set the timeout after the first iterations: give one"),
    (["--straggler-threshold", "-5"], "error: --straggler-threshold -5: a percentage"),
    (["--log-straggler"], "error: --log-straggler: megatron's StragglerDetector times only the "
     "code an entry wraps in its start/stop calls"),
])
def test_bad_values_are_one_error_line(flags, message, capsys):
    assert pretrain_gpt.main([*TINY, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_the_dry_run_shows_the_timeout_at_the_estimated_step(capsys):
    argv = [a for a in TINY if a != "--cpu"] + [
        "--dry-run", "--global-batch-size", "8", "--gpu-type", "H200"]
    assert pretrain_gpt.main(argv) == 0
    out = capsys.readouterr().out
    assert "[megagpt] flight recorder: on, the last 2000 collectives of every process group; " \
           "a hang dumps them to ./flight_recorder/rank_<rank>" in out
    (line,) = [x for x in out.splitlines() if x.startswith("  collective timeout:")]
    assert line.endswith("= 120 s at the estimated " + line.split("estimated ")[1])
    assert "hangs:" in out.splitlines()


def test_memory_history_snapshots_go_into_the_runs_folder(tmp_path):
    args = parsed("--save", str(tmp_path), "--save-interval", "2", "--record-memory-history")
    assert args.memory_snapshot_path == str(tmp_path / "memory_snapshot.pickle")
    mine = parsed("--record-memory-history", "--memory-snapshot-path", "/x/s.pickle")
    assert mine.memory_snapshot_path == "/x/s.pickle"


def test_the_timeout_tightens_after_the_warm_up_and_relaxes_while_saving():
    """The timing of the hook; the timeout itself is set on real groups in test_hangs."""
    applied, lines = [], []
    timeout = CollectiveTimeout(TimeoutPolicy(600.0, 3, 0.2), lines.append, applied.append)
    for iteration in (1, 2, 3):  # the warm-up: the launch timeout stays
        assert applied == []
        time.sleep(0.05)
        timeout.iteration_done(iteration)
    assert len(applied) == 1 and 0.5 <= applied[0] <= 2.0  # 10 x a ~0.05 s iteration
    assert lines[0].startswith("collective timeout: ") and "from iteration 4" in lines[0]
    with timeout.relaxed():
        assert applied[-1] == 600.0 and timeout.in_save
    assert applied[-1] == applied[0] and not timeout.in_save
    timeout.iteration_done(4)
    assert len(applied) == 3  # once tightened, it stays


def test_a_resumed_launch_warms_up_again():
    applied = []
    timeout = CollectiveTimeout(TimeoutPolicy(600.0, 2, 5.0, fixed_s=30.0), lambda line: None,
                                applied.append)
    timeout.iteration_done(1001)  # the first iteration of a launch resumed at 1000
    assert applied == []
    timeout.iteration_done(1002)
    assert applied == [30.0]

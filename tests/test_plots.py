"""megagpt.run_log.plots: reading megatron's log text and TensorBoard scalars, and the PNG
command."""

import subprocess
import sys

import pytest

from helpers import REPO, TINY_MODEL, entry_env, parse_losses, run_entry
from megagpt.run_log import plots

LOG = """\
 [2026-11-29 09:04:21] iteration        1/      20 | consumed samples:            4 | elapsed time per iteration (ms): 985.4 | learning rate: 5.000000E-04 | global batch size:     4 | lm loss: 6.238687E+00 | loss scale: 1.0 |
 [2026-11-29 09:04:22] iteration        2/      20 | consumed samples:            8 | elapsed time per iteration (ms): 500.0 | throughput per GPU (TFLOP/s/GPU): 1.5 | learning rate: 1.000000E-03 | global batch size:     4 | lm loss: 6.100000E+00 |
validation loss at iteration 2 | lm loss value: 6.0 |
 [2026-11-29 09:04:23] iteration        2/      20 | consumed samples:            8 | elapsed time per iteration (ms): 400.0 | learning rate: 1.000000E-03 | global batch size:     4 | lm loss: 6.050000E+00 |
"""


def test_log_text_fields_and_the_last_line_for_an_iteration_wins(tmp_path):
    path = tmp_path / "train.log"
    path.write_text(LOG)
    run = plots.load_run(str(path))
    assert run.loss == {1: 6.238687, 2: 6.05}
    assert run.lr == {1: 5e-4, 2: 1e-3}
    assert run.tflops == {2: 1.5}
    assert run.samples_per_second() == {1: 4 / 0.9854, 2: 4 / 0.4}
    assert run.label == tmp_path.name  # a run's train.log is named after its folder


def test_tensorboard_scalars_as_megatron_writes_them(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    for step in (1, 2, 3):
        writer.add_scalar("lm loss", 7.0 - step, step)
        writer.add_scalar("learning-rate", 1e-3 * step, step)
        writer.add_scalar("iteration-time", 0.5, step)  # seconds
        writer.add_scalar("batch-size", 8, step)
    writer.close()
    run = plots.load_run(str(tmp_path / "tb"), "tb")
    assert run.loss == {1: 6.0, 2: 5.0, 3: 4.0}
    assert run.lr[2] == pytest.approx(2e-3)
    assert run.samples_per_second() == {1: 16.0, 2: 16.0, 3: 16.0}


def test_missing_or_empty_runs_are_user_errors(tmp_path, capsys):
    (tmp_path / "empty.log").write_text("no iterations here\n")
    assert plots.main([str(tmp_path / "nope.log"), "--out", str(tmp_path / "x.png")]) == 2
    assert "nope.log: no such file" in capsys.readouterr().err
    assert plots.main([str(tmp_path / "empty.log"), "--out", str(tmp_path / "x.png")]) == 2
    assert "no training iterations found" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_plot_command_draws_a_real_tiny_run_from_its_log_and_tensorboard(tmp_path):
    tb = tmp_path / "tensorboard"
    result = run_entry([*TINY_MODEL, "--train-iters", "5", "--tensorboard-dir", str(tb),
                        "--log-throughput", "--log-timers-to-tensorboard"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    (tmp_path / "train.log").write_text(result.stdout)
    out = tmp_path / "runs.png"
    cmd = subprocess.run(
        [sys.executable, str(REPO / "tools" / "plot_runs.py"), str(tmp_path / "train.log"),
         str(tb), "--labels", "log", "tensorboard", "--out", str(out)],
        env=entry_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert cmd.returncode == 0, cmd.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    from_log = plots.load_run(str(tmp_path / "train.log"))
    from_tb = plots.load_run(str(tb))
    assert from_log.loss == pytest.approx(parse_losses(result.stdout))
    assert sorted(from_tb.loss) == [1, 2, 3, 4, 5]
    assert from_tb.loss == pytest.approx(from_log.loss, rel=1e-5)
    assert from_log.tflops and from_tb.tflops  # --log-throughput, in both sources
    assert "log: iterations 1..5" in cmd.stdout and f"wrote {out}" in cmd.stdout

"""End to end: pretrain_gpt.py --cpu trains a tiny model through megatron.training.pretrain,
saves at iteration 10, and a resumed run reproduces iterations 11-20 exactly."""

import pytest

from helpers import TINY_MODEL, parse_losses, run_entry

pytestmark = pytest.mark.slow

ITERS = ["--train-iters", "20"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = run_entry([*TINY_MODEL, *ITERS], cwd=tmp_path_factory.mktemp("full"))
    assert out.returncode == 0, out.stdout[-3000:]
    return out


@pytest.fixture(scope="module")
def stopped_and_resumed(tmp_path_factory):
    work = tmp_path_factory.mktemp("resume")
    ckpt = str(work / "ckpt")
    first = run_entry([*TINY_MODEL, *ITERS, "--save", ckpt, "--save-interval", "10",
                       "--exit-interval", "10"], cwd=work)
    assert first.returncode == 0, first.stdout[-3000:]
    second = run_entry([*TINY_MODEL, *ITERS, "--save", ckpt, "--save-interval", "10",
                        "--load", ckpt], cwd=work)
    assert second.returncode == 0, second.stdout[-3000:]
    return first, second


def test_tiny_model_trains_and_its_loss_falls(uninterrupted):
    losses = parse_losses(uninterrupted.stdout)
    assert sorted(losses) == list(range(1, 21))
    first, last = sum(losses[i] for i in range(1, 6)) / 5, sum(losses[i] for i in range(16, 21)) / 5
    assert last < first - 0.2, (first, last)


def test_log_says_what_was_adapted_and_which_path_ran(uninterrupted):
    log = uninterrupted.stdout
    assert "[megagpt] installed: transformer-engine=no" in log
    assert ("[megagpt] compat: layers: megatron's local modules (the fast spec where it "
            "applies): Transformer Engine is not installed") in log
    assert "[megagpt] layer spec: " in log
    assert "> compiling dataset index builder" in log and "No targets specified" not in log


def test_resume_from_iteration_10_reproduces_11_to_20_exactly(uninterrupted, stopped_and_resumed):
    first, second = stopped_and_resumed
    full = parse_losses(uninterrupted.stdout)
    before, after = parse_losses(first.stdout), parse_losses(second.stdout)
    assert sorted(before) == list(range(1, 11))
    assert sorted(after) == list(range(11, 21))
    assert {i: before[i] for i in before} == {i: full[i] for i in range(1, 11)}
    assert after == {i: full[i] for i in range(11, 21)}


def test_bad_flags_are_one_line_errors_not_tracebacks(tmp_path):
    out = run_entry(["--cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "64",
                     "--num-attention-heads", "4", "--seq-length", "64",
                     "--max-position-embeddings", "64", "--micro-batch-size", "2",
                     "--train-iters", "2", "--bf16"], cwd=tmp_path)
    assert out.returncode == 2
    assert "error: CPU mode (--cpu) cannot run with: --bf16" in out.stdout
    assert "Traceback" not in out.stdout

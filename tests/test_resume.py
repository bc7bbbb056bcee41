"""Resume fidelity: stopped at N/2 and relaunched, a run logs the uninterrupted losses.

One uninterrupted run and one run stopped at N/2 (``--exit-interval``) and relaunched
with the very same command (``--save`` = ``--load``), dropout on so that the random-number
state matters, in deterministic CPU mode.
"""

import json
from types import SimpleNamespace

import pytest
import yaml

from helpers import TINY_MODEL, parse_losses, run_entry

N = 12
HALF = N // 2
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("resume")
    base = TINY_MODEL + DROPOUT + ["--train-iters", str(N)]
    ckpt = work / "ckpt"
    same_command = base + ["--save", str(ckpt), "--load", str(ckpt),
                           "--save-interval", str(HALF), "--exit-interval", str(HALF)]
    full = run_entry(base, cwd=work)
    first = run_entry(same_command, cwd=work)
    second = run_entry(same_command, cwd=work)
    for proc in (full, first, second):
        assert proc.returncode == 0, proc.stdout[-3000:]
    return SimpleNamespace(ckpt=ckpt, full=full.stdout, first=first.stdout,
                           second=second.stdout)


@pytest.mark.slow
def test_first_launch_starts_fresh_and_says_so(runs):
    assert "starting from scratch" in runs.first
    assert f"loading {runs.ckpt}/iter_{HALF:07d}" in runs.second


@pytest.mark.slow
def test_resumed_losses_equal_uninterrupted(runs):
    full = parse_losses(runs.full)
    first, second = parse_losses(runs.first), parse_losses(runs.second)
    assert sorted(full) == list(range(1, N + 1))
    assert sorted(first) == list(range(1, HALF + 1))
    assert sorted(second) == list(range(HALF + 1, N + 1))
    # Exact: same code, same seeds, deterministic mode; dropout draws from the restored RNG.
    assert {**first, **second} == full


@pytest.mark.slow
def test_checkpoint_holds_full_training_state(runs):
    from torch.distributed.checkpoint import FileSystemReader

    ckpt_dir = runs.ckpt / f"iter_{HALF:07d}"
    assert json.loads((ckpt_dir / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    keys = set(FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata)
    assert "embedding.word_embeddings.weight" in keys  # model
    assert any(k.startswith("optimizer.state.exp_avg.") for k in keys)  # Adam moments
    # RNG states, and the common state: iteration, scheduler, args (consumed samples).
    assert any(k.startswith("rng_state") for k in keys)
    assert any(k.startswith("common_state") for k in keys)
    snapshot = yaml.safe_load((ckpt_dir / "megagpt_config.yaml").read_text())
    assert snapshot["entry"]["iteration"] == HALF
    assert snapshot["entry"]["consumed_train_samples"] == HALF * 4  # global batch 4
    assert snapshot["entry"]["model"]["hidden_size"] == 64
    assert snapshot["container"]["checkpoint"]["save_interval"] == HALF


@pytest.fixture(scope="module")
def async_runs(runs, tmp_path_factory):
    """The stopped-and-relaunched pair again, saving with --async-save (megatron's own
    writer in its persistent process; nvidia-resiliency-ext is not installed here)."""
    work = tmp_path_factory.mktemp("resume_async")
    ckpt = work / "ckpt"
    same_command = TINY_MODEL + DROPOUT + [
        "--train-iters", str(N), "--save", str(ckpt), "--load", str(ckpt), "--async-save",
        "--save-interval", str(HALF), "--exit-interval", str(HALF)]
    first = run_entry(same_command, cwd=work)
    second = run_entry(same_command, cwd=work)
    for proc in (first, second):
        assert proc.returncode == 0, proc.stdout[-3000:]
        assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    return SimpleNamespace(ckpt=ckpt, full=runs.full, first=first.stdout, second=second.stdout)


@pytest.mark.slow
def test_async_save_resumes_with_the_uninterrupted_losses(async_runs):
    from megagpt.resilience.checkpoint_guard import incompleteness

    first = async_runs.first
    assert first.count("async save: megatron's own writer (--async-strategy mcore) in a "
                       "persistent writer process") == 1
    assert f"scheduled an async checkpoint save at iteration {HALF:7d}" in first
    ckpt_dir = async_runs.ckpt / f"iter_{HALF:07d}"
    for iteration in (HALF, N):  # saved by each launch, finalized before it exited
        assert incompleteness(str(async_runs.ckpt / f"iter_{iteration:07d}")) is None
    assert (async_runs.ckpt / "latest_checkpointed_iteration.txt").read_text() == str(N)
    # the snapshot is written when the asynchronous save is finalized
    snapshot = yaml.safe_load((ckpt_dir / "megagpt_config.yaml").read_text())
    assert snapshot["entry"]["iteration"] == HALF
    assert f"loading {ckpt_dir}" in async_runs.second
    full = parse_losses(async_runs.full)
    assert {**parse_losses(first), **parse_losses(async_runs.second)} == full


def test_first_iteration_on_a_log_boundary_resets_the_accumulators(monkeypatch):
    """Megatron leaves the first iteration's loss in the accumulator; on a boundary that
    makes the next logged loss the mean of two iterations (Megatron-LM#6237)."""
    import inspect

    from megatron.training import global_vars
    from megatron.training import training as mtraining

    from megagpt.resilience import fidelity

    assert fidelity.TRAINING_LOG_NEEDLE in inspect.getsource(mtraining.training_log), \
        "megatron changed training_log: check whether the first-iteration wrapper is still needed"

    seen = []

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                     report_memory_flag, skipped_iter, grad_norm, params_norm,
                     num_zeros_in_grad, max_attention_logit, pg_collection=None,
                     is_first_iteration=False, **kw):
        seen.append((iteration, is_first_iteration))

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", SimpleNamespace(log_interval=10))
    wrapped = fidelity.first_log_boundary_resets(training_log)
    common = ({}, {}, 1e-3)
    rest = (1.0, True, 0, 1.0, None, None, None)
    wrapped(*common, 11, *rest, is_first_iteration=True)  # first after resume at 10
    wrapped(*common, 20, *rest, is_first_iteration=True)  # first, and on a boundary
    wrapped(*common, 21, *rest, is_first_iteration=False)
    assert seen == [(11, True), (20, False), (21, False)]


def test_building_data_iterators_draws_no_random_numbers():
    import torch

    from megagpt.resilience import fidelity

    def build():
        # What DataLoader.__iter__ does for its worker base seed.
        return torch.empty((), dtype=torch.int64).random_().item()

    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    fidelity.without_drawing_random_numbers(build)()
    assert torch.equal(torch.rand(3), expected)
    torch.manual_seed(0)
    build()
    assert not torch.equal(torch.rand(3), expected)  # unwrapped, it does draw

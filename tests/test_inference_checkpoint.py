"""Finding the checkpoint a --load names, and replaying its saved flags on one device."""

import pytest

from megagpt.inference import model_flags
from megagpt.inference.checkpoint import CheckpointError, checkpoint_folder

# A training command line as the trainer saves it (--config already expanded).
SAVED = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
         "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
         "--sequence-parallel", "--bf16", "--use-distributed-optimizer",
         "--save", "/ckpt", "--load", "/ckpt", "--save-interval", "1000",
         "--tensorboard-dir", "/tb", "--swiglu", "--rotary-base=500000",
         "--recompute-granularity", "full", "--recompute-method", "uniform",
         "--data-path", "0.5", "/data/a", "0.5", "/data/b", "--cpu",
         "--position-embedding-type", "rope", "--lr", "3e-4"]


def test_launch_flags_and_their_values_are_dropped_and_the_model_flags_kept():
    assert model_flags.without_launch_flags(SAVED) == [
        "--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
        "--swiglu", "--rotary-base=500000", "--data-path", "0.5", "/data/a", "0.5", "/data/b",
        "--position-embedding-type", "rope", "--lr", "3e-4"]


def test_the_layers_that_ran_and_the_fast_paths_options_are_the_launchs_not_the_models():
    """Which layers ran, today's fast-path options and an earlier version's (refused by
    today's parser) are left out: the replay chooses for this machine."""
    saved = ["--num-layers", "2", "--transformer-impl", "transformer_engine",
             "--fast-cuda-graphs", "iteration", "--fast-disable", "hash-dropout,grad-write",
             "--fast-compile=on", "--no-fast-spec", "--fast-multi-gpu-path",
             "--fast-cuda-graph-capture-timeout", "60",
             "--no-fast-hash-dropout", "--fast-cuda-graph", "--swiglu"]
    assert model_flags.without_launch_flags(saved) == ["--num-layers", "2", "--swiglu"]


def test_the_device_flags_and_then_the_overrides_come_last():
    from megagpt.inference.checkpoint import SavedConfig

    saved = SavedConfig({"argv": SAVED}, {})
    argv = model_flags.replay_argv(saved, cpu=True, bf16=True, overrides=["--num-layers", "2"])
    tail = argv[-8:]
    assert tail == ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                    "--no-fast-spec", "--cpu", "--num-layers", "2"]
    assert "--bf16" not in argv


def test_options_nobody_knows_are_listed():
    assert model_flags.unknown_flags(["--num-layers", "2", "--nmu-layers", "3", "7"]) == \
        ["--nmu-layers"]


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "no such directory"),
    (lambda p: p.write_text("x"), "not a directory"),
    (lambda p: p.mkdir(), "no checkpoint there (no latest_checkpointed_iteration.txt, no "
                          "iter_* folders)"),
])
def test_a_load_without_a_checkpoint_is_one_line_naming_it(tmp_path, make, message):
    path = tmp_path / "ckpt"
    make(path)
    with pytest.raises(CheckpointError) as caught:
        checkpoint_folder(str(path))
    assert str(caught.value).startswith(f"--load {path}: {message}")


def test_a_run_folder_whose_checkpoints_are_all_incomplete_says_why(tmp_path):
    (tmp_path / "iter_0000010").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    with pytest.raises(CheckpointError, match=r"no complete checkpoint \(iter_0000010: "
                                              r"metadata.json is missing"):
        checkpoint_folder(str(tmp_path))


def test_a_flag_megatron_cannot_parse_is_its_one_line():
    with pytest.raises(model_flags.ModelFlagsError) as caught:
        model_flags.parse_model_args(["--num-layers", "two", "--cpu"], cpu=True)
    assert str(caught.value) == "--num-layers two: not a whole number"

"""--config FILE.yaml: shapes that load, the command line winning, clear errors."""

import pytest

from megagpt import launch
from megagpt.command_line import config_file

TINY = ["--cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "5"]


def test_mapping_to_argv_rules():
    argv = config_file.mapping_to_argv({
        "num-layers": 12, "--hidden-size": 768, "num_attention_heads": 12,
        "bf16": True, "fp16": False, "load": None, "data-path": [0.7, "a", 0.3, "b"]})
    assert argv == ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
                    "--bf16", "--data-path", "0.7", "a", "0.3", "b"]


def test_upstream_model_args_file_loads_as_it_is(tmp_path):
    path = tmp_path / "model_config.yaml"
    path.write_text("ENV_VARS:\n  CUDA_DEVICE_MAX_CONNECTIONS: 1\n"
                    "MODEL_ARGS:\n  --num-layers: 12\n  --hidden-size: 512\n")
    argv, source = config_file.expand_config_file(["--config", str(path), "--lr", "1e-4"])
    assert source == str(path)
    assert argv == ["--num-layers", "12", "--hidden-size", "512", "--lr", "1e-4"]


def test_command_line_overrides_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("num-layers: 12\nhidden-size: 128\nnum-attention-heads: 4\n")
    args = launch.parse_arguments(["--config", str(path), *TINY])
    assert args.num_layers == 2  # from the command line, after the file
    assert args.hidden_size == 64
    args = launch.parse_arguments([*TINY[:2], "--config", str(path), *TINY[6:]])
    assert args.num_layers == 12 and args.hidden_size == 128  # from the file


@pytest.mark.parametrize("text, message", [
    ("num-layers: [unclosed", "not valid YAML"),
    ("- just\n- a list\n", "expected a mapping"),
    ("num-layerz: 3\n", r"line 1: num-layerz: unknown option \(did you mean num-layers\?\)"),
])
def test_bad_config_files_name_the_file_and_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(config_file.ConfigFileError, match=message) as info:
        launch.parse_arguments(["--config", str(path), *TINY])
    assert str(path) in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(config_file.ConfigFileError, match="no such file"):
        launch.parse_arguments(["--config", str(tmp_path / "nope.yaml"), *TINY])

"""A misspelled option or a bad value: one line naming it, where it was given (the command
line, or the --config file's line and key) and the closest options, megatron's and the
entry's; from the option list of an earlier parse before torch is imported."""

import os
import subprocess
import sys

import pytest

from helpers import ENTRY, entry_env
from megagpt import launch
from megagpt.command_line import arguments
from megagpt.command_line import option_errors
from megagpt.command_line.option_errors import OptionCache, OptionError

TINY = ["--cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "5",
        "--lr", "1e-3"]


def refused(argv) -> str:
    with pytest.raises(OptionError) as caught:
        launch.parse_arguments(argv)
    return str(caught.value)


@pytest.fixture(scope="module")
def options():
    """What the entry's full parser takes, as the early check reads it from the cache."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    arguments.add_entry_arguments(parser)
    return option_errors.describe_options(parser)


def test_a_misspelled_option_on_the_command_line(options):
    expected = ("--hiden-size: unknown option (did you mean --hidden-size?); pretrain_gpt.py "
                "--help lists them all")
    assert refused([*TINY, "--hiden-size", "128"]) == expected
    assert option_errors.early_problem([*TINY, "--hiden-size", "128"], options, None, []) == \
        expected
    # an entry option and an underscore spelling are found too
    assert "(did you mean --dry-run?)" in refused([*TINY, "--dryrun"])
    assert "(did you mean --num-layers?)" in refused([*TINY, "--num_layers", "3"])


def test_a_misspelled_key_in_the_config_file_names_the_file_and_line(tmp_path, options):
    config = tmp_path / "run.yaml"
    config.write_text("# model\nnum-layers: 2\nhiden-size: 64\n")
    expected = f"--config {config}, line 3: hiden-size: unknown option (did you mean hidden-size?)"
    with pytest.raises(arguments.ConfigFileError) as caught:
        launch.parse_arguments(["--config", str(config), *TINY[6:]])
    assert str(caught.value) == expected
    argv, _ = arguments.expand_config_file(["--config", str(config), *TINY[6:]])
    assert option_errors.early_problem(argv, options, str(config), argv[:4]) == expected
    config.write_text("MODEL_ARGS:\n  --num-layers: 2\n  --hiden_size: 64\n")  # upstream's shape
    with pytest.raises(arguments.ConfigFileError, match=r"line 3: --hiden_size: unknown option "
                                                        r"\(did you mean --hidden-size\?\)"):
        launch.parse_arguments(["--config", str(config), *TINY[6:]])


@pytest.mark.parametrize("where", ["file", "command line"])
def test_a_bad_value_names_the_flag_and_where_it_was_given(tmp_path, options, where):
    config = tmp_path / "run.yaml"
    config.write_text("num-layers: 2\nnum-attention-heads: four\n" if where == "file"
                      else "num-layers: 2\n")
    cli = [] if where == "file" else ["--num-attention-heads", "four"]
    argv = ["--config", str(config), *TINY[2:4], *TINY[6:8], *TINY[10:], *cli]
    expected = (f"--config {config}, line 2: num-attention-heads: four: not a whole number"
                if where == "file" else "--num-attention-heads four: not a whole number")
    assert refused(argv) == expected
    expanded, _ = arguments.expand_config_file(argv)
    file_argv = expanded[:len(expanded) - len(argv) + 2]
    assert option_errors.early_problem(expanded, options, str(config), file_argv) == expected


def test_a_value_that_is_not_one_of_the_choices(options):
    expected = ("--lr-decay-style cosin: not one of constant, linear, cosine, "
                "inverse-square-root, WSD (did you mean cosine?)")
    assert refused([*TINY, "--lr-decay-style", "cosin"]) == expected
    assert option_errors.early_problem([*TINY, "--lr-decay-style", "cosin"], options, None,
                                       []) == expected
    assert refused([*TINY, "--seq-length"]) == "--seq-length needs one value after it"


def test_the_option_list_is_kept_per_install_and_read_back(tmp_path, options):
    cache = OptionCache(tmp_path)
    assert cache.read() is None
    cache.write(options)
    assert cache.read() == options and cache.path().parent == tmp_path


def test_a_misspelled_option_is_one_line_and_the_second_time_torch_is_not_imported(tmp_path):
    """The first launch parses in full (and keeps the option list); the second one names the
    option before importing torch and megatron (Python's -X importtime lists the imports).
    Neither prints argparse's usage."""
    env = entry_env({"MEGAGPT_CACHE_DIR": str(tmp_path / "cache")})
    for attempt in ("full parse", "early"):
        out = subprocess.run([sys.executable, "-X", "importtime", str(ENTRY), *TINY,
                              "--hiden-size", "128"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr[-3000:]
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert errors == ["error: --hiden-size: unknown option (did you mean --hidden-size?); "
                          "pretrain_gpt.py --help lists them all"], attempt
        assert "usage:" not in out.stdout + out.stderr
        imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()
                    if line.startswith("import time:")}
        assert ("torch" in imported) == (attempt == "full parse"), attempt
    assert len(os.listdir(tmp_path / "cache" / "options")) == 1

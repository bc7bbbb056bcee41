"""megagpt.command_line.arguments: what the command line must say, and --help."""

import pytest

from megagpt import launch
from megagpt.command_line import arguments
from megagpt.errors import UserError

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
         "--train-iters", "2"]


def test_help_lists_megatron_and_entry_options(capsys):
    # megatron 0.19's own --help crashes on a bare '%' in one help text; ours must not.
    with pytest.raises(SystemExit) as info:
        launch.parse_arguments(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "megagpt entry" in out and "--num-layers" in out and "--no-fast-spec" in out


def test_real_data_needs_a_tokenizer():
    with pytest.raises(arguments.ArgumentError, match="--tokenizer-type is required"):
        launch.parse_arguments([*MODEL, "--cpu", "--data-path", "corpus_text_document"])


def test_mock_data_and_dry_runs_default_to_a_null_tokenizer():
    for extra in (["--mock-data"], ["--dry-run"]):
        args = launch.parse_arguments([*MODEL, "--cpu", *extra])
        assert args.tokenizer_type == "NullTokenizer" and args.vocab_size == 50257


def test_learning_rate_is_required_before_any_work():
    args = launch.parse_arguments([*MODEL, "--cpu", "--mock-data"])
    with pytest.raises(arguments.ArgumentError, match="--lr is required"):
        arguments.validate_arguments(args, device_arch=0)


def test_megatron_assertions_become_argument_errors():
    args = launch.parse_arguments([*MODEL, "--cpu", "--mock-data", "--lr", "1e-3",
                                      "--global-batch-size", "3"])
    with pytest.raises(arguments.ArgumentError, match="invalid arguments"):
        arguments.validate_arguments(args, device_arch=0)


@pytest.mark.parametrize("flag", ["--hybrid-layer-pattern", "--hybrid-override-pattern"])
def test_a_hybrid_mamba_pattern_is_refused_before_it_can_set_the_depth(flag):
    # megatron's validate_args would take the pattern's four layers for --num-layers
    with pytest.raises(arguments.ArgumentError, match=f"{flag} M\\*M\\*: .*hybrid Mamba"):
        launch.parse_arguments([*MODEL, "--cpu", "--mock-data", "--lr", "1e-3", flag,
                                   "M*M*"])


def test_spec_local_is_megatrons_local_spec_and_satisfies_attention_backend_local():
    # megatron's --spec help: "To use local spec specify local as the argument"
    args = launch.parse_arguments([*MODEL, "--cpu", "--mock-data", "--lr", "1e-3",
                                      "--spec", "local", "--attention-backend", "local"])
    assert args.spec == ["local"] and args.transformer_impl == "local"
    assert args.attention_backend.name == "local"


def test_spec_local_with_transformer_engine_named_is_refused():
    from types import SimpleNamespace

    from megagpt.compat import Installed
    from megagpt.launch.layers import transformer_impl

    te = Installed(transformer_engine=True, apex=False, fused_layer_norm=False,
                   masked_softmax_kernels=False, gradient_accumulation_kernels=False)
    args = SimpleNamespace(spec=["local"], transformer_impl="transformer_engine")
    with pytest.raises(UserError, match="--spec local asks for megatron's local modules"):
        transformer_impl(args, {"--transformer-impl"}, te)
    assert transformer_impl(args, set(), te)[0] == "local"

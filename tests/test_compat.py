"""Compatibility with what is installed: adaptations, explicit requests, the Makefile step."""

import argparse

import pytest

from megagpt import compat

NOTHING = compat.Installed(transformer_engine=False, apex=False, fused_layer_norm=False,
                           masked_softmax_kernels=False, gradient_accumulation_kernels=False)
EVERYTHING = compat.Installed(transformer_engine=True, apex=True, fused_layer_norm=True,
                              masked_softmax_kernels=True, gradient_accumulation_kernels=True)


def megatron_defaults(argv=()):
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return parser.parse_args(list(argv))


def test_plain_install_adapts_the_five_settings_with_one_line_each():
    args, lines = megatron_defaults(), []
    compat.adapt_args_to_installed(args, [], NOTHING, lines.append)
    assert args.transformer_impl == "local"
    assert args.no_persist_layer_norm is True
    assert args.masked_softmax_fusion is False
    assert args.gradient_accumulation_fusion is False
    assert len(lines) == 4 and all(line.startswith("compat: ") for line in lines)


def test_nothing_changes_when_everything_is_installed():
    args, lines = megatron_defaults(), []
    compat.adapt_args_to_installed(args, [], EVERYTHING, lines.append)
    assert args.transformer_impl == "transformer_engine" and lines == []


def test_explicit_transformer_engine_request_without_te_is_a_clear_error():
    argv = ["--transformer-impl", "transformer_engine"]
    with pytest.raises(compat.MissingDependencyError, match="Transformer Engine is not installed"):
        compat.adapt_args_to_installed(megatron_defaults(argv), argv, NOTHING, print)


def test_detect_reports_this_environment():
    installed = compat.Installed.detect()
    assert "transformer-engine=" in installed.summary()


def test_dataset_helper_compilation_is_skipped_when_the_extension_is_prebuilt():
    import megatron.core.datasets.utils as dataset_utils
    from megatron.core.datasets import helpers_cpp  # noqa: F401  (the wheel ships it)

    from megagpt import megatron_wrappers

    compat.skip_dataset_helper_compilation()
    compat.skip_dataset_helper_compilation()  # once is enough: the second changes nothing
    dataset_utils.compile_helpers()  # would run `make` and sys.exit(1) without the skip
    assert megatron_wrappers.installed(dataset_utils, "compile_helpers") == ["megagpt.compat"]


def test_sequence_parallelism_without_te_or_apex_needs_the_fast_spec():
    """megatron's torch norm asserts on --sequence-parallel while building the model; the
    fast spec's norms serve it, so only a run without the fast spec is refused, early."""
    flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]

    def plain_install(extra=(), **attrs):
        args = megatron_defaults(flags + list(extra))
        compat.adapt_args_to_installed(args, flags, NOTHING, lambda line: None)
        for name, value in attrs.items():
            setattr(args, name, value)
        return args

    compat.check_required_packages(plain_install(), NOTHING)  # the fast spec serves it
    moe = plain_install(["--num-experts", "4", "--disable-bias-linear"])
    for args in (plain_install(fast_spec=False), moe):
        with pytest.raises(compat.MissingDependencyError, match="--sequence-parallel without"):
            compat.check_required_packages(args, NOTHING)
        compat.check_required_packages(args, EVERYTHING)  # TE's or apex's norms serve it


def test_settings_megatrons_torch_norm_and_local_experts_cannot_run_are_refused_early():
    args = megatron_defaults(["--apply-layernorm-1p"])
    with pytest.raises(compat.MissingDependencyError, match="--apply-layernorm-1p needs"):
        compat.check_required_packages(args, NOTHING)
    compat.check_required_packages(args, EVERYTHING)
    args = megatron_defaults(["--num-experts", "4"])  # megatron's default: linear biases on
    with pytest.raises(compat.MissingDependencyError, match="--disable-bias-linear"):
        compat.check_required_packages(args, NOTHING)
    compat.check_required_packages(args, EVERYTHING)
    compat.check_required_packages(megatron_defaults(["--num-experts", "4",
                                                      "--disable-bias-linear"]), NOTHING)
    args = megatron_defaults(["--fp8-format", "hybrid"])
    with pytest.raises(compat.MissingDependencyError, match="--fp8-format hybrid needs"):
        compat.check_required_packages(args, NOTHING)
    compat.check_required_packages(args, EVERYTHING)


def test_rerun_mode_spelling_of_megatrons_parser_reaches_its_enum():
    from megatron.core.rerun_state_machine import RerunMode

    args, lines = megatron_defaults(["--rerun-mode", "report_stats"]), []
    compat.adapt_megatron_quirks(args, lines.append)
    assert RerunMode(args.rerun_mode) is RerunMode.REPORT_DETERMINISM_STATS and len(lines) == 1


def test_context_parallelism_without_transformer_engine_is_refused_early():
    args = megatron_defaults(["--context-parallel-size", "2"])
    with pytest.raises(compat.MissingDependencyError, match="--context-parallel-size 2 needs"):
        compat.check_required_packages(args, NOTHING)
    compat.check_required_packages(args, EVERYTHING)  # with TE it is fine

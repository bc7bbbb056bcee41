"""Compatibility with what is installed: adaptations, explicit requests, the Makefile step."""

import argparse
import inspect
import re

import pytest

from megagpt import compat
from megagpt.errors import UserError
from megagpt.launch import fp8, installed as launch_installed, layers, megatron_quirks

NOTHING = compat.Installed(transformer_engine=False, apex=False, fused_layer_norm=False,
                           masked_softmax_kernels=False, gradient_accumulation_kernels=False)
EVERYTHING = compat.Installed(transformer_engine=True, apex=True, fused_layer_norm=True,
                              masked_softmax_kernels=True, gradient_accumulation_kernels=True)


def stepped(step, args, flags=(), installed=NOTHING, lines=None):
    """``args`` as one step of the launch's resolution decides them (the planner's view),
    its log lines appended to ``lines``."""
    from megagpt.flags import explicit_flags
    from megagpt.launch.planner import Planner

    p = Planner(args, frozenset(explicit_flags(flags)), installed)
    step(p)
    if lines is not None:
        lines.extend(p.lines)
    return p.v


def adapt_to_installed(p):
    """The launch's compat steps that adapt to what is installed: the layers, then the
    settings that need what is missing."""
    layers.choose_transformer_impl(p)
    launch_installed.adapt_to_installed(p)


def check_required_packages(args, installed):
    """The launch's compat refusals: what nothing installed rescues, and FP8 nothing here
    runs."""
    launch_installed.check_required_packages(args, installed)
    fp8.refuse_what_cannot_run(args, installed)


def megatron_defaults(argv=()):
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return parser.parse_args(list(argv))


def test_plain_install_adapts_the_five_settings_with_one_line_each():
    args, lines = megatron_defaults(), []
    args = stepped(adapt_to_installed, args, [], NOTHING, lines)
    assert args.transformer_impl == "local"
    assert args.no_persist_layer_norm is True
    assert args.masked_softmax_fusion is False
    assert args.gradient_accumulation_fusion is False
    assert len(lines) == 4 and all(line.startswith("compat: ") for line in lines)


def test_rope_fusion_is_turned_off_without_transformer_engine_and_megatron_needs_it():
    """megatron's fused RoPE is TE's kernel only: without TE its TransformerConfig refuses
    the default of every RoPE model, so the launch turns it off, with its line."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    rope = ["--position-embedding-type", "rope"]
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                          apply_rope_fusion=megatron_defaults(rope).apply_rope_fusion)
    # learned positions: megatron's validate_args clears it itself
    for argv, installed, fused in ((rope, NOTHING, False), (rope, TE_WITHOUT_APEX, True),
                                   (["--use-rotary-position-embeddings"], NOTHING, False),
                                   ([], NOTHING, True)):
        lines = []
        args = stepped(adapt_to_installed, megatron_defaults(argv), argv, installed,
                       lines)
        assert args.apply_rope_fusion is fused, (argv, installed)
        said = [line for line in lines if "RoPE" in line]
        assert said == ([] if fused else
                        ["compat: fused RoPE needs Transformer Engine's kernels; "
                         "--no-rope-fusion"])
        if not fused:
            TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                              apply_rope_fusion=args.apply_rope_fusion)  # builds


TE_WITHOUT_APEX = compat.Installed(transformer_engine=True, apex=False, fused_layer_norm=False,
                                   masked_softmax_kernels=False,
                                   gradient_accumulation_kernels=False)


def test_with_everything_installed_only_the_layers_are_chosen():
    args, lines = megatron_defaults(), []
    args = stepped(adapt_to_installed, args, [], EVERYTHING, lines)
    assert args.transformer_impl == "local"  # the fast spec: no model parallelism
    assert args.gradient_accumulation_fusion and args.masked_softmax_fusion
    assert len(lines) == 1 and "fast spec measured faster" in lines[0]


# (flags, installed) -> megatron's --transformer-impl, and a word of the logged reason
LAYER_CHOICES = [
    ([], NOTHING, "local", "not installed"),
    ([], TE_WITHOUT_APEX, "local", "measured faster"),
    (["--cpu"], TE_WITHOUT_APEX, "local", "--cpu"),
    (["--transformer-impl", "transformer_engine"], TE_WITHOUT_APEX, "transformer_engine",
     "as given"),
    (["--transformer-impl", "local"], TE_WITHOUT_APEX, "local", "as given"),
    (["--tensor-model-parallel-size", "2"], TE_WITHOUT_APEX, "transformer_engine",
     "tensor x pipeline parallel 2 x 1"),
    (["--pipeline-model-parallel-size", "4"], TE_WITHOUT_APEX, "transformer_engine",
     "1 x 4"),
    (["--fp8-format", "hybrid", "--bf16"], TE_WITHOUT_APEX, "local",
     "FP8 linears measured faster than TE's FP8"),
    (["--fp8-format", "hybrid"], TE_WITHOUT_APEX, "transformer_engine", "add --bf16"),
    (["--fp8-format", "hybrid", "--bf16", "--fp8-recipe", "mxfp8"], TE_WITHOUT_APEX,
     "transformer_engine", "--fp8-recipe mxfp8"),
    (["--fp8-format", "hybrid", "--bf16", "--tensor-model-parallel-size", "2"],
     TE_WITHOUT_APEX, "transformer_engine", "FP8 under tensor or pipeline parallelism"),
    (["--context-parallel-size", "2"], TE_WITHOUT_APEX, "transformer_engine",
     "context parallelism"),
    (["--multi-latent-attention"], TE_WITHOUT_APEX, "transformer_engine", "multi-latent"),
    (["--num-experts", "4"], TE_WITHOUT_APEX, "transformer_engine", "MoE"),
    (["--window-size", "128,0"], TE_WITHOUT_APEX, "transformer_engine", "sliding-window"),
    (["--apply-layernorm-1p"], TE_WITHOUT_APEX, "transformer_engine", "layernorm-1p"),
    # the fast spec's norms are torch's, which have no zero-centred gamma
    (["--apply-layernorm-1p"], EVERYTHING, "transformer_engine", "layernorm-1p"),
]


@pytest.mark.parametrize("flags,installed,impl,why", LAYER_CHOICES,
                         ids=[" ".join(f) or "defaults" for f, *_ in LAYER_CHOICES])
def test_layers_are_chosen_by_what_is_installed_and_the_layout(flags, installed, impl, why):
    from megagpt.command_line.fast_path_options import add_fast_path_arguments

    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    parser.add_argument("--cpu", action="store_true")
    add_fast_path_arguments(parser)
    args, lines = parser.parse_args(flags), []
    args = stepped(adapt_to_installed, args, flags, installed, lines)
    assert args.transformer_impl == impl
    assert why in lines[0], lines[0]


def test_no_fast_spec_with_te_installed_keeps_megatrons_default_layers():
    from megagpt.command_line.fast_path_options import add_fast_path_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    from megatron.training.arguments import add_megatron_arguments

    add_megatron_arguments(parser)
    add_fast_path_arguments(parser)
    args = parser.parse_args(["--no-fast-spec"])
    args = stepped(adapt_to_installed, args, ["--no-fast-spec"], TE_WITHOUT_APEX, None)
    assert args.transformer_impl == "transformer_engine"


def test_gradient_accumulation_fusion_follows_the_kernels_really_there():
    """TE's layers fuse it with their own kernels; megatron's linear layers need apex's
    fused_weight_gradient_mlp_cuda, which TE does not provide."""
    def adapted(flags, installed):
        args, lines = megatron_defaults(flags), []
        args = stepped(adapt_to_installed, args, flags, installed, lines)
        return args, lines

    te_layers, lines = adapted(["--transformer-impl", "transformer_engine"], TE_WITHOUT_APEX)
    assert te_layers.gradient_accumulation_fusion  # for TE's layers
    assert launch_installed.te_layers_fuse_wgrad_alone(te_layers, TE_WITHOUT_APEX)
    assert sum("gradient-accumulation fusion in Transformer Engine's layers" in line
               for line in lines) == 1
    fast, lines = adapted([], TE_WITHOUT_APEX)  # the fast spec: megatron's linears only
    assert not fast.gradient_accumulation_fusion
    assert any("needs apex's fused_weight_gradient_mlp_cuda" in line for line in lines)
    assert not launch_installed.te_layers_fuse_wgrad_alone(fast, TE_WITHOUT_APEX)
    with_apex, _ = adapted(["--transformer-impl", "transformer_engine"], EVERYTHING)
    assert with_apex.gradient_accumulation_fusion
    assert not launch_installed.te_layers_fuse_wgrad_alone(with_apex, EVERYTHING)


def test_megatrons_linears_build_without_the_missing_wgrad_kernel():
    """Under TE's layers without apex, a model's megatron ColumnParallelLinear (the output
    layer) is built with gradient-accumulation fusion off; megatron's own __init__ refuses
    it otherwise. The model's config keeps the setting for TE's layers."""
    from megatron.core.tensor_parallel import layers

    from megatron.core.transformer import TransformerConfig

    from gloo_ranks import single_gloo_rank
    from megagpt import megatron_wrappers

    assert not layers._grad_accum_fusion_available  # no apex here
    with single_gloo_rank():
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                                   use_cpu_initialization=True,
                                   gradient_accumulation_fusion=True)
        build = dict(config=config, init_method=lambda w: None, bias=False)
        with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
            layers.ColumnParallelLinear(8, 16, **build)
        with compat.megatron_linears_without_wgrad_fusion():
            column = layers.ColumnParallelLinear(8, 16, **build)
            row = layers.RowParallelLinear(16, 8, input_is_parallel=True, skip_bias_add=False,
                                           **build)
        for cls in (layers.ColumnParallelLinear, layers.RowParallelLinear):
            assert megatron_wrappers.installed(cls, "__init__") == []  # undone on exit
    assert not column.gradient_accumulation_fusion and not row.gradient_accumulation_fusion
    assert config.gradient_accumulation_fusion  # TE's layers still read it
    assert column.config is config


def test_the_launch_builds_megatrons_linears_without_wgrad_fusion_only_under_te_without_apex():
    from megagpt.flags import explicit_flags
    from megagpt.launch.planner import Planner

    def chosen(flags, installed):
        p = Planner(megatron_defaults(flags), frozenset(explicit_flags(flags)), installed)
        adapt_to_installed(p)
        return p.chosen(launch_installed.MEGATRON_LINEARS_WGRAD) is not None

    assert chosen(["--transformer-impl", "transformer_engine"], TE_WITHOUT_APEX)
    assert not chosen([], TE_WITHOUT_APEX)  # the fast spec: megatron's linears, fusion off
    assert not chosen(["--transformer-impl", "transformer_engine"], EVERYTHING)


def test_explicit_transformer_engine_request_without_te_is_a_clear_error():
    argv = ["--transformer-impl", "transformer_engine"]
    with pytest.raises(compat.MissingDependencyError, match="Transformer Engine is not installed"):
        stepped(adapt_to_installed, megatron_defaults(argv), argv, NOTHING, None)


def test_detect_reports_this_environment():
    installed = compat.Installed.detect()
    assert "transformer-engine=" in installed.summary()


def test_dataset_helper_compilation_is_skipped_when_the_extension_is_prebuilt():
    import megatron.core.datasets.utils as dataset_utils
    from megatron.core.datasets import helpers_cpp  # noqa: F401  (the wheel ships it)

    from megagpt import megatron_wrappers

    megatrons = dataset_utils.compile_helpers
    with compat.dataset_helpers_prebuilt():
        dataset_utils.compile_helpers()  # would run `make` and sys.exit(1) without the skip
        assert megatron_wrappers.installed(dataset_utils, "compile_helpers") == ["megagpt.compat"]
    assert dataset_utils.compile_helpers is megatrons


def test_sequence_parallelism_without_te_or_apex_needs_the_fast_spec():
    """megatron's torch norm asserts on --sequence-parallel while building the model; the
    fast spec's norms serve it, so only a run without the fast spec is refused, early."""
    flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]

    def plain_install(extra=(), **attrs):
        args = megatron_defaults(flags + list(extra))
        for name, value in attrs.items():
            setattr(args, name, value)
        return stepped(adapt_to_installed, args, flags, NOTHING)

    def refusal(args, installed):
        fast = layers.layer_path(args)[0] is layers.LayerPath.FAST
        return launch_installed.sequence_parallel_norms_missing(args, installed, fast)

    assert refusal(plain_install(), NOTHING) is None  # the fast spec serves it
    moe = plain_install(["--num-experts", "4", "--disable-bias-linear"])
    for args in (plain_install(fast_spec=False), moe):
        assert "--sequence-parallel without" in str(refusal(args, NOTHING))
        assert refusal(args, EVERYTHING) is None  # TE's or apex's norms serve it


def test_settings_megatrons_torch_norm_and_local_experts_cannot_run_are_refused_early():
    args = megatron_defaults(["--apply-layernorm-1p"])
    with pytest.raises(compat.MissingDependencyError, match="--apply-layernorm-1p needs"):
        check_required_packages(args, NOTHING)
    check_required_packages(args, EVERYTHING)
    check_required_packages(megatron_defaults(["--num-experts", "4",
                                                      "--disable-bias-linear"]), NOTHING)
    # FP8: the fast spec's linears run it without TE; what they cannot run needs TE's
    check_required_packages(megatron_defaults(["--fp8-format", "hybrid", "--bf16"]),
                                   NOTHING)
    for flags, attrs, needle in (
            (["--fp8-recipe", "mxfp8"], {}, "--fp8-recipe mxfp8"),
            (["--num-experts", "4", "--disable-bias-linear"], {}, "MoE experts"),
            (["--recompute-activations"], {}, "activation recompute"),
            ([], {"fast_spec": False}, "--no-fast-spec")):  # the entry's own option
        args = megatron_defaults(["--fp8-format", "hybrid", "--bf16", *flags])
        vars(args).update(attrs)
        with pytest.raises(compat.MissingDependencyError,
                           match=f"--fp8-format hybrid: the fast spec's FP8 linears cannot run "
                                 f"this launch \\(.*{re.escape(needle)}.*Transformer Engine's FP8"):
            check_required_packages(args, NOTHING)
        check_required_packages(args, EVERYTHING)  # TE's FP8 layers run it


@pytest.mark.parametrize("flags, attrs, needle", [
    ([], {"gpu_type": "A100-80GB"}, "A100-80GB (--gpu-type) has no FP8 tensor cores"),
    ([], {"cpu": True}, "FP8 needs a GPU with FP8 tensor cores"),
    (["--hidden-size", "72", "--num-attention-heads", "4"], {},
     "--hidden-size is 72, not a multiple of 16"),
    (["--seq-length", "36", "--max-position-embeddings", "36", "--micro-batch-size", "1"], {},
     "tokens per micro-batch (--seq-length x --micro-batch-size) is 36"),
])
def test_fp8_where_no_layers_can_run_it_is_refused_with_or_without_te(flags, attrs, needle):
    args = megatron_defaults(["--fp8-format", "hybrid", "--bf16", *flags])
    vars(args).update(attrs)  # the entry's own options
    for installed in (NOTHING, EVERYTHING):
        with pytest.raises(UserError, match=re.escape(needle)):
            check_required_packages(args, installed)


def _sequential_experts_step(args):
    """A forward and backward of megatron's SequentialMLP (two experts, megatron's linears)
    as ``args`` configure its biases and fusions, with autograd on, on the CPU."""
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_parts import cpu_megatron

    config = _megatron_mlp_config(args, num_moe_experts=2)
    with cpu_megatron():
        experts = SequentialMLP(2, config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                         linear_fc2=RowParallelLinear),
                                pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        tokens = torch.randn(6, 32, requires_grad=True)
        output, _ = experts(tokens, torch.tensor([4, 2]), torch.rand(6))
        output.sum().backward()
        return tokens.grad


def test_moe_experts_with_linear_biases_are_refused_unless_te_groups_them():
    """megatron's sequential experts stop at the first step on their own biases (run here
    as the refusal says), so a launch with them is refused before anything is built, with or
    without Transformer Engine; TE's grouped experts (``--moe-grouped-gemm`` under TE's
    layers) add the bias out of place and are let through."""
    import torch

    biased = megatron_defaults(["--num-experts", "4"])  # megatron's default: linear biases on
    # the GeLU fusion off, as launched
    biased = stepped(megatron_quirks.adapt_megatron_quirks, biased)
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        _sequential_experts_step(biased)
    assert torch.isfinite(_sequential_experts_step(
        megatron_defaults(["--num-experts", "4", "--disable-bias-linear"]))).all()

    with pytest.raises(compat.MissingDependencyError,
                       match="--num-experts 4 with linear biases needs Transformer Engine"):
        check_required_packages(megatron_defaults(["--num-experts", "4"]), NOTHING)
    for installed in (EVERYTHING, TE_WITHOUT_APEX):
        with pytest.raises(UserError, match="needs --moe-grouped-gemm .*Add "
                           "--moe-grouped-gemm, or --disable-bias-linear"):
            check_required_packages(megatron_defaults(["--num-experts", "4"]), installed)
        with pytest.raises(UserError, match="drop --transformer-impl local"):
            check_required_packages(megatron_defaults(
                ["--num-experts", "4", "--moe-grouped-gemm", "--transformer-impl", "local"]),
                installed)
        spec_local = megatron_defaults(["--num-experts", "4", "--moe-grouped-gemm",
                                        "--spec", "local"])
        spec_local.transformer_impl = "local"  # as the launch chooses for --spec local
        with pytest.raises(UserError, match="and drop --spec local, or"):
            check_required_packages(spec_local, installed)
        check_required_packages(
            megatron_defaults(["--num-experts", "4", "--moe-grouped-gemm"]), installed)
    with pytest.raises(compat.MissingDependencyError, match="needs Transformer Engine"):
        check_required_packages(
            megatron_defaults(["--num-experts", "4", "--moe-grouped-gemm"]), NOTHING)


def test_te_grouped_experts_with_biases_run_without_megatrons_bias_dropout_fusion():
    """megatron's TEGroupedMLP asserts on its bias-dropout fusion where the experts have
    biases; that default goes, with a line, only there."""
    from megatron.core.transformer.moe import experts

    args, lines = megatron_defaults(["--num-experts", "4", "--moe-grouped-gemm"]), []
    args = stepped(megatron_quirks.adapt_megatron_quirks, args, lines=lines)
    assert args.bias_dropout_fusion is False and args.bias_gelu_fusion is False
    assert lines[-1].startswith("compat: --no-bias-dropout-fusion: Transformer Engine's grouped")
    assert "bias_dropout_fusion is not supported in TEGroupedMLP" in inspect.getsource(
        experts.TEGroupedMLP.__init__)  # the assertion this answers, in the installed megatron
    for argv in (["--num-experts", "4"], ["--num-experts", "4", "--moe-grouped-gemm",
                                          "--disable-bias-linear"],
                 ["--num-experts", "4", "--moe-grouped-gemm", "--transformer-impl", "local"]):
        args = megatron_defaults(argv)
        args = stepped(megatron_quirks.adapt_megatron_quirks, args, lines=None)
        assert args.bias_dropout_fusion is True, argv


def test_grouped_gemm_under_megatrons_local_modules_is_said_to_run_sequential_experts():
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.experts import SequentialMLP

    # what megatron builds for the flag without TE's modules
    spec = get_moe_module_spec(use_te=False, num_experts=4, moe_grouped_gemm=True)
    assert spec.keywords["submodules"].experts.func is SequentialMLP
    args, lines = megatron_defaults(["--num-experts", "4", "--moe-grouped-gemm",
                                     "--disable-bias-linear", "--transformer-impl", "local"]), []
    args = stepped(megatron_quirks.adapt_megatron_quirks, args, lines=lines)
    assert any("--moe-grouped-gemm under megatron's local modules" in line and
               "SequentialMLP" in line for line in lines)
    args, lines = megatron_defaults(["--num-experts", "4", "--moe-grouped-gemm",
                                     "--disable-bias-linear", "--transformer-impl",
                                     "transformer_engine"]), []
    args = stepped(megatron_quirks.adapt_megatron_quirks, args, lines=lines)
    assert not any("--moe-grouped-gemm" in line for line in lines)


def test_rerun_mode_spelling_of_megatrons_parser_reaches_its_enum():
    from megatron.core.rerun_state_machine import RerunMode

    args, lines = megatron_defaults(["--rerun-mode", "report_stats"]), []
    args = stepped(megatron_quirks.adapt_megatron_quirks, args, lines=lines)
    assert RerunMode(args.rerun_mode) is RerunMode.REPORT_DETERMINISM_STATS and len(lines) == 1


def _megatron_mlp_config(args, **extra):
    """megatron's TransformerConfig for ``args``' MLP, as megatron's
    ``core_transformer_config_from_args`` maps the activation flags."""
    import torch.nn.functional as F
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        add_bias_linear=args.add_bias_linear,
        # which megatron's args-to-config step drops where the linears have no bias
        bias_activation_fusion=args.bias_gelu_fusion and args.add_bias_linear,
        activation_func=squared_relu if args.squared_relu else F.gelu,
        use_cpu_initialization=True, **extra)


def test_squared_relu_runs_without_the_bias_gelu_fusion_megatron_refuses_with_it():
    args = megatron_defaults(["--squared-relu"])
    with pytest.raises(ValueError, match="bias_activation_fusion"):
        _megatron_mlp_config(args)  # megatron's own check, as launched before
    lines = []
    args = stepped(megatron_quirks.adapt_megatron_quirks, args, lines=lines)
    assert args.bias_gelu_fusion is False and lines == [
        "compat: --no-bias-gelu-fusion: megatron fuses a bias only into GeLU, SwiGLU and "
        "quick-GeGLU (--squared-relu)"]
    _megatron_mlp_config(args)


def test_moe_experts_with_biases_run_without_the_fusion_megatron_stops_at_the_first_step():
    """megatron's experts pass the router's probabilities to each expert's MLP, whose fused
    bias-GeLU path raises on them: the MLP megatron builds for an expert, run on the CPU."""
    import torch
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from megatron_parts import cpu_megatron

    def expert_forward(args):
        config = _megatron_mlp_config(args, num_moe_experts=4)
        mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                        linear_fc2=RowParallelLinear), is_expert=True,
                  ffn_hidden_size=64)
        tokens, probs = torch.randn(6, 32), torch.rand(6)
        return mlp(tokens, per_token_scale=probs)[0]

    args = megatron_defaults(["--num-experts", "4"])
    with cpu_megatron():
        with pytest.raises(ValueError, match="per_token_scale"):
            expert_forward(args)
        lines = []
        args = stepped(megatron_quirks.adapt_megatron_quirks, args, lines=lines)
        assert args.bias_gelu_fusion is False and len(lines) == 1
        # past the activation now; in training megatron's MLP then adds the expert's bias in
        # place to its row-parallel linear's output, a view, which autograd refuses (these
        # experts are refused at launch: the test above); TE's grouped experts, which the
        # launch lets through, add it out of place. The activation's values, without autograd:
        with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
            expert_forward(args)
        with torch.no_grad():
            assert torch.isfinite(expert_forward(args)).all()
    # where megatron can fuse it, the fusion stays: dense GeLU, MoE with SwiGLU or no biases
    for argv in ([], ["--num-experts", "4", "--swiglu"],
                 ["--num-experts", "4", "--disable-bias-linear"]):
        args, lines = megatron_defaults(argv), []
        args = stepped(megatron_quirks.adapt_megatron_quirks, args, lines=lines)
        assert args.bias_gelu_fusion is True and lines == [], argv


def test_context_parallelism_without_transformer_engine_is_refused_early():
    args = megatron_defaults(["--context-parallel-size", "2"])
    with pytest.raises(compat.MissingDependencyError, match="--context-parallel-size 2 needs"):
        check_required_packages(args, NOTHING)
    check_required_packages(args, EVERYTHING)  # with TE it is fine

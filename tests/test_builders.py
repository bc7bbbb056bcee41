"""The launch's layer-spec choice, built by gpt_builders and model_provider, on real megatron
objects."""

import pytest
import torch

import gpt_builders
import model_provider
from gloo_ranks import single_gloo_rank
from megagpt import cpu_mode, launch
from megagpt.command_line import arguments

TINY = ["--cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
        "--vocab-size", "128", "--lr", "1e-3"]


def choose(*extra, installed=None):
    return gpt_builders.LayerSpecChoice.of(launch.resolve([*TINY, *extra], installed))


def resolved(*extra):
    """(the launch's written arguments, validated, with megatron's globals set; the launch)."""
    resolved_launch = launch.resolve([*TINY, *extra])
    args = launch.write(resolved_launch)
    arguments.validate_arguments(args, device_arch=0)
    arguments.set_megatron_globals(args)
    return args, resolved_launch


def test_default_without_transformer_engine_is_the_fast_spec():
    assert choose().path is gpt_builders.LayerPath.FAST


def test_no_fast_spec_falls_back_to_local_and_says_why():
    choice = choose("--no-fast-spec")
    assert choice.path is gpt_builders.LayerPath.LOCAL
    assert "--no-fast-spec" in choice.describe()


def test_experts_use_the_moe_block_spec():
    assert choose("--num-experts", "4", "--disable-bias-linear").path is gpt_builders.LayerPath.MOE_BLOCK


def test_user_spec_is_left_to_megatron():
    choice = choose("--spec", "megatron.core.models.gpt.gpt_layer_specs",
                    "get_gpt_layer_local_spec")
    assert choice.path is gpt_builders.LayerPath.USER_SPEC


def test_spec_local_is_megatrons_local_spec_not_a_module_to_import():
    choice = choose("--spec", "local")
    assert choice.path is gpt_builders.LayerPath.LOCAL and "--spec local" in str(choice.reason)


def test_transformer_engine_spec_when_selected():
    from megagpt.compat import Installed

    te = Installed(transformer_engine=True, apex=False, fused_layer_norm=False,
                   masked_softmax_kernels=False, gradient_accumulation_kernels=False)
    on_a_gpu = [flag for flag in TINY if flag != "--cpu"]
    choice = gpt_builders.LayerSpecChoice.of(launch.resolve(
        [*on_a_gpu, "--transformer-impl", "transformer_engine"], te))
    assert choice.path is gpt_builders.LayerPath.TRANSFORMER_ENGINE


@pytest.fixture()
def one_rank():
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.global_vars import unset_global_variables

    with single_gloo_rank(), cpu_mode.active():
        model_parallel_cuda_manual_seed(1234)
        yield
        unset_global_variables()  # set by the test through set_megatron_globals


@pytest.mark.parametrize("extra", [[], ["--no-fast-spec"],
                                   ["--spec", "local", "--attention-backend", "local"]],
                         ids=["fast", "local", "spec-local"])
def test_model_provider_builds_a_stage_that_runs(one_rank, extra):
    import pretrain_gpt

    args, resolved_launch = resolved(*extra)
    model_config, _, choice = pretrain_gpt.build_configs(args, resolved_launch)
    model = model_provider.model_provider(model_config)
    tokens = torch.randint(0, 128, (2, 32))
    positions = torch.arange(32).repeat(2, 1)
    losses = model(tokens, positions, None, labels=tokens)
    assert losses.shape == (2, 32) and torch.isfinite(losses).all()
    assert choice.path == (gpt_builders.LayerPath.LOCAL if extra else gpt_builders.LayerPath.FAST)
    core = type(model.decoder.layers[0].self_attention.core_attention).__name__
    assert core == ("DotProductAttention" if extra else "SDPADotProductAttention")


def test_the_local_spec_ends_in_its_own_norm_where_megatrons_block_would_take_tes(
        one_rank, monkeypatch):
    """Where TE imports, megatron's block takes TE's norm as the final norm of any layer spec
    it is given; TE's norm needs a GPU, so a ``--cpu`` run of the local spec (generating
    from a checkpoint trained under TE's layers, say) stopped there. A stand-in that refuses
    to run is bound where TE's norm would be: the model must not build it."""
    import pretrain_gpt
    from megatron.core.transformer import transformer_block

    class NormNeedingAGpu(torch.nn.Module):
        def __init__(self, *a, **k):
            raise AssertionError("the final norm was megatron's block-level choice")

    monkeypatch.setattr(transformer_block, "LayerNormImpl", NormNeedingAGpu)
    args, resolved_launch = resolved("--no-fast-spec")
    model_config, _, choice = pretrain_gpt.build_configs(args, resolved_launch)
    model = model_provider.model_provider(model_config)
    assert choice.path is gpt_builders.LayerPath.LOCAL
    layer_norm = type(model.decoder.layers[0].input_layernorm)
    assert type(model.decoder.final_layernorm) is layer_norm
    tokens = torch.randint(0, 128, (2, 32))
    losses = model(tokens, torch.arange(32).repeat(2, 1), None, labels=tokens)
    assert torch.isfinite(losses).all()

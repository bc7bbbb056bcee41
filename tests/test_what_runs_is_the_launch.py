"""What runs is what the launch says: for every CPU row of the flag matrix (tests/flag_matrix.py)
that trains, the launch is resolved and written as the entry does, megatron validates it, and
inside the launch's one context of megatron changes the model's layer spec, its loss, the
optimizer class megatron will build, the CUDA-graph mode megatron runs and the gradient-write
mode are compared with the launch's choices. A row of one process also builds its model stage
(megatron's GPTModel on the CPU) and checks its layers and its output layer."""

from __future__ import annotations

import pytest

import flag_matrix
from gloo_ranks import single_gloo_rank
from megatron_parts import megatron_changes_in_place

# the rows the matrix trains on a plain install (a refused row never builds anything)
ROWS = [row for row in flag_matrix.ROWS if row.expected_refusal(te_installed=False) is None]

GPT2_VOCABULARY = 50257  # the rows that name GPT-2's BPE files


@pytest.fixture(scope="module")
def one_rank():
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megagpt import cpu_mode

    with single_gloo_rank():
        with cpu_mode.active():
            model_parallel_cuda_manual_seed(1234)
        yield


def _te_installed() -> bool:
    from megagpt.compat import Installed

    return Installed.detect().transformer_engine


def _resolved(row, monkeypatch):
    """(the launch of ``row`` on the CPU, its validated arguments), as ``pretrain_gpt.main``
    makes them; the data placeholders stay names (nothing here reads data)."""
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    from megagpt.command_line import arguments
    from megagpt.launch import resolve, write

    monkeypatch.setenv("WORLD_SIZE", str(row.nproc))
    monkeypatch.setenv("RANK", "0")
    launch = resolve(flag_matrix.launch_flags(row, "cpu", {}))
    args = write(launch)  # into os.environ, as the entry's (the test's is restored after)
    arguments.validate_arguments(args, device_arch=0)
    if args.padded_vocab_size is None:  # megatron pads it with its globals' tokenizer: GPT-2's
        args.padded_vocab_size = calculate_padded_vocab_size(
            args.vocab_size or GPT2_VOCABULARY, args.make_vocab_size_divisible_by,
            args.tensor_model_parallel_size, logging_enabled=False)
    return launch, args


def _built_layers(block_spec):
    """(layer path, the fused layer's options or None) of a decoder block spec, read from the
    modules it builds."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megagpt.fast_spec.attention import SDPADotProductAttention
    from megagpt.fast_spec.layer import FastTransformerLayer
    from megagpt.launch.layers import LayerPath

    layer = block_spec.layer_specs[0]
    fused = layer.params.get("fused_options") if layer.module is FastTransformerLayer else None
    mlp = layer.submodules.mlp
    if getattr(mlp, "module", getattr(mlp, "func", None)) is MoELayer:  # a spec or a partial
        return LayerPath.MOE_BLOCK, fused
    core = layer.submodules.self_attention.submodules.core_attention
    if isinstance(core, type) and issubclass(core, SDPADotProductAttention):
        return LayerPath.FAST, fused
    assert core is DotProductAttention, core
    return LayerPath.LOCAL, fused


@pytest.mark.skipif("_te_installed()", reason="the CPU rows as a plain install resolves them")
@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_what_is_built_and_installed_is_what_the_launch_says(row, one_rank, monkeypatch):
    import megatron.core.optimizer as mopt
    import megatron.training.training as mtraining

    from megagpt import gpt_model, megatron_wrappers
    from megagpt.fast_spec.lm_loss import fused_lm_head_loss, fused_lm_head_unsupported_reason
    from megagpt.launch import fast_path as chosen
    from megagpt.launch.cuda_graphs import CUDA_GRAPH, NAN_CHECK, NanCheck
    from megagpt.launch.layers import LAYERS
    from megagpt.launch.megatron_changes import launched
    from megagpt.launch.optimizer_kernels import ASYNC_STEP, OPTIMIZER, OptimizerKernels
    from megagpt.train_step import grad_write
    from megagpt.train_step.optimizer import torch_fused_adam

    launch, args = _resolved(row, monkeypatch)
    model_config, layers = gpt_model.gpt_model_config(args, launch)
    assert layers.path is launch[LAYERS]

    # the graph mode megatron runs (validated), and the loss the forward step hands the model
    assert args.cuda_graph_impl == launch[CUDA_GRAPH].megatron_impl
    loss = gpt_model.output_processor(launch)
    if launch[chosen.LM_LOSS] is chosen.LmLoss.CHUNKED:
        assert loss.func is fused_lm_head_loss
        assert loss.keywords["grad_in_forward"] is launch[chosen.LM_GRAD_IN_FORWARD]
        assert loss.keywords["compile_kernels"] is launch[chosen.COMPILE]
    else:
        assert loss is None

    megatrons_adam = mopt.Adam
    with launched(launch, args):
        # the layer spec, as megatron's GPTModelBuilder asks for it
        vp_stage = 0 if args.virtual_pipeline_model_parallel_size else None
        built, fused = _built_layers(model_config.transformer_layer_spec(model_config,
                                                                          vp_stage=vp_stage))
        assert built is launch[LAYERS]
        assert (fused is not None) is launch[chosen.FUSED_LAYER]
        if fused is not None:
            assert fused.compile is launch[chosen.COMPILE]
            assert fused.hash_dropout is launch[chosen.HASH_DROPOUT]
        # the optimizer class megatron builds, its step, the gradient buffer's mode
        fused_adam = launch[OPTIMIZER].fused
        assert (mopt.Adam is torch_fused_adam) is fused_adam
        assert (mopt.Adam is megatrons_adam) is (not fused_adam)
        wrapping_setup = megatron_wrappers.installed(mtraining, "setup_model_and_optimizer")
        assert ("megagpt.train_step.flat_adam" in wrapping_setup) is (
            launch[OPTIMIZER] is OptimizerKernels.FLAT_ADAMW)
        assert ("megagpt.train_step.async_step" in wrapping_setup) is launch[ASYNC_STEP]
        assert grad_write.grad_write_enabled() is launch[chosen.GRAD_WRITE]
        assert ("megagpt.resilience.divergence" in megatron_wrappers.installed(
            mtraining, "train_step")) is (launch[NAN_CHECK] is NanCheck.GRADIENT_NORM)
        if row.nproc == 1:  # this process is the whole layout: the stage itself
            model = gpt_model.build_stage(model_config)
            layer = model.decoder.layers[0]
            assert (type(layer).__name__ == "FastTransformerLayer") is (fused is not None)
            if loss is not None:  # the chunked loss takes this output layer, not megatron's
                assert fused_lm_head_unsupported_reason(model.output_layer,
                                                        model_config.transformer) is None
    assert megatron_changes_in_place() == []  # and all of it undone

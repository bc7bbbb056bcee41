"""Per-layer CUDA graphs holding the fused layer (``--fast-cuda-graphs layers``, megatron's
``--cuda-graph-impl local``) and the one-GPU stand-in for several GPUs
(``--fast-multi-gpu-path``): which runs take them, what they refuse, how the fused layer
behaves under megatron's graph manager, and (GPU) that graphed training gives the losses of
the eager layers."""

from __future__ import annotations

import pytest
import torch

from megatron_parts import fast_path_namespace

from megagpt.fast_spec import grad_marks


def _resolved(argv=(), **attrs):
    from megagpt.launch.fast_path import apply_fast_path_defaults

    args = fast_path_namespace(argv, **attrs)
    lines: list[str] = []
    apply_fast_path_defaults(args, lines.append)
    return args, lines


# ---------------------------------------------------------------------------------------
# which runs take per-layer graphs
# ---------------------------------------------------------------------------------------
def test_data_parallel_launches_take_layer_graphs_with_the_compiled_layer():
    args, lines = _resolved(world_size=8, micro_batch_size=8, global_batch_size=512,
                            use_distributed_optimizer=True)
    assert not args.fast_cuda_graph and args.fast_layer_graphs
    assert args.cuda_graph_impl == "local" and args.fast_spec_compile is True
    # summed across ranks and accumulated: neither the bf16 buffer nor written gradients
    assert not args.fast_bf16_grad_buffer and not args.fast_grad_write
    assert any("per-layer CUDA graphs" in line or "captured as CUDA graphs" in line
               for line in lines), lines


def test_in_step_nan_checks_give_way_to_the_norm_check_unless_kept():
    args, lines = _resolved(world_size=8)
    assert args.cuda_graph_impl == "local" and not args.check_for_nan_in_loss_and_grad
    assert any("in-step NaN/Inf checks off" in line for line in lines), lines
    args, _ = _resolved(["--fast-disable", "deferred-nan-checks"], world_size=8)
    assert args.cuda_graph_impl == "local" and args.check_for_nan_in_loss_and_grad
    args, _ = _resolved(["--fast-cuda-graphs", "none"], world_size=8)
    assert args.check_for_nan_in_loss_and_grad  # megatron's default without graphs


def test_one_gpu_keeps_the_full_iteration_graph():
    args, _ = _resolved()
    assert args.cuda_graph_impl == "full_iteration" and not args.fast_layer_graphs


def test_multi_gpu_path_on_one_gpu_resolves_as_two_data_parallel_ranks():
    """The measuring switch: one GPU takes exactly the path of a data-parallel launch."""
    one, _ = _resolved(["--fast-multi-gpu-path"], use_distributed_optimizer=True,
                       global_batch_size=64)
    several, _ = _resolved([], world_size=2, use_distributed_optimizer=True,
                           global_batch_size=64)
    names = ("fast_cuda_graph", "fast_layer_graphs", "cuda_graph_impl", "fast_spec_compile",
             "fast_bf16_grad_buffer", "fast_grad_write", "grad_reduce_in_bf16")
    assert {n: getattr(one, n) for n in names} == {n: getattr(several, n) for n in names}
    assert one.cuda_graph_impl == "local"
    # at one micro-batch per step too: the bf16 buffer and writing need one rank
    one, lines = _resolved(["--fast-multi-gpu-path"])
    assert not one.fast_cuda_graph and not one.fast_bf16_grad_buffer and not one.fast_grad_write
    assert any("more than one GPU" in line for line in lines), lines


@pytest.mark.parametrize("attrs,needle", [
    ({"tensor_model_parallel_size": 2}, "tensor parallelism"),
    ({"pipeline_model_parallel_size": 2}, "pipeline parallelism"),
])
def test_model_parallel_layouts_leave_layer_graphs_off_unless_asked(attrs, needle):
    args, lines = _resolved(world_size=4, **attrs)
    assert not args.fast_layer_graphs and args.cuda_graph_impl == "none"
    assert args.fast_spec_compile is False  # eager without a graph
    assert any("per-layer CUDA graphs off" in line and needle in line for line in lines), lines
    args, lines = _resolved(["--fast-cuda-graphs", "layers"], world_size=4, **attrs)
    assert args.fast_layer_graphs and args.cuda_graph_impl == "local"
    assert any("asked for; not yet measured there" in line for line in lines), lines


@pytest.mark.parametrize("argv,attrs,needle", [
    ([], {"recompute_granularity": "full"}, "--recompute-granularity full"),
    # the fused layer does not call the modules whose pre-hooks wait for the gathers
    ([], {"overlap_param_gather": True, "use_distributed_optimizer": True},
     "the fused layer is off"),
    (["--fast-disable", "fused-layer"], {}, "fused layer is off"),
    ([], {"cpu": True}, "CPU mode"),
    ([], {"cuda_graph_impl": "transformer_engine"}, "--cuda-graph-impl transformer_engine"),
])
def test_layer_graphs_are_refused_where_they_cannot_hold_the_layers(argv, attrs, needle):
    from megagpt.errors import UserError

    args, _ = _resolved(argv, world_size=2, **attrs)
    assert not args.fast_layer_graphs
    assert args.cuda_graph_impl == attrs.get("cuda_graph_impl", "none")
    with pytest.raises(UserError, match=f"--fast-cuda-graphs layers: .*{needle}"):
        _resolved(["--fast-cuda-graphs", "layers", *argv], world_size=2, **attrs)


def test_written_gradients_are_refused_under_layer_graphs():
    """megatron's captured backward adds each gradient into main_grad itself: a buffer left
    unzeroed would then sum two steps."""
    from megagpt.errors import UserError
    from megagpt.launch.fast_path_reasons import grad_write_unsupported_reason
    from megagpt.launch.layers import LayerPath

    args, _ = _resolved(["--fast-cuda-graphs", "layers"])
    assert args.fast_layer_graphs and not args.fast_grad_write
    assert "per-layer CUDA graphs" in grad_write_unsupported_reason(args, LayerPath.FAST)
    with pytest.raises(UserError, match="gradients written: per-layer CUDA graphs"):
        _resolved(["--fast-cuda-graphs", "layers"], fast_grad_write=True)
    args, _ = _resolved(["--fast-cuda-graphs", "none"])
    assert args.fast_grad_write  # one micro-batch, one rank, no graph: written again


def test_megatrons_own_local_flag_holds_the_fused_layer():
    args, lines = _resolved([], cuda_graph_impl="local")
    assert args.fast_layer_graphs and args.cuda_graph_impl == "local"
    assert args.fast_spec_compile is True


def test_the_switches_parse():
    a = fast_path_namespace([])
    assert a.fast_layer_graphs is None and a.fast_multi_gpu_path is False
    a = fast_path_namespace(["--fast-cuda-graphs", "none", "--fast-multi-gpu-path"])
    assert a.fast_layer_graphs is False and a.fast_multi_gpu_path is True


# ---------------------------------------------------------------------------------------
# the fused layer under megatron's graph manager (real megatron layers on the CPU)
# ---------------------------------------------------------------------------------------
@pytest.fixture()
def fast_layer():
    import argparse

    from gloo_ranks import single_gloo_rank
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core.transformer.spec_utils import build_module

    from megagpt.fast_spec.layer import FusedLayerOptions
    from megagpt.fast_spec.spec import get_fast_gpt_layer_spec

    with single_gloo_rank():
        model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
        config = TransformerConfig(
            num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
            hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
            persist_layer_norm=False, gradient_accumulation_fusion=False)
        args = argparse.Namespace(fast_spec=True, normalization="LayerNorm",
                                  qk_layernorm=False, num_experts=None,
                                  reset_attention_mask=False, context_parallel_size=1)
        spec = get_fast_gpt_layer_spec(args, FusedLayerOptions())
        yield build_module(spec, config=config, layer_number=1)


def test_fused_layer_is_graphed_in_training_and_runs_itself_otherwise(fast_layer):
    layer = fast_layer
    assert layer.fused_unsupported_reason is None
    # megatron's manager needs CUDA to be built; its presence is what megatron checks
    layer.cudagraph_manager = object()
    layer.train()
    assert layer._should_call_local_cudagraph(hidden_states=None)
    with torch.no_grad():
        assert not layer._should_call_local_cudagraph(hidden_states=None)
    layer.eval()
    assert not layer._should_call_local_cudagraph(hidden_states=None)
    del layer.cudagraph_manager
    layer.train()
    assert not layer._should_call_local_cudagraph(hidden_states=None)


def test_fused_layer_accepts_per_layer_graphs_and_leaves_gradients_to_autograd(fast_layer):
    layer = fast_layer
    for w in (layer.self_attention.linear_qkv.weight, layer.self_attention.linear_proj.weight,
              layer.mlp.linear_fc1.weight, layer.mlp.linear_fc2.weight):
        w.main_grad = torch.zeros_like(w)
        w.grad_added_to_main_grad = False
        grad_marks.open_step(w, writing=True)  # its DDP writes this step (grad_write)
    weights = [layer.self_attention.linear_qkv.weight, layer.mlp.linear_fc1.weight]
    try:
        assert layer.wgrad_mode(weights) == "write"
        layer.config.cuda_graph_impl = "local"
        assert layer._static_fused_check() is None
        # megatron's captured backward adds the gradients itself
        assert layer.wgrad_mode(weights) is None
        layer.config.cuda_graph_impl = "transformer_engine"
        assert layer._static_fused_check() == "cuda_graph_impl=transformer_engine"
    finally:
        layer.config.cuda_graph_impl = "none"


# ---------------------------------------------------------------------------------------
# GPU: graphed layers train as the eager ones do
# ---------------------------------------------------------------------------------------
GPU_MODEL = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096",
    "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
    "--seq-length", "256", "--max-position-embeddings", "256",
    "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", "12",
    "--lr", "3e-4", "--lr-warmup-iters", "2", "--bf16", "--log-interval", "1",
    "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--transformer-impl", "local", "--fast-multi-gpu-path",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--fast-compile", "on",
]


@pytest.mark.gpu
def test_gpu_graphed_layers_train_as_the_eager_layers(tmp_path):
    from helpers import parse_losses, run_entry

    runs = {}
    for name, extra in (("graphs", []), ("eager", ["--fast-cuda-graphs", "none"])):
        (tmp_path / name).mkdir()
        out = run_entry([*GPU_MODEL, *extra], cwd=tmp_path / name, timeout=400)
        assert out.returncode == 0, out.stdout[-4000:]
        runs[name] = (out.stdout, parse_losses(out.stdout))
    graphed_log = runs["graphs"][0]
    assert "per-layer CUDA graphs" in graphed_log
    assert "built" in graphed_log and "cuda graph" in graphed_log.lower(), graphed_log[-3000:]
    assert "per-layer CUDA graphs" not in runs["eager"][0].split("layer spec:")[-1]
    graphed, eager = runs["graphs"][1], runs["eager"][1]
    assert sorted(graphed) == sorted(eager) == list(range(1, 13))
    for it in graphed:
        assert graphed[it] == pytest.approx(eager[it], rel=2e-3, abs=2e-3), (it, graphed, eager)
    assert graphed[12] < graphed[1] - 0.5  # it learns

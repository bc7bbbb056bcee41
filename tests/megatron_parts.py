"""Real megatron pieces for tests that run them in-process: the fast optimizer's kernels
installed in megatron's optimizer modules, and a tiny bf16 GPT wrapped in megatron's DDP."""

from __future__ import annotations

import argparse
import contextlib

import pytest
import torch

TINY_VOCAB, TINY_SEQ = 64, 16


@contextlib.contextmanager
def fast_optimizer_kernels(tensor_clip: bool = True):
    """megatron's optimizer modules with the fast optimizer's kernels (this process), put
    back as they were afterwards. Skips where TE or apex provide megatron's kernels."""
    from megagpt.train_step import optimizer

    if not optimizer.megatron_uses_local_fallbacks():
        pytest.skip("TE or apex installed: megatron's optimizer takes their kernels")
    with optimizer.fast_kernels(megatron_fused_optimizer=False, tensor_clip=tensor_clip):
        yield


def tiny_ddp_gpt(spec=None, grad_dtype=torch.bfloat16, device="cpu", overlap_grad_reduce=False,
                 use_distributed_optimizer=False):
    """A 2-layer, 32-wide bf16 GPT (tied embeddings, no dropout) in megatron's DDP with a
    ``grad_dtype`` gradient buffer. Needs megatron's parallel state (``single_gloo_rank``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0,
                               gradient_accumulation_fusion=False, bias_dropout_fusion=False,
                               masked_softmax_fusion=False, bias_activation_fusion=False,
                               persist_layer_norm=False)
    model = GPTModel(config, spec or get_gpt_layer_local_spec(), vocab_size=TINY_VOCAB,
                     max_sequence_length=TINY_SEQ, share_embeddings_and_output_weights=True)
    model = Float16Module(config, model.to(device))
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_dtype == torch.float32,
                                        overlap_grad_reduce=overlap_grad_reduce,
                                        use_distributed_optimizer=use_distributed_optimizer)
    return DistributedDataParallel(config, ddp, module=model)


def fast_path_namespace(argv=(), **attrs) -> argparse.Namespace:
    """The fast-path switches parsed from ``argv``, on a namespace of the megatron arguments
    their defaults look at (one GPU, bf16, one micro-batch of 8, the local spec's settings),
    ``attrs`` overriding them: what ``apply_fast_path_defaults`` sees after parsing."""
    from megagpt.command_line.fast_path_options import add_fast_path_arguments

    p = argparse.ArgumentParser()
    add_fast_path_arguments(p)
    args = p.parse_args(list(argv))
    base = dict(transformer_impl="local", spec=None, num_experts=None, world_size=1,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                context_parallel_size=1, cuda_graph_impl="none", bf16=True,
                check_for_nan_in_loss_and_grad=True, check_for_spiky_loss=False, cpu=False,
                optimizer="adam", micro_batch_size=8, global_batch_size=8,
                rampup_batch_size=None, grad_reduce_in_bf16=False, entry_argv=list(argv),
                fast_optimizer=False, gradient_accumulation_fusion=False,
                use_distributed_optimizer=False)
    base.update(attrs)
    for k, v in base.items():
        setattr(args, k, v)
    return args


# Model variants for the inference and conversion tests: each a set of megatron settings
# (TransformerConfig fields plus GPTModel's position / rotary / tie arguments).
GPT_VARIANTS = {
    # GPT-2: learned positions, LayerNorm, megatron's fused bias-GeLU (the tanh form), tied
    "gpt2": dict(position_embedding_type="learned_absolute", bias_activation_fusion=True),
    # exact GeLU (no fusion), untied output
    "gpt2_exact_untied": dict(position_embedding_type="learned_absolute", tied=False),
    # Llama: RoPE, RMSNorm, SwiGLU, no biases, grouped-query attention, untied
    "llama_gqa": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      bias=False, num_query_groups=2, tied=False),
    # tied Llama with llama3 RoPE scaling and a head size other than hidden / heads
    "llama_scaled_tied": dict(position_embedding_type="rope", normalization="RMSNorm",
                              swiglu=True, bias=False, kv_channels=8, rope_scaling=True,
                              rotary_base=500000),
    # what only the KV decoder covers: half-rotary RoPE, squared ReLU, q/k/v bias only
    "partial_rope_relu2": dict(position_embedding_type="rope", rotary_percent=0.5,
                               normalization="RMSNorm", activation="squared_relu", bias=False,
                               qkv_bias=True),
    # no position embedding at all, gated quick-GeLU
    "nope_quick_geglu": dict(position_embedding_type="none", activation="quick_gelu",
                             gated=True),
}


def tiny_gpt(variant: str, vocab_size: int = 96, max_length: int = 32, hidden: int = 32,
             seed: int = 0, qk_layernorm: bool = False, num_experts: int | None = None,
             on_gpu: bool = False):
    """A 2-layer fp32 GPTModel of ``GPT_VARIANTS[variant]`` on the CPU (or built on the
    current GPU), every parameter (norms and biases too) drawn at random so that a misplaced
    tensor shows; with q/k layer norms or experts when asked. Needs megatron's parallel
    state, and on the CPU CPU mode (``cpu_megatron``)."""
    import torch.nn.functional as F
    from megatron.core.activations import quick_gelu, squared_relu
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer import TransformerConfig

    v = dict(GPT_VARIANTS[variant])
    activation = {"squared_relu": squared_relu, "quick_gelu": quick_gelu}.get(
        v.pop("activation", None), F.silu if v.get("swiglu") else F.gelu)
    swiglu = v.pop("swiglu", False)
    bias = v.pop("bias", True)
    config = TransformerConfig(
        num_layers=2, hidden_size=hidden, num_attention_heads=4,
        num_query_groups=v.pop("num_query_groups", None), kv_channels=v.pop("kv_channels", None),
        ffn_hidden_size=48 if swiglu else 4 * hidden,
        normalization=v.pop("normalization", "LayerNorm"), layernorm_epsilon=1e-5,
        activation_func=activation, gated_linear_unit=swiglu or v.pop("gated", False),
        add_bias_linear=bias, add_qkv_bias=v.pop("qkv_bias", bias),
        bias_activation_fusion=v.pop("bias_activation_fusion", False),
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=not on_gpu,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, qk_layernorm=qk_layernorm,
        num_moe_experts=num_experts, moe_router_topk=2)
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_layernorm,
                                    normalization=config.normalization)
    model = GPTModel(
        config, spec,
        vocab_size=vocab_size, max_sequence_length=max_length,
        position_embedding_type=v.pop("position_embedding_type"),
        rotary_percent=v.pop("rotary_percent", 1.0), rotary_base=v.pop("rotary_base", 10000),
        rope_scaling=v.pop("rope_scaling", False),
        share_embeddings_and_output_weights=v.pop("tied", True))
    assert not v, f"unused settings {v}"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    if on_gpu:  # torch's own modules (position embedding, norms) are built on the CPU
        model.cuda(torch.cuda.current_device())
    return model.eval()


@contextlib.contextmanager
def cpu_megatron(seed: int = 0):
    """One gloo rank with megatron's parallel state, in CPU mode (inference included).
    Autograd stays on, as in training, so that megatron modules run here meet autograd's
    checks (an in-place change of a view, a missing gradient); a test that only infers
    opens ``torch.no_grad()`` itself."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from gloo_ranks import single_gloo_rank
    from megagpt import cpu_mode

    with single_gloo_rank(), cpu_mode.generating():
        model_parallel_cuda_manual_seed(seed)
        yield


def megatron_changes_in_place() -> list[str]:
    """The megatron attributes a change of the project is over now, megatron's own global
    tokenizer aside (megatron sets and clears it itself: ``megatron_wrappers.replace``'s
    ``megatron_sets``; an earlier test of this process may have left megatron's globals set)."""
    from megagpt import megatron_wrappers

    return sorted(target for target, chain in megatron_wrappers._CHAINS.items()
                  if not chain.megatron_sets)


def with_every_change(launch, cpu_fallbacks: bool = False):
    """``launch`` with every choice that turns a change of the launch's table on: the
    full-iteration graph, gradients written, the flat AdamW step, the asynchronous step, the
    gradient-norm guard, megatron's linears built without wgrad fusion (as under TE's layers
    without apex: no TE here, the choice is given), and with ``cpu_fallbacks`` CPU mode's
    torch fallbacks (as where megatron bound TE's kernels)."""
    import dataclasses

    from megagpt.launch import fast_path as chosen
    from megagpt.launch.cpu import CPU_OPTIMIZER, CpuOptimizer
    from megagpt.launch.cuda_graphs import CUDA_GRAPH, NAN_CHECK, CudaGraph, NanCheck
    from megagpt.launch.installed import MEGATRON_LINEARS_WGRAD
    from megagpt.launch.optimizer_kernels import ASYNC_STEP, OPTIMIZER, OptimizerKernels
    from megagpt.launch.plan import Choice, Reason, Why

    every = {CUDA_GRAPH: CudaGraph.FULL_ITERATION, chosen.GRAD_WRITE: True,
             OPTIMIZER: OptimizerKernels.FLAT_ADAMW, ASYNC_STEP: True,
             NAN_CHECK: NanCheck.GRADIENT_NORM}
    if cpu_fallbacks:
        every[CPU_OPTIMIZER] = CpuOptimizer.MEGATRONS_FALLBACKS
    choices = [dataclasses.replace(c, value=every.get(c.decision, c.value))
               for c in launch.choices]
    choices.append(Choice("compat", MEGATRON_LINEARS_WGRAD, False, Reason(Why.INSTALLED, "test")))
    return dataclasses.replace(launch, choices=tuple(choices))

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
    from megagpt.fast_spec import optim

    if not optim.megatron_uses_local_fallbacks():
        pytest.skip("TE or apex installed: megatron's optimizer takes their kernels")
    was_installed = "Adam" in optim._ORIGINALS
    optim.uninstall_fast_optimizer()
    optim.install_fast_optimizer(tensor_clip=tensor_clip)
    try:
        yield
    finally:
        optim.uninstall_fast_optimizer()
        if was_installed:
            optim.install_fast_optimizer()


def tiny_ddp_gpt(spec=None, grad_dtype=torch.bfloat16, device="cpu", overlap_grad_reduce=False):
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
                                        use_distributed_optimizer=False)
    return DistributedDataParallel(config, ddp, module=model)


def fast_path_namespace(argv=(), **attrs) -> argparse.Namespace:
    """The fast-path switches parsed from ``argv``, on a namespace of the megatron arguments
    their defaults look at (one GPU, bf16, one micro-batch of 8, the local spec's settings),
    ``attrs`` overriding them: what ``apply_fast_path_defaults`` sees after parsing."""
    from megagpt.fast_spec.settings import add_fast_path_arguments

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

"""Gradients written into megatron's gradient buffer instead of zeroed and added
(``megagpt.train_step.grad_write``; ``--fast-disable grad-write`` adds them).

Two tiny GPTs of the fast spec with the same weights, each in megatron's real DDP, run the
same batches on the CPU: one with writing on, one with megatron's zeroing and adding. After
every step their gradient buffers must be equal bit for bit, though the writing one's buffer
was never zeroed; a parameter that gets no gradient must read zero, and a second gradient in
one step (gradient accumulation) must stop the run instead of overwriting the first.
"""

from __future__ import annotations

import argparse
import contextlib

import pytest
import torch

from gloo_ranks import single_gloo_rank
from megatron_parts import TINY_SEQ as SEQ
from megatron_parts import TINY_VOCAB as VOCAB
from megatron_parts import fast_path_namespace, tiny_ddp_gpt

from megagpt.fast_spec import grad_marks

BATCH = 2
FUSED_WEIGHTS = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
                 "linear_fc2.weight")


# the wrappers of the running test, switched by _write (grad_write.writing's context)
_WRITING = contextlib.ExitStack()


@pytest.fixture()
def writing():
    """megatron's DDP with megagpt's wrappers (CPU mode, one gloo rank); taken off after."""
    from megagpt import cpu_mode
    from megagpt.train_step import grad_write

    with _WRITING:
        _WRITING.enter_context(grad_write.writing())
        with single_gloo_rank(), cpu_mode.active():
            yield grad_write
    assert not grad_write.grad_write_enabled()


def _write(on: bool) -> None:
    """Gradients written from the next ``zero_grad_buffer`` on (grad_write's wrappers in
    place), or zeroed and added as megatron does (taken off; the models' hooks stay)."""
    from megagpt.train_step import grad_write

    if on and not grad_write.grad_write_enabled():
        _WRITING.enter_context(grad_write.writing())
    elif not on:
        _WRITING.close()


def _fast_model(grad_dtype, overlap_grad_reduce=False):
    from megagpt.fast_spec.spec import get_fast_gpt_layer_spec

    from megagpt.fast_spec.layer import FusedLayerOptions

    spec = get_fast_gpt_layer_spec(argparse.Namespace(fast_spec=True), FusedLayerOptions())
    return tiny_ddp_gpt(spec, grad_dtype, overlap_grad_reduce=overlap_grad_reduce)


def _batch(seed: int):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], torch.arange(SEQ).expand(BATCH, -1), tokens[:, 1:]


def _step(model, seed: int, *, write: bool, zero: bool = True):
    _write(write)  # decided by each zero_grad_buffer, for its step
    if zero:
        model.zero_grad_buffer()
    tokens, positions, labels = _batch(seed)
    model(tokens, positions, None, labels=labels).float().mean().backward()
    model.finish_grad_sync()
    return {n: p.main_grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_written_gradients_equal_zeroed_and_added_ones(writing, grad_dtype):
    written, added = _fast_model(grad_dtype), _fast_model(grad_dtype)
    qkv = written.module.module.decoder.layers[0].self_attention.linear_qkv.weight
    for seed in range(3):
        before = qkv.main_grad.clone()
        g_written = _step(written, seed, write=True)
        g_added = _step(added, seed, write=False)
        assert written._megagpt_grad_write_step
        assert not getattr(added, "_megagpt_grad_write_step", False)
        for name, grad in g_added.items():
            assert grad.abs().sum() > 0, name
            torch.testing.assert_close(g_written[name], grad, rtol=0, atol=0, msg=name)
        if seed > 0:  # the step started from the last step's values: nothing zeroed them
            assert not torch.equal(before, g_written["module.module.decoder.layers.0."
                                                   "self_attention.linear_qkv.weight"])
    # in a bf16 buffer the fused layer's GEMMs wrote the four weights; in an fp32 one
    # (other dtype than the weights) autograd delivered them and the hook copied
    assert grad_marks.written_by_gemm(qkv) is (grad_dtype == torch.bfloat16)


def test_small_gradients_reach_the_buffer_together_at_the_end(writing):
    """Biases' and norms' gradients are held back by the hooks and copied together by
    finish_grad_sync; the GEMM-written weights are in the buffer already."""
    model = _fast_model(torch.bfloat16)
    _step(model, 0, write=True)
    layer = model.module.module.decoder.layers[0]
    bias, qkv = layer.self_attention.linear_proj.bias, layer.self_attention.linear_qkv.weight
    before = {"bias": bias.main_grad.clone(), "qkv": qkv.main_grad.clone()}
    _write(True)
    model.zero_grad_buffer()
    tokens, positions, labels = _batch(1)
    model(tokens, positions, None, labels=labels).float().mean().backward()
    assert torch.equal(bias.main_grad, before["bias"])  # not yet
    assert not torch.equal(qkv.main_grad, before["qkv"])  # written by its GEMM
    assert any(dst.data_ptr() == bias.main_grad.data_ptr()
               for dst, _ in model._megagpt_pending_copies)
    model.finish_grad_sync()
    assert not model._megagpt_pending_copies
    assert not torch.equal(bias.main_grad, before["bias"])


def test_large_gradients_are_copied_at_once(writing, monkeypatch):
    """Over the size limit a gradient goes into main_grad in its hook, not at the end."""
    monkeypatch.setattr(writing, "_COPY_LATER_MAX_BYTES", 0)
    model = _fast_model(torch.bfloat16)
    _step(model, 0, write=True)
    bias = model.module.module.decoder.layers[0].self_attention.linear_proj.bias
    before = bias.main_grad.clone()
    _write(True)
    model.zero_grad_buffer()
    tokens, positions, labels = _batch(1)
    model(tokens, positions, None, labels=labels).float().mean().backward()
    assert not model._megagpt_pending_copies
    assert not torch.equal(bias.main_grad, before)
    model.finish_grad_sync()


def test_overlapped_reduction_gets_each_gradient_at_once(writing):
    """With --overlap-grad-reduce megatron reduces a bucket as soon as its last gradient
    arrives, so nothing is held back; the gradients still equal megatron's added ones."""
    written = _fast_model(torch.bfloat16, overlap_grad_reduce=True)
    added = _fast_model(torch.bfloat16, overlap_grad_reduce=True)
    for seed in range(2):
        _write(True)
        written.zero_grad_buffer()
        tokens, positions, labels = _batch(seed)
        written(tokens, positions, None, labels=labels).float().mean().backward()
        assert not written._megagpt_pending_copies
        written.finish_grad_sync()
        g_added = _step(added, seed, write=False)
        for name, p in written.named_parameters():
            torch.testing.assert_close(p.main_grad, g_added[name], rtol=0, atol=0, msg=name)


def test_buffer_is_not_zeroed_while_writing(writing):
    model = _fast_model(torch.bfloat16)
    _step(model, 0, write=True)
    grads = {n: p.main_grad for n, p in model.named_parameters()}
    kept = {n: g.clone() for n, g in grads.items()}
    _write(True)
    model.zero_grad_buffer()
    for name, grad in grads.items():
        assert torch.equal(grad, kept[name]), name  # no fill
    _write(False)
    model.zero_grad_buffer()
    assert all(g.abs().sum() == 0 for g in grads.values())  # megatron's fill


def test_parameter_without_a_gradient_reads_zero(writing):
    written, added = _fast_model(torch.bfloat16), _fast_model(torch.bfloat16)
    _step(written, 0, write=True)
    _step(added, 0, write=False)
    pos_name = "module.module.embedding.position_embeddings.weight"
    for model in (written, added):  # no gradient for the position embeddings next step
        dict(model.named_parameters())[pos_name].requires_grad_(False)
    assert dict(written.named_parameters())[pos_name].main_grad.abs().sum() > 0
    g_written = _step(written, 1, write=True)
    g_added = _step(added, 1, write=False)
    assert g_written[pos_name].abs().sum() == 0
    for name, grad in g_added.items():
        torch.testing.assert_close(g_written[name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_a_second_gradient_in_one_step_stops_the_run(writing, grad_dtype):
    model = _fast_model(grad_dtype)
    _step(model, 0, write=True)
    with pytest.raises(RuntimeError, match="--fast-disable grad-write"):
        _step(model, 1, write=True, zero=False)  # two micro-batches' backward passes


def test_off_is_megatrons_zeroing_and_adding(writing):
    """Writing off: a second backward pass in one step accumulates, as megatron's does."""
    model = _fast_model(torch.bfloat16)
    once = _step(model, 0, write=False)
    twice = _step(model, 0, write=False, zero=False)
    name = "module.module.decoder.layers.0.mlp.linear_fc1.weight"
    torch.testing.assert_close(twice[name], 2 * once[name])


@pytest.mark.parametrize("attrs,needle", [
    ({}, None),
    ({"cpu": True}, None),
    ({"world_size": 2, "tensor_model_parallel_size": 2}, None),
    ({"global_batch_size": 16}, "micro-batch"),
    ({"rampup_batch_size": [8, 8, 100]}, "micro-batch"),
    ({"world_size": 2}, "data-parallel"),
    # megatron's fusion where megatron's output layer runs its own backward (the fast spec's
    # chunked loss off); beside the chunked loss the launch turns the fusion off and writes
    ({"gradient_accumulation_fusion": True, "fast_lm_loss": False}, "accumulation fusion"),
    ({"use_distributed_optimizer": True}, "distributed optimizer"),
    ({"transformer_impl": "transformer_engine"}, "fast spec"),
])
def test_on_by_default_where_nothing_is_accumulated(attrs, needle):
    from megagpt.train_step import grad_write
    from megagpt.launch.fast_path import apply_fast_path_defaults
    from megagpt.launch.fast_path_reasons import grad_write_unsupported_reason
    from megagpt.launch.layers import layer_path

    args = fast_path_namespace(**attrs)
    reason = grad_write_unsupported_reason(args, layer_path(args)[0])
    assert (reason is None) if needle is None else (needle in reason)
    apply_fast_path_defaults(args, lambda s: None)
    assert args.fast_grad_write is (needle is None)
    assert not grad_write.grad_write_enabled()  # the launch decides; its context installs it


def test_megatrons_fusion_beside_the_chunked_loss_is_turned_off_and_gradients_written():
    """apex's weight-gradient kernel turns megatron's fusion on; where the fast spec's fused
    layers and chunked loss form every weight gradient it has nothing to fuse."""
    from megagpt.launch.fast_path import apply_fast_path_defaults

    args = fast_path_namespace(gradient_accumulation_fusion=True)
    lines = []
    apply_fast_path_defaults(args, lines.append)
    assert args.gradient_accumulation_fusion is False and args.fast_grad_write is True
    assert any("--no-gradient-accumulation-fusion" in line for line in lines)


def test_switch_off_and_refused_where_gradients_are_summed():
    from megagpt.errors import UserError
    from megagpt.train_step import grad_write
    from megagpt.launch.fast_path import apply_fast_path_defaults

    args = fast_path_namespace(["--fast-disable", "grad-write"])
    apply_fast_path_defaults(args, lambda s: None)
    assert args.fast_grad_write is False and not grad_write.grad_write_enabled()
    args = fast_path_namespace(global_batch_size=32, fast_grad_write=True)  # asked for
    with pytest.raises(UserError, match="micro-batch"):
        apply_fast_path_defaults(args, lambda s: None)


@pytest.mark.slow
def test_entry_trains_the_same_with_gradients_written(tmp_path):
    """The entry on the CPU, one micro-batch per step (writing on by default): the same
    losses as with megatron's zeroing and adding, through megatron's training loop and its
    finalize_model_grads."""
    from helpers import TINY_MODEL, losses_with_and_without_grad_write

    written, added = losses_with_and_without_grad_write(
        [*TINY_MODEL, "--global-batch-size", "2", "--train-iters", "8"], tmp_path)
    assert sorted(written) == list(range(1, 9))
    assert written == added

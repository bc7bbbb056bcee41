"""Gradient-accumulation fusion in the fast spec's fused layer: the four weight GEMMs of each
layer accumulate into megatron's gradient buffer (``main_grad``) themselves.

A small GPT of the fast spec, wrapped in megatron's DDP (bf16 and fp32 gradient buffers),
runs forward and backward on the CPU (cpu_mode) with the fusion on and off: the gradient
buffers must hold the same values — in particular, megatron's DDP hook must not add the
placeholder gradients autograd carries for the fused weights.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from gloo_ranks import single_gloo_rank
from megatron_parts import TINY_SEQ as SEQ
from megatron_parts import TINY_VOCAB as VOCAB
from megatron_parts import tiny_ddp_gpt

BATCH = 2


@pytest.fixture()
def cpu_megatron():
    from megagpt import cpu_mode

    with single_gloo_rank(), cpu_mode.active():
        yield


def _build(fusion: bool, grad_dtype):
    from megagpt.fast_spec.spec import get_fast_gpt_layer_spec

    spec = get_fast_gpt_layer_spec(argparse.Namespace(
        fast_spec=True, fast_spec_fused_layer=True, fast_spec_compile=False,
        fast_wgrad_fusion=fusion))
    return tiny_ddp_gpt(spec, grad_dtype)


def _grads_after(model, iterations: int = 2):
    g = torch.Generator().manual_seed(1)
    for _ in range(iterations):  # zero_grad_buffer resets megatron's flag each iteration
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        model.zero_grad_buffer()
        out = model(tokens[:, :-1], torch.arange(SEQ).expand(BATCH, -1), None,
                    labels=tokens[:, 1:])
        out.float().mean().backward()
        model.finish_grad_sync()
    return {n: p.main_grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_fused_weight_gradients_land_in_main_grad(cpu_megatron, grad_dtype):
    fused = _build(True, grad_dtype)
    plain = _build(False, grad_dtype)  # each model's layers carry their own setting
    g_fused = _grads_after(fused)
    # the fused path was really taken: its weights carry megatron's "already added" flag
    qkv = fused.module.module.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.grad_added_to_main_grad is True
    g_plain = _grads_after(plain)
    plain_qkv = plain.module.module.decoder.layers[0].self_attention.linear_qkv.weight
    assert plain_qkv.grad_added_to_main_grad is False
    weights = [n for n in g_fused if n.endswith(("linear_qkv.weight", "linear_proj.weight",
                                                 "linear_fc1.weight", "linear_fc2.weight"))]
    assert len(weights) == 8
    for name, grad in g_plain.items():
        assert grad.abs().sum() > 0, name
        # bf16 buffer: the same GEMM rounded once either way; fp32 buffer: the fused GEMM
        # keeps the fp32 product that the plain path rounds to bf16 before adding
        tol = dict(rtol=0, atol=0) if grad_dtype == torch.bfloat16 else dict(rtol=1e-2, atol=1e-5)
        torch.testing.assert_close(g_fused[name], grad, **tol, msg=name)


def test_default_leaves_the_weights_to_autograd(cpu_megatron):
    from megagpt.fast_spec.settings import add_fast_path_arguments

    assert add_fast_path_arguments(argparse.ArgumentParser()).parse_args([]).fast_wgrad_fusion is False
    plain = _build(False, torch.bfloat16)
    _grads_after(plain, 1)
    qkv = plain.module.module.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.grad_added_to_main_grad is False


@pytest.mark.parametrize("write", [False, True], ids=["accumulate", "write"])
@pytest.mark.parametrize("backend, device", [
    ("aot_eager", "cpu"), ("inductor", "cpu"),
    pytest.param("inductor", "cuda", marks=pytest.mark.gpu)])
def test_compiled_layer_accumulates_into_views_of_one_buffer(backend, device, write):
    """torch.compile of the fused layer with the four main_grads as views of one buffer (as
    megatron's DDP lays them out): one graph for every layer, each layer's gradients in its
    own views, equal to autograd's. Written (``--fast-grad-write``), they replace what the
    buffer held; accumulated, they add to its zeros."""
    import torch._dynamo

    from megagpt.fast_spec import layer

    h, heads, s, b = 32, 4, 8, 2
    shapes = [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)]  # qkv, proj, fc1, fc2
    n_layers = 3
    per_layer = sum(o * i for o, i in shapes)
    buffer = torch.zeros(5 + n_layers * per_layer, device=device)  # an offset, as padding gives
    if write:
        buffer.fill_(7.0)  # last step's gradients, not zeroed
    consts = dict(rope=None, eps=1e-5, rms=False, groups=heads, q_per_group=1,
                  head_dim=h // heads, scale=(h // heads) ** -0.5, attn_p=0.0, hidden_p=0.0,
                  act="gelu", rotary_interleaved=False, rope_mscale=1.0, training=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fn = torch.compile(layer.fused_layer_forward, backend=backend, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    for i in range(n_layers):
        ws = [torch.nn.Parameter((torch.randn(o, ii, generator=g) * 0.1).to(device))
              for o, ii in shapes]
        small = [torch.nn.Parameter((torch.randn(n, generator=g) * 0.1).to(device))
                 for n in (h, h, 3 * h, h, h, h, 4 * h, h)]
        ln1_w, ln1_b, qkv_b, proj_b, ln2_w, ln2_b, fc1_b, fc2_b = small
        offset, views = 5 + i * per_layer, []
        for o, ii in shapes:
            views.append(buffer[offset:offset + o * ii].view(o, ii))
            offset += o * ii
        x = torch.randn(s, b, h, generator=g).to(device).requires_grad_()
        args = (x, ln1_w, ln1_b, ws[0], qkv_b, ws[1], proj_b, ln2_w, ln2_b, ws[2], fc1_b,
                ws[3], fc2_b)
        fn(*args, **consts, qkv_main_grad=views[0], proj_main_grad=views[1],
           fc1_main_grad=views[2], fc2_main_grad=views[3],
           wgrad_write=write).square().sum().backward()
        fused_x_grad = x.grad.clone()
        for t in [x] + ws + small:  # the fused weights' .grad is the placeholder (DDP drops it)
            t.grad = None
        layer.fused_layer_forward(*args, **consts).square().sum().backward()
        for w, view in zip(ws, views):
            torch.testing.assert_close(view, w.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fused_x_grad, x.grad, rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1

"""The fast path without Transformer Engine (megagpt.fast_spec): numerics against megatron's
local spec on a tiny GPTModel on the CPU (fp32, same weights -> same losses and gradients),
causal masking, fallbacks, the optimizer kernels, the chunked LM loss and the switches."""

from __future__ import annotations

import argparse
import functools
import operator

import pytest
import torch
import torch.nn.functional as F

SEQ, BATCH, VOCAB = 16, 2, 96


# ---------------------------------------------------------------------------------------
# one-process gloo + megatron model-parallel state, and the CPU shim GPTModel.forward needs
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def megatron_cpu():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    created_pg = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)
        created_pg = True
    if dist.get_world_size() != 1:
        pytest.skip("needs a one-process group")
    created_mp = False
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
        created_mp = True
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True, force_reset_rng=True)
    yield
    if created_mp:
        parallel_state.destroy_model_parallel()
    if created_pg:
        dist.destroy_process_group()


@pytest.fixture()
def cpu_buffers(monkeypatch, megatron_cpu):
    """megatron's GlobalMemoryBuffer allocates on torch.cuda.current_device(); on the CPU
    the local DotProductAttention needs it on the CPU (test-only shim)."""
    import megatron.core.utils as mutils

    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        n = functools.reduce(operator.mul, shape, 1)
        return torch.empty(n, dtype=dtype).view(*shape)

    monkeypatch.setattr(mutils.GlobalMemoryBuffer, "get_tensor", get_tensor)
    if not torch.cuda.is_available():
        # RotaryEmbedding moves its inverse frequencies to torch.cuda.current_device()
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    yield


def _with_fused_options(model, **options):
    """Give every fused layer of ``model`` these ``FusedLayerOptions`` (what the spec hands
    each layer from the run's flags; compile options the flags do not reach, for tests)."""
    from megagpt.fast_spec.layer import FastTransformerLayer, FusedLayerOptions

    chosen = FusedLayerOptions.make(**options)
    layers = [m for m in model.modules() if isinstance(m, FastTransformerLayer)]
    assert layers
    for layer in layers:
        layer.fused_options = chosen
    return chosen


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
              hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
              persist_layer_norm=False, gradient_accumulation_fusion=False,
              bias_activation_fusion=True, bias_dropout_fusion=True)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _spec(args):
    """The fast spec for ``args``, its fused layer as their switches ask (the launch's choices
    of a real run: ``megagpt.gpt_model.fused_layer_options``)."""
    from megagpt.fast_spec.layer import FusedLayerOptions
    from megagpt.fast_spec.spec import get_fast_gpt_layer_spec

    fused = FusedLayerOptions.make(compile=args.fast_spec_compile) \
        if args.fast_spec_fused_layer else None
    return get_fast_gpt_layer_spec(args, fused)


def _args(**kw):
    base = dict(fast_spec=True, fast_spec_fused_layer=True, fast_spec_compile=False,
                normalization="LayerNorm", qk_layernorm=False, num_experts=None,
                reset_attention_mask=False, context_parallel_size=1)
    base.update(kw)
    return argparse.Namespace(**base)


def _models(config, args, position_embedding_type="learned_absolute"):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(0)
    local_spec = get_gpt_layer_local_spec(normalization=args.normalization)
    ref = GPTModel(config, local_spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                   position_embedding_type=position_embedding_type)
    fast = GPTModel(config, _spec(args), vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type=position_embedding_type)
    missing = fast.load_state_dict(ref.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    return ref, fast


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return tokens, pos, mask, labels


def _loss_and_grads(model, batch, **kw):
    model.zero_grad(set_to_none=True)
    tokens, pos, mask, labels = batch
    losses = model(tokens, pos, mask, labels=labels, **kw)
    # a non-uniform weighting so every token's loss matters differently
    weights = torch.linspace(0.5, 1.5, losses.numel()).view_as(losses)
    (losses * weights).sum().backward()
    return losses.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_same(ref, fast, batch, rtol=1e-4, **fast_kw):
    l_ref, g_ref = _loss_and_grads(ref, batch)
    l_fast, g_fast = _loss_and_grads(fast, batch, **fast_kw)
    torch.testing.assert_close(l_fast, l_ref, rtol=rtol, atol=1e-5)
    assert g_ref.keys() == g_fast.keys()
    for name in g_ref:
        scale = g_ref[name].abs().max().clamp_min(1e-6)
        err = (g_fast[name] - g_ref[name]).abs().max() / scale
        assert err < rtol * 10, f"{name}: relative gradient error {err:.2e}"


class _Spy:
    """Counts calls of megagpt.fast_spec.layer.fused_layer_forward (eager mode)."""

    def __init__(self, monkeypatch):
        import megagpt.fast_spec.layer as layer_mod

        self.calls = 0
        original = layer_mod.fused_layer_forward

        def spy(*a, **k):
            self.calls += 1
            return original(*a, **k)

        monkeypatch.setattr(layer_mod, "fused_layer_forward", spy)


# ---------------------------------------------------------------------------------------
# numerics against the local spec
# ---------------------------------------------------------------------------------------
def test_sdpa_core_attention_matches_local_spec(cpu_buffers):
    ref, fast = _models(_config(), _args(fast_spec_fused_layer=False))
    from megagpt.fast_spec.attention import SDPADotProductAttention

    layer = fast.decoder.layers[0]
    assert type(layer).__name__ == "TransformerLayer"
    assert isinstance(layer.self_attention.core_attention, SDPADotProductAttention)
    _assert_same(ref, fast, _batch())


@pytest.mark.parametrize(
    "overrides,args_kw,pos_type",
    [
        ({}, {}, "learned_absolute"),  # megatron's default GPT: LayerNorm, bias-GeLU (tanh)
        ({"bias_activation_fusion": False}, {}, "learned_absolute"),  # exact GeLU
        ({"num_query_groups": 2}, {}, "learned_absolute"),  # grouped-query attention
        ({"normalization": "RMSNorm", "gated_linear_unit": True, "activation_func": F.silu,
          "add_bias_linear": False, "bias_activation_fusion": False},
         {"normalization": "RMSNorm"}, "rope"),  # llama-style block
    ],
    ids=["gpt-default", "exact-gelu", "gqa", "rmsnorm-swiglu-rope"],
)
def test_fused_layer_matches_local_spec(cpu_buffers, monkeypatch, overrides, args_kw, pos_type):
    spy = _Spy(monkeypatch)
    ref, fast = _models(_config(**overrides), _args(**args_kw), pos_type)
    for layer in fast.decoder.layers:
        assert layer.fused_unsupported_reason is None
    _assert_same(ref, fast, _batch(1))
    assert spy.calls == len(fast.decoder.layers)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-layer", "megatrons-layer"])
def test_apexs_persistent_layer_norm_default_leaves_the_fast_specs_norms_alone(
        cpu_buffers, fused):
    """Where apex is installed megatron's config has ``persist_layer_norm`` on (the choice of
    apex's kernel for its FusedLayerNorm); megatron's WrappedTorchNorm asserts on it. The fast
    spec's torch norms build, and the model computes what it computes without it."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megagpt.fast_spec.spec import fast_decoder_block_spec

    persistent = _config(persist_layer_norm=True)
    with pytest.raises(AssertionError, match="persist_layer_norm"):
        WrappedTorchNorm(persistent, 64)  # what every fast-spec launch met with apex
    args = _args(fast_spec_fused_layer=fused)
    ref, _ = _models(_config(), args)
    torch.manual_seed(0)
    # the block as the launch builds it (gpt_model.layer_spec_builder)
    fast = GPTModel(persistent, fast_decoder_block_spec(_spec(args), persistent),
                    vocab_size=VOCAB, max_sequence_length=SEQ)
    fast.load_state_dict(ref.state_dict(), strict=True)
    assert type(fast.decoder.final_layernorm) is torch.nn.LayerNorm
    _assert_same(ref, fast, _batch(2))


def _sequence_parallel_models(config):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megagpt.fast_spec.spec import fast_decoder_block_spec

    def build(args):
        torch.manual_seed(0)
        block = fast_decoder_block_spec(_spec(args), config)
        return GPTModel(config, block, vocab_size=VOCAB, max_sequence_length=SEQ)

    ref, fast = build(_args(fast_spec_fused_layer=False)), build(_args())
    assert type(ref.decoder.layers[0]).__name__ == "TransformerLayer"
    norm_weight = fast.decoder.final_layernorm.weight
    assert getattr(norm_weight, "sequence_parallel", False)  # finalize_model_grads sums it
    fast.load_state_dict(ref.state_dict(), strict=True)
    return ref, fast


def _tensor_parallel_fused_layer(rank, world_size, overrides):
    """On each of two tensor-parallel ranks: the fused layer on this rank's shards gives
    megatron's losses and this rank's gradients (CPU initialisation: both models start from
    the same full weights, split the same way)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megagpt.fast_spec.layer as layer_mod
    from megagpt import cpu_mode

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    calls = []
    original = layer_mod.fused_layer_forward

    def spy(*a, **k):
        calls.append(k.get("tp_group"))
        return original(*a, **k)

    layer_mod.fused_layer_forward = spy
    try:
        with cpu_mode.active():
            model_parallel_cuda_manual_seed(1234)
            if overrides.get("sequence_parallel"):
                # megatron's local spec refuses sequence parallelism (its torch norm
                # asserts): the reference is megatron's layer code with the fast spec's norms
                ref, fast = _sequence_parallel_models(_config(**overrides))
            else:
                ref, fast = _models(_config(**overrides), _args())
            assert all(layer.fused_unsupported_reason is None for layer in fast.decoder.layers)
            qkv = fast.decoder.layers[0].self_attention.linear_qkv.weight
            groups, head_dim = overrides.get("num_query_groups", 4), 64 // 4
            assert qkv.shape[0] == (64 + 2 * groups * head_dim) // 2  # this rank's shard
            _assert_same(ref, fast, _batch(1))
            assert len(calls) == len(fast.decoder.layers)
            assert all(g is not None and g.size() == 2 for g in calls)
    finally:
        layer_mod.fused_layer_forward = original
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("overrides", [
    {}, {"num_query_groups": 2},
    {"sequence_parallel": True, "tensor_model_parallel_size": 2},
], ids=["gpt-default", "gqa", "sequence-parallel"])
def test_fused_layer_under_tensor_parallelism_matches_megatrons_layer(overrides):
    from gloo_ranks import run_on_ranks

    run_on_ranks(_tensor_parallel_fused_layer, 2, overrides)


def test_fused_layer_falls_back_and_still_matches(cpu_buffers, monkeypatch):
    """A layer the fused path does not cover runs megatron's layer code (with SDPA)."""
    spy = _Spy(monkeypatch)
    ref, fast = _models(_config(apply_residual_connection_post_layernorm=True), _args())
    reason = fast.decoder.layers[0].fused_unsupported_reason
    assert reason == "apply_residual_connection_post_layernorm"
    _assert_same(ref, fast, _batch(2))
    assert spy.calls == 0


def test_eager_layer_adds_bias_and_residual_rounded_once_as_megatron_does():
    """A bias below half a unit in the last place of the projection's output still reaches
    the residual stream in bf16: the eager layer's sum is rounded once, as megatron's fused
    bias-dropout-add rounds it (added step by step, such a bias vanished in ``out + bias``)."""
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train

    from megagpt.fast_spec.layer import _bias_dropout_add

    g = torch.Generator().manual_seed(0)
    out = (torch.randn(32, 2, 64, generator=g) * 0.05).bfloat16()
    residual = (torch.randn(32, 2, 64, generator=g) * 0.02).bfloat16()
    bias = torch.full((64,), 3e-5).bfloat16()  # Adam's first steps move a bias about this far
    once = (residual.float() + (out.float() + bias.float())).bfloat16()
    step_by_step = residual + (out + bias)
    assert not torch.equal(step_by_step, once)  # a bias the old sum lost
    got = _bias_dropout_add(out, bias, residual, 0.0, True, None, 0)
    assert torch.equal(got, once)
    assert torch.equal(got, bias_dropout_add_fused_train((out, bias), residual, 0.0))


def test_dropout_is_applied_in_training_and_not_in_eval(cpu_buffers):
    cfg = _config(hidden_dropout=0.5, attention_dropout=0.5)
    _, fast = _models(cfg, _args())
    tokens, pos, mask, labels = _batch(3)
    fast.eval()
    with torch.no_grad():
        a = fast(tokens, pos, mask, labels=labels)
        b = fast(tokens, pos, mask, labels=labels)
    torch.testing.assert_close(a, b)
    fast.train()
    with torch.no_grad():
        c = fast(tokens, pos, mask, labels=labels)
    assert not torch.allclose(a, c)


def test_only_a_compiled_layer_draws_hash_dropout_seeds(cpu_buffers, monkeypatch):
    """The fast spec's layer draws two seeds per forward where its function is compiled and
    hash dropout is on; eagerly (CPU mode, tensor parallelism) and with
    ``--fast-disable hash-dropout`` it keeps F.dropout."""
    import torch._dynamo

    import megagpt.fast_spec.layer as layer_mod
    from megagpt.fast_spec import hash_dropout

    drawn = []
    real = hash_dropout.draw_seeds
    monkeypatch.setattr(hash_dropout, "draw_seeds",
                        lambda count, device: drawn.append(count) or real(count, device))
    _, fast = _models(_config(num_layers=2, hidden_dropout=0.2), _args())
    batch = _batch(1)
    _loss_and_grads(fast, batch)
    assert drawn == []  # eager layers
    torch._dynamo.reset()
    _with_fused_options(fast, compile=True, options={"backend": "eager"})
    _loss_and_grads(fast, batch)
    assert drawn == [2, 2]  # one pair per layer
    drawn.clear()
    _with_fused_options(fast, compile=True, options={"backend": "eager"}, hash_dropout=False)
    _loss_and_grads(fast, batch)
    assert drawn == []
    assert layer_mod.FusedLayerOptions().hash_dropout


@pytest.mark.parametrize("fused", [True, False], ids=["fused-layer", "sdpa-only"])
def test_attention_is_causal(cpu_buffers, fused):
    """Changing token t changes no output before t, and changes the output at t."""
    _, fast = _models(_config(), _args(fast_spec_fused_layer=fused))
    fast.eval()
    tokens, pos, mask, _ = _batch(4)
    t = SEQ // 2
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % VOCAB
    with torch.no_grad():
        a = fast(tokens, pos, mask)  # logits [b, s, v]
        b = fast(changed, pos, mask)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=1e-5, atol=1e-6)
    assert (a[:, t:] - b[:, t:]).abs().max() > 1e-3


@pytest.mark.parametrize("fused", [True, False], ids=["fused-layer", "sdpa-only"])
def test_attention_backend_narrows_the_sdpa_kernels(cpu_buffers, monkeypatch, fused):
    """--attention-backend reaches the SDPA call of both attention paths: with unfused (math)
    and flash (torch's CPU flash kernel) the model matches megatron's local attention; with
    fused (cuDNN, which has no CPU kernel) torch finds no kernel, so the restriction holds."""
    from megatron.core.transformer.enums import AttnBackend

    def build(backend):
        # each model's constructor sets TE's switches for its backend, and asserts on others
        for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
            monkeypatch.delenv(name, raising=False)
        return _models(_config(attention_backend=backend), _args(fast_spec_fused_layer=fused))

    for backend in (AttnBackend.unfused, AttnBackend.flash):
        ref, fast = build(backend)
        _assert_same(ref, fast, _batch(2))
    _, fast = build(AttnBackend.fused)
    if fused:  # the fused function itself runs attention
        assert all(layer.fused_unsupported_reason is None for layer in fast.decoder.layers)
    with pytest.raises(RuntimeError, match="No available kernel|No viable backend"):
        _loss_and_grads(fast, _batch(2))


def test_document_mask_is_honoured_with_reset_attention_mask(cpu_buffers):
    """--reset-attention-mask: the fast spec applies the mask it is given, like the local one."""
    ref, fast = _models(_config(), _args(reset_attention_mask=True))
    from megagpt.fast_spec.spec import SDPAMaskedDotProductAttention

    assert isinstance(fast.decoder.layers[0].self_attention.core_attention,
                      SDPAMaskedDotProductAttention)
    assert fast.decoder.layers[0].fused_unsupported_reason is not None
    tokens, pos, _, labels = _batch(5)
    doc = torch.zeros(SEQ, SEQ, dtype=torch.bool)
    doc[SEQ // 2:, : SEQ // 2] = True  # second document cannot see the first
    mask = (torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1) | doc).expand(BATCH, 1, SEQ, SEQ)
    _assert_same(ref, fast, (tokens, pos, mask.contiguous(), labels))


@pytest.mark.parametrize("pos_type", ["learned_absolute", "rope"])
def test_fused_layer_traces_as_one_graph_for_all_layers(cpu_buffers, pos_type):
    """torch.compile(fullgraph=True) traces the fused layer without graph breaks, one graph
    shared by every layer (backend 'eager': no C++ compiler needed), same numbers."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    ref, fast = _models(_config(num_layers=3), _args(), pos_type)
    batch = _batch(6)
    l_ref, g_ref = _loss_and_grads(ref, batch)  # megatron's own torch.compile'd fusions run here
    torch._dynamo.reset()
    counters.clear()
    _with_fused_options(fast, compile=True, options={"backend": "eager"})
    l_fast, g_fast = _loss_and_grads(fast, batch)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(l_fast, l_ref, rtol=1e-4, atol=1e-5)
    for name in g_ref:
        torch.testing.assert_close(g_fast[name], g_ref[name], rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------------------------------
# chunked LM-head cross entropy
# ---------------------------------------------------------------------------------------
def test_chunked_cross_entropy_gradcheck():
    from megagpt.fast_spec.lm_loss import chunked_linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(23, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (23,), generator=g)
    # 4 chunks of at most 6 tokens
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_linear_cross_entropy(h, w, labels, chunk_elements=11 * 6), (h, w))
    ref = F.cross_entropy(h @ w.t(), labels, reduction="none")
    torch.testing.assert_close(chunked_linear_cross_entropy(h, w, labels, 11 * 6), ref)


def test_chunked_lm_loss_matches_megatron_loss_in_gpt_model(cpu_buffers):
    from megagpt.fast_spec.lm_loss import fused_lm_head_loss

    ref, fast = _models(_config(), _args())
    _assert_same(ref, fast, _batch(7), output_processor=fused_lm_head_loss)
    # no labels: the processor returns logits exactly as GPTModel does
    tokens, pos, mask, _ = _batch(7)
    with torch.no_grad():
        torch.testing.assert_close(fast(tokens, pos, mask, output_processor=fused_lm_head_loss),
                                   ref(tokens, pos, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights_kind", ["mask", "float"])
def test_gradients_formed_in_forward_equal_autograds(weights_kind):
    """Losses and their gradients, formed in the forward pass, against autograd of the plain
    cross entropy, when the upstream gradient is c * w (a masked sum scaled by 1/tokens)."""
    from megagpt.fast_spec.lm_loss import chunked_linear_cross_entropy_grad_in_forward

    g = torch.Generator().manual_seed(3)
    h = torch.randn(23, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (23,), generator=g)
    if weights_kind == "mask":
        weights = (torch.rand(23, generator=g) > 0.3).double()
    else:
        weights = torch.rand(23, generator=g, dtype=torch.float64) + 0.5
    c = 1.0 / weights.sum()
    losses = chunked_linear_cross_entropy_grad_in_forward(h, w, labels, weights, 11 * 6)
    (losses * weights).sum().mul(c).backward()
    ours = (losses.detach(), h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    ref_losses = F.cross_entropy(h @ w.t(), labels, reduction="none")
    (ref_losses * weights).sum().mul(c).backward()
    for a, b in zip(ours, (ref_losses.detach(), h.grad, w.grad)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradients_formed_in_forward_through_gpt_model_and_loss_func(cpu_buffers):
    """The entry's own loss_func (masked sum, megatron's division by the token count) on
    GPTModel with the processor that forms the LM head's gradients in forward, against
    megatron's LM head and loss; and without gradients the plain chunked loss runs."""
    import pretrain_gpt
    from megagpt.fast_spec.lm_loss import fused_lm_head_loss

    ref, fast = _models(_config(), _args())
    tokens, pos, mask, labels = _batch(9)
    loss_mask = (torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(1)) > 0.25).float()
    checks = pretrain_gpt.LossChecks(nan_and_inf=False, spiky_loss=False)
    processor = functools.partial(fused_lm_head_loss, grad_in_forward=True)
    results = []
    for model, kw in ((ref, {}), (fast, {"output_processor": processor})):
        model.zero_grad(set_to_none=True)
        out = model(tokens, pos, mask, labels=labels, loss_mask=loss_mask, **kw)
        loss_sum, num_tokens, _ = pretrain_gpt.loss_func(loss_mask, out, checks)
        (loss_sum / num_tokens).backward()  # what megatron's schedule does with the pair
        results.append((out.detach(), {n: q.grad.clone() for n, q in model.named_parameters()}))
    (l_ref, g_ref), (l_fast, g_fast) = results
    torch.testing.assert_close(l_fast, l_ref, rtol=1e-4, atol=1e-5)
    for name in g_ref:
        scale = g_ref[name].abs().max().clamp_min(1e-6)
        assert (g_fast[name] - g_ref[name]).abs().max() / scale < 1e-3, name
    with torch.no_grad():
        torch.testing.assert_close(
            fast(tokens, pos, mask, labels=labels, loss_mask=loss_mask, output_processor=processor),
            l_ref, rtol=1e-4, atol=1e-5)


def test_chunk_kernels_trace_without_graph_breaks():
    from megagpt.fast_spec.lm_loss import _ce_backward_chunk, _ce_forward_chunk

    logits = torch.randn(5, 13)
    labels = torch.randint(0, 13, (5,))
    fwd = torch.compile(_ce_forward_chunk, backend="eager", fullgraph=True)
    loss, lse = fwd(logits, labels, torch.float32)
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels, reduction="none"))
    grad = torch.rand(5)
    bwd = torch.compile(_ce_backward_chunk, backend="eager", fullgraph=True)
    x = logits.clone().requires_grad_(True)
    (F.cross_entropy(x, labels, reduction="none") * grad).sum().backward()
    torch.testing.assert_close(bwd(logits, lse, labels, grad), x.grad)


# ---------------------------------------------------------------------------------------
# optimizer kernels
# ---------------------------------------------------------------------------------------
def test_foreach_multi_tensor_kernels():
    from megagpt.train_step.optimizer import (
        foreach_copy_this_to_that,
        foreach_multi_tensor_l2norm,
        foreach_multi_tensor_scale,
    )

    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(n, generator=g) for n in (3, 17, 1000)] + [torch.randn(4, 4).bfloat16()]
    norm, _ = foreach_multi_tensor_l2norm(2048, None, [ts], False)
    expected = torch.cat([t.float().flatten() for t in ts]).norm()
    assert norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], expected, rtol=1e-5, atol=0)

    src = [t.float() for t in ts[:3]]
    dst = [torch.zeros_like(t) for t in src]
    foreach_multi_tensor_scale(2048, None, [src, dst], 0.5)
    for s, d in zip(src, dst):
        torch.testing.assert_close(d, s * 0.5)
    foreach_multi_tensor_scale(2048, None, [dst, dst], 2.0)  # in place
    for s, d in zip(src, dst):
        torch.testing.assert_close(d, s)

    low = [torch.empty_like(s, dtype=torch.bfloat16) for s in src]
    foreach_copy_this_to_that(src, low)  # fp32 master -> bf16 model weights
    for s, d in zip(src, low):
        torch.testing.assert_close(d, s.bfloat16())


def test_optimizer_kernels_take_fsdp2s_sharded_parameters(megatron_cpu):
    """--use-torch-fsdp2 hands megatron's copy of the main parameters into the model's DTensors,
    which have no sharding rule for ``_foreach_copy_`` (on the GPU the first step stopped with
    NotImplementedError); megatron's norm and scale take their local tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from megagpt.train_step.optimizer import foreach_copy_this_to_that

    mesh = init_device_mesh("cpu", (1,))  # on the module's one-rank gloo group
    src = [distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]) for _ in range(2)]
    dst = [distribute_tensor(torch.zeros(8, 4, dtype=torch.bfloat16), mesh, [Shard(0)])
           for _ in range(2)]
    with pytest.raises(NotImplementedError):  # what the copy must not rely on
        torch._foreach_copy_([d.clone() for d in dst], src)
    foreach_copy_this_to_that(src, dst)
    for s, d in zip(src, dst):
        torch.testing.assert_close(d.full_tensor(), s.full_tensor().bfloat16())


def test_fast_kernels_swap_megatron_fallbacks_and_restore():
    import megatron.core.optimizer as mopt
    import megatron.core.optimizer.clip_grads as mclip
    import megatron.core.optimizer.optimizer as moo
    from megatron.core import utils as mutils

    from megagpt.train_step import optimizer as optim

    if not optim.megatron_uses_local_fallbacks():
        pytest.skip("TE or apex installed: megatron has its fused kernels")
    before = (mopt.Adam, mclip.l2_norm_impl, moo._multi_tensor_copy_this_to_that)
    assert mopt.USING_PYTORCH_OPTIMIZER and mclip.l2_norm_impl is mutils.local_multi_tensor_l2_norm
    with optim.fast_kernels(megatron_fused_optimizer=False) as changed:
        assert changed
        assert mopt.Adam is optim.torch_fused_adam and not mopt.USING_PYTORCH_OPTIMIZER
        assert mclip.l2_norm_impl is optim.foreach_multi_tensor_l2norm
        assert mclip.multi_tensor_scale_impl is optim.foreach_multi_tensor_scale
        assert moo._multi_tensor_copy_this_to_that is optim.foreach_copy_this_to_that
    assert (mopt.Adam, mclip.l2_norm_impl, moo._multi_tensor_copy_this_to_that) == before
    assert mclip.l2_norm_impl is mutils.local_multi_tensor_l2_norm
    assert mopt.USING_PYTORCH_OPTIMIZER


def test_torch_fused_adam_takes_megatrons_arguments_and_matches_foreach_adamw():
    from megagpt.train_step.optimizer import torch_fused_adam

    torch.manual_seed(0)
    p1 = torch.nn.Parameter(torch.randn(64))
    p2 = torch.nn.Parameter(p1.detach().clone())
    kw = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    fused = torch_fused_adam([p1], capturable=False, adam_w_mode=True, **kw)
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"]
    plain = torch.optim.AdamW([p2], foreach=False, **kw)
    for step in range(3):
        grad = torch.randn(64, generator=torch.Generator().manual_seed(step))
        p1.grad, p2.grad = grad.clone(), grad.clone()
        fused.step()
        plain.step()
    torch.testing.assert_close(p1, p2, rtol=1e-6, atol=1e-7)
    assert isinstance(torch_fused_adam([torch.nn.Parameter(torch.zeros(2))], adam_w_mode=False),
                      torch.optim.Adam)
    with pytest.raises(TypeError, match="exp_avg_dtype"):
        torch_fused_adam([torch.nn.Parameter(torch.zeros(2))], exp_avg_dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# switches and when the fast path applies
# ---------------------------------------------------------------------------------------
def _parse(argv):
    from megagpt.command_line.fast_path_options import add_fast_path_arguments

    p = argparse.ArgumentParser()
    add_fast_path_arguments(p)
    return p.parse_args(argv)


def _resolved(argv=(), **attrs):
    from megagpt.launch.fast_path import apply_fast_path_defaults

    args = _parse(list(argv))
    base = dict(transformer_impl="local", spec=None, num_experts=None, world_size=1,
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                context_parallel_size=1, cuda_graph_impl="none",
                check_for_nan_in_loss_and_grad=True, check_for_spiky_loss=False,
                cpu=False, optimizer="adam")
    base.update(attrs)
    for k, v in base.items():
        setattr(args, k, v)
    lines = []
    launch = apply_fast_path_defaults(args, lines.append)
    return args, lines, launch


@pytest.fixture()
def restore_optimizer():
    """Nothing of megatron changed before the test, and nothing left changed after it."""
    from megatron_parts import megatron_changes_in_place

    assert megatron_changes_in_place() == []
    yield
    assert megatron_changes_in_place() == []


def test_flags_parse_on_a_parser_and_on_a_group():
    from megagpt.command_line.fast_path_options import add_fast_path_arguments

    a = _parse([])
    assert a.fast_spec and a.fast_spec_fused_layer and a.fast_optimizer and a.fast_lm_loss
    assert a.fast_spec_compile is None and a.fast_cuda_graph is None
    assert a.fast_layer_graphs is None and a.fast_disable == []
    a = _parse(["--no-fast-spec", "--fast-compile", "off", "--fast-cuda-graphs", "none",
                "--fast-disable", "optimizer,lm-loss", "--fast-disable", "fused-layer"])
    assert not any([a.fast_spec, a.fast_spec_compile, a.fast_cuda_graph, a.fast_layer_graphs,
                    a.fast_optimizer, a.fast_lm_loss, a.fast_spec_fused_layer])
    assert a.fast_disable == ["optimizer", "lm-loss", "fused-layer"]
    assert a.fast_flat_adam and a.fast_async_step  # only the pieces named
    a = _parse(["--fast-disable", "deferred-nan-checks", "--fast-cuda-graphs", "layers"])
    assert a.fast_step_nan_checks is True
    assert (a.fast_cuda_graph, a.fast_layer_graphs) == (False, True)
    p = argparse.ArgumentParser()
    add_fast_path_arguments(p.add_argument_group("entry"))
    assert p.parse_args(["--fast-cuda-graphs", "iteration"]).fast_cuda_graph is True
    assert p.parse_args(["--fast-compile", "on"]).fast_spec_compile is True


def test_an_unknown_piece_is_refused_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        _parse(["--fast-disable", "flat-adam,warp-drive"])
    err = capsys.readouterr().err
    assert "unknown piece(s) warp-drive" in err and "flat-adam" in err.split("known:")[1]


@pytest.mark.parametrize("old,new", [
    ("--fast-cuda-graph", "--fast-cuda-graphs iteration"),
    ("--no-fast-layer-graphs", "--fast-cuda-graphs none"),
    ("--no-fast-flat-adam", "--fast-disable flat-adam"),
    ("--fast-wgrad-fusion", "removed"),
])
def test_an_earlier_versions_option_is_refused_with_its_new_spelling(tmp_path, old, new):
    """Through the entry's parser, before megatron's: one line naming what to use."""
    from megagpt.launch import parse_arguments
    from megagpt.errors import UserError

    with pytest.raises(UserError, match=f"{old} is no longer an option: .*{new}"):
        parse_arguments(["--num-layers", "2", "--hidden-size", "64", old, "--cpu"])


def test_defaults_single_gpu_fast_path_uses_graph_and_compile(restore_optimizer):
    args, lines, _ = _resolved()
    assert args.cuda_graph_impl == "full_iteration" and args.fast_cuda_graph
    assert args.fast_spec_compile is True
    assert args.check_for_nan_in_loss_and_grad is False
    assert any("CUDA graph" in line for line in lines)


@pytest.mark.parametrize(
    "argv,attrs,reason,impl",
    [
        # where the fast spec runs without the full-iteration graph, per-layer graphs hold
        # the compiled layer
        (["--fast-cuda-graphs", "layers"], {}, None, "local"),
        ([], {"world_size": 8}, "more than one GPU", "local"),
        ([], {"check_for_spiky_loss": True}, "spiky", "local"),
        ([], {"cuda_graph_impl": "local"}, "--cuda-graph-impl local", "local"),
        (["--fast-cuda-graphs", "none"], {}, None, "none"),
        (["--no-fast-spec"], {}, None, "none"),
        ([], {"context_parallel_size": 2}, None, "none"),
        ([], {"transformer_impl": "transformer_engine", "world_size": 2}, "asks for it",
         "none"),
        ([], {"transformer_impl": "transformer_engine", "num_experts": 4}, None, "none"),
    ],
)
def test_graph_stays_off_where_it_does_not_apply(restore_optimizer, argv, attrs, reason, impl):
    args, lines, _ = _resolved(argv, **attrs)
    assert not args.fast_cuda_graph
    assert args.cuda_graph_impl == impl
    assert args.fast_layer_graphs is (impl == "local")
    # megatron's in-step checks wait for the GPU: off under per-layer graphs too
    assert args.check_for_nan_in_loss_and_grad is (impl == "none")
    # compiled inside graphs; eager without any (a CPU-bound step)
    assert args.fast_spec_compile is (impl == "local")
    if reason:
        assert any(reason in line for line in lines), lines


def test_te_dense_layers_on_one_gpu_take_the_full_iteration_graph_when_asked(
        restore_optimizer):
    """Transformer Engine's layer spec takes the launch-level graph when asked for
    (--fast-cuda-graphs iteration: megatron's --cuda-graph-impl full_iteration, with the fast path's
    capture deadline and NaN handling; bench/notes/fast-path.md has its measured gain), and says
    how to ask where it is off; per-layer graphs and the gradient writes stay the fast spec's."""
    args, lines, _ = _resolved([], transformer_impl="transformer_engine")
    assert not args.fast_cuda_graph and args.cuda_graph_impl == "none"
    assert any("--fast-cuda-graphs iteration asks for it" in line for line in lines), lines
    args, lines, _ = _resolved(["--fast-cuda-graphs", "iteration"], transformer_impl="transformer_engine")
    assert args.fast_cuda_graph and args.cuda_graph_impl == "full_iteration"
    assert args.check_for_nan_in_loss_and_grad is False
    assert not args.fast_layer_graphs and not args.fast_grad_write
    assert not args.fast_bf16_grad_buffer
    assert any("captured as one CUDA graph" in line for line in lines), lines


def test_megatrons_own_full_iteration_flag_is_kept_and_said_so(restore_optimizer):
    """megatron's --cuda-graph-impl full_iteration, given by the user, runs as given (also on
    several GPUs, where the fast path would not choose it): the log must not call it off."""
    args, lines, _ = _resolved([], cuda_graph_impl="full_iteration", world_size=2,
                            check_for_nan_in_loss_and_grad=False)
    assert args.cuda_graph_impl == "full_iteration" and not args.fast_cuda_graph
    assert args.fast_spec_compile is True  # compiled, as under the fast path's own graph
    assert any("full_iteration as given" in line and "2 GPU" in line for line in lines), lines
    assert not any("graph off" in line for line in lines), lines


def test_graph_asked_for_on_several_gpus(restore_optimizer, monkeypatch):
    """Asked for on several GPUs, the full-iteration graph captures the data-parallel
    collectives (NCCL told to connect every peer up front); under pipeline parallelism, and
    with --overlap-param-gather, it is refused before any work."""
    from megagpt.errors import UserError

    monkeypatch.delenv("NCCL_RUNTIME_CONNECT", raising=False)
    args, lines, _ = _resolved(["--fast-cuda-graphs", "iteration"], world_size=2)
    assert args.cuda_graph_impl == "full_iteration" and not args.fast_layer_graphs
    assert any("on 2 GPUs, asked for" in line for line in lines), lines
    import os

    assert os.environ["NCCL_RUNTIME_CONNECT"] == "0"
    monkeypatch.setenv("NCCL_RUNTIME_CONNECT", "1")  # the user's own setting is kept
    _resolved(["--fast-cuda-graphs", "iteration"], world_size=2)
    assert os.environ["NCCL_RUNTIME_CONNECT"] == "1"
    with pytest.raises(UserError, match="--fast-cuda-graphs iteration with pipeline parallelism"):
        _resolved(["--fast-cuda-graphs", "iteration"], world_size=2, pipeline_model_parallel_size=2)
    with pytest.raises(UserError, match="--overlap-param-gather with the full-iteration"):
        _resolved(["--fast-cuda-graphs", "iteration"], world_size=2, overlap_param_gather=True)
    with pytest.raises(UserError, match="--overlap-param-gather with the full-iteration"):
        _resolved([], cuda_graph_impl="full_iteration", overlap_param_gather=True,
                  check_for_nan_in_loss_and_grad=False)
    # by default on one GPU the graph gives way to --overlap-param-gather (and per-layer
    # graphs, which hold the fused layer, stay off with it)
    args, lines, _ = _resolved([], overlap_param_gather=True, use_distributed_optimizer=True)
    assert not args.fast_cuda_graph and args.cuda_graph_impl == "none"
    assert any("full-iteration CUDA graph off: --overlap-param-gather" in line
               for line in lines), lines
    args, _, _ = _resolved(["--fast-cuda-graphs", "iteration"], world_size=1)
    assert args.cuda_graph_impl == "full_iteration"


def test_cpu_mode_never_compiles_or_graphs(restore_optimizer):
    args, _, _ = _resolved(["--fast-compile", "on", "--fast-cuda-graphs", "iteration"], cpu=True)
    assert args.fast_spec_compile is False and not args.fast_cuda_graph
    assert args.cuda_graph_impl == "none"


def test_no_fast_optimizer_leaves_megatron_alone(restore_optimizer):
    import megatron.core.optimizer as mopt

    before = mopt.Adam
    _resolved(["--fast-disable", "optimizer"])
    assert mopt.Adam is before


def test_resolving_patches_nothing_the_launchs_context_does(restore_optimizer):
    """--help and --dry-run resolve the launch only; the launch's context installs the
    optimizer and step replacements, and takes them off again."""
    import megatron.core.optimizer as mopt
    import megatron.training.training as mtraining

    from megagpt import megatron_wrappers
    from megagpt.launch.megatron_changes import launched
    from megagpt.train_step import flat_adam, grad_write, optimizer as optim

    if not optim.megatron_uses_local_fallbacks():
        pytest.skip("TE or apex installed: megatron has its fused kernels")
    before = (mopt.Adam, mtraining.training_log)
    args, _, launch = _resolved(bf16=True)
    assert (mopt.Adam, mtraining.training_log) == before
    assert args.fast_grad_write and not grad_write.grad_write_enabled()
    # what the run log and the other pieces read of a launch's validated arguments
    vars(args).update(seq_length=16, log_interval=1, save=None, tensorboard_dir=None,
                      fp16=False, gpu_type=None)
    lines = []
    with launched(launch, args, log=lines.append):
        assert grad_write.grad_write_enabled()
        assert mopt.Adam is optim.torch_fused_adam
        assert mtraining.training_log is not before[1]
        assert flat_adam.__name__ in megatron_wrappers.installed(  # the flat step, once built
            mtraining, "setup_model_and_optimizer")
    assert any("no host synchronisation" in line for line in lines)
    assert (mopt.Adam, mtraining.training_log) == before and not grad_write.grad_write_enabled()


def test_no_fast_flat_adam_keeps_megatrons_step(restore_optimizer):
    from megagpt.launch.megatron_changes import pieces
    from megagpt.train_step import optimizer as optim

    if not optim.megatron_uses_local_fallbacks():
        pytest.skip("TE or apex installed: megatron has its fused kernels")
    lines = []
    for argv, flat in (([], True), (["--fast-disable", "flat-adam"], False)):
        args, _, launch = _resolved(argv, bf16=True)
        names = [name for name, _ in pieces(launch, args, log=lines.append)]
        assert ("flat AdamW step" in names) is flat and "optimizer kernels" in names
    assert any("--fast-disable flat-adam" in line for line in lines)


@pytest.mark.parametrize(
    "attrs,needle",
    [
        ({"context_parallel_size": 2}, "context parallelism"),
        ({"multi_latent_attention": True}, "multi-latent"),
        ({"softmax_type": "off-by-one"}, "softmax"),
        ({"window_size": (64, 0)}, "sliding-window"),
        ({"fast_spec": False}, "--no-fast-spec"),
        ({"spec": ["mod", "fn"]}, "--spec"),
    ],
)
def test_fast_spec_unsupported_reasons(attrs, needle):
    from megagpt.fast_spec.spec import fast_spec_unsupported_reason

    assert fast_spec_unsupported_reason(_args()) is None
    reason = fast_spec_unsupported_reason(_args(**attrs))
    assert reason is not None and needle in reason


@pytest.mark.parametrize("acc_dtype, op_dtype", [(torch.float32, torch.float32),
                                                  (torch.float32, torch.bfloat16)])
def test_weight_gradient_written_ignores_what_the_accumulator_held(acc_dtype, op_dtype):
    """The chunked loss's first chunk writes its weight gradient into an uninitialised
    accumulator (no zero fill): NaN there must not leak; later chunks add."""
    from megagpt.fast_spec.lm_loss import accumulate_weight_grad

    g = torch.Generator().manual_seed(0)
    a = [torch.randn(16, 8, generator=g).to(op_dtype) for _ in range(2)]
    x = [torch.randn(16, 4, generator=g).to(op_dtype) for _ in range(2)]
    acc = torch.full((8, 4), float("nan"), dtype=acc_dtype)
    accumulate_weight_grad(acc, a[0], x[0], write=True)
    accumulate_weight_grad(acc, a[1], x[1])
    ref = sum(ai.double().t() @ xi.double() for ai, xi in zip(a, x))
    torch.testing.assert_close(acc.double(), ref, rtol=1e-2, atol=1e-2)


def test_chunks_grow_with_the_hidden_size():
    from megagpt.fast_spec.lm_loss import _chunks, chunk_elements_for

    tokens, vocab = 8192, 50304
    assert len(_chunks(tokens, vocab, chunk_elements_for(1024))) == 8  # 345M: 1024 tokens
    assert len(_chunks(tokens, vocab, chunk_elements_for(2048))) == 4  # 1.3B: 2048 tokens
    assert chunk_elements_for(512) == chunk_elements_for(1024)


# ---------------------------------------------------------------------------------------
# GPU (skipped without CUDA)
# ---------------------------------------------------------------------------------------
def _lm_head_inputs(tokens: int, hidden: int, vocab: int, seed: int):
    """bf16 hidden states, a bf16 output weight and labels on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.05).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    return h, w, labels


@pytest.mark.gpu
def test_gpu_compiled_chunked_loss_matches_eager():
    from megagpt.fast_spec import lm_loss

    h, w, labels = _lm_head_inputs(tokens=4096, hidden=256, vocab=5000, seed=0)
    out = {}
    for compiled in (True, False):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = lm_loss.chunked_linear_cross_entropy(hh, ww, labels, chunk_elements=2**21,
                                                    compile_kernels=compiled)
        loss.sum().backward()
        out[compiled] = (loss, hh.grad.float(), ww.grad.float())
    ref = F.cross_entropy((h.float() @ w.float().t()), labels, reduction="none")
    torch.testing.assert_close(out[True][0], ref, rtol=2e-2, atol=2e-2)
    for a, b in zip(out[True], out[False]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("fused_accumulation", [True, False])
def test_gpu_chunked_loss_gradients_match_fp32_autograd(monkeypatch, fused_accumulation):
    """Over many chunks, the weight gradient holds every chunk's contribution — with the
    weight gradient accumulated by one fp32-output GEMM per chunk, and with GEMM + add."""
    from megagpt.fast_spec import lm_loss

    h, w, labels = _lm_head_inputs(tokens=2048, hidden=128, vocab=4096, seed=1)
    assert lm_loss.fused_fp32_accumulation_works(h.device)  # torch 2.11 on an H200 does
    if not fused_accumulation:
        monkeypatch.setitem(lm_loss._FUSED_FP32_ACCUMULATION, str(h.device), False)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lm_loss.chunked_linear_cross_entropy(hh, ww, labels, chunk_elements=2**20).sum().backward()
    # the first chunk writes into an uninitialised accumulator: its old contents must not count
    acc = torch.full(w.shape, float("nan"), device="cuda")
    logit_grad = torch.randn(512, w.size(0), device="cuda").bfloat16()
    lm_loss.accumulate_weight_grad(acc, logit_grad, h[:512], write=True)
    torch.testing.assert_close(acc, logit_grad.float().t() @ h[:512].float(), rtol=1e-2,
                               atol=1e-2)
    hf, wf = h.float().requires_grad_(), w.float().requires_grad_()
    F.cross_entropy(hf @ wf.t(), labels, reduction="sum").backward()
    for ours, ref in ((hh.grad, hf.grad), (ww.grad, wf.grad)):
        rel = (ours.float() - ref).norm() / ref.norm()
        assert rel < 2e-2, rel


@pytest.mark.gpu
def test_gpu_gradients_formed_in_forward_match_the_recomputing_loss():
    """bf16, compiled, many chunks, a loss mask with zeros: the same losses and gradients as
    the chunked loss that recomputes logits in backward."""
    from megagpt.fast_spec import lm_loss

    h, w, labels = _lm_head_inputs(tokens=4096, hidden=256, vocab=5000, seed=2)
    mask = (torch.rand(4096, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
            > 0.2).float()
    out = []
    for grad_in_forward in (True, False):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if grad_in_forward:
            loss = lm_loss.chunked_linear_cross_entropy_grad_in_forward(
                hh, ww, labels, mask, chunk_elements=2**21)
        else:
            loss = lm_loss.chunked_linear_cross_entropy(hh, ww, labels, chunk_elements=2**21)
        ((loss * mask).sum() / mask.sum()).backward()
        out.append((loss, hh.grad.float(), ww.grad.float()))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-4)


@pytest.mark.gpu
def test_gpu_fused_layer_compiled_matches_eager_bf16():
    from megagpt.fast_spec.layer import fused_layer_forward

    torch.manual_seed(0)
    s, b, h, heads = 256, 2, 256, 4
    dev, dt = "cuda", torch.bfloat16

    def p(*shape, scale=0.02):
        return (torch.randn(*shape, device=dev) * scale).to(dt).requires_grad_()

    x = torch.randn(s, b, h, device=dev, dtype=dt, requires_grad=True)
    tensors = [torch.ones(h, device=dev, dtype=dt, requires_grad=True), p(h), p(3 * h, h),
               p(3 * h), p(h, h), p(h), torch.ones(h, device=dev, dtype=dt, requires_grad=True),
               p(h), p(4 * h, h), p(4 * h), p(h, 4 * h), p(h), None]
    consts = dict(eps=1e-5, rms=False, groups=heads, q_per_group=1, head_dim=h // heads,
                  scale=(h // heads) ** -0.5, attn_p=0.0, hidden_p=0.0, act="gelu_tanh",
                  rotary_interleaved=False, rope_mscale=1.0, training=True)
    outs = []
    for fn in (fused_layer_forward, torch.compile(fused_layer_forward, fullgraph=True)):
        for t in [x, *tensors]:
            if t is not None:
                t.grad = None
        y = fn(x, *tensors, **consts)
        y.float().square().mean().backward()
        outs.append((y.float(), x.grad.float(), tensors[2].grad.float()))
    for a, b_ in zip(*outs):
        torch.testing.assert_close(a, b_, rtol=3e-2, atol=3e-3)


def test_output_processor_is_the_launchs_lm_loss():
    from megagpt.fast_spec.lm_loss import fused_lm_head_loss
    from megagpt.gpt_model import output_processor

    def chosen(argv=(), **attrs):
        return output_processor(_resolved(argv, **attrs)[2])

    compiled = chosen(["--fast-compile", "on"])
    assert compiled.func is fused_lm_head_loss
    assert compiled.keywords == {"grad_in_forward": True, "compile_kernels": True}
    for argv, attrs in ((["--fast-disable", "lm-grad-in-forward"], {}),
                        ([], dict(pipeline_model_parallel_size=2, world_size=2))):
        eager = chosen(["--fast-compile", "off", *argv], **attrs)
        assert eager.func is fused_lm_head_loss
        assert eager.keywords == {"grad_in_forward": False, "compile_kernels": False}
    assert chosen(["--fast-disable", "lm-loss"]) is None
    assert chosen(transformer_impl="transformer_engine") is None
    assert chosen(cross_entropy_loss_fusion=True) is None
    assert chosen(tensor_model_parallel_size=2, world_size=2) is None  # vocab-parallel output


def test_compiler_failure_falls_back_to_eager(cpu_buffers):
    """A torch.compile failure does not stop training: the fused layer runs eagerly."""
    import torch._dynamo

    from megagpt.fast_spec import layer as layer_mod

    def broken_backend(gm, example_inputs):
        raise RuntimeError("backend exploded")

    ref, fast = _models(_config(), _args())
    torch._dynamo.reset()
    options = _with_fused_options(fast, compile=True, options={"backend": broken_backend})
    assert layer_mod.layer_function(options) is not layer_mod.fused_layer_forward
    _assert_same(ref, fast, _batch(8))
    # the failed setting runs eagerly from now on; other settings still compile
    assert layer_mod.layer_function(options) is layer_mod.fused_layer_forward
    assert layer_mod.layer_function(layer_mod.FusedLayerOptions.make(
        compile=True, options={"backend": "eager"})) is not layer_mod.fused_layer_forward


# TE's layer spec fuses each pre-norm into the linear after it; its checkpoint names the norm's
# tensors after that linear (megatron's TELayerNormColumnParallelLinear)
TE_NORM_NAMES = {"self_attention.linear_qkv.layer_norm_weight",
                 "self_attention.linear_qkv.layer_norm_bias",
                 "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias"}


def _is_extra_state(key: str) -> bool:
    return key.endswith("_extra_state")


def test_fast_spec_checkpoint_names_its_norms_as_te_layers_do(megatron_cpu):
    """A distributed checkpoint crosses between the fast spec and TE's layers only if both
    name every tensor alike: the fast spec's layer norms must be saved under TE's names, not
    under ``input_layernorm`` / ``pre_mlp_layernorm`` (megatron's local spec maps them; the
    fast spec keeps that map). Every other tensor has the same name in both specs."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megagpt.fast_spec.spec import fast_decoder_block_spec

    config = _config()
    model = GPTModel(config, fast_decoder_block_spec(_spec(_args()), config),
                     vocab_size=VOCAB, max_sequence_length=SEQ)
    # the name each tensor has in the checkpoint (layers stacked under one name, their index
    # an offset), not the module path it has in the model
    keys = {v.key for v in model.sharded_state_dict().values() if not _is_extra_state(v.key)}
    layer_keys = {k.removeprefix("decoder.layers.") for k in keys if k.startswith("decoder.layers.")}
    assert TE_NORM_NAMES <= layer_keys, sorted(layer_keys)
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in keys), sorted(keys)
    assert {"self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
            "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"} <= layer_keys

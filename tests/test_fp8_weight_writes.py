"""The FP8 weights the flat AdamW step writes for the fast spec's FP8 linears
(megagpt.fast_spec.fp8_weights, megagpt.train_step.flat_adam_fp8).

A real megatron GPT of the fast spec's fused layers in FP8 (the recipe's float32 emulation
of the GEMMs, which runs on the CPU), in megatron's DDP with megatron's bf16 optimizer and
the flat step, is trained with the writes on and off: the copies must be, at every step,
the forward's own cast of the weight (``fp8_cast``'s reference: bytes, scale, amax), and the
two runs must give the same losses and weights, bit for bit. The GPU tests (``gpu``) hold
the Triton kernel against the reference and the compiled layer under a CUDA graph.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gloo_ranks import single_gloo_rank
from megatron_parts import TINY_SEQ as SEQ
from megatron_parts import TINY_VOCAB as VOCAB
from megatron_parts import fast_optimizer_kernels, tiny_ddp_gpt

from megagpt.fast_spec import fp8, fp8_cast, fp8_weights
from megagpt.fast_spec.fp8 import ALL_LINEARS, FC1, FC2, Fp8Recipe

BATCH = 2
E4M3 = torch.float8_e4m3fn
ROOT = Path(__file__).resolve().parents[1]

RECIPES = {
    "hybrid": Fp8Recipe(emulate=True),
    "e4m3, history 3, max": Fp8Recipe(format="e4m3", history_len=3, amax_algo="max",
                                      emulate=True),
    "history 4, most recent, own first amaxes": Fp8Recipe(
        history_len=4, first_scales="amax", grad_scaling="current", emulate=True),
    "no fp8 wgrad, qkv and proj in bf16": Fp8Recipe(wgrad=False, linears=(FC1, FC2),
                                                    emulate=True),
}


@pytest.fixture()
def cpu_megatron():
    from megagpt import cpu_mode

    with fast_optimizer_kernels(), single_gloo_rank(), cpu_mode.active():
        yield


def _written(recipe: Fp8Recipe, on: bool = True) -> Fp8Recipe:
    import dataclasses

    return dataclasses.replace(recipe, weights_written=on)


def _spec_args():
    return argparse.Namespace(fast_spec=True, fast_spec_fused_layer=True,
                              fast_spec_compile=False, normalization="LayerNorm",
                              qk_layernorm=False, num_experts=None, reset_attention_mask=False,
                              context_parallel_size=1)


def _build(recipe: Fp8Recipe, device="cpu", compile_layer=False, compiled_step=False,
           attach=True):
    """The tiny GPT of fused FP8 layers, megatron's bf16 optimizer and the flat step."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megagpt.fast_spec.layer import FusedLayerOptions
    from megagpt.fast_spec.spec import get_fast_gpt_layer_spec
    from megagpt.train_step import flat_adam

    fused = FusedLayerOptions.make(compile=compile_layer, fp8=recipe)
    # 32 wide, 32 tokens a micro-batch: every GEMM dimension a multiple of 16, as FP8's
    # need on a GPU
    model = tiny_ddp_gpt(spec=get_fast_gpt_layer_spec(_spec_args(), fused), device=device)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, adam_beta1=0.9,
                        adam_beta2=0.95, bf16=True, params_dtype=torch.bfloat16, clip_grad=1.0),
        [model])
    if not attach:
        return model, opt, None
    (sub,) = flat_adam.megatron_optimizers(opt)
    params = flat_adam.buffer_params([model])
    assert flat_adam.unsupported_reason(sub, params) is None
    state = flat_adam.attach(sub, params, compiled=compiled_step)
    return model, opt, state



def _layers(model):
    from megagpt.fast_spec.layer import FastTransformerLayer

    return [m for m in model.modules() if isinstance(m, FastTransformerLayer)]


def _batches(n: int, device="cpu", seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(device) for _ in range(n)]


def _forward(model, tokens):
    positions = torch.arange(SEQ, device=tokens.device).expand(BATCH, -1)
    return model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()


def _train_step(model, opt, tokens) -> float:
    model.zero_grad_buffer()
    opt.zero_grad()
    loss = _forward(model, tokens)
    loss.backward()
    model.finish_grad_sync()
    ok, _, _ = opt.step()
    assert ok
    return loss.item()


def _evaluate(model, tokens) -> float:
    model.eval()
    with torch.no_grad():
        loss = _forward(model, tokens).item()
    model.train()
    return loss


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


class _WeightCasts:
    """Counts the FP8 casts of the layers' weights (the forward's own, by their storage)."""

    def __init__(self, monkeypatch, model):
        self.weights = {p.data_ptr() for layer in _layers(model)
                        for p in (layer.self_attention.linear_qkv.weight,
                                  layer.self_attention.linear_proj.weight,
                                  layer.mlp.linear_fc1.weight, layer.mlp.linear_fc2.weight)}
        self.count = 0
        original = fp8_cast.cast_transpose

        def counting(t, *args, **kwargs):
            if t.data_ptr() in self.weights:
                self.count += 1
            return original(t, *args, **kwargs)

        monkeypatch.setattr(fp8_cast, "cast_transpose", counting)

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def _assert_copies_are_the_forwards_cast(layer):
    """Each FP8 weight's copies: the forward's own cast of the weight by the scale its next
    forward reads from the history (bytes of both layouts, scale, amax)."""
    recipe = layer.fused_options.fp8
    copies = layer._fp8_copies
    scales = fp8.delayed_scales(layer._fp8_history, recipe)
    for linear, weight in layer._fp8_weight_tensors().items():
        scale = scales[2 * linear + 1].reshape(1)
        q, q_t, amax = fp8_cast._cast_reference(weight.detach(), scale, E4M3, True)
        assert torch.equal(copies.w8[linear].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(copies.w8_t[linear].view(torch.uint8), q_t.view(torch.uint8))
        assert torch.equal(copies.scales[linear:linear + 1], scale)
        assert torch.equal(copies.amax[linear:linear + 1], amax)
    assert copies.fresh


# ---------------------------------------------------------------------------------------
# on the CPU: the reference operator, in a real megatron model and optimizer
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
def test_every_step_writes_each_weight_as_the_next_forward_would_cast_it(
        cpu_megatron, monkeypatch, recipe):
    model, opt, state = _build(_written(recipe))
    layers = _layers(model)
    assert state.fp8_weights is not None
    assert state.fp8_weights.count == len(layers) * len(recipe.linears)
    casts = _WeightCasts(monkeypatch, model)
    batches = _batches(5)
    _train_step(model, opt, batches[0])
    # the first forward casts its weights itself (no copies yet, no history to scale by)
    assert casts.take() == len(layers) * len(recipe.linears)
    for tokens in batches[1:]:
        for layer in layers:
            _assert_copies_are_the_forwards_cast(layer)
        amaxes = {id(layer): layer._fp8_copies.amax.clone() for layer in layers}
        _train_step(model, opt, tokens)
        assert casts.take() == 0  # every forward read the optimizer's copies
        for layer in layers:
            # the weights' amaxes in the history are the copies', as the forward's cast
            # records its own
            for linear in recipe.linears:
                assert layer._fp8_history[0, 2 * linear + 1] == amaxes[id(layer)][linear]
            for linear in set(ALL_LINEARS) - set(recipe.linears):
                assert layer._fp8_copies.w8[linear] is None
                assert layer._fp8_history[:, 2 * linear + 1].eq(0).all()


@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
def test_training_with_the_writes_on_and_off_gives_the_same_losses_and_weights(
        cpu_megatron, recipe):
    """Evaluation between the steps, as megatron's evaluate runs it (eval mode, no
    gradients: it moves the amax history as a training forward does)."""
    batches = _batches(7)
    runs = {}
    for on in (False, True):
        model, opt, state = _build(_written(recipe, on))
        assert (state.fp8_weights is not None) == on
        losses = [_train_step(model, opt, t) for t in batches[:3]]
        losses += [_evaluate(model, batches[3]), _evaluate(model, batches[4])]
        if on:  # back in training the copies follow the history evaluation moved on
            for layer in _layers(model):
                _assert_copies_are_the_forwards_cast(layer)
        losses += [_train_step(model, opt, t) for t in batches[5:]]
        runs[on] = losses, _weights(model), [layer._fp8_history.clone()
                                             for layer in _layers(model)]
    (losses_off, weights_off, history_off), (losses_on, weights_on, history_on) = \
        runs[False], runs[True]
    assert losses_on == losses_off
    assert all(torch.equal(a, b) for a, b in zip(weights_on, weights_off))
    assert all(torch.equal(a, b) for a, b in zip(history_on, history_off))


def test_a_resumed_run_casts_its_first_forward_and_trains_as_without_the_writes(
        cpu_megatron, monkeypatch):
    """The copies are derived state: not in the checkpoint, made again after a resume,
    whose first forward scales by its own amaxes (as the launch's plan sets a resume)."""
    recipe = _written(Fp8Recipe(history_len=2, emulate=True))
    model, opt, _ = _build(recipe)
    bf16_keys = set(_build(None)[0].state_dict())
    batches = _batches(6)
    for tokens in batches[:3]:
        _train_step(model, opt, tokens)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    assert set(saved_model) == bf16_keys  # nothing FP8 in the checkpoint

    resumed = {}
    for on in (True, False):
        model, opt, _ = _build(_written(Fp8Recipe(history_len=2, first_scales="amax",
                                                  emulate=True), on))
        model.load_state_dict(saved_model)
        # a copy each: the step counts loaded are stepped in place
        opt.load_state_dict(copy.deepcopy(saved_opt))
        casts = _WeightCasts(monkeypatch, model)
        losses = [_train_step(model, opt, batches[3])]
        assert casts.take() == 8  # the first forward after the resume casts its weights
        losses += [_train_step(model, opt, t) for t in batches[4:]]
        assert casts.take() == (0 if on else 16)
        resumed[on] = losses, _weights(model)
    assert resumed[True][0] == resumed[False][0]
    assert all(torch.equal(a, b) for a, b in zip(resumed[True][1], resumed[False][1]))


def test_a_state_dict_loaded_in_training_recasts_the_copies(cpu_megatron):
    model, opt, _ = _build(_written(Fp8Recipe(emulate=True)))
    for tokens in _batches(2):
        _train_step(model, opt, tokens)
    other, _, _ = _build(Fp8Recipe(emulate=True))
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    model.load_state_dict(other.state_dict())
    for layer in _layers(model):
        _assert_copies_are_the_forwards_cast(layer)


def test_the_compiled_layer_reads_every_layers_copies_without_recompiling():
    """torch.compile (AOTAutograd's graphs, fullgraph) of the fused layer over three layers
    whose copies are views of one store, as the flat step binds them: two graphs in all
    (the first forward, which casts; the others, which read), and the same outputs and
    histories as the compiled layer casting its weights every step."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from megagpt.fast_spec.layer import fused_layer_forward
    from megagpt.train_step import flat_adam_fp8 as writes

    h, s, b, n_layers = 64, 16, 2, 3
    g = torch.Generator().manual_seed(0)
    names = ("qkv_w", "proj_w", "fc1_w", "fc2_w")
    shapes = dict(ln1_w=(h,), ln1_b=(h,), qkv_w=(3 * h, h), qkv_b=(3 * h,), proj_w=(h, h),
                  proj_b=(h,), ln2_w=(h,), ln2_b=(h,), fc1_w=(4 * h, h), fc1_b=(4 * h,),
                  fc2_w=(h, 4 * h), fc2_b=(h,))
    start = [{k: torch.randn(*shape, generator=g) * (1.0 if k.startswith("ln") and
                                                     k.endswith("w") else 0.05)
              for k, shape in shapes.items()} for _ in range(n_layers)]
    recipe = Fp8Recipe(history_len=2, weights_written=True)
    kw = dict(rope=None, eps=1e-5, rms=False, groups=4, q_per_group=1, head_dim=h // 4,
              scale=(h // 4) ** -0.5, attn_p=0.0, hidden_p=0.0, act="gelu_tanh",
              rotary_interleaved=False, rope_mscale=1.0, training=True, fp8=recipe)
    x = torch.randn(s, b, h, generator=g)
    layer_copies = [fp8_weights.LayerCopies(ALL_LINEARS) for _ in range(n_layers)]
    offset, marked = 0, []
    for copies in layer_copies:
        for linear, name in enumerate(names):
            rows, cols = shapes[name]
            marked.append(writes._Marked(offset, rows, cols, copies, linear))
            offset += rows * cols + 3
    writes.Fp8WeightWrites(marked, offset, "cpu")
    compiled = torch.compile(fused_layer_forward, backend="aot_eager", fullgraph=True,
                             dynamic=False)

    def train(read: bool):
        weights = [{k: v.clone().requires_grad_() for k, v in layer.items()} for layer in start]
        histories = [fp8.new_history(recipe, "cpu") for _ in range(n_layers)]
        outs = []
        for step in range(4):
            for layer, history, copies in zip(weights, histories, layer_copies):
                extra = dict(fp8_history=history, fp8_warm=step > 0,
                             fp8_next_scales=copies.next_scales)
                if step > 0 and read:
                    extra["fp8_weights"] = copies.forward_inputs()
                out = compiled(x, **layer, **kw, **extra)
                out.sum().backward()
                copies.forward_done()
                outs.append(out.detach())
            with torch.no_grad():  # the optimizer: new weights, their copies cast
                for layer, copies in zip(weights, layer_copies):
                    for name in names:
                        layer[name].sub_(1e-2 * layer[name].grad.sign())
                        layer[name].grad = None
                    copies.refresh({i: layer[name] for i, name in enumerate(names)})
        return outs, histories

    torch._dynamo.reset()
    counters.clear()
    read = train(read=True)
    assert counters["stats"]["unique_graphs"] == 2
    cast = train(read=False)
    assert all(torch.equal(a, b) for a, b in zip(read[0], cast[0]))
    assert all(torch.equal(a, b) for a, b in zip(read[1], cast[1]))


def test_the_optimizers_log_line_says_whether_it_writes_the_fp8_weights(cpu_megatron,
                                                                         monkeypatch):
    from megatron.core.optimizer import ChainedOptimizer

    from megagpt.train_step import flat_adam

    lines = []
    model, opt, _ = _build(_written(Fp8Recipe(emulate=True)), attach=False)
    flat_adam.attach_after_setup(lambda: ([model], opt, None), lines.append, False)()
    assert "the bf16 weight copy and the FP8 copies of 8 linear weights in one pass" \
        in lines[-1]
    model, opt, _ = _build(_written(Fp8Recipe(emulate=True)), attach=False)
    two = ChainedOptimizer([opt.chained_optimizers[0], opt.chained_optimizers[0]])
    flat_adam.attach_after_setup(lambda: ([model], two, None), lines.append, False)()
    assert lines[-1].endswith("not used: 2 chained optimizers (the norm spans all of them); "
                              "the FP8 linears' weights are cast in each forward instead")
    # and they are: the layers' copies are never bound
    casts = _WeightCasts(monkeypatch, model)
    for tokens in _batches(2):
        _train_step(model, two, tokens)
    assert casts.take() == 16


def test_without_the_recipes_writes_nothing_is_marked_or_written(cpu_megatron):
    model, _, state = _build(Fp8Recipe(emulate=True))
    assert state.fp8_weights is None
    assert all(layer._fp8_copies is None for layer in _layers(model))
    assert not any(fp8_weights.marked(p) for p in model.parameters())
    with pytest.raises(ValueError, match="need delayed scaling"):
        Fp8Recipe(scaling="tensorwise", weights_written=True)


def test_the_kernel_tables_cover_the_buffer_once():
    """The Triton kernel's programs: 2-D tiles over each marked weight, 1-D blocks over the
    rest of the buffer, every element in exactly one program."""
    from megagpt.train_step import flat_adam_fp8 as writes

    rows = [(100, 48, 80, 0, 1), (100 + 48 * 80 + 37, 64, 16, 48 * 80, 6)]
    size = rows[1][0] + 64 * 16 + 5000
    covered = torch.zeros(size, dtype=torch.int32)
    for weight, tile_row, tile_col in writes._tiles(rows).tolist():
        offset, n_rows, n_cols = rows[weight][:3]
        r = torch.arange(tile_row * writes.TILE_ROWS, (tile_row + 1) * writes.TILE_ROWS)
        c = torch.arange(tile_col * writes.TILE_COLS, (tile_col + 1) * writes.TILE_COLS)
        r, c = r[r < n_rows], c[c < n_cols]
        covered[offset + (r[:, None] * n_cols + c[None, :]).flatten()] += 1
    for start, end in writes._blocks([(o, o + r * c) for o, r, c, *_ in rows], size).tolist():
        idx = torch.arange(start, min(start + writes.BLOCK, end))
        covered[idx] += 1
    assert covered.eq(1).all()


KERNEL_IN_THE_INTERPRETER = textwrap.dedent("""
    import types
    import torch
    import triton.language as tl
    from megagpt.fast_spec import fp8_cast
    from megagpt.train_step import flat_adam_fp8 as writes

    # libdevice's externs do not run in Triton's interpreter: pow from its own math
    writes.libdevice = types.SimpleNamespace(
        pow=lambda a, b: tl.exp(tl.log(a + tl.zeros_like(b)) * b))
    E4M3 = torch.float8_e4m3fn
    g = torch.Generator().manual_seed(0)
    rows = [(100, 48, 80, 0, 1), (100 + 48 * 80 + 37, 64, 16, 48 * 80, 6)]
    n = rows[1][0] + 64 * 16 + 2100
    grad = (torch.randn(n, generator=g) * 0.1).bfloat16()
    main = torch.randn(n, generator=g) * 0.05
    m, v = torch.randn(n, generator=g) * 0.01, torch.rand(n, generator=g) * 1e-4
    group_index = torch.zeros(n, dtype=torch.uint8)
    group_index[3000:] = 1
    lr_and_wd = torch.tensor([[1e-3, 2e-3], [0.1, 0.0]])
    step, clip = torch.tensor(3.0), torch.tensor(0.7)
    next_scales = torch.tensor([1.0, 3.0, 1, 1, 1, 1, 40.0, 1])
    weights = torch.tensor(rows, dtype=torch.int64)
    tiles = writes._tiles(rows)
    blocks = writes._blocks([(o, o + r * c) for o, r, c, *_ in rows], n)
    out = {}
    for kernel in (False, True):
        bufs = [main.clone(), m.clone(), v.clone(), main.bfloat16()]
        scales, amax = torch.zeros(8), torch.zeros(8)
        w8, w8_t = (torch.zeros(48 * 80 + 64 * 16, dtype=E4M3) for _ in range(2))
        args = (grad, *bufs, group_index, lr_and_wd, step, clip, next_scales)
        if kernel:
            scales.copy_(next_scales)
            writes._flat_adamw_fp8_kernel[(len(tiles) + len(blocks),)](
                *args, amax, w8, w8_t, weights, tiles, blocks, len(tiles), 2, 1,
                0.9, 0.95, 1 - 0.9, 1 - 0.95, 1e-8, LIMIT=448.0, DECOUPLED=True,
                ROWS=writes.TILE_ROWS, COLS=writes.TILE_COLS, BLOCK=writes.BLOCK)
        else:
            writes._reference(*args, scales, amax, w8, w8_t, weights, 0.9, 0.95, 1e-8, True)
        out[kernel] = bufs, scales, amax, w8, w8_t
    (ref, _, _, _, _), (got, scales, amax, w8, w8_t) = out[False], out[True]
    # every element stepped once: the moments equal the reference's, bit for bit; the
    # weights to the interpreter's pow
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-7)
    # the bf16 weights: the new fp32 ones rounded (the interpreter's rounding, not the GPU's)
    torch.testing.assert_close(got[3].float(), got[0], rtol=2 ** -7, atol=0)
    assert torch.equal(scales, next_scales)
    # the copies: fp8_cast's kernel's cast of the weights written (its rounding into e4m3
    # is the interpreter's, on both sides)
    for offset, r, c, f8, slot in rows:
        w = got[3][offset:offset + r * c].view(r, c)
        q, q_t = torch.empty(r, c, dtype=E4M3), torch.empty(c, r, dtype=E4M3)
        a = torch.zeros(1)
        fp8_cast._cast_transpose_kernel[(-(-r // 64), -(-c // 64))](
            w, next_scales[slot:slot + 1], q, q_t, a, r, c, LIMIT=448.0, TRANSPOSE=True,
            BLOCK_M=64, BLOCK_N=64)
        assert torch.equal(w8[f8:f8 + r * c].view(torch.uint8), q.view(torch.uint8).flatten())
        assert torch.equal(w8_t[f8:f8 + r * c].view(torch.uint8),
                           q_t.view(torch.uint8).flatten())
        assert amax[slot] == a[0] == w.float().abs().max()
    print("kernel ok")
""")


def test_the_triton_kernel_in_tritons_interpreter():
    """The kernel's layout (tiles, blocks, both layouts, amaxes) on the CPU, in Triton's
    interpreter (numpy): ``TRITON_INTERPRET`` must be set before its functions are made."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", KERNEL_IN_THE_INTERPRETER], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "kernel ok" in done.stdout, done.stderr[-3000:]


def test_the_dry_runs_memory_holds_the_written_copies_between_steps():
    """The copies the optimizer writes: 2 bytes per FP8 weight, all layers, held; the
    forward's transposed copy (1 byte per weight per layer in flight) then made no more."""
    import dataclasses

    from megagpt.preflight import estimate as est
    from megagpt.preflight.launch_path import FAST, WhatRuns

    args = argparse.Namespace(
        hidden_size=2048, num_attention_heads=16, kv_channels=None, num_query_groups=None,
        group_query_attention=False, ffn_hidden_size=8192, swiglu=False, num_layers=24,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
        seq_length=2048, context_parallel_size=1, micro_batch_size=4, sequence_parallel=False)
    cast = WhatRuns(path=FAST, chunked_loss=True, optimizer="fused AdamW, flat step",
                    cuda_graph=True, fp8=True)
    written = dataclasses.replace(cast, fp8_weights_written=True)
    per_layer = 2048 * 3 * 2048 + 2048 * 2048 + 2 * 2048 * 8192
    assert est.fp8_weight_store_bytes(args, cast) == 0.0
    assert est.fp8_weight_store_bytes(args, written) == 2 * 24 * per_layer
    assert est.layer_activation_bytes(args, "none", cast) \
        - est.layer_activation_bytes(args, "none", written) == per_layer
    mlp_only = dataclasses.replace(written, fp8_linears=(FC1, FC2))
    assert est.fp8_weight_store_bytes(args, mlp_only) == 2 * 24 * 2 * 2048 * 8192


# ---------------------------------------------------------------------------------------
# on a GPU: the Triton kernel, the compiled layer under a CUDA graph
# ---------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _fp8_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability 8.9+)")


@gpu
@needs_cuda
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_the_kernel_equals_the_compiled_update_and_the_cast_bit_for_bit(decoupled):
    """The Triton kernel's AdamW against the flat step's compiled update (what a step
    without the writes computes), bit for bit; its copies against fp8_cast's cast of the
    weights it wrote, bit for bit; and against the eager reference to fp32 rounding."""
    from megagpt.train_step import adamw_update
    from megagpt.train_step import flat_adam_fp8 as writes

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [(3 * 1024, 1024), (1024, 1024), (4096, 1024), (1024, 4096), (48, 80)]
    rows, offset, f8 = [], 4096 + 7, 0
    for slot, (r, c) in enumerate(shapes):
        rows.append((offset, r, c, f8, slot))
        offset += r * c + 1000 + slot
        f8 += -(-r * c // 16) * 16
    n = offset + 123457
    grad = (torch.randn(n, device=dev, generator=g) * 1e-2).bfloat16()
    main = torch.randn(n, device=dev, generator=g) * 0.02
    m = torch.randn(n, device=dev, generator=g) * 1e-3
    v = torch.rand(n, device=dev, generator=g) * 1e-6
    group_index = torch.randint(0, 2, (n,), device=dev, generator=g).to(torch.uint8)
    lr_and_wd = torch.tensor([[3e-4, 6e-4], [0.1, 0.0]], device=dev)
    step, clip = torch.tensor(7.0, device=dev), torch.tensor(0.8, device=dev)
    next_scales = torch.rand(len(shapes), device=dev, generator=g) * 1e4 + 1.0
    weights = torch.tensor(rows, dtype=torch.int64, device=dev)
    tiles = writes._tiles(rows).to(dev)
    blocks = writes._blocks([(o, o + r * c) for o, r, c, *_ in rows], n).to(dev)
    kw = dict(beta1=0.9, beta2=0.95, eps=1e-8, decoupled=decoupled)

    def fresh():
        return [main.clone(), m.clone(), v.clone(), main.bfloat16()]

    compiled = fresh()
    adamw_update.run_update(grad, *compiled, group_index, lr_and_wd, step, clip, **kw,
                            compiled=True)
    eager = fresh()
    adamw_update.run_update(grad, *eager, group_index, lr_and_wd, step, clip, **kw,
                            compiled=False)
    got = fresh()
    scales, amax = torch.zeros(len(shapes), device=dev), torch.full((len(shapes),), 7.0,
                                                                    device=dev)
    w8, w8_t = (torch.zeros(f8, dtype=E4M3, device=dev) for _ in range(2))
    torch.ops.megagpt.flat_adamw_fp8_update(grad, *got, group_index, lr_and_wd, step, clip,
                                            next_scales, scales, amax, w8, w8_t, weights,
                                            tiles, blocks, *kw.values())
    for name, a, b in zip(("main", "exp_avg", "exp_avg_sq", "model"), got, compiled):
        assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max()}"
    for a, b in zip(got[:3], eager[:3]):  # eager: IEEE division and pow, no fused multiply-add
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert torch.equal(got[3], got[0].bfloat16())
    assert torch.equal(scales, next_scales)
    for offset, r, c, f, slot in rows:
        w = got[3][offset:offset + r * c].view(r, c)
        q, q_t, a = fp8_cast.cast_transpose(w, next_scales[slot:slot + 1], E4M3, True)
        ref_q, ref_q_t, ref_a = fp8_cast._cast_reference(w, next_scales[slot:slot + 1], E4M3,
                                                         True)
        for copy_, cast in ((w8[f:f + r * c], q), (w8[f:f + r * c], ref_q),
                            (w8_t[f:f + r * c], q_t), (w8_t[f:f + r * c], ref_q_t)):
            assert torch.equal(copy_.view(torch.uint8), cast.reshape(-1).view(torch.uint8))
        assert amax[slot] == a[0] == ref_a[0]


def _graphed_training(recipe: Fp8Recipe, steps: int, warmup: int = 3):
    """The tiny GPT, its fused layers compiled, trained on the GPU as the fast path's
    one-GPU default runs it: megatron's full-iteration graph (forward and backward
    captured after ``warmup`` eager steps, replayed after) and the flat step, compiled,
    outside it. Losses, weights, the layers' amax histories, the flat step, and the graphs
    dynamo compiled from the second step on (none: the inputs do not recompile)."""
    from torch._dynamo.utils import counters

    model, opt, state = _build(recipe, device="cuda", compile_layer=True, compiled_step=True)
    batches = _batches(steps, device="cuda")
    tokens = batches[0].clone()  # the graph's static input
    loss_out = None
    graph = None
    losses = []

    def forward_backward():
        loss = _forward(model, tokens)
        loss.backward()
        model.finish_grad_sync()
        return loss.detach()

    compiled_by_step = []
    for i, batch in enumerate(batches):
        compiled_by_step.append(counters["stats"]["unique_graphs"])
        tokens.copy_(batch)
        model.zero_grad_buffer()
        opt.zero_grad()
        if i < warmup:
            loss_out = forward_backward()
        elif graph is None:
            if hasattr(torch.autograd.graph, "set_override_stale_capture_stream"):
                torch.autograd.graph.set_override_stale_capture_stream(True)
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
                loss_out = forward_backward()
            graph.replay()
        else:
            graph.replay()
        losses.append(loss_out.item())
        ok, _, _ = opt.step()
        assert ok
    torch.cuda.synchronize()
    recompiled = counters["stats"]["unique_graphs"] - compiled_by_step[2]
    return (losses, _weights(model), [layer._fp8_history.clone() for layer in _layers(model)],
            state, recompiled)


@gpu
@needs_cuda
def test_the_compiled_layer_under_a_cuda_graph_trains_the_same_with_the_writes_on_and_off():
    """The copies are static buffers: the captured forward reads them, the optimizer's
    kernel rewrites them in place, and each replay computes what the forward's own cast
    would have given; the compiled layer compiles once for the copies (no recompiles)."""
    _fp8_gpu()
    import torch._dynamo

    with fast_optimizer_kernels(), single_gloo_rank("nccl"):
        recipe = Fp8Recipe(history_len=2)
        torch._dynamo.reset()
        off = _graphed_training(_written(recipe, False), steps=8)
        torch._dynamo.reset()
        on = _graphed_training(_written(recipe, True), steps=8)
    assert on[3].fp8_weights is not None and off[3].fp8_weights is None
    # the first forward casts (not warm), the second on reads the copies: nothing compiled
    # after the second step's
    assert on[4] == off[4] == 0
    assert all(torch.isfinite(torch.tensor(on[0])))
    assert on[0] == off[0]
    assert all(torch.equal(a, b) for a, b in zip(on[1], off[1]))
    assert all(torch.equal(a, b) for a, b in zip(on[2], off[2]))

"""The fast spec's FP8 linears (megagpt.fast_spec.fp8) and the fused layer in FP8.

On the CPU the GEMMs run through torch's CPU ``_scaled_mm`` (and the float32 emulation the
recipe can ask for); the GPU tests (``gpu`` marker) run cuBLAS's FP8 kernels and hold the
emulation against them. The references are written out here from the definitions (one
scale per tensor, fp8_max / amax), not through the module's own helpers.
"""

from __future__ import annotations

import math

import pytest
import torch

from megagpt.fast_spec import fp8
from megagpt.fast_spec import layer as fast_layer  # registers megagpt::wgrad_into_main_grad
from test_fast_spec import (  # noqa: F401  (fixtures)
    _args, _batch, _config, _loss_and_grads, _models, _with_fused_options, cpu_buffers,
    megatron_cpu,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def sqnr(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB (torchao's measure)."""
    exact, approx = exact.double(), approx.double()
    return 20 * math.log10(exact.norm() / (approx - exact).norm().clamp_min(1e-300))


def dequantised(t: torch.Tensor, dtype, fp8_max: float) -> torch.Tensor:
    """``t`` rounded through ``dtype`` with one scale for the whole tensor, in float64."""
    amax = t.abs().max().double()
    scale = fp8_max / amax if amax > 0 else torch.tensor(1.0, dtype=torch.float64)
    q = (t.double() * scale).clamp(-fp8_max, fp8_max).to(torch.float32).to(dtype)
    return q.double() / scale


def _operands(m=64, k=96, n=48, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(device, dtype).requires_grad_()
    grad_out = (torch.randn(m, n, generator=g) * 1e-3).to(device, dtype)
    return x, w, b, grad_out


def _run(recipe, x, w, b, grad_out, main_grad=None):
    for t in (x, w, b):
        t.grad = None
    step = fp8.start_step(recipe, None, warm=False)
    y = fp8.fp8_linear(x, w, b, main_grad, step, fp8.QKV)
    y.backward(grad_out)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("emulate", [False, True], ids=["scaled_mm", "emulated"])
def test_the_three_gemms_equal_an_fp32_product_of_the_quantised_operands(fmt, emulate):
    x, w, b, grad_out = _operands()
    recipe = fp8.Fp8Recipe(format=fmt, scaling="tensorwise", emulate=emulate)
    y, dx, dw, db = _run(recipe, x, w, b, grad_out)
    g_dtype, g_max = (E5M2, 57344.0) if fmt == "hybrid" else (E4M3, 448.0)
    xq, wq = dequantised(x.detach(), E4M3, 448.0), dequantised(w.detach(), E4M3, 448.0)
    gq = dequantised(grad_out, g_dtype, g_max)
    # the products of the quantised operands: only float32 accumulation and rounding differ
    for got, exact in ((y, xq @ wq.t() + b.detach().double()), (dx, gq @ wq),
                       (dw, gq.t() @ xq)):
        assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    # the bias gradient is not quantised
    torch.testing.assert_close(db, grad_out.sum(0))


@pytest.mark.parametrize("fmt, grad_floor_db", [("hybrid", 20.0), ("e4m3", 25.0)])
def test_signal_to_noise_against_the_unquantised_linear(fmt, grad_floor_db):
    """torchao's bounds: >= 25 dB for the product; gradients through e5m2 (two mantissa bits
    against e4m3's three) lose ~6 dB more, so >= 20 dB under hybrid."""
    x, w, b, grad_out = _operands(m=256, k=512, n=384, seed=3)
    y, dx, dw, _ = _run(fp8.Fp8Recipe(format=fmt, scaling="tensorwise"), x, w, b, grad_out)
    y_ref = x @ w.t() + b
    for t in (x, w, b):
        t.grad = None
    y_ref.backward(grad_out)
    assert sqnr(y, y_ref.detach()) >= 25.0
    assert sqnr(dx, x.grad) >= grad_floor_db
    assert sqnr(dw, w.grad) >= grad_floor_db


@pytest.mark.parametrize("case", ["zeros", "outliers", "zero gradient"])
def test_zeros_and_outliers_stay_finite(case):
    x, w, b, grad_out = _operands(seed=5)
    with torch.no_grad():
        if case == "zeros":
            x.zero_()
        elif case == "outliers":
            x[3, 7] = 1e4
            w[1, 2] = -300.0
    if case == "zero gradient":
        grad_out = torch.zeros_like(grad_out)
    y, dx, dw, db = _run(fp8.Fp8Recipe(scaling="tensorwise"), x, w, b, grad_out)
    for t in (y, dx, dw, db):
        assert torch.isfinite(t).all()
    if case == "outliers":  # the outlier itself survives the cast (it sets the scale)
        y_ref = x.detach() @ w.detach().t() + b.detach()
        assert sqnr(y, y_ref) >= 20.0
    if case == "zero gradient":
        assert not dx.any() and not dw.any()


@pytest.mark.parametrize("wgrad", [True, False], ids=["fp8-wgrad", "bf16-wgrad"])
def test_the_gradient_written_into_main_grad_equals_autograds(wgrad):
    x, w, b, grad_out = _operands(seed=7)
    recipe = fp8.Fp8Recipe(scaling="tensorwise", wgrad=wgrad)
    _, dx_ref, dw_ref, _ = _run(recipe, x, w, b, grad_out)
    dx_ref, dw_ref = dx_ref.clone(), dw_ref.clone()
    main_grad = torch.full_like(w, float("nan"))  # written, not added to
    _, dx, placeholder, _ = _run(recipe, x, w, b, grad_out, main_grad=main_grad)
    torch.testing.assert_close(main_grad, dw_ref, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
    assert placeholder.shape == w.shape and placeholder.dtype == w.dtype


def test_delayed_scaling_scales_by_the_amaxes_of_the_forward_before():
    recipe = fp8.Fp8Recipe(scaling="delayed", first_scales="amax", grad_scaling="current")
    history = fp8.new_history(recipe, "cpu")
    x, w, b, _ = _operands(seed=9)
    first = fp8.start_step(recipe, history, warm=False)
    assert first.scales is None  # nothing recorded yet: each tensor's own amax
    y_first = fp8.fp8_linear(x, w, b, None, first, fp8.FC1)
    assert history[0, 2 * fp8.FC1] == x.detach().abs().max()
    assert history[0, 2 * fp8.FC1 + 1] == w.detach().abs().max()
    # the next forward scales by what the first recorded, whatever its own tensor holds
    x2 = (x.detach() * 3).requires_grad_()
    second = fp8.start_step(recipe, history, warm=True)
    assert second.scales[2 * fp8.FC1] == pytest.approx(448.0 / x.detach().abs().max().item())
    y_second = fp8.fp8_linear(x2, w, b, None, second, fp8.FC1)
    assert history[0, 2 * fp8.FC1] == x2.detach().abs().max()  # recorded for the one after
    # 3x the input saturates what exceeds the first forward's range: the second output is not
    # 3x the first, unlike with current scaling
    assert torch.isfinite(y_second).all() and torch.isfinite(y_first).all()
    current = fp8.fp8_linear(x2, w, b, None, fp8.start_step(
        fp8.Fp8Recipe(scaling="tensorwise"), None, False), fp8.FC1)
    assert not torch.allclose(y_second, current)


def test_unit_first_scales_cast_the_first_forward_and_its_gradients_by_one():
    """TE's delayed scaling: before any amax is recorded every scale is 1, so the first
    forward's small values round through e4m3 unscaled, and gradients below e5m2's
    smallest subnormal (2^-16) vanish; the second forward scales by the first's amaxes."""
    recipe = fp8.Fp8Recipe(scaling="delayed", first_scales="unit", grad_scaling="current",
                           emulate=True)
    history = fp8.new_history(recipe, "cpu")
    x, w, b, grad_out = _operands(seed=4)
    first = fp8.start_step(recipe, history, warm=False)
    assert first.first_unit and torch.equal(first.scales, torch.ones(fp8.HISTORY_COLUMNS))
    y = fp8.fp8_linear(x, w, b, None, first, fp8.FC2)
    y.backward(grad_out)
    xq, wq = (t.detach().to(E4M3).double() for t in (x, w))
    gq = grad_out.to(E5M2).double()
    for got, exact in ((y, xq @ wq.t() + b.detach().double()), (x.grad, gq @ wq),
                       (w.grad, gq.t() @ xq)):
        assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    # the amaxes are still recorded, for the next forward to scale by
    assert history[0, 2 * fp8.FC2] == x.detach().abs().max()
    # a gradient of 1e-6 is below e5m2's range at scale 1: the first backward's are zero,
    # the second's (scaled by its own amax) are not
    tiny = grad_out * 1e-3
    x.grad = w.grad = None
    fp8.fp8_linear(x, w, b, None, fp8.start_step(recipe, fp8.new_history(recipe, "cpu"),
                                                 warm=False), fp8.FC2).backward(tiny)
    assert not w.grad.any() and not x.grad.any()
    second = fp8.start_step(recipe, history, warm=True)
    assert not second.first_unit and second.grad_scale(fp8.FC2) is None
    assert second.scales[2 * fp8.FC2] == pytest.approx(448.0 / x.detach().abs().max().item())
    x.grad = w.grad = None
    fp8.fp8_linear(x, w, b, None, second, fp8.FC2).backward(tiny)
    assert w.grad.abs().max() > 0 and x.grad.abs().max() > 0
    assert "the first forward's scales 1" in recipe.describe()
    with pytest.raises(ValueError, match="first scales"):
        fp8.Fp8Recipe(first_scales="ones")


def test_delayed_gradient_scaling_scales_by_the_backward_before():
    """TE's delayed scaling of gradients: the backward records its gradient's amax; the next
    forward's step reads the scale from it (the gradient type's range), and a gradient
    beyond that range saturates rather than overflowing."""
    recipe = fp8.Fp8Recipe(scaling="delayed", first_scales="amax", grad_scaling="delayed",
                           emulate=True)
    history = fp8.new_history(recipe, "cpu")
    x, w, b, grad_out = _operands(seed=5)
    first = fp8.start_step(recipe, history, warm=False)
    assert first.grad_scale(fp8.PROJ) is None  # nothing recorded: the gradient's own amax
    fp8.fp8_linear(x, w, b, None, first, fp8.PROJ).backward(grad_out)
    column = fp8.GRAD_COLUMNS + fp8.PROJ
    assert history[0, column] == grad_out.abs().max()
    second = fp8.start_step(recipe, history, warm=True)
    assert second.grad_scale(fp8.PROJ) == pytest.approx(57344.0 / grad_out.abs().max().item())
    x.grad = w.grad = None
    fp8.fp8_linear(x, w, b, None, second, fp8.PROJ).backward(grad_out * 4)
    # scaled by the smaller amax before: the largest quarter of the gradient saturates
    xq, wq = (dequantised(t.detach(), E4M3, 448.0) for t in (x, w))
    g_scale = second.grad_scale(fp8.PROJ).double()
    gq = ((grad_out * 4).double() * g_scale).clamp(-57344, 57344).float().to(E5M2).double()
    exact = (gq / g_scale) @ wq
    assert torch.isfinite(x.grad).all()
    assert (x.grad.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert history[0, column] == (grad_out * 4).abs().max()  # recorded for the step after
    assert "gradients by the backward before's" in recipe.describe()
    with pytest.raises(ValueError, match="gradient scaling"):
        fp8.Fp8Recipe(grad_scaling="history")


def test_an_amax_history_longer_than_one_step_takes_its_maximum():
    recipe = fp8.Fp8Recipe(scaling="delayed", history_len=3, amax_algo="max")
    history = fp8.new_history(recipe, "cpu")
    w = torch.ones(16, 16)
    for value in (4.0, 8.0, 2.0):
        step = fp8.start_step(recipe, history, warm=True)
        fp8.fp8_linear(torch.full((16, 16), value), w, None, None, step, fp8.QKV)
    assert history[:, 0].tolist() == [2.0, 8.0, 4.0]  # newest first
    scales = fp8.delayed_scales(history, recipe)
    assert scales[0].item() == pytest.approx(448.0 / 8.0)
    fp8.start_step(recipe, history, warm=True)  # the oldest (4.0) drops out
    assert history[1:, 0].tolist() == [2.0, 8.0]


@pytest.mark.parametrize("wgrad", [True, False], ids=["fp8-wgrad", "bf16-wgrad"])
def test_a_forward_reading_the_optimizers_copies_equals_its_own_cast(wgrad):
    """The weight's copies as the optimizer writes them (its cast by the scale the history
    gives, both layouts, the amax): the forward that reads them computes, records and
    differentiates exactly as the one that casts the weight itself."""
    from megagpt.fast_spec.fp8_cast import _cast_reference

    recipe = fp8.Fp8Recipe(scaling="delayed", history_len=2, amax_algo="max", wgrad=wgrad,
                           emulate=True)
    x, w, b, grad_out = _operands(seed=3)
    runs = []
    for written in (False, True):
        history = fp8.new_history(recipe, "cpu")
        fp8.fp8_linear(x, w, b, None, fp8.start_step(recipe, history, warm=False), fp8.FC1)
        weights = None
        if written:
            scales = fp8.next_weight_scales(history, recipe)
            q, q_t, amax = _cast_reference(w.detach(), scales[fp8.FC1:fp8.FC1 + 1], E4M3, True)
            w8, w8_t = [None] * fp8.LINEARS, [None] * fp8.LINEARS
            w8[fp8.FC1], w8_t[fp8.FC1] = q, q_t
            amaxes = torch.zeros(fp8.LINEARS)
            amaxes[fp8.FC1] = amax[0]
            weights = (tuple(w8), tuple(w8_t), scales, amaxes)
        for t in (x, w, b):
            t.grad = None
        step = fp8.start_step(recipe, history, warm=True, weights=weights)
        assert (step.weight_copy(fp8.FC1) is None) != written
        assert step.weight_copy(fp8.QKV) is None
        y = fp8.fp8_linear(x, w, b, None, step, fp8.FC1)
        y.backward(grad_out)
        runs.append((y.detach(), x.grad, w.grad, b.grad, history.clone()))
    for cast, read in zip(*runs):
        assert torch.equal(cast, read)
    with pytest.raises(ValueError, match="for a forward after the first"):
        fp8.start_step(recipe, fp8.new_history(recipe, "cpu"), warm=False, weights=weights)


def test_the_recipe_refuses_what_it_does_not_know():
    with pytest.raises(ValueError, match="format"):
        fp8.Fp8Recipe(format="e5m2")
    with pytest.raises(ValueError, match="recipe"):
        fp8.Fp8Recipe(scaling="mxfp8")
    assert "e5m2 gradients" in fp8.Fp8Recipe(format="hybrid").describe()


# ---------------------------------------------------------------------------------------
# the fused layer in FP8, in a real megatron GPTModel (CPU, float32)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("scaling", ["tensorwise", "delayed"])
def test_the_fused_layer_in_fp8_tracks_the_unquantised_model(cpu_buffers, scaling):
    ref, fast = _models(_config(num_layers=2), _args())
    batch = _batch(11)
    losses_ref, grads_ref = _loss_and_grads(ref, batch)
    keys_before = {k: v.clone() for k, v in fast.state_dict().items()
                   if isinstance(v, torch.Tensor)}
    _with_fused_options(fast, fp8=fp8.Fp8Recipe(scaling=scaling))
    for _ in range(2):  # delayed: the second step scales by the first's amaxes
        losses, grads = _loss_and_grads(fast, batch)
    assert torch.isfinite(losses).all()
    assert sqnr(losses, losses_ref) >= 18.0
    for name in ("decoder.layers.0.mlp.linear_fc1.weight",
                 "decoder.layers.1.self_attention.linear_qkv.weight"):
        assert sqnr(grads[name], grads_ref[name]) >= 12.0, name
    # the state dict is the unquantised model's: the same keys and values, nothing FP8 added
    after = {k: v for k, v in fast.state_dict().items() if isinstance(v, torch.Tensor)}
    assert set(after) == set(keys_before)
    for key, value in keys_before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)
    layers = [m for m in fast.modules() if isinstance(m, fast_layer.FastTransformerLayer)]
    assert all(layer._fp8_warm == (scaling == "delayed") for layer in layers)


def test_linears_left_out_of_the_recipe_run_in_bf16(cpu_buffers):
    """A recipe of fc1 and fc2 only: a left-out linear is the plain product, bit for bit;
    in a model, the attention's weight gradients come closer to the unquantised model's
    than with all four in FP8."""
    recipe = fp8.Fp8Recipe(scaling="tensorwise", emulate=True, linears=(fp8.FC1, fp8.FC2))
    step = fp8.start_step(recipe, None, warm=False)
    x, w, b = torch.randn(16, 32), torch.randn(48, 32), torch.randn(48)
    assert fp8.for_linear(step, fp8.PROJ) is None and fp8.for_linear(step, fp8.FC1) is step
    torch.testing.assert_close(fast_layer._linear(x, w, b, None, step, fp8.PROJ),
                               torch.nn.functional.linear(x, w, b), rtol=0, atol=0)
    assert not torch.equal(fast_layer._linear(x, w, b, None, step, fp8.FC1),
                           torch.nn.functional.linear(x, w, b))

    ref, fast = _models(_config(num_layers=1), _args())
    batch = _batch(5)
    _, grads_ref = _loss_and_grads(ref, batch)
    _with_fused_options(fast, fp8=recipe)
    _, grads_mlp = _loss_and_grads(fast, batch)
    _with_fused_options(fast, fp8=fp8.Fp8Recipe(scaling="tensorwise", emulate=True))
    _, grads_all = _loss_and_grads(fast, batch)
    for name in ("decoder.layers.0.self_attention.linear_qkv.weight",
                 "decoder.layers.0.self_attention.linear_proj.weight"):
        assert sqnr(grads_mlp[name], grads_ref[name]) > sqnr(grads_all[name], grads_ref[name])
    assert str(fp8.Fp8Recipe(linears=(fp8.FC1, fp8.FC2))) == \
        "hybrid, delayed scaling, fast spec (qkv, proj in bf16)"
    with pytest.raises(ValueError, match="FP8 linears"):
        fp8.Fp8Recipe(linears=())


@pytest.mark.parametrize("scaling", ["tensorwise", "delayed", "delayed-grads", "delayed-written"])
def test_the_fp8_layer_traces_as_one_graph_without_breaks(cpu_buffers, scaling):
    """fullgraph, through AOTAutograd (backend 'aot_eager': the forward and backward graphs
    inductor would get), with the weight gradients written into main_grad by the custom op;
    under delayed scaling two steps, the second scaled by the first's amaxes (its gradients
    too, by what backward recorded, with ``grad_scaling="delayed"``; with ``written``, its
    weights read from copies cast by the scales the first left, as the optimizer's)."""
    from megagpt.fast_spec.fp8_cast import _cast_reference

    import torch._dynamo
    from torch._dynamo.utils import counters

    from megagpt.fast_spec.layer import fused_layer_forward

    torch._dynamo.reset()
    counters.clear()
    h, s, b = 64, 16, 2
    g = torch.Generator().manual_seed(0)

    def p(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()

    weights = dict(ln1_w=p(h, scale=1.0), ln1_b=p(h), qkv_w=p(3 * h, h), qkv_b=p(3 * h),
                   proj_w=p(h, h), proj_b=p(h), ln2_w=p(h, scale=1.0), ln2_b=p(h),
                   fc1_w=p(4 * h, h), fc1_b=p(4 * h), fc2_w=p(h, 4 * h), fc2_b=p(h))
    main_grads = {f"{n}_main_grad": torch.zeros_like(weights[f"{n}_w"])
                  for n in ("qkv", "proj", "fc1", "fc2")}
    scaling, _, variant = scaling.partition("-")
    written = variant == "written"
    recipe = fp8.Fp8Recipe(scaling=scaling, grad_scaling="delayed" if variant else "current",
                           weights_written=written)
    kw = dict(rope=None, eps=1e-5, rms=False, groups=4, q_per_group=1, head_dim=h // 4,
              scale=(h // 4) ** -0.5, attn_p=0.0, hidden_p=0.0, act="gelu_tanh",
              rotary_interleaved=False, rope_mscale=1.0, training=True, fp8=recipe)
    x = torch.randn(s, b, h, generator=g, requires_grad=True)

    def copies(next_scales):
        w8, w8_t = [], []
        amaxes = torch.zeros(fp8.LINEARS)
        for i, name in enumerate(("qkv_w", "proj_w", "fc1_w", "fc2_w")):
            q, q_t, amax = _cast_reference(weights[name].detach(), next_scales[i:i + 1], E4M3,
                                           True)
            w8.append(q)
            w8_t.append(q_t)
            amaxes[i] = amax[0]
        return tuple(w8), tuple(w8_t), next_scales.clone(), amaxes

    def run(fn, grads_into, read_copies=written):
        call = dict(kw)
        history = fp8.new_history(recipe, "cpu")
        next_scales = torch.zeros(fp8.LINEARS)
        # a first forward (scaled by its own amaxes, which it records), then one scaled by
        # what the first recorded
        for warm in ((False, True) if recipe.delayed else (False,)):
            if recipe.delayed:
                call.update(fp8_history=history, fp8_warm=warm)
            if written:
                call["fp8_next_scales"] = next_scales
                if warm and read_copies:
                    call["fp8_weights"] = copies(next_scales)
            for t in (x, *weights.values()):
                t.grad = None
            out = fn(x, **weights, **call, **grads_into)
            out.sum().backward()
        return out.detach(), call.get("fp8_history"), next_scales

    compiled = torch.compile(fused_layer_forward, backend="aot_eager", fullgraph=True)
    out, history, next_scales = run(compiled, main_grads)
    assert not counters["graph_break"], dict(counters["graph_break"])
    eager_grads = {k: torch.zeros_like(v) for k, v in main_grads.items()}
    eager, eager_history, eager_next = run(fused_layer_forward, eager_grads)
    torch.testing.assert_close(out, eager)
    for name in main_grads:
        assert main_grads[name].abs().sum() > 0
        torch.testing.assert_close(main_grads[name], eager_grads[name])
    if recipe.delayed:  # the in-place amax records survive the functionalised graph
        recorded = history[0] if recipe.delayed_grads else history[0, :fp8.GRAD_COLUMNS]
        assert (recorded > 0).all()
        assert recipe.delayed_grads or not history[0, fp8.GRAD_COLUMNS:].any()
        torch.testing.assert_close(history, eager_history)
    if written:  # the scales left for the optimizer, as the next forward reads them
        assert torch.equal(next_scales, fp8.delayed_scales(history, recipe)[1:8:2])
        assert torch.equal(next_scales, eager_next)
        # reading the copies is the forward's own cast, bit for bit
        cast_grads = {k: torch.zeros_like(v) for k, v in main_grads.items()}
        cast, cast_history, _ = run(fused_layer_forward, cast_grads, read_copies=False)
        assert torch.equal(eager, cast) and torch.equal(eager_history, cast_history)
        assert all(torch.equal(eager_grads[k], cast_grads[k]) for k in cast_grads)


def test_a_layer_that_cannot_take_the_fused_path_refuses_fp8(cpu_buffers):
    from megagpt.errors import UserError
    from megagpt.fast_spec.layer import FusedLayerOptions
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megagpt.fast_spec.spec import get_fast_gpt_layer_spec

    spec = get_fast_gpt_layer_spec(_args(), FusedLayerOptions.make(fp8=fp8.Fp8Recipe()))
    config = _config(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1)
    with pytest.raises(UserError, match="cannot run the fused layer .*recompute"):
        GPTModel(config, spec, vocab_size=96, max_sequence_length=16)


# ---------------------------------------------------------------------------------------
# on a GPU: cuBLAS's FP8 kernels
# ---------------------------------------------------------------------------------------
def _fp8_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability 8.9+)")


@gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_the_emulation_matches_cublas_fp8_kernels(fmt):
    _fp8_gpu()
    x, w, b, grad_out = _operands(m=512, k=1024, n=768, dtype=torch.bfloat16, device="cuda")
    real = _run(fp8.Fp8Recipe(format=fmt, scaling="tensorwise"), x, w, b, grad_out)
    real = [t.clone() for t in real]
    emulated = _run(fp8.Fp8Recipe(format=fmt, scaling="tensorwise", emulate=True),
                    x, w, b, grad_out)
    for r, e in zip(real, emulated):
        # the same quantised operands; bf16 outputs, the forward's fast accumulation
        assert sqnr(r.float(), e.float()) >= 40.0


@gpu
@needs_cuda
@pytest.mark.parametrize("scaling", ["tensorwise", "delayed", "delayed-unit", "delayed-grads"])
def test_the_compiled_fp8_layer_on_the_gpu(scaling):
    """inductor's kernels around cuBLAS's FP8 GEMMs, weight gradients into main_grad, under a
    CUDA graph as the fast path runs it; against the bf16 layer."""
    _fp8_gpu()
    import torch._dynamo

    from megagpt.fast_spec.layer import fused_layer_forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    h, s, b = 256, 128, 2
    dev, dt = "cuda", torch.bfloat16

    def p(*shape, scale=0.02):
        return (torch.randn(*shape, device=dev, dtype=dt) * scale).requires_grad_()

    weights = dict(ln1_w=p(h, scale=1.0), ln1_b=p(h), qkv_w=p(3 * h, h), qkv_b=p(3 * h),
                   proj_w=p(h, h), proj_b=p(h), ln2_w=p(h, scale=1.0), ln2_b=p(h),
                   fc1_w=p(4 * h, h), fc1_b=p(4 * h), fc2_w=p(h, 4 * h), fc2_b=p(h))
    kw = dict(rope=None, eps=1e-5, rms=False, groups=4, q_per_group=1, head_dim=h // 4,
              scale=(h // 4) ** -0.5, attn_p=0.0, hidden_p=0.0, act="gelu_tanh",
              rotary_interleaved=False, rope_mscale=1.0, training=True)
    x = torch.randn(s, b, h, device=dev, dtype=dt, requires_grad=True)
    grad_out = torch.randn_like(x)
    compiled = torch.compile(fused_layer_forward, dynamic=False, fullgraph=True)

    def grads(extra):
        main_grads = {f"{n}_main_grad": torch.zeros_like(weights[f"{n}_w"])
                      for n in ("qkv", "proj", "fc1", "fc2")}
        for t in (x, *weights.values()):
            t.grad = None
        out = compiled(x, **weights, **kw, **main_grads, **extra)
        out.backward(grad_out)
        return out.detach(), x.grad.clone(), main_grads

    out_bf16, dx_bf16, mg_bf16 = grads({})
    scaling, _, variant = scaling.partition("-")  # TE's first scales, or TE's gradients
    recipe = fp8.Fp8Recipe(scaling=scaling, first_scales="unit" if variant == "unit" else "amax",
                           grad_scaling="delayed" if variant == "grads" else "current")
    extra = {"fp8": recipe}
    if recipe.delayed:
        extra.update(fp8_history=fp8.new_history(recipe, dev), fp8_warm=False)
        grads(extra)
        extra["fp8_warm"] = True
    out, dx, mg = grads(extra)
    assert sqnr(out.float(), out_bf16.float()) >= 18.0
    assert sqnr(dx.float(), dx_bf16.float()) >= 12.0
    for name in mg:
        assert torch.isfinite(mg[name]).all()
        assert sqnr(mg[name].float(), mg_bf16[name].float()) >= 12.0, name


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(4096, 1024), (100, 200), (1, 48)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_the_cast_kernel_equals_torchs_cast_bit_for_bit(shape, dtype):
    from megagpt.fast_spec.fp8_cast import _cast_reference, cast_transpose

    g = torch.Generator(device="cuda").manual_seed(0)
    t = torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16) * 3
    t[0, 0] = 1e4  # saturates at the scale below
    scale = torch.tensor([0.05], device="cuda")
    q, q_t, amax = cast_transpose(t, scale, dtype, True)
    r, r_t, r_amax = _cast_reference(t, scale, dtype, True)
    assert torch.equal(q.view(torch.uint8), r.view(torch.uint8))
    assert torch.equal(q_t.view(torch.uint8), r_t.view(torch.uint8))
    assert torch.equal(amax, r_amax)
    q2, empty, _ = cast_transpose(t, scale, dtype, False)
    assert torch.equal(q2.view(torch.uint8), r.view(torch.uint8)) and empty.numel() == 0

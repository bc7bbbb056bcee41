"""The flat AdamW step (megagpt.train_step.flat_adam) against megatron's own bf16 step.

Megatron's DDP, its bf16 optimizer (``Float16OptimizerWithFloat16Params`` around torch's
fused AdamW, the fast optimizer's kernels) and a small GPT run here on the CPU (cpu_mode maps
megatron's CUDA tensors to the CPU); the same model, data and seed are stepped once with
megatron's five-pass step and once with the flat one.
"""

from __future__ import annotations

import pytest
import torch

from gloo_ranks import run_on_ranks, single_gloo_rank
from megatron_parts import TINY_SEQ as SEQ
from megatron_parts import TINY_VOCAB as VOCAB
from megatron_parts import fast_optimizer_kernels, tiny_ddp_gpt

BATCH = 2


@pytest.fixture()
def cpu_megatron():
    from megagpt import cpu_mode

    with fast_optimizer_kernels(), single_gloo_rank(), cpu_mode.active():
        yield


def _build(grad_dtype=torch.bfloat16, clip_grad=1.0, lr=1e-2, device="cpu"):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = tiny_ddp_gpt(grad_dtype=grad_dtype, device=device)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.1, adam_beta1=0.9,
                        adam_beta2=0.95, bf16=True, params_dtype=torch.bfloat16,
                        clip_grad=clip_grad),
        [model])
    return model, opt


def _train(model, opt, steps: int, lrs=None):
    g = getattr(model, "_test_data", None)
    if g is None:
        g = model._test_data = torch.Generator().manual_seed(1)
    losses = []
    for i in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        model.zero_grad_buffer()
        opt.zero_grad()
        if lrs:
            for group in opt.param_groups:
                group["lr"] = lrs[i]
        tokens = tokens.to(_device(model))
        out = model(tokens[:, :-1], torch.arange(SEQ, device=tokens.device).expand(BATCH, -1),
                    None, labels=tokens[:, 1:])
        loss = out.float().mean()
        loss.backward()
        model.finish_grad_sync()  # the data-parallel all-reduce, as megatron's schedule does
        losses.append(loss.item())
        ok, norm, _ = opt.step()
        assert ok
    return losses, norm


def _device(model):
    return next(model.parameters()).device


def _flat(model, opt, compiled=False):
    from megagpt.train_step import flat_adam

    subs = flat_adam.megatron_optimizers(opt)
    assert len(subs) == 1
    params = flat_adam.buffer_params([model])
    assert flat_adam.unsupported_reason(subs[0], params) is None
    return flat_adam.attach(subs[0], params, compiled=compiled)


def _state(opt):
    sub = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    out = []
    for model_group, main_group in zip(sub.float16_groups, sub.fp32_from_float16_groups):
        for model_param, main_param in zip(model_group, main_group):
            st = sub.optimizer.state[main_param]
            out.append((model_param.detach().clone(), main_param.detach().clone(),
                        st["exp_avg"].clone(), st["exp_avg_sq"].clone(), float(st["step"])))
    return out


def _compare(opt_a, opt_b, steps, main_atol, moment_rtol):
    for (pa, ma, ea, va, sa), (pb, mb, eb, vb, sb) in zip(_state(opt_a), _state(opt_b)):
        assert sa == sb == float(steps)
        torch.testing.assert_close(eb, ea, rtol=moment_rtol, atol=1e-12)
        torch.testing.assert_close(vb, va, rtol=moment_rtol, atol=1e-14)
        torch.testing.assert_close(mb, ma, rtol=1e-6, atol=main_atol)
        # the bf16 weights are the fp32 masters rounded, as megatron's copy makes them
        assert torch.equal(pb, mb.to(pb.dtype))
        assert torch.equal(pa, ma.to(pa.dtype))


# the clipped moments carry the clip factor's fp32 rounding (the second moment squared)
CLIPPED_MOMENT_RTOL = 4e-6


def _assert_same_norm(flat_norm, megatron_norm):
    """The flat step's norm (one pass over buffer runs) against megatron's (per-parameter
    norms, then their norm): both fp32 sums of the same squares, in other orders."""
    flat, ref = torch.as_tensor(flat_norm).double(), torch.as_tensor(megatron_norm).double()
    assert float(ref.reshape(-1)[0]) > 0
    torch.testing.assert_close(flat, ref, rtol=1e-6, atol=0)


def _weights(opt):
    return torch.cat([s[1].flatten() for s in _state(opt)])


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("clip_grad", [0.05, 0.0])
def test_flat_step_equals_megatrons_step(cpu_megatron, grad_dtype, clip_grad):
    lrs = [1e-2, 5e-3, 2e-2, 1e-2, 1e-3]  # a schedule: each step must read the new lr
    model_a, opt_a = _build(grad_dtype, clip_grad)
    model_b, opt_b = _build(grad_dtype, clip_grad)
    state = _flat(model_b, opt_b)
    assert state.grad.dtype == grad_dtype
    # the norm is read from the buffer in one run: every parameter counts, none apart
    assert state.norm_spans == [(0, state.grad.numel())]

    # one step: the same gradients; the norm summed in another order, so the clip factor
    # and the moments agree to fp32 rounding, the weights to fp32 rounding of the update
    losses_a, norm_a = _train(model_a, opt_a, 1, lrs)
    losses_b, norm_b = _train(model_b, opt_b, 1, lrs)
    assert losses_a == losses_b
    _assert_same_norm(norm_b, norm_a)
    if clip_grad:
        assert float(torch.as_tensor(norm_a).reshape(())) > clip_grad, "the clip must bite"
    _compare(opt_a, opt_b, 1, main_atol=1e-8, moment_rtol=CLIPPED_MOMENT_RTOL if clip_grad else 0)

    # four more, with the learning rate changing under them. After a last-bit difference a
    # bf16 weight may round the other way, and Adam turns near-zero gradient noise (a key
    # bias's gradient is zero in exact arithmetic) into full-size steps of either sign; so
    # the runs agree in loss and in almost every weight, not bit for bit.
    start = _weights(opt_a)
    losses_a, norm_a = _train(model_a, opt_a, 4, lrs[1:])
    losses_b, norm_b = _train(model_b, opt_b, 4, lrs[1:])
    torch.testing.assert_close(torch.tensor(losses_b), torch.tensor(losses_a), rtol=1e-4, atol=0)
    moved = (_weights(opt_a) - start).abs()
    apart = (_weights(opt_b) - _weights(opt_a)).abs()
    assert apart.median() < 1e-3 * moved.median(), (apart.median(), moved.median())
    assert (apart > 0.1 * moved).float().mean() < 0.01


def test_setup_wrapper_attaches_or_says_why_not(cpu_megatron):
    from megatron.core.optimizer import ChainedOptimizer

    from megagpt.train_step import flat_adam

    model, opt = _build()
    lines = []
    flat_adam.attach_after_setup(lambda: ([model], opt, None), lines.append, False)()
    assert isinstance(opt.chained_optimizers[0]._megagpt_flat_adam, flat_adam.FlatAdamState)
    assert "flat AdamW step over" in lines[-1]

    model2, opt2 = _build()
    two = ChainedOptimizer([opt2.chained_optimizers[0], opt2.chained_optimizers[0]])
    flat_adam.attach_after_setup(lambda: ([model2], two, None), lines.append, False)()
    assert "not used: 2 chained optimizers" in lines[-1]
    assert not hasattr(opt2.chained_optimizers[0], "_megagpt_flat_adam")


def _tensor_parallel_flat_step(rank, world_size):
    """Two tensor-parallel ranks: the norms and biases of row-parallel layers are duplicated on
    both, and megatron's norm counts them on rank 0 only; the flat step's norm must too."""
    from megatron.core import parallel_state

    from megagpt import cpu_mode
    from megagpt.train_step import flat_adam

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        with fast_optimizer_kernels(), cpu_mode.active():
            model_a, opt_a = _build(torch.bfloat16, 0.05)
            model_b, opt_b = _build(torch.bfloat16, 0.05)
            sub = opt_b.chained_optimizers[0]
            counted = [flat_adam.counted_in_norm(sub, p)
                       for g in sub.fp32_from_float16_groups for p in g]
            assert all(counted) if rank == 0 else not all(counted)
            state = _flat(model_b, opt_b)
            # rank 0 reads the whole buffer; rank 1 the runs between its duplicates, or (when
            # they are too scattered) megatron's per-parameter norm
            counted_numel = sum(p.numel() for g in sub.fp32_from_float16_groups for p in g
                                if flat_adam.counted_in_norm(sub, p))
            if rank == 0:
                assert state.norm_spans == [(0, state.grad.numel())]
            if state.norm_spans is not None:
                assert sum(e - s for s, e in state.norm_spans) == counted_numel
            losses_a, norm_a = _train(model_a, opt_a, 1)
            losses_b, norm_b = _train(model_b, opt_b, 1)
            assert losses_a == losses_b
            _assert_same_norm(norm_b, norm_a)
            _compare(opt_a, opt_b, 1, main_atol=1e-8, moment_rtol=CLIPPED_MOMENT_RTOL)
    finally:
        parallel_state.destroy_model_parallel()


def test_flat_step_under_tensor_parallelism():
    from megagpt.train_step import optimizer as optim

    if not optim.megatron_uses_local_fallbacks():
        pytest.skip("TE or apex installed: megatron's optimizer takes their kernels")
    run_on_ranks(_tensor_parallel_flat_step, 2)


def _data_parallel_flat_step(rank, world_size):
    """On each of two data-parallel ranks (different data; megatron's DDP all-reduces the bf16
    gradient buffer): megatron's step and the flat step from the same start."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megagpt import cpu_mode

    parallel_state.initialize_model_parallel()
    try:
        with fast_optimizer_kernels(), cpu_mode.active():
            model_a, opt_a = _build(torch.bfloat16, 0.05)
            model_b, opt_b = _build(torch.bfloat16, 0.05)
            _flat(model_b, opt_b)
            for model in (model_a, model_b):  # each rank its own samples
                model._test_data = torch.Generator().manual_seed(100 + rank)
            losses_a, norm_a = _train(model_a, opt_a, 2)
            losses_b, norm_b = _train(model_b, opt_b, 2)
            assert losses_a[0] == losses_b[0]
            torch.testing.assert_close(torch.as_tensor(norm_b), torch.as_tensor(norm_a),
                                       rtol=1e-5, atol=0)
            weights = _weights(opt_b)
            torch.testing.assert_close(weights, _weights(opt_a), rtol=1e-4, atol=1e-4)
            # data parallelism keeps the replicas equal
            gathered = [torch.empty_like(weights) for _ in range(world_size)]
            dist.all_gather(gathered, weights)
            assert torch.equal(gathered[0], gathered[1])
    finally:
        parallel_state.destroy_model_parallel()


def test_flat_step_under_data_parallelism():
    from megagpt.train_step import optimizer as optim

    if not optim.megatron_uses_local_fallbacks():
        pytest.skip("TE or apex installed: megatron's optimizer takes their kernels")
    run_on_ranks(_data_parallel_flat_step, 2)


def test_tensors_are_views_of_the_flat_buffers(cpu_megatron):
    model, opt = _build()
    state = _flat(model, opt)
    sub = opt.chained_optimizers[0]
    base = state.main.untyped_storage().data_ptr()
    for main_group in sub.fp32_from_float16_groups:
        for p in main_group:
            assert p.untyped_storage().data_ptr() == base
            assert sub.optimizer.state[p]["exp_avg"].untyped_storage().data_ptr() == \
                state.exp_avg.untyped_storage().data_ptr()
    for model_group in sub.float16_groups:
        for p in model_group:
            assert p.untyped_storage().data_ptr() == state.model.untyped_storage().data_ptr()
            assert p.main_grad.untyped_storage().data_ptr() == \
                state.grad.untyped_storage().data_ptr()


@pytest.mark.parametrize("saved_flat, resumed_flat", [(True, True), (True, False), (False, True)],
                         ids=["flat-to-flat", "flat-to-megatron", "megatron-to-flat"])
def test_a_loaded_optimizer_state_is_taken_into_the_flat_buffers(cpu_megatron, saved_flat,
                                                                   resumed_flat):
    """Loading a state dict replaces torch's state tensors; the next flat step must use the
    loaded values, not the stale flat copies. And the checkpoint is megatron's either way:
    a run saved with the flat step resumes under megatron's, and the other way round."""
    import copy

    model_a, opt_a = _build()
    if saved_flat:
        _flat(model_a, opt_a)
    _train(model_a, opt_a, 3)
    saved_opt = copy.deepcopy(opt_a.state_dict())
    saved_model = copy.deepcopy(model_a.state_dict())
    losses_a, _ = _train(model_a, opt_a, 2)  # steps 4 and 5, uninterrupted

    model_b, opt_b = _build()
    if resumed_flat:
        _flat(model_b, opt_b)
    _train(model_b, opt_b, 1)  # some other state, then the checkpoint is loaded over it
    model_b.load_state_dict(saved_model)
    opt_b.load_state_dict(saved_opt)
    model_b._test_data = torch.Generator().manual_seed(1)
    for _ in range(3):  # the same data position as run a
        torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=model_b._test_data)
    losses_b, _ = _train(model_b, opt_b, 2)
    if saved_flat == resumed_flat:  # the same arithmetic: the same bits
        assert losses_b == losses_a
        for a, b in zip(_state(opt_a), _state(opt_b)):
            assert all(torch.equal(x, y) for x, y in zip(a[:4], b[:4])) and a[4] == b[4]
    else:  # the two steps' arithmetic differs in the last bit, then bf16 noise
        torch.testing.assert_close(torch.tensor(losses_b), torch.tensor(losses_a),
                                   rtol=1e-4, atol=0)
        assert [s[4] for s in _state(opt_b)] == [s[4] for s in _state(opt_a)] == [5.0] * 28
        apart = (_weights(opt_b) - _weights(opt_a)).abs()
        # most weights agree to fp32 rounding; a few follow Adam's sign of near-zero gradients
        assert apart.median() < 1e-6, apart.median()
        assert (apart > 1e-4).float().mean() < 0.02, (apart > 1e-4).float().mean()


def _update_inputs(n=1024, groups=3, block=1):
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=g).bfloat16()
    bufs = [torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1,
            torch.rand(n, generator=g) * 0.01, torch.zeros(n, dtype=torch.bfloat16)]
    index = (torch.arange(n // block) % groups).to(torch.uint8)
    table = torch.tensor([[1e-3, 2e-3, 5e-4], [0.1, 0.0, 0.05]])[:, :groups]
    return grad, bufs, index, table


def _run(grad, bufs, index, table, compiled=False):
    from megagpt.train_step.adamw_update import run_update

    b = [x.clone() for x in bufs]
    run_update(grad, *b, index, table, torch.tensor(3.0), torch.tensor(0.5),
               beta1=0.9, beta2=0.95, eps=1e-8, decoupled=True, compiled=compiled)
    return b


def test_group_index_per_block_means_per_element():
    """One group entry per block of 8 elements is the same as that entry on each of the 8."""
    grad, bufs, index, table = _update_inputs(block=8)
    per_block = _run(grad, bufs, index, table)
    per_element = _run(grad, bufs, index.repeat_interleave(8), table)
    for a, b in zip(per_block, per_element):
        assert torch.equal(a, b)
    assert not torch.equal(per_block[0], bufs[0]), "the update must change the weights"


def test_block_size_is_the_largest_power_of_two_no_boundary_splits():
    from megagpt.train_step.flat_adam import _block_size

    assert _block_size([0, 1024, 3 * 1024, 50304 * 1024]) == 1024
    assert _block_size([0, 96, 128]) == 32
    assert _block_size([0, 4096], largest=256) == 256
    assert _block_size([0, 7, 12]) == 1


@pytest.mark.parametrize("block", [1, 8])
def test_compiled_update_equals_eager(block):
    """The torch.compile'd kernel (one pass) computes what the eager function does."""
    grad, bufs, index, table = _update_inputs(block=block)
    eager = _run(grad, bufs, index, table)
    try:
        compiled = _run(grad, bufs, index, table, compiled=True)
    except Exception as exc:  # no C++ toolchain for inductor's CPU backend
        if type(exc).__module__.startswith(("torch._dynamo", "torch._inductor")):
            pytest.skip(f"torch.compile unavailable here: {type(exc).__name__}")
        raise
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("setting, needle", [
    ("log_num_zeros_in_grad", "--log-num-zeros-in-grad"),
    ("fp32_param", "some parameters are fp32"),
    ("second_optimizer", "also holds parameters of another optimizer"),
    ("amsgrad", "not torch Adam/AdamW"),
])
def test_where_the_flat_step_does_not_apply(cpu_megatron, setting, needle):
    from megagpt.train_step import flat_adam

    model, opt = _build()
    sub = opt.chained_optimizers[0]
    params = flat_adam.buffer_params([model])
    if setting == "log_num_zeros_in_grad":
        sub.config.log_num_zeros_in_grad = True
    elif setting == "fp32_param":
        sub.fp32_from_fp32_groups[0].append(torch.nn.Parameter(torch.zeros(2)))
    elif setting == "second_optimizer":
        # one parameter in the middle of the buffer belongs to another optimizer: the flat
        # step over this optimizer's span would update it too
        group = sub.float16_groups[0]
        order = sorted(range(len(group)), key=lambda i: group[i].main_grad.storage_offset())
        middle = order[len(order) // 2]
        moved = group.pop(middle)
        sub.fp32_from_float16_groups[0].pop(middle)
        assert any(moved is p for p in params)
    elif setting == "amsgrad":
        for group in sub.optimizer.param_groups:
            group["amsgrad"] = True
    reason = flat_adam.unsupported_reason(sub, params)
    assert reason is not None and needle in reason


@pytest.fixture()
def gpu_megatron():
    with fast_optimizer_kernels(), single_gloo_rank("nccl"):
        yield


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_gpu_compiled_flat_step_equals_megatrons_step(gpu_megatron, grad_dtype):
    """On the GPU: megatron's step (torch's CUDA fused AdamW) against the compiled kernel."""
    model_a, opt_a = _build(grad_dtype, 0.05, device="cuda")
    model_b, opt_b = _build(grad_dtype, 0.05, device="cuda")
    state = _flat(model_b, opt_b, compiled=True)
    losses_a, norm_a = _train(model_a, opt_a, 1)
    losses_b, norm_b = _train(model_b, opt_b, 1)
    assert state.compiled and state.compile_error is None
    assert losses_a == losses_b
    _assert_same_norm(norm_b, norm_a)
    _compare(opt_a, opt_b, 1, main_atol=1e-8, moment_rtol=CLIPPED_MOMENT_RTOL)
    start = _weights(opt_a)
    losses_a, _ = _train(model_a, opt_a, 4)
    losses_b, _ = _train(model_b, opt_b, 4)
    torch.testing.assert_close(torch.tensor(losses_b), torch.tensor(losses_a), rtol=1e-4, atol=0)
    moved = (_weights(opt_a) - start).abs()
    apart = (_weights(opt_b) - _weights(opt_a)).abs()
    assert apart.median() < 1e-3 * moved.median(), (apart.median(), moved.median())

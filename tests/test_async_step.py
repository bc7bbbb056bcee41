"""The fast path's step without host waits (megagpt.train_step.async_step), the gradient norm
kept on the device, the divergence guard that reads it late, and the bf16 gradient buffer.

Megatron's own clipping, reductions and logging code runs here on the CPU (cpu_mode maps its
CUDA tensors to the CPU); only the pinned-memory copy needs a GPU to differ from a plain one.
"""

from __future__ import annotations

import math

import pytest
import torch

from gloo_ranks import run_on_ranks, single_gloo_rank
from megatron_parts import fast_optimizer_kernels, fast_path_namespace


@pytest.fixture()
def cpu_megatron():
    from megagpt import cpu_mode

    with single_gloo_rank(), cpu_mode.active():
        yield


@pytest.fixture()
def tensor_clip():
    """megatron's clip_grads with the fast optimizer's tensor-scale kernel installed."""
    with fast_optimizer_kernels(tensor_clip=True):
        yield


def test_tensor_scale_kernel_in_place_and_copy():
    from megagpt.train_step.optimizer import foreach_multi_tensor_scale_tensor

    ts = [torch.randn(5), torch.randn(3, 4), torch.randn(7).double()]
    before = [t.clone() for t in ts]
    foreach_multi_tensor_scale_tensor(2048, None, [ts, ts], torch.tensor([0.25]))
    for t, b in zip(ts, before):
        torch.testing.assert_close(t, b * 0.25)
    dst = [torch.empty_like(t) for t in ts]
    foreach_multi_tensor_scale_tensor(2048, None, [ts, dst], torch.tensor([4.0]))
    for d, b in zip(dst, before):
        torch.testing.assert_close(d, b)


@pytest.mark.parametrize("scale_down", [True, False])
def test_megatron_clips_by_a_norm_that_stays_a_tensor(cpu_megatron, tensor_clip, scale_down):
    from megatron.core.optimizer.clip_grads import (
        clip_grad_by_total_norm_fp32,
        get_grad_norm_fp32,
    )

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 300)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    grads = [p.grad.clone() for p in params]
    expected = torch.cat([x.flatten() for x in grads]).norm()

    norm = get_grad_norm_fp32([p.grad for p in params])
    assert isinstance(norm, torch.Tensor), "the norm must not come back to the host"
    torch.testing.assert_close(norm.reshape(()), expected)

    max_norm = expected.item() / 2 if scale_down else expected.item() * 2
    clip_grad_by_total_norm_fp32(params, max_norm, norm)
    factor = max_norm / (expected.item() + 1e-6) if scale_down else 1.0
    for p, before in zip(params, grads):
        torch.testing.assert_close(p.grad, before * factor)


def test_single_rank_reductions_are_identities(cpu_megatron):
    import megatron.training.utils as mutils

    from megagpt.train_step import async_step

    reduce_max = async_step.single_rank_reduce_max_stat(mutils.reduce_max_stat_across_model_parallel_group)
    logical_and = async_step.single_rank_logical_and(mutils.logical_and_across_model_parallel_group)
    norm = torch.tensor([2.5])
    out = reduce_max(norm)
    assert isinstance(out, torch.Tensor) and out.shape == () and out.item() == 2.5
    assert f"{out:.3f}" == "2.500"  # training_log formats it only when it logs
    assert reduce_max(3.0) == 3.0 and reduce_max(None) is None
    assert logical_and(True) is True and logical_and(False) is False
    # megatron's own functions give the same answers over one rank
    assert mutils.reduce_max_stat_across_model_parallel_group(3.0) == 3.0
    assert mutils.logical_and_across_model_parallel_group(False) is False


def _reductions_over_two_ranks(rank, world_size):
    from megatron.core import parallel_state

    import megatron.training.utils as mutils
    from megagpt import cpu_mode
    from megagpt.train_step import async_step

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        with cpu_mode.active():
            reduce_max = async_step.single_rank_reduce_max_stat(
                mutils.reduce_max_stat_across_model_parallel_group)
            logical_and = async_step.single_rank_logical_and(
                mutils.logical_and_across_model_parallel_group)
            # a real all-reduce over the two tensor-parallel ranks
            assert reduce_max(torch.tensor([float(rank + 1)])) == 2.0
            assert reduce_max(float(rank)) == 1.0
            assert logical_and(rank == 0) is False
            assert logical_and(True) is True
    finally:
        parallel_state.destroy_model_parallel()


def test_reductions_over_two_ranks_still_reduce():
    run_on_ranks(_reductions_over_two_ranks, 2)


def test_scalar_tensors_are_built_without_blocking(cpu_megatron):
    from megagpt.train_step.async_step import NonBlockingScalarTensors

    with NonBlockingScalarTensors():
        t = torch.tensor([0.0], dtype=torch.float, device="cuda")  # training_log's default
        u = torch.tensor([1, 2], device="cpu")
        v = torch.tensor(2.5)
    assert t.dtype == torch.float32 and t.tolist() == [0.0]
    assert u.tolist() == [1, 2] and v.item() == 2.5


def test_the_wrappers_are_in_place_inside_the_block_only():
    import megatron.training.dist_signal_handler as msignal
    import megatron.training.training as mtraining

    from megagpt.train_step import async_step

    names = ["reduce_max_stat_across_model_parallel_group",
             "logical_and_across_model_parallel_group", "training_log",
             "setup_model_and_optimizer"]
    before = {n: getattr(mtraining, n) for n in names}
    gather = msignal.all_gather_item
    with async_step.without_host_waits():
        assert all(getattr(mtraining, n) is not before[n] for n in names)
        assert msignal.all_gather_item is not gather
        assert msignal.all_gather_item([1], torch.int32) == [[1]]  # no process group here
    assert {n: getattr(mtraining, n) for n in names} == before
    assert msignal.all_gather_item is gather


# ---------------------------------------------------------------------------------------
# the divergence guard with norms that stay on the device
# ---------------------------------------------------------------------------------------
def _guarded_step(guard, norms):
    def train_step(*args, iteration=None, **kwargs):
        return ({}, False, False, False, 0, norms[iteration], 0, None)

    return guard.train_step(train_step)


def test_guard_reads_device_norms_one_iteration_late():
    from megagpt.resilience.divergence import DivergenceError, GradNormGuard

    norms = {0: torch.tensor(1.0), 1: torch.tensor(math.nan), 2: torch.tensor(3.0)}
    guard = GradNormGuard(lambda: "Resume from X.", final_iteration=10)
    step = _guarded_step(guard, norms)
    step(iteration=0)
    step(iteration=1)  # the NaN of iteration 2 is still pending: no wait on it
    assert [it for it, _ in guard.pending] == [2]
    with pytest.raises(DivergenceError, match=r"divergence at iteration 2: gradient norm nan.*"
                                              r"Resume from X.*--iterations-to-skip 2"):
        step(iteration=2)


def test_guard_checks_pending_norms_before_a_save_and_at_the_end():
    from megagpt.resilience.divergence import DivergenceError, GradNormGuard

    saved = []
    guard = GradNormGuard(lambda: "", final_iteration=3)
    save = guard.save_checkpoint(lambda iteration, *a, **k: saved.append(iteration))
    step = _guarded_step(guard, {0: torch.tensor(1.0), 1: torch.tensor(math.inf),
                                 2: torch.tensor(1.0)})
    step(iteration=0)
    save(1)
    assert saved == [1] and not guard.pending
    step(iteration=1)
    with pytest.raises(DivergenceError, match="iteration 2: gradient norm inf"):
        save(2)
    assert saved == [1], "a diverged model must not be saved"

    guard = GradNormGuard(lambda: "", final_iteration=1)
    with pytest.raises(DivergenceError, match="iteration 1"):  # last iteration: checked now
        _guarded_step(guard, {0: torch.tensor(math.nan)})(iteration=0)


def test_guard_checks_host_norms_at_once():
    from megagpt.resilience.divergence import DivergenceError, GradNormGuard

    step = _guarded_step(GradNormGuard(lambda: ""), {0: 1.0, 1: math.nan})
    assert step(iteration=0)[5] == 1.0
    with pytest.raises(DivergenceError, match="iteration 2"):
        step(iteration=1)


def test_norm_in_flight_keeps_the_value_and_host_norms_pass_through():
    from megagpt.resilience.divergence import NormInFlight

    assert NormInFlight(torch.tensor(2.5)).value() == 2.5
    assert NormInFlight(7.0).value() == 7.0
    assert math.isnan(NormInFlight(torch.tensor(math.nan)).value())


@pytest.mark.gpu
def test_reading_a_device_norm_waits_for_its_step_only():
    """The pending norm is read while later work is still queued: the read must not drain
    the stream (``float(cuda_tensor)`` would), or the GPU idles through the host's loop."""
    from megagpt.resilience.divergence import NormInFlight

    norm = torch.full((), 4.0, device="cuda").sqrt()
    staged = NormInFlight(norm)
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU work queued behind the norm
    assert staged.value() == 2.0
    assert not torch.cuda.current_stream().query(), "the read waited for the later work"
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------
# the bf16 gradient buffer
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "attrs,argv,needle",
    [
        ({}, (), None),
        ({"global_batch_size": None}, (), None),
        ({"bf16": False}, (), "not bf16"),
        ({"global_batch_size": 16}, (), "micro-batch"),
        ({"world_size": 2}, (), "data-parallel"),
        ({"world_size": 2, "tensor_model_parallel_size": 2}, (), None),
        ({"dry_run": True, "dry_run_world_size": 8}, (), "data-parallel"),  # the planned size
        ({"given": ["--accumulate-allreduce-grads-in-fp32"]}, (), "--accumulate-allreduce"),
        ({"cpu": True}, (), "CPU"),
        ({"transformer_impl": "transformer_engine"}, (), "fast spec"),
    ],
)
def test_bf16_grad_buffer_only_where_values_are_unchanged(attrs, argv, needle):
    from megagpt.launch.fast_path import apply_fast_path_defaults
    from megagpt.launch.fast_path_reasons import bf16_grad_buffer_unsupported_reason
    from megagpt.launch.layers import layer_path

    attrs = dict(attrs)
    given = frozenset(attrs.pop("given", ()))
    args = fast_path_namespace(argv, **attrs)
    reason = bf16_grad_buffer_unsupported_reason(args, layer_path(args)[0], given)
    assert (reason is None) if needle is None else (needle in reason)
    lines = []
    apply_fast_path_defaults(args, lines.append, given=given)
    assert args.grad_reduce_in_bf16 is (needle is None)
    assert any("bf16 buffer" in line for line in lines) is (needle is None)


def test_bf16_grad_buffer_switch_wins():
    from megagpt.launch.fast_path import apply_fast_path_defaults

    args = fast_path_namespace(["--fast-disable", "bf16-grad-buffer"])
    apply_fast_path_defaults(args, lambda s: None)
    assert not args.grad_reduce_in_bf16
    # asked for on the namespace (no option asks for it: megatron's --grad-reduce-in-bf16 does)
    args = fast_path_namespace(global_batch_size=32, fast_bf16_grad_buffer=True)
    apply_fast_path_defaults(args, lambda s: None)
    assert args.grad_reduce_in_bf16


@pytest.mark.parametrize("attrs,kept", [
    ({}, False),
    ({"reset_attention_mask": True}, True),  # document masks are applied
    ({"transformer_impl": "transformer_engine"}, True),  # not the fast spec
])
def test_no_attention_mask_from_the_loader_where_the_fast_spec_ignores_it(attrs, kept):
    from megagpt.launch.fast_path import apply_fast_path_defaults

    args = fast_path_namespace(create_attention_mask_in_dataloader=True, **attrs)
    lines = []
    apply_fast_path_defaults(args, lines.append)
    assert args.create_attention_mask_in_dataloader is kept
    assert any("no attention mask" in line for line in lines) is not kept


def test_constant_loss_scale_is_read_on_the_host():
    from megagpt.train_step.async_step import host_loss_scale_of_one

    class Bf16Optimizer:
        grad_scaler = None

        def __init__(self):
            self._scale_one = torch.tensor([1.0])  # megatron's: a CUDA tensor

        def get_loss_scale(self):
            return self._scale_one

    class Chained:
        def __init__(self, *opts):
            self.chained_optimizers = list(opts)

    class Fp16Optimizer(Bf16Optimizer):
        grad_scaler = object()

    bf16, fp16 = Bf16Optimizer(), Fp16Optimizer()
    setup = host_loss_scale_of_one(lambda *a, **k: ("model", Chained(bf16, fp16), "sched"))
    assert setup()[1].chained_optimizers == [bf16, fp16]
    scale = bf16.get_loss_scale()
    assert scale.shape == () and scale.device.type == "cpu" and scale.item() == 1.0
    assert fp16._scale_one.shape == (1,)  # a real grad scaler's optimizer is left alone
    loss = torch.tensor(2.0)
    assert (scale * loss).item() == 2.0


@pytest.mark.parametrize("buffer_dtype", [torch.bfloat16, torch.float32])
def test_main_grads_from_one_cast_per_buffer_equal_megatrons(buffer_dtype):
    import types

    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    from megagpt import megatron_wrappers
    from megagpt.train_step import optimizer as optim

    original = megatron_wrappers.original(Float16OptimizerWithFloat16Params,
                                          "_copy_model_grads_to_main_grads")

    def build():
        g = torch.Generator().manual_seed(0)
        shapes = [(4, 3), (5,), (2, 2, 2)]
        buffer = torch.randn(sum(torch.Size(s).numel() for s in shapes) + 3, generator=g)
        buffer = buffer.to(buffer_dtype)
        model, main, offset = [], [], 1  # a gap before the first gradient, as padding
        for shape in shapes:
            n = torch.Size(shape).numel()
            p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
            p.main_grad = buffer[offset:offset + n].view(shape)
            p.grad = torch.ones(shape, dtype=torch.bfloat16)  # freed by the copy
            model.append(p)
            main.append(torch.nn.Parameter(torch.zeros(shape)))
            offset += n
        no_ddp = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
        no_ddp.grad = torch.randn(3, generator=g).bfloat16()
        fp32 = torch.nn.Parameter(torch.zeros(2))
        fp32.main_grad = torch.randn(2, generator=g)
        return types.SimpleNamespace(
            float16_groups=[model[:2], model[2:] + [no_ddp]],
            fp32_from_float16_groups=[main[:2], main[2:] + [torch.nn.Parameter(torch.zeros(3))]],
            fp32_from_fp32_groups=[[fp32]])

    ours, theirs = build(), build()
    optim.copy_model_grads_to_main_grads(ours)
    original(theirs)
    for group_o, group_t in zip(ours.fp32_from_float16_groups, theirs.fp32_from_float16_groups):
        for po, pt in zip(group_o, group_t):
            assert po.grad.dtype == torch.float32 and po.grad.shape == po.shape
            assert torch.equal(po.grad, pt.grad)
    assert all(p.grad is None for group in ours.float16_groups for p in group)
    fp32 = ours.fp32_from_fp32_groups[0][0]
    assert fp32.grad is fp32.main_grad
    if buffer_dtype == torch.float32:  # used in place, as megatron's .float() does
        first = ours.float16_groups[0][0]
        assert ours.fp32_from_float16_groups[0][0].grad.data_ptr() == first.main_grad.data_ptr()
    # a second step reuses the plan and sees the new gradient values
    for p in ours.float16_groups[0]:
        p.main_grad.mul_(2)
    optim.copy_model_grads_to_main_grads(ours)
    torch.testing.assert_close(ours.fp32_from_float16_groups[0][1].grad,
                               ours.float16_groups[0][1].main_grad.float())


# ---------------------------------------------------------------------------------------
# end to end on the CPU: the asynchronous step changes when the host waits, not the numbers
# ---------------------------------------------------------------------------------------
_GRAD_NORM = __import__("re").compile(r"iteration\s+(\d+)/.*?grad norm: ([0-9.]+)")


def test_async_step_trains_like_megatrons_synchronous_step(tmp_path):
    from helpers import TINY_MODEL, parse_losses, run_entry

    # clipping active on most steps (small --clip-grad), so the on-device clip factor is used
    args = [*TINY_MODEL, "--train-iters", "12", "--clip-grad", "0.05"]
    runs = {}
    for name, extra in (("async", []), ("sync", ["--fast-disable", "async-step"])):
        proc = run_entry(args + extra, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:]
        runs[name] = proc.stdout
    assert "no host synchronisation inside a step" in runs["async"]
    assert "host synchronisations inside the step kept" in runs["sync"]
    losses = {k: parse_losses(v) for k, v in runs.items()}
    norms = {k: {int(i): float(n) for i, n in _GRAD_NORM.findall(v)} for k, v in runs.items()}
    assert sorted(losses["async"]) == list(range(1, 13)) == sorted(losses["sync"])
    assert max(norms["sync"].values()) > 0.05  # the clip did act
    for it in range(1, 13):
        # same arithmetic; the clip factor is formed in fp32 on the device instead of
        # fp64 on the host, so the last digits may differ
        assert losses["async"][it] == pytest.approx(losses["sync"][it], rel=1e-5, abs=1e-6)
        assert norms["async"][it] == pytest.approx(norms["sync"][it], rel=1e-3, abs=1e-3)


def test_the_log_line_names_the_pieces_that_are_on():
    from megagpt.compat import Installed
    from megagpt.gpt_model import describe
    from megagpt.launch.fast_path import plan_fast_path

    no_te = Installed(transformer_engine=False, apex=False, fused_layer_norm=False,
                      masked_softmax_kernels=False, gradient_accumulation_kernels=False)

    def described(argv=(), **attrs):
        return describe(plan_fast_path(fast_path_namespace(argv, fast_optimizer=True, **attrs),
                                       no_te, {}))

    on = described()
    assert "no host sync inside the step" in on and "bf16 gradient buffer" in on
    off = described(["--fast-disable", "async-step,bf16-grad-buffer"])
    assert "no host sync" not in off and "bf16 gradient buffer" not in off
    assert "gradients formed in forward" in on
    for argv, attrs in ((["--fast-disable", "lm-grad-in-forward"], {}),
                        ([], {"pipeline_model_parallel_size": 2, "world_size": 2})):
        assert "gradients formed in forward" not in described(argv, **attrs)

"""CPU mode: each stand-in behaves (the megatron sites it covers are checked with the rest of
the ledger, tests/test_megatron_ledger.py)."""

import pytest
import torch

from megagpt import cpu_mode


def test_cuda_device_arguments_land_on_the_cpu():
    with cpu_mode.active():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
        t = torch.ones(2)
        assert t.cuda() is t
        assert t.to("cuda").device.type == "cpu"
        assert t.to(device="cuda", dtype=torch.float64).dtype == torch.float64
        # clip_grads asserts this type name for its gradients.
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.type(torch.float64).dtype == torch.float64


def test_stand_ins_are_removed_on_exit():
    before = torch.cuda.device_count
    with cpu_mode.active():
        assert torch.cuda.device_count() == 1
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            pass
    assert torch.cuda.device_count is before
    assert torch.zeros(1).type() == "torch.FloatTensor"


def saved_on_a_gpu(obj, monkeypatch) -> bytes:
    """``obj`` serialised as a GPU run writes it: its storages tagged ``cuda:0`` (the tag is
    all ``torch.load`` goes by to place them)."""
    import io

    buffer = io.BytesIO()
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(obj, buffer)
    return buffer.getvalue()


def test_objects_saved_on_a_gpu_load_onto_the_cpu(monkeypatch):
    """torch's distributed checkpoint reads a checkpoint's objects with a bare torch.load:
    in CPU mode what a GPU run saved lands on the CPU; a caller's own map_location stands."""
    import io

    state = {"step": torch.tensor(3.0), "moments": [torch.arange(4.0)]}
    data = saved_on_a_gpu(state, monkeypatch)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(io.BytesIO(data), weights_only=False)
    with cpu_mode.active():
        loaded = torch.load(io.BytesIO(data), weights_only=False)
        assert loaded["step"].device.type == "cpu" and loaded["step"].item() == 3.0
        assert torch.equal(loaded["moments"][0], torch.arange(4.0))
        kept = torch.load(io.BytesIO(data), map_location=lambda s, _: s, weights_only=False)
        assert kept["step"].item() == 3.0
    assert torch.load.__name__ == "load"


def test_cpu_rng_tracker_forks_and_restores_generator_states():
    tracker = cpu_mode.CpuRngTracker()
    tracker.add("model-parallel-rng", 42)
    torch.manual_seed(0)
    outside_first = torch.rand(1)
    torch.manual_seed(0)
    with tracker.fork("model-parallel-rng"):
        inside = torch.rand(1)
    # The fork drew from seed 42's stream and left the outer stream where it was.
    assert torch.equal(inside, torch.rand(1, generator=torch.Generator().manual_seed(42)))
    assert torch.equal(torch.rand(1), outside_first)
    # Saved states round-trip: a new tracker continues the same stream.
    states = tracker.get_states()
    other = cpu_mode.CpuRngTracker()
    other.set_states(states)
    with tracker.fork("model-parallel-rng"):
        a = torch.rand(1)
    with other.fork("model-parallel-rng"):
        b = torch.rand(1)
    assert torch.equal(a, b)
    with pytest.raises(Exception, match="already exists"):
        tracker.add("other", 42)


class _Args:
    cpu = True
    bf16 = fp16 = use_distributed_optimizer = False
    fp8 = None
    transformer_impl = "local"
    distributed_backend = "nccl"
    gradient_accumulation_fusion = masked_softmax_fusion = True


def test_adapt_sets_gloo_and_rejects_gpu_only_settings():
    from megagpt.compat import Installed
    from megagpt.launch import cpu
    from megagpt.launch.planner import Planner

    no_te = Installed(transformer_engine=False, apex=False, fused_layer_norm=False,
                      masked_softmax_kernels=False, gradient_accumulation_kernels=False)

    def adapted(args):
        p = Planner(args, frozenset(), no_te)
        cpu.adapt(p)
        return p

    p = adapted(_Args())
    assert p.v.distributed_backend == "gloo"
    assert not p.v.gradient_accumulation_fusion and not p.v.masked_softmax_fusion
    assert p.lines and p.chosen(cpu.CPU_OPTIMIZER).value is cpu.CpuOptimizer.AS_BOUND

    bad = _Args()
    bad.bf16, bad.fp16 = True, True
    with pytest.raises(cpu_mode.CpuModeError, match="--bf16.*--fp16"):
        adapted(bad)
    # megatron's distributed optimizer runs in fp32 on the CPU (the flag matrix trains it)
    fine = _Args()
    fine.use_distributed_optimizer = True
    adapted(fine)


def test_backward_functions_allocate_on_the_cpu_too():
    """megatron's backward functions allocate with device=torch.cuda.current_device()
    (sequence parallelism's gathers and reduce-scatters); the engine runs them inside the
    mode's handler, where the mode is off."""
    class Doubling(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            buffer = torch.empty(g.shape, device=torch.cuda.current_device())
            buffer.copy_(g * 2)
            return buffer

    with cpu_mode.active():
        x = torch.ones(3, requires_grad=True)
        Doubling.apply(x).sum().backward()
        torch.autograd.backward(Doubling.apply(x).sum())
        (grad,) = torch.autograd.grad(Doubling.apply(x).sum(), x)
        assert torch.cuda.current_device() == 0  # outside backward: the ordinal again
    assert x.grad.tolist() == [4.0, 4.0, 4.0] and grad.tolist() == [2.0, 2.0, 2.0]


def test_te_bound_optimizer_kernels_give_way_to_megatrons_torch_fallbacks(monkeypatch):
    """Where Transformer Engine imports, megatron's optimizer modules bind its FusedAdam and
    multi-tensor kernels, which read CUDA memory only (a CPU run's gradients made them an
    illegal memory access on a GPU machine). In CPU mode megatron's own torch fallbacks take
    their place, and the bindings come back after. TE cannot import without CUDA, so here its
    kernels are stood in for by ones that refuse to run, bound where megatron binds TE's."""
    import megatron.core.optimizer as mopt
    import megatron.core.optimizer.clip_grads as mclip
    import megatron.core.optimizer.optimizer as moo
    import megatron.training.utils.common_utils as mcommon
    from megatron.core import utils as mutils

    def cuda_only(*args, **kwargs):
        raise AssertionError("a CUDA-only kernel ran in CPU mode")

    class FusedAdamStandIn:
        def __init__(self, *args, **kwargs):
            cuda_only()

    te_bindings = {(mopt, "Adam"): FusedAdamStandIn, (mopt, "SGD"): FusedAdamStandIn,
                   (mopt, "USING_PYTORCH_OPTIMIZER"): False}
    for module, names in ((mclip, ("multi_tensor_applier", "l2_norm_impl",
                                   "multi_tensor_scale_impl", "multi_tensor_scale_tensor_impl")),
                          (moo, ("multi_tensor_applier", "multi_tensor_scale_impl")),
                          (mcommon, ("multi_tensor_applier", "multi_tensor_l2norm"))):
        te_bindings.update({(module, name): cuda_only for name in names})
    try:
        for (module, name), value in te_bindings.items():
            monkeypatch.setattr(module, name, value)
        with cpu_mode.active():
            assert mopt.Adam is torch.optim.AdamW and mopt.SGD is torch.optim.SGD
            assert mopt.USING_PYTORCH_OPTIMIZER is True
            assert mclip.multi_tensor_scale_tensor_impl is None
            assert mcommon.multi_tensor_l2norm is mutils.local_multi_tensor_l2_norm
            params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 5)]
            for p in params:
                p.grad = torch.full_like(p, 2.0)
            # megatron's own clipping, on CPU gradients: scaled by 1 / 2 through the fallback
            mclip.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=2.0)
            assert all(torch.allclose(p.grad, torch.ones_like(p)) for p in params)
            mopt.Adam(params, lr=0.1).step()
        for (module, name), value in te_bindings.items():
            assert getattr(module, name) is value, f"{module.__name__}.{name} not restored"
    finally:
        monkeypatch.undo()


def test_megatrons_own_fallbacks_are_left_alone():
    """Without TE or apex megatron took its torch fallbacks itself: CPU mode changes none."""
    import megatron.core.optimizer as mopt

    from megagpt import megatron_wrappers

    if not megatron_wrappers.original(mopt, "USING_PYTORCH_OPTIMIZER"):
        pytest.skip("TE or apex is installed here")
    with cpu_mode.active():  # asks megatron
        assert megatron_wrappers.installed(mopt, "Adam") == []
    assert cpu_mode._torch_optimizer_kernels(restore=False) == []

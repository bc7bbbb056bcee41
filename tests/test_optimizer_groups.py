"""An optimizer checkpoint saved by one install's inner optimizer and loaded by another's:
megatron's bf16 optimizer around torch's AdamW (no TE or apex) saves groups without apex
FusedAdam's ``bias_correction``, which FusedAdam reads in every step. Real megatron
optimizers on the CPU; the receiving inner optimizer is an Adam with FusedAdam's group
settings and its read of them (apex's own kernels need CUDA: tests/test_apex_gpu.py crosses
the real one on a GPU)."""

import operator

import pytest
import torch

from gloo_ranks import single_gloo_rank
from megatron_parts import tiny_ddp_gpt


class FusedAdamGroups(torch.optim.Optimizer):
    """Adam with apex FusedAdam's parameter-group settings (apex/optimizers/fused_adam.py:
    lr, bias_correction, betas, eps, weight_decay) and its step count, one integer per group,
    each read in ``step`` as FusedAdam reads it, and no defaults filled in on loading (torch's
    Adam fills its own)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0):
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas,
                                      eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            bias_correction = 1 if group["bias_correction"] else 0
            beta1, beta2 = group["betas"]
            # one step per group, handed to the kernel as a C int (a float is refused)
            group["step"] = group["step"] + 1 if "step" in group else 1
            step = operator.index(group["step"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                c1 = 1 - beta1 ** step if bias_correction else 1.0
                c2 = 1 - beta2 ** step if bias_correction else 1.0
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(state["exp_avg"] / c1, (state["exp_avg_sq"] / c2).sqrt_()
                           .add_(group["eps"]), value=-group["lr"])


def _megatron_bf16_optimizer(model, distributed: bool):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    return get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, adam_beta1=0.9,
                        adam_beta2=0.95, bf16=True, params_dtype=torch.bfloat16,
                        clip_grad=1.0, use_distributed_optimizer=distributed), [model])


def _step(model, opt):
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    model.zero_grad_buffer()
    opt.zero_grad()
    out = model(tokens[:, :-1], torch.arange(16).expand(2, -1), None, labels=tokens[:, 1:])
    out.float().mean().backward()
    model.finish_grad_sync()
    return opt.step()


@pytest.fixture(params=["Float16OptimizerWithFloat16Params", "DistributedOptimizer"])
def saved_and_receiving(request):
    """megatron's bf16 optimizer (``request.param``) over torch's AdamW after one step (its
    state dict: the parameter groups; the distributed optimizer's tensors load apart), and a
    second one whose inner optimizer has FusedAdam's groups."""
    from megagpt import compat, cpu_mode

    distributed = request.param == "DistributedOptimizer"
    with single_gloo_rank(), cpu_mode.active(), compat.distributed_optimizer_resuming():
        model = tiny_ddp_gpt(use_distributed_optimizer=distributed)
        saving = _megatron_bf16_optimizer(model, distributed)
        _step(model, saving)
        saved = saving.state_dict()
        assert "bias_correction" not in saved["optimizer"]["param_groups"][0]
        receiving = _megatron_bf16_optimizer(model, distributed)
        inner = receiving.chained_optimizers[0] if hasattr(receiving, "chained_optimizers") \
            else receiving
        assert type(inner).__name__ == request.param
        # the same groups (megatron's own keys too) without what only torch's AdamW has
        torch_only = set(inner.optimizer.defaults) - {"lr", "betas", "eps", "weight_decay"}
        inner.optimizer = FusedAdamGroups([{k: v for k, v in g.items() if k not in torch_only}
                                           for g in inner.optimizer.param_groups])
        yield model, saved, receiving, inner


def test_without_the_wrapper_the_running_optimizers_setting_is_lost(saved_and_receiving):
    model, saved, receiving, inner = saved_and_receiving
    receiving.load_state_dict(saved)
    with pytest.raises(KeyError, match="bias_correction"):
        _step(model, receiving)
    for group in inner.optimizer.param_groups:  # past that, the distributed one's float step
        group["bias_correction"] = True
    if type(inner).__name__ == "DistributedOptimizer":
        with pytest.raises(TypeError):
            _step(model, receiving)


def test_a_loaded_group_keeps_the_running_optimizers_own_settings(saved_and_receiving):
    from megagpt import megatron_wrappers
    from megagpt.resilience import optimizer_groups

    model, saved, receiving, inner = saved_and_receiving
    saved_lrs = [g["lr"] for g in saved["optimizer"]["param_groups"]]
    inner.optimizer.param_groups[0]["lr"] = 123.0  # the checkpoint's value wins
    with megatron_wrappers.wrapped_all([
            (cls, "load_state_dict", optimizer_groups.__name__,
             optimizer_groups.keeping_the_running_settings)
            for cls in optimizer_groups.loader_classes()]):
        receiving.load_state_dict(saved)
    groups = inner.optimizer.param_groups
    assert all(g["bias_correction"] is True for g in groups)
    assert [g["lr"] for g in groups] == saved_lrs
    # the one step taken before the save: an int, as FusedAdam's kernel takes it
    assert [g["step"] for g in groups if g["params"]] == [1] * len(
        [g for g in groups if g["params"]])
    assert all(type(g["step"]) is int for g in groups if g["params"])
    before = [p.detach().clone() for g in groups for p in g["params"]]
    _step(model, receiving)
    after = [p for g in groups for p in g["params"]]
    assert any(not torch.equal(a, b) for a, b in zip(after, before))

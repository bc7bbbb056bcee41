"""An optimizer checkpoint from another install: the parameter groups' settings the saving
optimizer did not have keep the running optimizer's own values.

megatron's optimizers put the checkpoint's parameter groups in place of their inner torch
optimizer's, with the checkpoint's keys only: ``Float16OptimizerWithFloat16Params`` and
``FP32Optimizer`` through torch's ``Optimizer.load_state_dict``, ``DistributedOptimizer`` by
its own matching of the groups. Which inner optimizer runs depends on what is installed
(torch's AdamW without Transformer Engine or apex; apex's or TE's ``FusedAdam`` beside them,
under the distributed optimizer or ``--fast-disable optimizer``), and their groups hold
different settings: a checkpoint of torch's AdamW has no ``bias_correction``, which apex's
``FusedAdam`` reads in every step. A run saved without apex and resumed with it stopped at
its first step with ``KeyError: 'bias_correction'`` (one H100, 2026-12-06,
``bench/gpu_record_apex.sh OUT checkpoints``). torch's own optimizers fill a missing setting
with their default when they load (their ``__setstate__``); apex's and TE's do not.

The step count is kept apart by the two kinds: torch's AdamW keeps a step tensor in each
parameter's state, apex's and TE's FusedAdam one integer per group (``group["step"]``, which
their kernels take as a C ``int``: apex's ``multi_tensor_adam_cuda(..., const int step,
...)``). megatron's distributed optimizer saves torch's step into its groups as a float
(``.item()`` of the float tensor), which such a kernel refuses, and its other optimizers save
none there, so FusedAdam would start its bias correction afresh.

``keeping_the_running_settings`` wraps megatron's ``load_state_dict``: each loaded group
gets the running optimizer's value of every setting the checkpoint lacks, the value the
launch built it with, as a resume under the same install has it; a group's step saved as a
whole float is an integer again, and a group without one takes the step its parameters'
states share. What the checkpoint holds (learning rate, betas, step, ...) is loaded as
before; torch's optimizers read no group step.
"""

from __future__ import annotations

import functools
from typing import Callable

from megagpt.megatron_change import WRAPS, Change

# What ``keeping_the_running_settings`` changes in megatron: each of ``loader_classes()``'s
# ``load_state_dict``, in that order.
LOAD_STATE_DICTS = tuple(
    Change(f"{loader}.load_state_dict", WRAPS, __name__,
           does="a group's setting the checkpoint lacks takes the running optimizer's value",
           why="it loads the checkpoint's parameter groups with the checkpoint's keys only; "
               "saved by another install's inner optimizer (torch's AdamW), a group lacks a "
               "setting the running one reads in every step (apex's FusedAdam: KeyError "
               "'bias_correction' at the first step after the resume)",
           fingerprint=fingerprint, needle=needle)
    for loader, fingerprint, needle in (
        ("megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params",
         "23d536b83658", "self.optimizer.load_state_dict(state_dict[optimizer_key])"),
        ("megatron.core.optimizer.optimizer.FP32Optimizer", "4e445929e714", ""),
        ("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer", "707490502424",
         '{**param_groups_map[needed_groups], "params": inner_param_group[\'params\']}')))
MEGATRON_CHANGES = LOAD_STATE_DICTS


def keeping_the_running_settings(load: Callable) -> Callable:
    """megatron's ``load_state_dict``, then the running optimizer's settings in each group
    where the checkpoint's group has none (groups matched by position: megatron loads them in
    the running optimizer's order)."""
    import torch

    @functools.wraps(load)
    def load_state_dict(self, state_dict):
        inner = getattr(self, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            return load(self, state_dict)
        own = [{key: value for key, value in group.items() if key != "params"}
               for group in inner.param_groups]
        result = load(self, state_dict)
        for group, settings in zip(inner.param_groups, own):
            for key, value in settings.items():
                group.setdefault(key, value)
            step = group["step"] if "step" in group else _shared_step(inner, group)
            if isinstance(step, float) and step.is_integer():
                step = int(step)
            if step is not None:
                group["step"] = step
        return result

    return load_state_dict


def _shared_step(inner, group: dict) -> float | None:
    """The step every parameter's state in ``group`` holds (torch's AdamW), or None."""
    steps = set()
    for p in group["params"]:
        step = inner.state.get(p, {}).get("step")
        if step is not None:
            steps.add(float(step))
    return steps.pop() if len(steps) == 1 else None


def loader_classes() -> list[type]:
    """megatron's optimizers that load their inner optimizer's groups from a checkpoint."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    return [Float16OptimizerWithFloat16Params, FP32Optimizer, DistributedOptimizer]

"""Resuming in fp32 a checkpoint that megatron's bf16/fp16 optimizer saved.

megatron checkpoints its mixed-precision optimizer (``Float16OptimizerWithFloat16Params``) as

    {"optimizer": {"state": ..., "param_groups": ...}, "fp32_from_fp16_params": ..., ...}

and its fp32 optimizer (``FP32Optimizer``) as ``{"state": ..., "param_groups": ...}``. The Adam
moments are sharded tensors under the same keys in both, so an fp32 launch reads them from
either checkpoint. A parameter group's settings (learning rates, weight-decay multiplier, ...)
are not sharded: they come back where they were saved, one level down, while the fp32 launch
finds at its own level only the groups' parameter ids, which megatron supplies from the
launch itself. megatron's ``FP32Optimizer.load_state_dict`` then matches groups by their
settings, finds none, and stops ("Could not find parameter group with key ... in loaded
checkpoint"). Every ``--cpu`` resume of a GPU bf16 checkpoint meets this (CPU mode trains in
fp32), and so does a GPU launch that leaves out the ``--bf16`` it was saved with.

``fp32_layout`` moves the saved settings, and Adam's step count, to where the fp32
optimizer reads them. The mixed-precision checkpoint's fp32 master weights are not read: the
model goes on from its 16-bit weights, one 16-bit rounding away from the master copies.
"""

from __future__ import annotations

from typing import Callable

from megagpt.megatron_change import WRAPS, Change


def saved_by_mixed_precision_optimizer(state_dict) -> bool:
    """Whether ``state_dict``, as megatron's checkpoint loading hands it to the fp32
    optimizer, holds a mixed-precision optimizer's saved layout: the parameter groups one
    level down, under "optimizer" (a key the fp32 layout never has; the master weights are
    sharded tensors the fp32 launch does not ask for, so nothing else of them comes back)."""
    nested = state_dict.get("optimizer") if isinstance(state_dict, dict) else None
    return isinstance(nested, dict) and "param_groups" in nested


def fp32_layout(state_dict: dict) -> dict:
    """The fp32 optimizer's layout of a loaded mixed-precision optimizer state: the saved
    groups' settings with this launch's parameter ids (groups in the order both optimizers
    build them), the loaded moments, and the saved common step."""
    nested = state_dict["optimizer"]
    saved_groups = nested["param_groups"]
    launch_groups = state_dict.get("param_groups") or []
    if len(saved_groups) != len(launch_groups):
        raise ValueError(
            f"the checkpoint's bf16/fp16 optimizer has {len(saved_groups)} parameter groups "
            f"and this fp32 launch's {len(launch_groups)}; the model or its optimizer "
            "settings differ from the run that saved it")
    groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": ours["params"]}
              for saved, ours in zip(saved_groups, launch_groups)]
    state = dict(state_dict.get("state") or {})
    saved_state = nested.get("state") or {}
    if "common_step" in saved_state and "common_step" not in state:
        state["common_step"] = saved_state["common_step"]
    return {"state": state, "param_groups": groups}


FP32_LOAD_STATE_DICT = Change(
    "megatron.core.optimizer.optimizer.FP32Optimizer.load_state_dict", WRAPS, __name__,
    does="a bf16/fp16 optimizer's checkpoint is put in the fp32 layout before it loads",
    why="megatron's mixed-precision optimizer keeps its parameter groups' settings one level "
        "down, where the fp32 optimizer (CPU mode, a launch without --bf16) does not look, and "
        "megatron stops on 'Could not find parameter group'",
    fingerprint="4e445929e714")
MEGATRON_CHANGES = (FP32_LOAD_STATE_DICT,)


def reading_mixed_precision_checkpoints(load_state_dict: Callable) -> Callable:
    """Wrap ``FP32Optimizer.load_state_dict``: a mixed-precision optimizer's saved state is
    put in the fp32 layout first; any other state goes to megatron as it came."""
    def load_state_dict_of_either_precision(self, state_dict):
        if saved_by_mixed_precision_optimizer(state_dict):
            state_dict = fp32_layout(state_dict)
        return load_state_dict(self, state_dict)

    return load_state_dict_of_either_precision

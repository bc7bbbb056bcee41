"""Which kernels step the optimizer, and whether the step waits for the host.

megatron's Adam runs TE's or apex's FusedAdam where either is installed, else its torch
fallbacks. The fast path replaces it, where megatron's optimizer allows, with torch's fused
AdamW, and under megatron's bf16 optimizer with the flat step (``train_step.flat_adam``:
one pass over flat buffers); elsewhere torch's foreach kernels. The launch's megatron changes
install what this decides (``megatron_changes``).
"""

from __future__ import annotations

from typing import Callable, Optional

from .plan import Decision, Label, Reason, Why


class OptimizerKernels(Label):
    MEGATRONS = "megatron's"
    FOREACH = "foreach kernels"
    FUSED_ADAMW = "fused AdamW"
    FLAT_ADAMW = "fused AdamW, flat step"

    @property
    def fused(self) -> bool:
        """torch's fused AdamW steps in place of megatron's Adam (no temporaries)."""
        return self in (OptimizerKernels.FUSED_ADAMW, OptimizerKernels.FLAT_ADAMW)


OPTIMIZER: Decision[OptimizerKernels] = Decision("optimizer", OptimizerKernels)
ASYNC_STEP: Decision[bool] = Decision("async step", bool)


def fused_adam_left_out_reason(args, local_fallbacks: Callable[[], bool]) -> Optional[str]:
    """Why torch's fused AdamW does not replace megatron's Adam here (None: it does).
    ``local_fallbacks()``: whether megatron's optimizer took its no-TE/no-apex fallbacks."""
    if getattr(args, "optimizer", "adam") != "adam":
        return f"--optimizer {args.optimizer}: fused AdamW not applicable"
    if getattr(args, "use_precision_aware_optimizer", False):
        return "precision-aware optimizer requested; fused AdamW left out"
    if getattr(args, "optimizer_cpu_offload", False):
        return "optimizer CPU offload requested; fused AdamW left out"
    if getattr(args, "use_distributed_optimizer", False) and not local_fallbacks():
        # megatron's distributed optimizer reads and writes its checkpoint's Adam step the
        # way TE's / apex's FusedAdam keeps it (in the parameter groups) whenever either is
        # installed; that optimizer is already one fused kernel
        return ("the distributed optimizer keeps TE's/apex's FusedAdam (its checkpoints "
                "follow that optimizer's layout)")
    return None


def choose_optimizer(p) -> None:
    """The optimizer's kernels and step (the flat step attaches to the optimizer megatron
    builds where that optimizer allows it)."""
    if not p.v.fast_optimizer:
        given = Reason(Why.GIVEN, "--fast-disable optimizer")
        p.choose(OPTIMIZER, OptimizerKernels.MEGATRONS, given)
        p.choose(ASYNC_STEP, False, given)
        return
    fused_kernels = p.installed.megatron_fused_optimizer
    left_out = fused_adam_left_out_reason(p.v, lambda: not fused_kernels)
    if left_out is not None:
        value, reason = OptimizerKernels.FOREACH, Reason(Why.CONFLICT, left_out)
    elif not p.v.fast_flat_adam:
        value, reason = OptimizerKernels.FUSED_ADAMW, Reason(Why.GIVEN,
                                                             "--fast-disable flat-adam")
    elif not p.get("bf16", False):
        value, reason = OptimizerKernels.FUSED_ADAMW, Reason(
            Why.CONFLICT, "the flat step serves megatron's bf16 optimizer only")
    else:
        value, reason = OptimizerKernels.FLAT_ADAMW, Reason(
            Why.DEFAULT, "where megatron's bf16 optimizer allows it")
    p.choose(OPTIMIZER, value, reason)
    p.choose(ASYNC_STEP, bool(p.v.fast_async_step), Reason(Why.DEFAULT, "no host waits in the "
                                                           "step") if p.v.fast_async_step
             else Reason(Why.GIVEN, "--fast-disable async-step"))

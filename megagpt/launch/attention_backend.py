"""megatron's ``--attention-backend`` (auto, flash, fused, unfused, local) on each layer path.

megatron reads the flag in two places: Transformer Engine's attention picks its kernel from
the ``NVTE_FLASH_ATTN`` / ``NVTE_FUSED_ATTN`` / ``NVTE_UNFUSED_ATTN`` switches that megatron's
``LanguageModule._set_attention_backend`` sets from it when the model is built (asserting
that the environment does not already hold other values), and ``local`` needs megatron's
local spec (``--spec local``, its ``validate_args`` says). megatron's own local attention
(``DotProductAttention``) is unfused whatever the flag says.

The fast spec's attention is torch's ``scaled_dot_product_attention``; it honours the flag
by restricting the kernels torch may pick from to the same family as TE's:

  auto     torch picks (flash, cuDNN, memory-efficient, math)
  flash    torch's FlashAttention-2 kernel (TE: the flash-attn package's)
  fused    cuDNN's fused attention (TE's "fused" backend is cuDNN's too)
  unfused  torch's math kernel: matmul, softmax, matmul (TE: its unfused attention)

``attention_plan`` is what the launch's resolution decides and logs for the flag (the
``ATTENTION`` decision); the kernel table the fast spec's attention reads is
``megagpt.fast_spec.sdpa_kernels``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from megagpt.errors import UserError
from megagpt.fast_spec.sdpa_kernels import AUTO, FLASH, FUSED, LOCAL, UNFUSED, backend_name

from .layers import TRANSFORMER_ENGINE_IMPL, LayerPath
from .plan import Decision, Label, Reason, Why

KERNEL_NAMES = {FLASH: "torch's flash attention kernel", FUSED: "cuDNN's fused attention",
                UNFUSED: "torch's unfused math kernel", LOCAL: "torch's unfused math kernel"}

# what megatron's _set_attention_backend sets TE's switches to (flash, fused, unfused)
TE_SWITCHES = {
    AUTO: ("1", "1", "1"),
    FLASH: ("1", "0", "0"),
    FUSED: ("0", "1", "0"),
    UNFUSED: ("0", "0", "1"),
    LOCAL: ("0", "0", "0"),
}
TE_SWITCH_NAMES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def te_switch_conflict(backend: str, environ: Mapping[str, str]) -> Optional[str]:
    """Which of TE's attention switches in the environment megatron's model build would
    stop on for ``backend`` (None: none)."""
    expected = TE_SWITCHES.get(backend)
    if expected is None:
        return None
    for name, want in zip(TE_SWITCH_NAMES, expected):
        have = environ.get(name)
        if have is not None and have != want:
            return f"{name}={have} in the environment (megatron sets it to {want} for " \
                   f"--attention-backend {backend})"
    return None


def _te_backend_for(environ: Mapping[str, str]) -> Optional[str]:
    """The --attention-backend whose switches agree with those set in the environment (the
    first of flash, fused, unfused; None where none is set or none agrees)."""
    have = tuple(environ.get(name) for name in TE_SWITCH_NAMES)
    if all(value is None for value in have):
        return None
    for backend in (FLASH, FUSED, UNFUSED, AUTO):
        if all(h is None or h == w for h, w in zip(have, TE_SWITCHES[backend])):
            return backend
    return None


class AttentionModule(Label):
    """Whose core attention the layers run."""

    SDPA = "SDPA"  # the fast spec's: torch's scaled_dot_product_attention
    TE = "TE"  # Transformer Engine's
    MEGATRON_LOCAL = "megatron's DotProductAttention"  # unfused


@dataclass(frozen=True)
class Attention:
    """The attention a launch runs: whose module, and megatron's ``--attention-backend``
    (auto, flash, fused, unfused, local) as that module takes it."""

    module: AttentionModule
    backend: str

    def __str__(self) -> str:
        if self.module is AttentionModule.TE:
            return "TE picks" if self.backend == AUTO else f"TE's {self.backend} attention"
        if self.module is AttentionModule.MEGATRON_LOCAL:
            return str(self.module)
        if self.backend == AUTO:
            return "SDPA, torch picks"
        return f"SDPA, {KERNEL_NAMES[self.backend]} only"


ATTENTION: Decision[Attention] = Decision("attention", Attention)


@dataclass(frozen=True)
class AttentionPlan:
    attention: Attention  # what runs; its backend is megatron's --attention-backend after it
    reason: Reason
    log: tuple[str, ...] = ()


def attention_plan(args, path: LayerPath, environ: Mapping[str, str]) -> AttentionPlan:
    """What ``--attention-backend`` (and megatron's legacy ``--use-flash-attn``) come to on
    layers of ``path``; UserError where the launch cannot run them."""
    backend = backend_name(getattr(args, "attention_backend", None))
    log: list[str] = []
    if getattr(args, "use_flash_attn", False):
        if backend not in (AUTO, FLASH):
            raise UserError(f"--use-flash-attn with --attention-backend {backend}: the two ask "
                            "for different attention kernels; give one")
        if backend == AUTO:
            backend = FLASH
            log.append("attention: --use-flash-attn taken as --attention-backend flash "
                       "(megatron-core reads only --attention-backend)")
    te = path is LayerPath.TRANSFORMER_ENGINE or (
        path is LayerPath.MOE_BLOCK
        and getattr(args, "transformer_impl", None) == TRANSFORMER_ENGINE_IMPL)
    conflict = te_switch_conflict(backend, environ)
    if conflict is not None:
        # megatron asserts on it in every GPT model's constructor, whatever its layers
        suggested = _te_backend_for(environ) if te else None
        how = (f"and give --attention-backend {suggested} instead" if suggested
               else "and choose TE's kernel with --attention-backend flash|fused|unfused"
               if te else "(they choose Transformer Engine's attention kernels, which this "
               "launch does not run)")
        raise UserError(f"{conflict}: megatron stops on it while building the model; "
                        f"unset {', '.join(TE_SWITCH_NAMES)} {how}")
    if te:
        return AttentionPlan(Attention(AttentionModule.TE, backend), Reason(
            Why.MEGATRON, "megatron sets TE's NVTE_*_ATTN switches from --attention-backend"),
            tuple(log))
    if path is not LayerPath.FAST:
        if backend not in (AUTO, LOCAL):
            log.append(f"attention: megatron's local DotProductAttention (unfused): "
                       f"--attention-backend {backend} selects the kernels of TE's and the "
                       "fast spec's attention only")
        return AttentionPlan(Attention(AttentionModule.MEGATRON_LOCAL, backend), Reason(
            Why.MEGATRON, "megatron's local attention is unfused"), tuple(log))
    if backend == AUTO:
        return AttentionPlan(Attention(AttentionModule.SDPA, backend), Reason(
            Why.DEFAULT, "--attention-backend auto"), tuple(log))
    on_cpu = bool(getattr(args, "cpu", False))
    if backend == FUSED and on_cpu:
        raise UserError("--attention-backend fused with --cpu: cuDNN's fused attention runs "
                        "on NVIDIA GPUs only; use auto, flash or unfused on the CPU")
    if backend == FLASH and on_cpu and (getattr(args, "attention_dropout", 0.0) or 0.0) > 0.0:
        raise UserError(f"--attention-backend flash with --cpu and --attention-dropout "
                        f"{args.attention_dropout}: torch's flash attention kernel on the CPU "
                        "has no dropout; add --attention-dropout 0, or use auto or unfused")
    half = getattr(args, "bf16", False) or getattr(args, "fp16", False)
    if backend in (FLASH, FUSED) and not on_cpu and not half:
        raise UserError(f"--attention-backend {backend}: {KERNEL_NAMES[backend]} runs in bf16 "
                        "or fp16, and this launch trains in fp32; add --bf16, or use auto or "
                        "unfused")
    return AttentionPlan(Attention(AttentionModule.SDPA, backend), Reason(
        Why.GIVEN, f"--attention-backend {backend}"), tuple(log))

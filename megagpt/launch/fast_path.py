"""The fast path's steps of the launch's resolution: every choice of the fast path, with its
reason (``STEPS``, in the order each reads the ones before).

Each step is a function over the resolution's planner (``planner.Planner``): it reads the
arguments as decided so far (``p.v``, with every earlier step's values laid over the parsed
ones), not arguments an earlier step wrote: the grad-write check sees the ``cuda_graph_impl``
the layer-graph decision chose because the planner holds it. The concerns with modules of
their own: the layers (``layers``), attention (``attention_backend``), FP8 (``fp8``), the
CUDA graphs and the NaN check (``cuda_graphs``), the optimizer's kernels
(``optimizer_kernels``); the gradient pieces' reasons are ``fast_path_reasons``'.

``plan_fast_path(args, installed, environ)`` runs these steps alone over arguments another
resolution has adapted already; ``apply_fast_path_defaults(args)`` writes what they decide
into ``args`` (for the bench's layouts and tests).
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, Optional

from megagpt.errors import UserError
from megagpt.command_line.fast_path_options import SWITCH_DEFAULTS

from . import cuda_graphs, fp8, layers, optimizer_kernels
from . import fast_path_reasons as s
from .attention_backend import ATTENTION, attention_plan
from .plan import Decision, Label, Launch, Reason, Why
from .planner import Planner

SECTION = "fast path"


class LmLoss(Label):
    CHUNKED = "chunked"  # the chunked LM-head cross entropy (fast_spec.lm_loss)
    MEGATRONS = "megatron's"


FUSED_LAYER: Decision[bool] = Decision("fused layer", bool)
HASH_DROPOUT: Decision[bool] = Decision("hash dropout", bool)
GRAD_WRITE: Decision[bool] = Decision("grad write", bool)
BF16_GRAD_BUFFER: Decision[bool] = Decision("bf16 grad buffer", bool)
COMPILE: Decision[bool] = Decision("compile", bool)
LM_LOSS: Decision[LmLoss] = Decision("LM loss", LmLoss)
LM_GRAD_IN_FORWARD: Decision[bool] = Decision("LM grad in forward", bool)
ATTENTION_MASK: Decision[bool] = Decision("attention mask", bool)


# --- the steps, in the order each reads the ones before -----------------------------------

def _switch_defaults(p: Planner) -> None:
    for name, default in SWITCH_DEFAULTS:
        if not hasattr(p.args, name):
            p.set(name, default)


def _attention_kernels(p: Planner) -> None:
    """megatron's --attention-backend on this launch's layers (``attention_backend``)."""
    from megatron.core.transformer.enums import AttnBackend

    from megagpt.fast_spec.sdpa_kernels import backend_name

    planned = attention_plan(p.v, p.layers()[0], p.environ)
    if planned.attention.backend != backend_name(p.get("attention_backend")):
        p.set("attention_backend", AttnBackend[planned.attention.backend])
    for line in planned.log:
        p.log(line)
    p.choose(ATTENTION, planned.attention, planned.reason)


def _fused_layer(p: Planner) -> None:
    # With --overlap-param-gather, megatron's DDP waits for each bucket's all-gather in a
    # forward pre-hook of the module that owns the parameters; the fused layer reads its
    # weights without calling those modules, so with several buckets the waits never run
    # (on two CPU ranks: "assert self.param_gather_handle is None" at the third step).
    if not p.fast():
        p.choose(FUSED_LAYER, False, Reason(Why.CONFLICT, "the fast spec is not used"))
    elif p.get("overlap_param_gather", False) and p.v.fast_spec_fused_layer:
        p.set("fast_spec_fused_layer", False)
        p.log("fast spec: fused layer off: --overlap-param-gather waits for each parameter "
              "bucket in its modules' forward pre-hooks, which the fused layer does not call")
        p.choose(FUSED_LAYER, False, Reason(Why.CONFLICT, "--overlap-param-gather"))
    elif not p.v.fast_spec_fused_layer:
        p.choose(FUSED_LAYER, False, Reason(Why.GIVEN, "--fast-disable fused-layer"))
    else:
        p.choose(FUSED_LAYER, True, Reason(Why.DEFAULT, "the fast spec's default"))


def _bf16_grad_buffer(p: Planner) -> None:
    asked = p.v.fast_bf16_grad_buffer
    if asked is None:
        off = s.bf16_grad_buffer_unsupported_reason(p.v, p.layers()[0], p.given)
        p.set("fast_bf16_grad_buffer", off is None)
        if off is None:
            p.log("fast path: gradients kept in a bf16 buffer (--grad-reduce-in-bf16): one "
                  "micro-batch, one data-parallel rank, so the values equal the fp32 buffer's "
                  "(--fast-disable bf16-grad-buffer keeps fp32)")
            reason = Reason(Why.LAYOUT, "one micro-batch, one data-parallel rank: the fp32 "
                            "buffer's values")
        else:
            reason = Reason(Why.CONFLICT, off)
    else:
        reason = Reason(Why.GIVEN, "asked for" if asked else "--fast-disable bf16-grad-buffer")
    if p.v.fast_bf16_grad_buffer:
        p.set("grad_reduce_in_bf16", True)
    p.choose(BF16_GRAD_BUFFER, bool(p.v.fast_bf16_grad_buffer), reason)


def _grad_write(p: Planner) -> None:
    asked = p.v.fast_grad_write
    path = p.layers()[0]
    chunked = p.chosen(LM_LOSS).value is LmLoss.CHUNKED
    unused = (s.wgrad_fusion_unused_reason(p.v, path, chunked)
              if asked is not False and p.get("gradient_accumulation_fusion", False) else None)
    if unused is not None:
        # on by megatron's default where apex's kernel imports: it would keep gradients
        # added into a zeroed buffer while nothing of this launch uses the kernel
        p.set("gradient_accumulation_fusion", False)
        if s.grad_write_unsupported_reason(p.v, path) is None:
            p.log(f"fast path: --no-gradient-accumulation-fusion: {unused}; they are written "
                  "into megatron's buffer instead (--fast-disable grad-write keeps the fusion)")
        else:
            del p.decided["gradient_accumulation_fusion"]
    off = s.grad_write_unsupported_reason(p.v, path)
    if asked is None:
        p.set("fast_grad_write", off is None)
        reason = (Reason(Why.CONFLICT, off) if off is not None else Reason(
            Why.DEFAULT, "nothing is accumulated in the buffer: written, not zeroed and added"))
    elif asked and off is not None:
        raise UserError(f"gradients written: {off}: gradients are summed in the buffer "
                        "there, which needs megatron's zeroing")
    else:
        reason = Reason(Why.GIVEN, "asked for" if asked else "--fast-disable grad-write")
    p.choose(GRAD_WRITE, bool(p.v.fast_grad_write), reason)


def _attention_mask(p: Planner) -> None:
    # The fast spec's attention is causal by construction (SDPA's is_causal); the [s, s]
    # mask per sample is built by the loader's workers and copied to the GPU every step
    # (8 MB at 345M, 16 MB at 1.3B) only to be ignored. Document masks still need it.
    wanted = p.get("create_attention_mask_in_dataloader", False)
    if wanted and not p.get("reset_attention_mask", False) and p.fast():
        p.set("create_attention_mask_in_dataloader", False)
        p.log("fast path: no attention mask from the data loader (the fast spec's attention "
              "is causal by construction; --no-fast-spec keeps megatron's)")
        p.choose(ATTENTION_MASK, False, Reason(Why.DEFAULT, "the fast spec's attention is "
                                               "causal"))
    elif wanted:
        p.choose(ATTENTION_MASK, True, Reason(Why.GIVEN, "--reset-attention-mask")
                 if p.get("reset_attention_mask", False)
                 else Reason(Why.MEGATRON, "megatron's layers read it"))
    else:
        p.choose(ATTENTION_MASK, False, Reason(Why.GIVEN, "not asked of the data loader"))


def _compile(p: Planner) -> None:
    asked = p.v.fast_spec_compile
    impl = p.get("cuda_graph_impl", "none")
    if p.get("cpu", False):
        if asked:
            p.log("fast spec: CPU mode: the fused layer runs eagerly (no torch.compile)")
        p.set("fast_spec_compile", False)
        reason = Reason(Why.CPU, "CPU mode")
    elif asked is None:
        # inside a graph launch cost disappears and compiled kernels win; outside one the
        # step is bound by launches, where the compiled layer is no faster than eager
        p.set("fast_spec_compile", impl in ("full_iteration", "local"))
        reason = (Reason(Why.DEFAULT, "inside CUDA graphs compiled kernels win")
                  if p.v.fast_spec_compile else
                  Reason(Why.DEFAULT, "no CUDA graph: launch-bound, eager is as fast"))
    else:
        reason = Reason(Why.GIVEN, "--fast-compile" if asked else "--fast-compile off")
    p.choose(COMPILE, bool(p.v.fast_spec_compile), reason)
    # the compiled layer runs on one tensor-parallel rank only (eager on several)
    if p.v.fast_spec_compile and p.fast() and (
            p.get("tensor_model_parallel_size", 1) or 1) == 1:
        _compiled_layer_notes(p)


def _compiled_layer_notes(p: Planner) -> None:
    if (p.get("hidden_dropout", 0.0) or 0.0) > 0.0:
        p.log("fast spec: compiled layer: residual dropout masks "
              + ("hashed from each element's index and a seed (--fast-disable hash-dropout)"
                 if p.v.fast_hash_dropout else "from F.dropout (--fast-disable hash-dropout)"))


def _hash_dropout(p: Planner) -> None:
    """The compiled fused layer's residual dropout masks: hashed from each element's index
    and a seed, or F.dropout's (an eager layer's are F.dropout's either way)."""
    if not p.v.fast_hash_dropout:
        p.choose(HASH_DROPOUT, False, Reason(Why.GIVEN, "--fast-disable hash-dropout"))
    elif p.v.fast_spec_compile:
        p.choose(HASH_DROPOUT, True, Reason(
            Why.DEFAULT, "the compiled fused layer's residual dropout masks are hashed from "
            "each element's index and a seed"))
    else:
        p.choose(HASH_DROPOUT, True, Reason(
            Why.DEFAULT, "for a compiled fused layer; an eager one draws F.dropout's masks"))


def _lm_loss(p: Planner) -> None:
    """The last stage's loss: the chunked LM-head cross entropy (``fast_spec.lm_loss``) or
    megatron's output layer and loss. (The chunked loss still hands an output layer it cannot
    serve, one with a bias, to megatron's path.)"""
    from megagpt.fast_spec.lm_loss import lm_grad_in_forward_unsupported_reason

    megatrons = LmLoss.MEGATRONS
    if not p.v.fast_lm_loss:
        p.choose(LM_LOSS, megatrons, Reason(Why.GIVEN, "--fast-disable lm-loss"))
    elif p.get("transformer_impl", "local") == layers.TRANSFORMER_ENGINE_IMPL:
        p.choose(LM_LOSS, megatrons, Reason(Why.CONFLICT, "Transformer Engine's layers keep "
                                            "upstream's path"))
    elif p.get("cross_entropy_loss_fusion", False):
        p.choose(LM_LOSS, megatrons, Reason(Why.GIVEN, "--cross-entropy-loss-fusion"))
    elif (p.get("tensor_model_parallel_size", 1) or 1) != 1:
        p.choose(LM_LOSS, megatrons, Reason(Why.LAYOUT, "tensor-parallel output layer"))
    else:
        p.choose(LM_LOSS, LmLoss.CHUNKED, Reason(Why.DEFAULT, "the [tokens, vocab] logits "
                                                 "never exist all at once"))
    if p.chosen(LM_LOSS).value is not LmLoss.CHUNKED:
        p.choose(LM_GRAD_IN_FORWARD, False, Reason(Why.CONFLICT, "megatron's loss"))
        return
    off = lm_grad_in_forward_unsupported_reason(p.v)
    p.choose(LM_GRAD_IN_FORWARD, off is None,
             Reason(Why.DEFAULT, "LM head gradients formed in forward") if off is None
             else Reason(Why.CONFLICT, f"LM head recomputed in backward: {off}"))


STEPS: tuple[Callable[[Planner], None], ...] = (
    _switch_defaults, layers.choose_layers, _attention_kernels, _fused_layer, fp8.choose_fp8,
    cuda_graphs.choose_cuda_graphs, cuda_graphs.choose_nccl_connect, _bf16_grad_buffer,
    _lm_loss, _grad_write, _attention_mask, _compile, _hash_dropout,
    optimizer_kernels.choose_optimizer,
)


def plan_fast_path(args, installed=None, environ: Optional[Mapping[str, str]] = None,
                   given: frozenset[str] = frozenset()) -> Launch:
    """The fast path's steps alone over ``args``, arguments adapted already (changes nothing;
    raises UserError for a switch asked for where it cannot run). ``installed``:
    ``compat.Installed`` (None: detected); ``environ``: default ``os.environ``; ``given``:
    the flags the command line gave."""
    if installed is None:
        from megagpt.compat import Installed

        installed = Installed.detect()
    p = Planner(args, frozenset(given), installed, os.environ if environ is None else environ)
    p.section = SECTION
    for step in STEPS:
        step(p)
    return p.launch()


def apply_fast_path_defaults(args, log: Optional[Callable[[str], None]] = None,
                             installed=None, given: frozenset[str] = frozenset()) -> Launch:
    """``plan_fast_path`` for ``args``, written into ``args`` and ``os.environ``; returns it."""
    from .writer import write

    launch = plan_fast_path(args, installed, given=given)
    write(launch, args, log=log)
    return launch

"""The fast path's steps of the launch's resolution: every choice of the fast path, with its
reason (``STEPS``, in the order each reads the ones before).

Each step is a function over the resolution's planner (``planner.Planner``): it reads the
arguments as decided so far (``p.v``, with every earlier step's values laid over the parsed
ones), not arguments an earlier step wrote: the grad-write check sees the ``cuda_graph_impl``
the layer-graph decision chose because the planner holds it. The switches and their reasons
live in ``fast_path_reasons`` (``*_unsupported_reason``); the layers (fast spec, Transformer
Engine's, megatron's local ones) follow ``--transformer-impl`` as ``megagpt.layer_impl`` chose
it, and ``layer_path`` is the one place that tells them apart.

``plan_fast_path(args, installed, environ)`` runs these steps alone over arguments another
resolution has adapted already; ``apply_fast_path_defaults(args)`` writes what they decide
into ``args`` (for the bench's layouts and tests).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Mapping, Optional

from megagpt.errors import UserError
from megagpt.fast_path_flags import SWITCH_DEFAULTS

from . import fast_path_reasons as s
from .planner import Launch, Planner


NCCL_CONNECT = "NCCL_RUNTIME_CONNECT"
NCCL_CHOICE = "NCCL connect"
SECTION = "fast path"

# the names of the choices what runs reads (megagpt.gpt_model, launch.megatron_changes)
LAYERS = "layers"
FUSED_LAYER = "fused layer"
HASH_DROPOUT = "hash dropout"
CUDA_GRAPH = "CUDA graph"
NAN_CHECK = "NaN check"
GRAD_WRITE = "grad write"
BF16_GRAD_BUFFER = "bf16 grad buffer"
COMPILE = "compile"
LM_LOSS = "LM loss"
LM_GRAD_IN_FORWARD = "LM grad in forward"
OPTIMIZER = "optimizer"
ASYNC_STEP = "async step"
FP8 = "FP8"  # "off", TE's layers (a text), or the fast spec's ``Fp8Recipe``

# the values of CUDA_GRAPH, NAN_CHECK, LM_LOSS and OPTIMIZER
FULL_ITERATION, PER_LAYER = "full iteration", "per layer"
GRADIENT_NORM = "gradient norm"
CHUNKED, MEGATRONS = "chunked", "megatron's"
FOREACH, FUSED_ADAMW, FLAT_ADAMW = "foreach kernels", "fused AdamW", "fused AdamW, flat step"


# --- the steps, in the order each reads the ones before -----------------------------------

def _switch_defaults(p: Planner) -> None:
    for name, default in SWITCH_DEFAULTS:
        if not hasattr(p.args, name):
            p.set(name, default)


def _layers(p: Planner) -> None:
    p.choose(LAYERS, *p.layers())
    from megagpt.compat import sequence_parallel_norms_missing

    refusal = sequence_parallel_norms_missing(p.v, p.installed, p.fast())
    if refusal is not None:
        raise refusal


def _attention_kernels(p: Planner) -> None:
    """megatron's --attention-backend on this launch's layers (``attention_backend``)."""
    from megatron.core.transformer.enums import AttnBackend

    from megagpt.fast_spec.sdpa_kernels import backend_name

    from .attention_backend import attention_plan

    planned = attention_plan(p.v, p.layers()[0], p.environ)
    if planned.backend != backend_name(p.get("attention_backend")):
        p.set("attention_backend", AttnBackend[planned.backend])
    for line in planned.log:
        p.log(line)
    p.choose("attention", planned.kernels, planned.reason)


def _fused_layer(p: Planner) -> None:
    # With --overlap-param-gather, megatron's DDP waits for each bucket's all-gather in a
    # forward pre-hook of the module that owns the parameters; the fused layer reads its
    # weights without calling those modules, so with several buckets the waits never run
    # (on two CPU ranks: "assert self.param_gather_handle is None" at the third step).
    if not p.fast():
        p.choose(FUSED_LAYER, False, "the fast spec is not used")
    elif p.get("overlap_param_gather", False) and p.v.fast_spec_fused_layer:
        p.set("fast_spec_fused_layer", False)
        p.log("fast spec: fused layer off: --overlap-param-gather waits for each parameter "
              "bucket in its modules' forward pre-hooks, which the fused layer does not call")
        p.choose(FUSED_LAYER, False, "--overlap-param-gather")
    elif not p.v.fast_spec_fused_layer:
        p.choose(FUSED_LAYER, False, "--fast-disable fused-layer")
    else:
        p.choose(FUSED_LAYER, True, "the fast spec's default")


def _fp8(p: Planner) -> None:
    """``--fp8-format``: in TE's layers, or in the fast spec's FP8 linears
    (``fast_spec.fp8``), which take it off megatron's ``fp8`` (megatron's FP8 path is TE's)
    into ``fast_fp8``."""
    fmt = p.get("fp8", None)
    if not fmt:
        p.choose(FP8, "off", "--fp8-format not given")
        return
    impl = p.chosen("transformer impl")  # megagpt.layer_impl's choice, with its reason
    why = impl.reason if impl is not None else "--transformer-impl as given"
    if p.te():
        p.choose(FP8, f"{fmt}, {p.get('fp8_recipe', 'delayed')} scaling, Transformer "
                 "Engine's layers", why)
        return
    if not p.fast():
        off = p.layers()[1].removeprefix("megatron's local modules; fast spec off: ")
        raise UserError(f"--fp8-format {fmt}: megatron's local modules have no FP8 without "
                        f"Transformer Engine, and the fast spec's cannot run here: {off}")
    if not p.v.fast_spec_fused_layer:
        raise UserError(f"--fp8-format {fmt}: FP8 runs in the fast spec's fused layer, which "
                        "this launch turns off (--overlap-param-gather or --fast-disable "
                        "fused-layer)")
    from megagpt.fast_spec.fp8_support import (linears_in_fp8, recipe_from_args,
                                               weight_writes_unsupported_reason)

    floor = p.get("fast_fp8_min_width", None)
    if floor is not None and floor < 0:
        raise UserError(f"--fast-fp8-min-width {floor}: a width of 0 or more")
    for flag, what in (("first_scales", "the first forward's scales are"),
                       ("grad_scaling", "the gradients' scaling is")):
        given = p.get(f"fast_fp8_{flag}", None)
        if given is not None and p.get("fp8_recipe", "delayed") != "delayed":
            raise UserError(f"--fast-fp8-{flag.replace('_', '-')} {given}: {what} delayed "
                            f"scaling's; --fp8-recipe {p.get('fp8_recipe')} scales every "
                            "tensor by its own amax")
    fp8, bf16 = linears_in_fp8(p.v)
    if not fp8:
        p.set("fp8", None)
        p.log(f"fast spec: --fp8-format {fmt} not taken: every fused-layer linear is too "
              f"narrow to gain in FP8 ({'; '.join(bf16)}); bf16 (--fast-fp8-min-width 0 "
              "runs them in FP8)")
        p.choose(FP8, "off", "every linear too narrow to gain (--fast-fp8-min-width)")
        return
    recipe = recipe_from_args(p.v)
    if recipe.first_scales == "unit":
        from megagpt.resilience.checkpoint_guard import checkpoint_to_load

        resumed = checkpoint_to_load(p.v)
        if resumed is not None:
            # the amax history is not in the checkpoint (TE's is): scales of 1 would cut the
            # first step's gradients of a model that has trained
            recipe = dataclasses.replace(recipe, first_scales="amax")
            p.log(f"fast spec: delayed scaling's first scales of 1 are for training's first "
                  f"step; resuming {resumed}, the first forward scales by its own amaxes")
    cast = weight_writes_unsupported_reason(p.v)
    recipe = dataclasses.replace(recipe, weights_written=cast is None)
    p.set("fast_fp8", fmt)
    p.set("fp8", None)
    narrow = f"; in bf16, too narrow to gain: {', '.join(bf16)}" if bf16 else ""
    weights = ("their FP8 weights written by the flat AdamW step with the bf16 ones"
               if cast is None else f"their weights cast to FP8 in each forward ({cast})")
    p.log(f"fast spec: FP8 linears ({recipe.describe()}): {', '.join(g for _, g in fp8)} "
          f"through torch._scaled_mm{narrow}, {weights}; embeddings, attention, the output "
          "layer and the loss in bf16; weights, gradients and checkpoints as in bf16")
    p.choose(FP8, recipe, why)


def _full_iteration_graph(p: Planner) -> None:
    asked = p.v.fast_cuda_graph
    impl = p.get("cuda_graph_impl", "none")
    if asked is None:
        reason = s.cuda_graph_unsupported_reason(p.v)
        p.set("fast_cuda_graph", reason is None)
        p.full_off = reason
        if reason is not None and (p.fast() or p.te()):
            if impl == "full_iteration":
                # megatron's own flag: its graph runs as asked, outside this switch's checks
                p.log("fast path: megatron's --cuda-graph-impl full_iteration as given: each "
                      "iteration's forward and backward are captured as one CUDA graph (on "
                      f"{p.world()} GPU(s); the fast path's own graph is automatic on one GPU "
                      "only)")
            else:
                p.log(f"{s._path_name(p.v)}: full-iteration CUDA graph off: {reason}")
    elif asked:
        _full_iteration_asked(p, impl)
    else:
        p.full_off = _graphs_given(p)
    full_iteration = p.v.fast_cuda_graph or impl == "full_iteration"
    if full_iteration and p.get("overlap_param_gather", False):
        # megatron launches the all-gather of the updated parameters in one step and waits
        # for it in the next forward pass: a graph captured per step holds only half of it
        # (megatron stops at the second iteration, in start_param_sync)
        raise UserError(
            "--overlap-param-gather with the full-iteration CUDA graph: megatron starts the "
            "parameter all-gather in one step and finishes it in the next, which a graph "
            "captured per step cannot hold. Leave out --overlap-param-gather, or the graph "
            "(--fast-cuda-graphs none)")
    if p.v.fast_cuda_graph:
        p.set("cuda_graph_impl", "full_iteration")
        if p.get("check_for_nan_in_loss_and_grad", False):
            p.set("check_for_nan_in_loss_and_grad", False)
            p.log("fast path: --no-check-for-nan-in-loss-and-grad (needed inside a CUDA graph; "
                  "losses are still logged)")
        p.log(f"{s._path_name(p.v)}: forward+backward captured as one CUDA graph per "
              "iteration (--cuda-graph-impl full_iteration; --fast-cuda-graphs none turns it "
              "off)")


def _graphs_given(p: Planner) -> str:
    """The ``--fast-cuda-graphs`` choice that turned a graph off."""
    return f"--fast-cuda-graphs {p.get('fast_cuda_graphs', 'none')}"


def _full_iteration_asked(p: Planner, impl) -> None:
    """--fast-cuda-graphs iteration given: where it cannot run, ignored or refused."""
    if p.get("cpu", False) or not (p.fast() or p.te()):
        p.log("fast path: --fast-cuda-graphs iteration ignored (CPU mode, or neither the "
              "fast spec nor Transformer Engine's dense layers are used)")
        p.set("fast_cuda_graph", False)
        p.full_off = ("--fast-cuda-graphs iteration ignored (CPU mode, or not the fast spec "
                      "nor TE's layers)")
    elif impl not in ("none", None, "full_iteration"):
        p.log(f"fast path: --fast-cuda-graphs iteration ignored: --cuda-graph-impl {impl}")
        p.set("fast_cuda_graph", False)
        p.full_off = f"--fast-cuda-graphs iteration ignored: --cuda-graph-impl {impl}"
    elif (conflict := s.graphed_recompute_conflict(p.v)) is not None:
        raise UserError(f"--fast-cuda-graphs iteration with {conflict}. Leave "
                        "out the flag, the dropout, or the module's recompute "
                        "(--recompute-modules)")
    elif (p.get("pipeline_model_parallel_size", 1) or 1) != 1:
        # megatron's pipeline schedule waits on the host for its exchanges inside the step,
        # which a capture forbids (a PP=2 capture failed: docs/speed.md, "Full-iteration
        # CUDA graph")
        raise UserError(
            "--fast-cuda-graphs iteration with pipeline parallelism: megatron's pipeline "
            "schedule synchronises with the host inside the step, which a CUDA graph capture "
            "forbids. Leave the flag out (per-layer graphs: --fast-cuda-graphs layers).")
    elif p.world() != 1:
        p.log(f"fast path: full-iteration CUDA graph on {p.world()} GPUs, asked for: the "
              "data- and tensor-parallel collectives are captured inside it (not yet measured "
              "on several GPUs; NCCL connects every peer when its communicator is made, and a "
              "capture that does not finish within --fast-cuda-graph-capture-timeout stops "
              "the run naming its rank)")


def _layer_graphs(p: Planner) -> None:
    """``fast_layer_graphs``: default, refusal, and megatron's ``cuda_graph_impl``."""
    asked = p.v.fast_layer_graphs
    given_local = p.get("cuda_graph_impl", "none") == "local" and asked is None
    reason = s.layer_graphs_unsupported_reason(p.v)
    if asked is None:
        off = reason or (None if given_local else s.layer_graphs_default_off_reason(p.v))
        p.set("fast_layer_graphs", off is None)
        p.layers_off = off
        if off is not None and p.fast() and not p.get("cpu", False) \
                and p.get("cuda_graph_impl", "none") != "full_iteration":
            p.log(f"fast path: per-layer CUDA graphs off: {off}")
    elif asked and reason is not None:
        raise UserError(f"--fast-cuda-graphs layers: {reason}; leave the flag out")
    elif not asked:
        p.layers_off = _graphs_given(p)
    if not p.v.fast_layer_graphs:
        return
    p.set("cuda_graph_impl", "local")
    p.log("fast path: each layer's forward and backward captured as CUDA graphs, holding the "
          "compiled fused layer (megatron's --cuda-graph-impl local; --fast-cuda-graphs none "
          "turns them off)")
    if p.get("check_for_nan_in_loss_and_grad", False) and not p.get("fast_step_nan_checks",
                                                                    False):
        # each check reads a GPU value on the host: once per micro-batch (the loss) and per
        # gradient bucket; the host then has nothing queued and the GPU idles through its
        # Python, the optimizer's per-parameter loops exposed behind the last wait (figures:
        # docs/speed.md, "Per-layer CUDA graphs")
        p.set("check_for_nan_in_loss_and_grad", False)
        p.log("fast path: megatron's in-step NaN/Inf checks off under per-layer graphs (each "
              "waits for the GPU); every step's gradient norm is checked instead "
              "(--fast-disable deferred-nan-checks keeps megatron's)")
    default_off = s.layer_graphs_default_off_reason(p.v)
    if default_off is not None:
        p.log(f"fast path: per-layer CUDA graphs with {default_off.split(' (')[0]}: asked "
              "for; not yet measured there")


def _graph_choices(p: Planner) -> None:
    """What the two graph decisions come to, and the NaN check they leave."""
    impl = p.get("cuda_graph_impl", "none") or "none"
    given_impl = getattr(p.args, "cuda_graph_impl", "none")
    if impl == "full_iteration":
        why = ("--fast-cuda-graphs iteration" if getattr(p.args, "fast_cuda_graph", None)
               else "one GPU, no model parallelism: launches are the step's cost"
               if p.v.fast_cuda_graph else "--cuda-graph-impl full_iteration as given")
        p.choose(CUDA_GRAPH, FULL_ITERATION, why)
    elif impl == "local":
        why = ("--fast-cuda-graphs layers" if getattr(p.args, "fast_layer_graphs", None)
               else "--cuda-graph-impl local as given" if given_impl == "local"
               else f"full-iteration graph off: {p.full_off}")
        p.choose(CUDA_GRAPH, PER_LAYER, why)
    else:
        why = f"full iteration: {p.full_off or 'off'}; per layer: {p.layers_off or 'off'}"
        p.choose(CUDA_GRAPH, impl, why)
    fp8 = p.chosen(FP8)
    if (impl in ("full_iteration", "local") and getattr(fp8 and fp8.value, "delayed", False)
            and p.get("cuda_graph_warmup_steps", 3) == 0):
        # the graph would hold the first iteration's forward, scaled before any amax was
        # recorded, and replay it every step
        raise UserError("--cuda-graph-warmup-steps 0 with the fast spec's delayed FP8 "
                        "scaling: the CUDA graph would be captured at the first iteration, "
                        "before any amax is recorded, and replay its scales; give 1 or more "
                        "(default 3) or --fp8-recipe tensorwise")
    nan = bool(p.get("check_for_nan_in_loss_and_grad", False))
    if nan:
        p.choose(NAN_CHECK, "in step", "megatron's checks of each loss and gradient bucket")
    elif not getattr(p.args, "check_for_nan_in_loss_and_grad", False):
        p.choose(NAN_CHECK, "off", "megatron's --no-check-for-nan-in-loss-and-grad")
    elif impl == "full_iteration":
        p.choose(NAN_CHECK, GRADIENT_NORM, "a check inside a CUDA graph cannot sync")
    else:
        p.choose(NAN_CHECK, GRADIENT_NORM, "each in-step check waits for the GPU under "
                 "per-layer graphs (--fast-disable deferred-nan-checks keeps them)")


def _nccl_connect(p: Planner) -> None:
    # NCCL (2.22+) connects peers lazily, on a collective's first use of them; inside a
    # capture that cannot happen (a DP=2 capture hung: docs/speed.md, "Full-iteration CUDA
    # graph"). 0 connects them when each communicator is made, after this point.
    full_iteration = p.get("cuda_graph_impl", "none") == "full_iteration"
    current = p.environ.get(NCCL_CONNECT)
    if not (full_iteration and p.world() != 1):
        p.choose(NCCL_CHOICE, current or "unset", "no NCCL collective is captured in a graph")
    elif current is not None:
        p.choose(NCCL_CHOICE, current, "as set in the environment")
    else:
        p.set_env(NCCL_CONNECT, "0")
        p.log("fast path: NCCL_RUNTIME_CONNECT=0 (every NCCL peer connected up front, as a "
              "captured collective cannot connect one)")
        p.choose(NCCL_CHOICE, "0", "a captured collective cannot connect a peer")


def _bf16_grad_buffer(p: Planner) -> None:
    asked = p.v.fast_bf16_grad_buffer
    if asked is None:
        reason = s.bf16_grad_buffer_unsupported_reason(p.v, p.given)
        p.set("fast_bf16_grad_buffer", reason is None)
        if reason is None:
            p.log("fast path: gradients kept in a bf16 buffer (--grad-reduce-in-bf16): one "
                  "micro-batch, one data-parallel rank, so the values equal the fp32 buffer's "
                  "(--fast-disable bf16-grad-buffer keeps fp32)")
            reason = "one micro-batch, one data-parallel rank: the fp32 buffer's values"
    else:
        reason = "asked for" if asked else "--fast-disable bf16-grad-buffer"
    if p.v.fast_bf16_grad_buffer:
        p.set("grad_reduce_in_bf16", True)
    p.choose(BF16_GRAD_BUFFER, bool(p.v.fast_bf16_grad_buffer), reason)


def _grad_write(p: Planner) -> None:
    asked = p.v.fast_grad_write
    unused = (s.wgrad_fusion_unused_reason(p.v, p.chosen(LM_LOSS).value == CHUNKED)
              if asked is not False and p.get("gradient_accumulation_fusion", False) else None)
    if unused is not None:
        # on by megatron's default where apex's kernel imports: it would keep gradients
        # added into a zeroed buffer while nothing of this launch uses the kernel
        p.set("gradient_accumulation_fusion", False)
        if s.grad_write_unsupported_reason(p.v) is None:
            p.log(f"fast path: --no-gradient-accumulation-fusion: {unused}; they are written "
                  "into megatron's buffer instead (--fast-disable grad-write keeps the fusion)")
        else:
            del p.decided["gradient_accumulation_fusion"]
    reason = s.grad_write_unsupported_reason(p.v)
    if asked is None:
        p.set("fast_grad_write", reason is None)
        reason = reason or "nothing is accumulated in the buffer: written, not zeroed and added"
    elif asked and reason is not None:
        raise UserError(f"gradients written: {reason}: gradients are summed in the buffer "
                        "there, which needs megatron's zeroing")
    else:
        reason = "asked for" if asked else "--fast-disable grad-write"
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
        p.choose("attention mask", False, "the fast spec's attention is causal")
    elif wanted:
        p.choose("attention mask", True, "--reset-attention-mask" if p.get(
            "reset_attention_mask", False) else "megatron's layers read it")
    else:
        p.choose("attention mask", False, "not asked of the data loader")


def _compile(p: Planner) -> None:
    asked = p.v.fast_spec_compile
    impl = p.get("cuda_graph_impl", "none")
    if p.get("cpu", False):
        if asked:
            p.log("fast spec: CPU mode: the fused layer runs eagerly (no torch.compile)")
        p.set("fast_spec_compile", False)
        reason = "CPU mode"
    elif asked is None:
        # inside a graph launch cost disappears and compiled kernels win; outside one the
        # step is bound by launches, where the compiled layer is no faster than eager
        p.set("fast_spec_compile", impl in ("full_iteration", "local"))
        reason = ("inside CUDA graphs compiled kernels win" if p.v.fast_spec_compile
                  else "no CUDA graph: launch-bound, eager is as fast")
    else:
        reason = "--fast-compile" if asked else "--fast-compile off"
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
        p.choose(HASH_DROPOUT, False, "--fast-disable hash-dropout")
    elif p.v.fast_spec_compile:
        p.choose(HASH_DROPOUT, True, "the compiled fused layer's residual dropout masks are "
                 "hashed from each element's index and a seed")
    else:
        p.choose(HASH_DROPOUT, True, "for a compiled fused layer; an eager one draws "
                 "F.dropout's masks")


def _lm_loss(p: Planner) -> None:
    """The last stage's loss: the chunked LM-head cross entropy (``fast_spec.lm_loss``) or
    megatron's output layer and loss. (The chunked loss still hands an output layer it cannot
    serve, one with a bias, to megatron's path.)"""
    from megagpt.fast_spec.lm_loss import lm_grad_in_forward_unsupported_reason

    if not p.v.fast_lm_loss:
        p.choose(LM_LOSS, MEGATRONS, "--fast-disable lm-loss")
    elif p.get("transformer_impl", "local") == "transformer_engine":
        p.choose(LM_LOSS, MEGATRONS, "Transformer Engine's layers keep upstream's path")
    elif p.get("cross_entropy_loss_fusion", False):
        p.choose(LM_LOSS, MEGATRONS, "--cross-entropy-loss-fusion")
    elif (p.get("tensor_model_parallel_size", 1) or 1) != 1:
        p.choose(LM_LOSS, MEGATRONS, "tensor-parallel output layer")
    else:
        p.choose(LM_LOSS, CHUNKED, "the [tokens, vocab] logits never exist all at once")
    if p.chosen(LM_LOSS).value != CHUNKED:
        p.choose(LM_GRAD_IN_FORWARD, False, "megatron's loss")
        return
    off = lm_grad_in_forward_unsupported_reason(p.v)
    p.choose(LM_GRAD_IN_FORWARD, off is None, "LM head gradients formed in forward"
             if off is None else f"LM head recomputed in backward: {off}")


def _optimizer(p: Planner) -> None:
    """The optimizer's kernels and step, as the launch's megatron changes install them
    (``megatron_changes``; the flat step attaches to the optimizer megatron builds where
    that optimizer allows it)."""
    if not p.v.fast_optimizer:
        p.choose(OPTIMIZER, MEGATRONS, "--fast-disable optimizer")
        p.choose(ASYNC_STEP, False, "--fast-disable optimizer")
        return
    fused_kernels = p.installed.megatron_fused_optimizer
    left_out = s.fused_adam_left_out_reason(p.v, lambda: not fused_kernels)
    if left_out is not None:
        value, reason = FOREACH, left_out
    elif not p.v.fast_flat_adam:
        value, reason = FUSED_ADAMW, "--fast-disable flat-adam"
    elif not p.get("bf16", False):
        value, reason = FUSED_ADAMW, "the flat step serves megatron's bf16 optimizer only"
    else:
        value, reason = FLAT_ADAMW, "where megatron's bf16 optimizer allows it"
    p.choose(OPTIMIZER, value, reason)
    p.choose(ASYNC_STEP, bool(p.v.fast_async_step), "no host waits in the step"
             if p.v.fast_async_step else "--fast-disable async-step")


STEPS: tuple[Callable[[Planner], None], ...] = (
    _switch_defaults, _layers, _attention_kernels, _fused_layer, _fp8, _full_iteration_graph,
    _layer_graphs, _graph_choices, _nccl_connect, _bf16_grad_buffer, _lm_loss, _grad_write,
    _attention_mask, _compile, _hash_dropout, _optimizer,
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

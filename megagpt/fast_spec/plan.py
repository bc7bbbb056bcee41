"""The fast path as one plan: every choice this launch makes, with its reason.

``plan_fast_path(args, installed, environ)`` reads the parsed (and adapted) arguments, what
is installed and the environment, and returns a frozen ``FastPathPlan``; it changes nothing
and may be asked any number of times. ``apply_plan(plan, args, environ, log)`` is the only
place where the fast path changes megatron's arguments and the environment, in this order:

  1. megatron's arguments, each once, in the order the plan decided them;
  2. the environment (NCCL reads it when its communicators are made, later);
  3. the log lines, in the order the plan wrote them.

Each decision reads the earlier ones through ``_View`` (the arguments with the plan's values
laid over them), not through arguments an earlier step wrote: the grad-write check sees the
``cuda_graph_impl`` the layer-graph decision chose because the plan holds it.

The switches and their reasons live in ``settings`` (``*_unsupported_reason``); the layers
(fast spec, Transformer Engine's, megatron's local ones) follow ``--transformer-impl`` as
``megagpt.layer_impl`` chose it, and ``layer_path`` (its own module) is the one place that
tells them apart. ``apply_fast_path_defaults(args, log)`` is the two in one call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, MutableMapping, Optional

from megagpt.errors import UserError

from . import settings as s
from .layer_path import fast_path_selected, layer_path, te_layers_selected

NCCL_CONNECT = "NCCL_RUNTIME_CONNECT"
NCCL_CHOICE = "NCCL connect"

@dataclass(frozen=True)
class Choice:
    name: str
    value: object
    reason: str

    def describe(self) -> str:
        value = ("on" if self.value else "off") if isinstance(self.value, bool) else self.value
        return f"  {self.name:<17} {value} — {self.reason}"


@dataclass(frozen=True)
class FastPathPlan:
    choices: tuple[Choice, ...]
    args: tuple[tuple[str, object], ...]  # (megatron argument, value), in the order decided
    environ: tuple[tuple[str, str], ...]  # (variable, value) to set
    log: tuple[str, ...]  # what apply_plan logs, in order

    def choice(self, name: str) -> Choice:
        for c in self.choices:
            if c.name == name:
                return c
        raise KeyError(name)

    def value(self, name: str):
        return self.choice(name).value

    def describe(self) -> list[str]:
        """The plan for ``--dry-run``: one line per choice."""
        return ["fast path:", *(c.describe() for c in self.choices)]


class _View:
    """The arguments as the plan has decided them so far (read-only)."""

    def __init__(self, args, decided: dict):
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "_decided", decided)

    def __getattr__(self, name):
        decided = object.__getattribute__(self, "_decided")
        if name in decided:
            return decided[name]
        return getattr(object.__getattribute__(self, "_args"), name)

    def __setattr__(self, name, value):
        raise AttributeError("the plan's view of the arguments is read-only")


class _Planner:
    """One plan being made: the decisions so far (``decided``, seen through ``v``), the
    environment to set, the log lines and the choices, each appended in order."""

    def __init__(self, args, environ: Mapping[str, str], installed):
        self.args = args  # as parsed: what was asked; decisions read ``v``
        self.decided: dict = {}
        self.v = _View(args, self.decided)
        self.environ = environ
        self.installed = installed
        self.env: dict = {}
        self.lines: list[str] = []
        self.choices: list[Choice] = []
        self.full_off = None  # why the full-iteration graph is off (None: on or not asked)
        self.layers_off = None  # why per-layer graphs are off

    def get(self, name, default=None):
        return getattr(self.v, name, default)

    def set(self, name, value) -> None:
        self.decided[name] = value

    def log(self, line: str) -> None:
        self.lines.append(line)

    def choose(self, name: str, value, reason: str) -> None:
        self.choices.append(Choice(name, value, reason))

    def fast(self) -> bool:
        return fast_path_selected(self.v)

    def te(self) -> bool:
        return te_layers_selected(self.v)

    def world(self) -> int:
        return s._planned_world_size(self.v)

    def plan(self) -> FastPathPlan:
        for step in STEPS:
            step(self)
        return FastPathPlan(tuple(self.choices), tuple(self.decided.items()),
                            tuple(self.env.items()), tuple(self.lines))


# --- the steps, in the order each reads the ones before -----------------------------------

def _switch_defaults(p: _Planner) -> None:
    for name, default in s.SWITCH_DEFAULTS:
        if not hasattr(p.args, name):
            p.set(name, default)


def _layers(p: _Planner) -> None:
    p.choose("layers", *layer_path(p.v))


def _attention_kernels(p: _Planner) -> None:
    """megatron's --attention-backend on this launch's layers (``attention_backend``)."""
    from megatron.core.transformer.enums import AttnBackend

    from .attention_backend import attention_plan, backend_name

    planned = attention_plan(p.v, layer_path(p.v)[0], p.environ)
    if planned.backend != backend_name(p.get("attention_backend")):
        p.set("attention_backend", AttnBackend[planned.backend])
    for line in planned.log:
        p.log(line)
    p.choose("attention", planned.kernels, planned.reason)


def _fused_layer(p: _Planner) -> None:
    # With --overlap-param-gather, megatron's DDP waits for each bucket's all-gather in a
    # forward pre-hook of the module that owns the parameters; the fused layer reads its
    # weights without calling those modules, so with several buckets the waits never run
    # (on two CPU ranks: "assert self.param_gather_handle is None" at the third step).
    if not p.fast():
        p.choose("fused layer", False, "the fast spec is not used")
    elif p.get("overlap_param_gather", False) and p.v.fast_spec_fused_layer:
        p.set("fast_spec_fused_layer", False)
        p.log("fast spec: fused layer off: --overlap-param-gather waits for each parameter "
              "bucket in its modules' forward pre-hooks, which the fused layer does not call")
        p.choose("fused layer", False, "--overlap-param-gather")
    elif not p.v.fast_spec_fused_layer:
        p.choose("fused layer", False, "--fast-disable fused-layer")
    else:
        p.choose("fused layer", True, "the fast spec's default")


def _fp8(p: _Planner) -> None:
    """``--fp8-format``: in TE's layers, or in the fast spec's FP8 linears (``fp8.py``),
    which take it off megatron's ``fp8`` (megatron's FP8 path is TE's) into ``fast_fp8``."""
    fmt = p.get("fp8", None)
    if not fmt:
        p.choose("FP8", "off", "--fp8-format not given")
        return
    if p.te():
        p.choose("FP8", f"{fmt}, {p.get('fp8_recipe', 'delayed')} scaling, Transformer "
                 "Engine's layers", p.get("transformer_impl_reason", "TE's layers"))
        return
    if not p.fast():
        why = layer_path(p.v)[1].removeprefix("megatron's local modules; fast spec off: ")
        raise UserError(f"--fp8-format {fmt}: megatron's local modules have no FP8 without "
                        f"Transformer Engine, and the fast spec's cannot run here: {why}")
    if not p.v.fast_spec_fused_layer:
        raise UserError(f"--fp8-format {fmt}: FP8 runs in the fast spec's fused layer, which "
                        "this launch turns off (--overlap-param-gather or --fast-disable "
                        "fused-layer)")
    from .fp8_support import recipe_from_args

    recipe = recipe_from_args(p.v)
    p.set("fast_fp8", fmt)
    p.set("fp8", None)
    p.log(f"fast spec: FP8 linears ({recipe.describe()}): QKV, projection, fc1 and fc2 "
          "through torch._scaled_mm; embeddings, attention, the output layer and the loss in "
          "bf16; weights, gradients and checkpoints as in bf16")
    p.choose("FP8", f"{fmt}, {recipe.scaling} scaling, fast spec",
             p.get("transformer_impl_reason", "the fast spec's FP8 linears"))


def _full_iteration_graph(p: _Planner) -> None:
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


def _graphs_given(p: _Planner) -> str:
    """The ``--fast-cuda-graphs`` choice that turned a graph off."""
    return f"--fast-cuda-graphs {p.get('fast_cuda_graphs', 'none')}"


def _full_iteration_asked(p: _Planner, impl) -> None:
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


def _layer_graphs(p: _Planner) -> None:
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


def _graph_choices(p: _Planner) -> None:
    """What the two graph decisions come to, and the NaN check they leave."""
    impl = p.get("cuda_graph_impl", "none") or "none"
    given_impl = getattr(p.args, "cuda_graph_impl", "none")
    if impl == "full_iteration":
        why = ("--fast-cuda-graphs iteration" if getattr(p.args, "fast_cuda_graph", None)
               else "one GPU, no model parallelism: launches are the step's cost"
               if p.v.fast_cuda_graph else "--cuda-graph-impl full_iteration as given")
        p.choose("CUDA graph", "full iteration", why)
    elif impl == "local":
        why = ("--fast-cuda-graphs layers" if getattr(p.args, "fast_layer_graphs", None)
               else "--cuda-graph-impl local as given" if given_impl == "local"
               else f"full-iteration graph off: {p.full_off}")
        p.choose("CUDA graph", "per layer", why)
    else:
        why = f"full iteration: {p.full_off or 'off'}; per layer: {p.layers_off or 'off'}"
        p.choose("CUDA graph", impl, why)
    nan = bool(p.get("check_for_nan_in_loss_and_grad", False))
    if nan:
        p.choose("NaN check", "in step", "megatron's checks of each loss and gradient bucket")
    elif not getattr(p.args, "check_for_nan_in_loss_and_grad", False):
        p.choose("NaN check", "off", "megatron's --no-check-for-nan-in-loss-and-grad")
    elif impl == "full_iteration":
        p.choose("NaN check", "gradient norm", "a check inside a CUDA graph cannot sync")
    else:
        p.choose("NaN check", "gradient norm", "each in-step check waits for the GPU under "
                 "per-layer graphs (--fast-disable deferred-nan-checks keeps them)")


def _nccl_connect(p: _Planner) -> None:
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
        p.env[NCCL_CONNECT] = "0"
        p.log("fast path: NCCL_RUNTIME_CONNECT=0 (every NCCL peer connected up front, as a "
              "captured collective cannot connect one)")
        p.choose(NCCL_CHOICE, "0", "a captured collective cannot connect a peer")


def _bf16_grad_buffer(p: _Planner) -> None:
    asked = p.v.fast_bf16_grad_buffer
    if asked is None:
        reason = s.bf16_grad_buffer_unsupported_reason(p.v)
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
    p.choose("bf16 grad buffer", bool(p.v.fast_bf16_grad_buffer), reason)


def _grad_write(p: _Planner) -> None:
    asked = p.v.fast_grad_write
    unused = (s.wgrad_fusion_unused_reason(p.v)
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
    p.choose("grad write", bool(p.v.fast_grad_write), reason)


def _attention_mask(p: _Planner) -> None:
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


def _compile(p: _Planner) -> None:
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
    p.choose("compile", bool(p.v.fast_spec_compile), reason)
    # the compiled layer runs on one tensor-parallel rank only (eager on several)
    if p.v.fast_spec_compile and p.fast() and (
            p.get("tensor_model_parallel_size", 1) or 1) == 1:
        _compiled_layer_notes(p)


def _compiled_layer_notes(p: _Planner) -> None:
    if (p.get("hidden_dropout", 0.0) or 0.0) > 0.0:
        p.log("fast spec: compiled layer: residual dropout masks "
              + ("hashed from each element's index and a seed (--fast-disable hash-dropout)"
                 if p.v.fast_hash_dropout else "from F.dropout (--fast-disable hash-dropout)"))


def _lm_loss(p: _Planner) -> None:
    """As ``lm_loss.get_output_processor`` decides it (the output layer may still refuse)."""
    if not p.v.fast_lm_loss:
        p.choose("LM loss", "megatron's", "--fast-disable lm-loss")
    elif p.get("transformer_impl", "local") == "transformer_engine":
        p.choose("LM loss", "megatron's", "Transformer Engine's layers keep upstream's path")
    elif p.get("cross_entropy_loss_fusion", False):
        p.choose("LM loss", "megatron's", "--cross-entropy-loss-fusion")
    elif (p.get("tensor_model_parallel_size", 1) or 1) != 1:
        p.choose("LM loss", "megatron's", "tensor-parallel output layer")
    else:
        from .lm_loss import lm_grad_in_forward_unsupported_reason

        off = lm_grad_in_forward_unsupported_reason(p.v)
        p.choose("LM loss", "chunked", "LM head gradients formed in forward" if off is None
                 else f"LM head recomputed in backward: {off}")


def _optimizer(p: _Planner) -> None:
    """What ``install_fast_path_patches`` installs at launch (the flat step is decided once
    the optimizer exists)."""
    if not p.v.fast_optimizer:
        p.choose("optimizer", "megatron's", "--fast-disable optimizer")
        return
    installed = p.installed
    fallbacks = not (installed.transformer_engine or installed.apex) if installed else True
    left_out = s.fused_adam_left_out_reason(p.v, lambda: fallbacks)
    if left_out is not None:
        value, reason = "foreach kernels", left_out
    elif p.v.fast_flat_adam:
        value, reason = "fused AdamW, flat step", "where megatron's bf16 optimizer allows it"
    else:
        value, reason = "fused AdamW", "--fast-disable flat-adam"
    step = "no host waits in the step" if p.v.fast_async_step else "--fast-disable async-step"
    p.choose("optimizer", value, f"{reason}; {step}")


STEPS: tuple[Callable[[_Planner], None], ...] = (
    _switch_defaults, _layers, _attention_kernels, _fused_layer, _fp8, _full_iteration_graph,
    _layer_graphs, _graph_choices, _nccl_connect, _bf16_grad_buffer, _grad_write,
    _attention_mask, _compile, _lm_loss, _optimizer,
)


def plan_fast_path(args, installed=None, environ: Optional[Mapping[str, str]] = None
                   ) -> FastPathPlan:
    """The fast path's plan for ``args`` (changes nothing; raises UserError for a switch
    asked for where it cannot run). ``installed``: ``compat.Installed`` (None: detected)."""
    if installed is None:
        from megagpt.compat import Installed

        installed = Installed.detect()
    return _Planner(args, os.environ if environ is None else environ, installed).plan()


def apply_plan(plan: FastPathPlan, args, environ: Optional[MutableMapping[str, str]] = None,
               log: Optional[Callable[[str], None]] = None) -> None:
    """Write ``plan`` into megatron's ``args`` and ``environ`` (default ``os.environ``), then
    log its lines: the only writer of the fast path's settings."""
    environ = os.environ if environ is None else environ
    for name, value in plan.args:
        setattr(args, name, value)
    for name, value in plan.environ:
        environ[name] = value
    for line in plan.log:
        (log or (lambda line: None))(line)


def apply_fast_path_defaults(args, log: Optional[Callable[[str], None]] = None,
                             installed=None) -> FastPathPlan:
    """The plan for ``args`` applied; returns it. Call after parsing, before megatron's
    ``validate_args`` and before the model and optimizer are built; it patches nothing in
    megatron (``settings.install_fast_path_patches`` does, at launch)."""
    plan = plan_fast_path(args, installed)
    apply_plan(plan, args, log=log)
    return plan

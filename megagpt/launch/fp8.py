"""Every FP8 decision of a launch (``--fp8-format``), in one place.

In order of the resolution:

1. **Whether anything can run it** (``refuse_what_cannot_run``, a compat step): a GPU with FP8
   tensor cores (``hardware_reason``), GEMM dimensions FP8 takes (``shape_reason``), and
   layers that run it: the fast spec's FP8 linears (``fast_spec.fp8``) or, where it is
   installed, Transformer Engine's.
2. **Whose layers** (read by ``layers.transformer_impl``): without tensor and pipeline
   parallelism the fast spec's FP8 linears, which measured faster than TE's FP8 layers on one
   GPU (bench/notes/fp8.md; ``fast_spec_faster_reason``); under tensor or pipeline
   parallelism TE's (``needs_te_layers``: the fast spec's layer runs eagerly there); and TE's
   wherever the fast spec cannot run the recipe (``fast_spec_refusal``).
3. **The recipe and its linears** (``choose_fp8``, a fast-path step): on TE's layers TE's
   (``TeFp8``); on the fast spec an ``Fp8Recipe`` (``recipe_from_args``) on the linears wide
   enough to gain (``linears_in_fp8``, ``--fast-fp8-min-width``), or none where every linear is
   too narrow; its weights written in FP8 by the flat AdamW step, or cast in each forward
   where that step does not own them whole (``weight_writes_unsupported_reason``). megatron's own ``--fp8-format`` is TE's: for the fast spec's linears the
   launch writes ``fp8`` off for megatron, and what runs reads the ``FP8`` decision.
4. **What the graphs may hold** (``refuse_a_graph_before_any_amax``): a CUDA graph captured
   before delayed scaling has recorded an amax would replay its first scales.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megagpt.compat import MissingDependencyError
from megagpt.errors import UserError
from megagpt.fast_spec.fp8 import (ALL_LINEARS, AMAX_ALGOS, FC1, FC2, FORMATS, LINEAR_NAMES, PROJ,
                                   QKV, Fp8Recipe)

from .layout import planned_data_parallel_size
from .plan import Decision, Reason, Why


@dataclass(frozen=True)
class TeFp8:
    """FP8 in Transformer Engine's layers, as megatron's fp8 arguments ask TE for it."""

    format: str  # --fp8-format
    recipe: str  # --fp8-recipe

    def __str__(self) -> str:
        return f"{self.format}, {self.recipe} scaling, Transformer Engine's layers"


# The launch's FP8: the fast spec's recipe, TE's, or none (bf16)
FP8: Decision[Fp8Recipe | TeFp8 | None] = Decision("FP8", (Fp8Recipe, TeFp8, type(None)))

# cuBLAS's FP8 GEMM: every dimension of both operands a multiple of 16
FP8_GEMM_MULTIPLE = 16
# FP8 tensor cores: compute capability 8.9 (Ada) onwards
FP8_COMPUTE_CAPABILITY = (8, 9)
FAST_RECIPES = ("tensorwise", "delayed")
# The narrowest GEMM measured to gain in FP8 (--fast-fp8-min-width's default): at 345M
# (hidden 1024, 8192 tokens per micro-batch, the attention projection 8192 x 1024 x 1024)
# the step took 41.7 ms in FP8 against 44.5 in bf16 (1.067x; 1.3B: 1.262x; one H200,
# 2026-12-04, bench_throughput.py). Narrower GEMMs are not measured to gain: each linear's
# own FP8 advantage shrinks with its width (bench/bench_fp8_gemm.py --shapes 345M,1.3B:
# the projection 0.55x and 0.93x, fc2 0.97x and 1.36x, scales computed eagerly there),
# so a linear with a dimension below this stays in bf16, and the plan says which.
FP8_MIN_WIDTH = 1024


def asked(args) -> Optional[str]:
    """The ``--fp8-format`` the command line gives (None: none)."""
    return getattr(args, "fp8", None) or None


def _size(args, name: str) -> int:
    return int(getattr(args, name, 1) or 1)


# --- what the GPU and the shapes allow --------------------------------------------------

def hardware_reason(args) -> Optional[str]:
    """Why this launch's GPU cannot run FP8 (None: it can, or there is no GPU to ask).

    ``--cpu`` has none; a dry run plans for ``--gpu-type`` (else this machine's GPU, else
    ``megagpt.gpus``'s default); a launch asks CUDA for its GPU's compute capability."""
    from megagpt.gpus import fp8_gpu_names

    capable = (f"compute capability {FP8_COMPUTE_CAPABILITY[0]}.{FP8_COMPUTE_CAPABILITY[1]} "
               f"or later, such as the {fp8_gpu_names()}")
    if getattr(args, "cpu", False):
        return f"FP8 needs a GPU with FP8 tensor cores ({capable}); --cpu trains in fp32"
    if getattr(args, "dry_run", False) or getattr(args, "gpu_type", None):
        from megagpt.gpus import resolve_gpu

        gpu = resolve_gpu(getattr(args, "gpu_type", None), None)
        if gpu.spec is not None and gpu.spec.fp8_tflops is None:
            return (f"the {gpu.name} ({gpu.source}) has no FP8 tensor cores ({capable}); "
                    "train it in bf16")
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    capability = torch.cuda.get_device_capability()
    if tuple(capability) < FP8_COMPUTE_CAPABILITY:
        name = torch.cuda.get_device_name()
        return (f"this GPU ({name}, compute capability {capability[0]}.{capability[1]}) has "
                f"no FP8 tensor cores ({capable}); train it in bf16")
    return None


@dataclass(frozen=True)
class GemmSizes:
    """The sizes of the fused layer's GEMMs on one tensor-parallel rank (None: not given;
    megatron's validation names a missing size itself)."""

    hidden: Optional[int] = None
    qkv_out: Optional[int] = None
    heads_width: Optional[int] = None
    ffn: Optional[int] = None
    fc1_out: Optional[int] = None
    tokens: Optional[int] = None

    def named(self) -> dict[str, int]:
        """Each size given, by what a message calls it."""
        names = {"hidden": "--hidden-size",
                 "qkv_out": "the QKV output per tensor-parallel rank",
                 "heads_width": "the attention heads' width per tensor-parallel rank",
                 "ffn": "--ffn-hidden-size per tensor-parallel rank",
                 "fc1_out": "fc1's output per tensor-parallel rank",
                 "tokens": "tokens per micro-batch (--seq-length x --micro-batch-size)"}
        return {names[field.name]: getattr(self, field.name)
                for field in dataclasses.fields(self) if getattr(self, field.name) is not None}


def gemm_sizes(args) -> GemmSizes:
    """The fused layer's GEMM sizes on one tensor-parallel rank, from the arguments."""
    tp = _size(args, "tensor_model_parallel_size")
    hidden, heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", None)
    sizes = {}
    if hidden and heads:
        head_dim = int(getattr(args, "kv_channels", None) or hidden // heads)
        groups = (int(args.num_query_groups) if getattr(args, "group_query_attention", False)
                  and getattr(args, "num_query_groups", None) else heads)
        ffn = int(getattr(args, "ffn_hidden_size", None) or 4 * hidden)
        glu = bool(getattr(args, "swiglu", False))
        sizes.update(hidden=int(hidden), qkv_out=(heads + 2 * groups) * head_dim // tp,
                     heads_width=heads * head_dim // tp, ffn=ffn // tp,
                     fc1_out=ffn * (2 if glu else 1) // tp)
    seq, micro = getattr(args, "seq_length", None), getattr(args, "micro_batch_size", None)
    if seq and micro:
        sizes["tokens"] = int(seq) * int(micro)
    return GemmSizes(**sizes)


def shape_reason(args) -> Optional[str]:
    """A GEMM dimension FP8 cannot take (None: every one is a multiple of 16, as cuBLAS's FP8
    GEMM, which Transformer Engine calls too, needs)."""
    for what, size in gemm_sizes(args).named().items():
        if size % FP8_GEMM_MULTIPLE:
            return (f"{what} is {size}, not a multiple of {FP8_GEMM_MULTIPLE} (FP8 GEMMs, "
                    "Transformer Engine's too, need multiples of 16)")
    return None


def linear_gemms(args) -> dict[int, tuple[int, int, int]]:
    """Each fused-layer linear's GEMM on one tensor-parallel rank: (tokens, in, out)."""
    g = gemm_sizes(args)
    if g.hidden is None or g.tokens is None:
        return {}
    return {QKV: (g.tokens, g.hidden, g.qkv_out), PROJ: (g.tokens, g.heads_width, g.hidden),
            FC1: (g.tokens, g.hidden, g.fc1_out), FC2: (g.tokens, g.ffn, g.hidden)}


def linears_in_fp8(args) -> tuple[list[tuple[int, str]], list[str]]:
    """(the linears that run in FP8, with their GEMM; what stays in bf16, and why) under
    ``--fast-fp8-min-width`` (default ``FP8_MIN_WIDTH``; 0: every linear)."""
    floor = getattr(args, "fast_fp8_min_width", None)
    floor = FP8_MIN_WIDTH if floor is None else int(floor)
    gemms = linear_gemms(args)
    if not gemms:  # sizes not given (megatron's validation names them): nothing to judge
        return [(i, LINEAR_NAMES[i]) for i in ALL_LINEARS], []
    fp8, bf16 = [], []
    for linear, (m, k, n) in gemms.items():
        gemm = f"{LINEAR_NAMES[linear]} {m}x{k}x{n}"
        if min(m, k, n) >= floor:
            fp8.append((linear, gemm))
        else:
            bf16.append(f"{gemm} (a dimension below {floor})")
    return fp8, bf16


# --- whose layers run it ----------------------------------------------------------------------

def fast_spec_unsupported_reason(args) -> Optional[str]:
    """What of this ``--fp8-format`` launch the fast spec's FP8 cannot run (None: it can).

    The hardware is ``hardware_reason``'s; this is the launch: the recipe, the layer path (FP8
    runs in the fused layer's four linears), the precision. The fast spec's own limits
    (``fast_spec.spec.fast_spec_unsupported_reason``) come on top."""
    fmt = asked(args)
    if fmt not in FORMATS:
        return f"--fp8-format {fmt}"
    recipe = getattr(args, "fp8_recipe", None) or "delayed"
    if recipe not in FAST_RECIPES:
        return f"--fp8-recipe {recipe} (the fast spec runs tensorwise and delayed scaling)"
    if (getattr(args, "fp8_amax_compute_algo", None) or "most_recent") not in AMAX_ALGOS:
        return f"--fp8-amax-compute-algo {args.fp8_amax_compute_algo}"
    for flag, attr in (("--fp8-param-gather", "fp8_param_gather"),
                       ("--fp8-dot-product-attention", "fp8_dot_product_attention"),
                       ("--fp8-multi-head-attention", "fp8_multi_head_attention"),
                       ("--first-last-layers-bf16", "first_last_layers_bf16"),
                       ("--fp4-format", "fp4")):
        if getattr(args, attr, None):
            return f"{flag} (Transformer Engine's FP8 modules)"
    if not (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
        return "FP8 linears with fp32 parameters (add --bf16)"
    if getattr(args, "num_experts", None):
        return "MoE experts (the fast spec's FP8 runs in its dense fused layer)"
    if getattr(args, "recompute_granularity", None) or getattr(args, "recompute_activations",
                                                                 False):
        return "activation recompute (the fused layer, where FP8 runs, does not recompute)"
    if not getattr(args, "fast_spec_fused_layer", True):
        return "--fast-disable fused-layer (FP8 runs in the fused layer)"
    if getattr(args, "overlap_param_gather", False):
        return "--overlap-param-gather (it keeps megatron's layer, which has no FP8 without TE)"
    return None


def fast_spec_refusal(args) -> Optional[str]:
    """Why the fast spec's layers cannot take this launch's FP8, as the layer path says it
    (None: no FP8 asked, or the fast spec runs it)."""
    fmt = asked(args)
    if fmt is None:
        return None
    reason = fast_spec_unsupported_reason(args)
    return None if reason is None else f"--fp8-format {fmt} on the fast spec: {reason}"


def needs_te_layers(args) -> Optional[str]:
    """Why this launch's FP8 needs Transformer Engine's layers by its layout (None: it does
    not): under tensor or pipeline parallelism the fast spec's FP8 layer runs eagerly, as its
    bf16 layer does (``layers.transformer_impl``)."""
    if asked(args) and (_size(args, "tensor_model_parallel_size") > 1
                        or _size(args, "pipeline_model_parallel_size") > 1):
        return "FP8 under tensor or pipeline parallelism: TE's FP8 layers"
    return None


def fast_spec_faster_reason(args) -> Optional[str]:
    """Why the fast spec's layers run this launch's FP8 where TE is installed too (None: no
    FP8 asked)."""
    if not asked(args):
        return None
    return ("FP8 without tensor or pipeline parallelism: the fast spec's FP8 linears "
            "measured faster than TE's FP8 layers here (docs/fp8.md)")


def refuse_what_cannot_run(args, installed) -> None:
    """``--fp8-format``: a GPU with FP8 tensor cores, and layers that run it — the fast spec's
    FP8 linears, or Transformer Engine's (``UserError`` where none can)."""
    from megagpt.fast_spec.spec import fast_spec_unsupported_reason as fast_spec_limits

    fmt = asked(args)
    if fmt is None:
        return
    for reason in (hardware_reason(args), shape_reason(args)):
        if reason is not None:
            raise UserError(f"--fp8-format {fmt}: {reason}")
    if installed.transformer_engine:
        return  # the layers' choice takes TE's FP8 layers where the fast spec cannot
    reason = fast_spec_limits(args) or fast_spec_unsupported_reason(args)
    if reason is not None:
        raise MissingDependencyError(
            f"--fp8-format {fmt}: the fast spec's FP8 linears cannot run this launch "
            f"({reason}); Transformer Engine's FP8 layers can (pip install 'megagpt[te]')")


# --- the recipe ---------------------------------------------------------------------------

def recipe_from_args(args, emulate: bool = False) -> Fp8Recipe:
    """The fast spec's FP8 recipe for megatron's fp8 arguments as the command line gives them,
    on the linears wide enough to gain (``linears_in_fp8``; all four where none is)."""
    linears = tuple(i for i, _ in linears_in_fp8(args)[0]) or ALL_LINEARS
    return Fp8Recipe(
        linears=linears,
        format=asked(args), scaling=getattr(args, "fp8_recipe", None) or "delayed",
        margin=int(getattr(args, "fp8_margin", 0) or 0),
        history_len=int(getattr(args, "fp8_amax_history_len", 1) or 1),
        amax_algo=getattr(args, "fp8_amax_compute_algo", None) or "most_recent",
        wgrad=bool(getattr(args, "fp8_wgrad", True)),
        # the entry's own options: unset, the recipe's defaults (TE's delayed scaling)
        first_scales=getattr(args, "fast_fp8_first_scales", None) or Fp8Recipe.first_scales,
        grad_scaling=getattr(args, "fast_fp8_grad_scaling", None) or Fp8Recipe.grad_scaling,
        emulate=emulate)


def weight_writes_unsupported_reason(args) -> Optional[str]:
    """Why the flat AdamW step cannot write the FP8 linears' weights for their forwards
    (None: it writes them; ``Fp8Recipe.weights_written``); where it cannot, each forward
    casts them. From the arguments as the plan has decided them so far."""
    if not getattr(args, "fast_fp8_weight_writes", False):
        # the optimizer's writes ran slower than the forward's cast: 103.5 against 79.0 ms
        # per iteration at the wide shape, one H100, 2026-12-08 (bench/notes/fp8.md)
        return "the default; --fast-fp8-weight-writes has the optimizer write them"
    recipe = getattr(args, "fp8_recipe", None) or "delayed"
    if recipe != "delayed":
        return (f"--fp8-recipe {recipe}: a current scale is the weight's own amax, known only "
                "once the weight is written")
    if not getattr(args, "fast_optimizer", True):
        return "--fast-disable optimizer (the flat AdamW step writes them)"
    if not getattr(args, "fast_flat_adam", True):
        return "--fast-disable flat-adam (the flat AdamW step writes them)"
    if not getattr(args, "bf16", False):
        return "the flat AdamW step serves megatron's bf16 optimizer only (add --bf16)"
    optimizer = getattr(args, "optimizer", "adam") or "adam"
    if optimizer != "adam":
        return f"--optimizer {optimizer} (the flat step is AdamW's)"
    for flag, attr in (("--use-distributed-optimizer", "use_distributed_optimizer"),
                       ("--use-megatron-fsdp", "use_megatron_fsdp"),
                       ("--use-torch-fsdp2", "use_torch_fsdp2")):
        if getattr(args, attr, False):
            return f"{flag} (each rank steps a shard of every weight)"
    for flag, attr in (("--use-precision-aware-optimizer", "use_precision_aware_optimizer"),
                       ("--optimizer-cpu-offload", "optimizer_cpu_offload"),
                       ("--log-num-zeros-in-grad", "log_num_zeros_in_grad")):
        if getattr(args, attr, False):
            return f"{flag} (the flat AdamW step does not run)"
    if _size(args, "tensor_model_parallel_size") > 1:
        return "tensor parallelism (each rank's shards are cast in its forward)"
    micro = _size(args, "micro_batch_size")
    per_step = _size(args, "global_batch_size") // (micro * planned_data_parallel_size(args))
    if per_step > 1 or getattr(args, "rampup_batch_size", None):
        # each forward after the first scales by the history the one before it recorded
        return ("more than one micro-batch per step (the optimizer's copies serve the "
                "step's first forward only)")
    return None


def _refuse_unusable_fast_options(p, fmt: str) -> None:
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


# --- the steps of the resolution -----------------------------------------------------------

def refuse_fp8_that_cannot_run(p) -> None:
    """``refuse_what_cannot_run`` as a step of the launch's resolution."""
    refuse_what_cannot_run(p.v, p.installed)


def choose_fp8(p) -> None:
    """``--fp8-format``: in TE's layers, or in the fast spec's FP8 linears (``fast_spec.fp8``),
    for which megatron's own ``fp8`` (its FP8 path is TE's) is written off."""
    fmt = asked(p.v)
    if fmt is None:
        p.choose(FP8, None, Reason(Why.GIVEN, "--fp8-format not given"))
        return
    why = p.impl_reason()
    if p.te():
        p.choose(FP8, TeFp8(fmt, p.get("fp8_recipe", "delayed")), why)
        return
    if not p.fast():
        path_reason = p.layers()[1]
        off = path_reason.cause or path_reason
        raise UserError(f"--fp8-format {fmt}: megatron's local modules have no FP8 without "
                        f"Transformer Engine, and the fast spec's cannot run here: {off}")
    if not p.v.fast_spec_fused_layer:
        raise UserError(f"--fp8-format {fmt}: FP8 runs in the fast spec's fused layer, which "
                        "this launch turns off (--overlap-param-gather or --fast-disable "
                        "fused-layer)")
    _refuse_unusable_fast_options(p, fmt)
    fp8, bf16 = linears_in_fp8(p.v)
    recipe = recipe_from_args(p.v)
    p.set("fp8", None)  # megatron's FP8 is TE's: the fast spec's linears read the plan
    if not fp8:
        p.log(f"fast spec: --fp8-format {fmt} not taken: every fused-layer linear is too "
              f"narrow to gain in FP8 ({'; '.join(bf16)}); bf16 (--fast-fp8-min-width 0 "
              "runs them in FP8)")
        p.choose(FP8, None, Reason(Why.SHAPE, "every linear too narrow to gain "
                                   "(--fast-fp8-min-width)"))
        return
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
    narrow = f"; in bf16, too narrow to gain: {', '.join(bf16)}" if bf16 else ""
    weights = ("their FP8 weights written by the flat AdamW step with the bf16 ones"
               if cast is None else f"their weights cast to FP8 in each forward ({cast})")
    p.log(f"fast spec: FP8 linears ({recipe.describe()}): {', '.join(g for _, g in fp8)} "
          f"through torch._scaled_mm{narrow}, {weights}; embeddings, attention, the output "
          "layer and the loss in bf16; weights, gradients and checkpoints as in bf16")
    p.choose(FP8, recipe, why)


def refuse_a_graph_before_any_amax(p, graphed: bool) -> None:
    """A CUDA graph (``graphed``: the launch captures one) would hold the first iteration's
    forward, scaled before delayed scaling recorded any amax, and replay it every step."""
    recipe = p.chosen(FP8)
    if (graphed and recipe is not None and isinstance(recipe.value, Fp8Recipe)
            and recipe.value.delayed and p.get("cuda_graph_warmup_steps", 3) == 0):
        raise UserError("--cuda-graph-warmup-steps 0 with the fast spec's delayed FP8 "
                        "scaling: the CUDA graph would be captured at the first iteration, "
                        "before any amax is recorded, and replay its scales; give 1 or more "
                        "(default 3) or --fp8-recipe tensorwise")

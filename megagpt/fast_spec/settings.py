"""The fast path's command line (training without Transformer Engine's layers).

``add_fast_path_arguments(parser)`` adds six options to megatron's parser:

  --no-fast-spec                  megatron's layers instead of the fast spec
  --fast-cuda-graphs {auto,none,iteration,layers}
                                  one CUDA graph per iteration, graphs per layer, or none
  --fast-compile {auto,on,off}    torch.compile the fused layer and the chunked loss
  --fast-disable PIECE[,PIECE]    turn named pieces off, to measure what each is worth
  --fast-cuda-graph-capture-timeout SECONDS
  --fast-multi-gpu-path           on one GPU, the path of a launch on several GPUs

They set the namespace attributes the plan reads (``fast_cuda_graph``,
``fast_layer_graphs``, ``fast_spec_compile`` and one per piece, ``PIECES``); "auto" leaves
an attribute None for the plan to decide. What each piece does and what it measured:
docs/speed.md.

After parsing, before the model and optimizer are built, ``plan.plan_fast_path`` decides
each automatic default, with its reason, and ``plan.apply_plan`` writes them.
``install_fast_path_patches(args, log)`` installs the
optimizer and step replacements inside megatron's modules; the entry calls it when it
launches training.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from megagpt.errors import UserError

from .layer_path import fast_path_selected, te_layers_selected

# --fast-disable's pieces: name -> (namespace attribute, its value when disabled)
PIECES = {
    "fused-layer": ("fast_spec_fused_layer", False),
    "hash-dropout": ("fast_hash_dropout", False),
    "optimizer": ("fast_optimizer", False),
    "flat-adam": ("fast_flat_adam", False),
    "async-step": ("fast_async_step", False),
    "lm-loss": ("fast_lm_loss", False),
    "lm-grad-in-forward": ("fast_lm_grad_in_forward", False),
    "bf16-grad-buffer": ("fast_bf16_grad_buffer", False),
    "grad-write": ("fast_grad_write", False),
    "deferred-nan-checks": ("fast_step_nan_checks", True),
}

# every namespace attribute the options set, with its value when none is given (None: the
# plan decides); for namespaces that did not go through this parser too
SWITCH_DEFAULTS = (
    ("fast_spec", True),
    ("fast_spec_fused_layer", True),
    ("fast_spec_compile", None),
    ("fast_hash_dropout", True),
    ("fast_cuda_graph", None),
    ("fast_layer_graphs", None),
    ("fast_cuda_graph_capture_timeout", 300.0),
    ("fast_multi_gpu_path", False),
    ("fast_step_nan_checks", False),
    ("fast_optimizer", True),
    ("fast_lm_loss", True),
    ("fast_lm_grad_in_forward", True),
    ("fast_async_step", True),
    ("fast_flat_adam", True),
    ("fast_bf16_grad_buffer", None),
    ("fast_grad_write", None),
    ("fast_fp8", None),  # --fp8-format, where the plan gives it to the fast spec's linears
)

# --fast-cuda-graphs -> (fast_cuda_graph, fast_layer_graphs); None: the plan decides
CUDA_GRAPHS = {
    "auto": (None, None),
    "none": (False, False),
    "iteration": (True, False),
    "layers": (False, True),
}
COMPILE = {"auto": None, "on": True, "off": False}

# options of earlier versions, and what says the same now
REPLACED_FLAGS = {
    "--fast-cuda-graph": "--fast-cuda-graphs iteration",
    "--no-fast-cuda-graph": "--fast-cuda-graphs none (or layers)",
    "--fast-layer-graphs": "--fast-cuda-graphs layers",
    "--no-fast-layer-graphs": "--fast-cuda-graphs none",
    "--fast-spec-compile": "--fast-compile on",
    "--no-fast-spec-compile": "--fast-compile off",
    "--fast-step-nan-checks": "--fast-disable deferred-nan-checks",
    "--fast-bf16-grad-buffer": "--grad-reduce-in-bf16 (megatron's)",
    "--fast-grad-write": "nothing: it is on wherever it applies",
    "--fast-wgrad-fusion": "nothing: it measured within run-to-run noise and was removed",
    "--no-fast-one-block-rows": "nothing: it measured under 1 % and was removed",
    **{f"--no-fast-{piece}": f"--fast-disable {piece}" for piece in PIECES},
    "--no-fast-spec-fused-layer": "--fast-disable fused-layer",
}


def check_replaced_flags(argv: list[str]) -> None:
    """One line naming the option that replaced an earlier version's, before parsing."""
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag in REPLACED_FLAGS:
            raise UserError(f"{flag} is no longer an option: use {REPLACED_FLAGS[flag]}")


def _pieces(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PIECES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown piece(s) {', '.join(unknown)}; known: {', '.join(PIECES)}")
    return names


class _SetAttributes(argparse.Action):
    """Stores a choice as the namespace attributes it stands for."""

    def __init__(self, option_strings, dest, table, **kwargs):
        self.table = table
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if isinstance(values, list):  # --fast-disable given more than once: all of them
            values = [*(getattr(namespace, self.dest, None) or []), *values]
        setattr(namespace, self.dest, values)
        for name, value in self.table(values):
            setattr(namespace, name, value)


def _graph_attributes(choice):
    return zip(("fast_cuda_graph", "fast_layer_graphs"), CUDA_GRAPHS[choice])


def _compile_attributes(choice):
    return [("fast_spec_compile", COMPILE[choice])]


def _disabled_attributes(names):
    return [PIECES[name] for name in names]


def add_fast_path_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the fast path's options to ``parser`` (an ArgumentParser or an argument group)."""
    if isinstance(parser, argparse.ArgumentParser):
        group = parser.add_argument_group(title="fast path (megagpt.fast_spec)")
    else:  # already an argument group: argparse deprecates nesting groups
        group = parser
    group.add_argument(
        "--no-fast-spec", action="store_false", dest="fast_spec",
        help="Build megatron's layers (TE's where installed, else its local spec) instead of "
        "the fast spec.")
    group.add_argument(
        "--fast-cuda-graphs", choices=tuple(CUDA_GRAPHS), default="auto",
        action=_SetAttributes, table=_graph_attributes,
        help="CUDA graphs: one per iteration, per layer, or none. auto: per iteration on "
        "one GPU, per layer on several without model parallelism.")
    group.add_argument(
        "--fast-compile", choices=tuple(COMPILE), default="auto",
        action=_SetAttributes, table=_compile_attributes,
        help="torch.compile the fused layer and the chunked loss. auto: where CUDA graphs "
        "hold the layers.")
    group.add_argument(
        "--fast-disable", type=_pieces, default=[], metavar="PIECE[,PIECE]",
        action=_SetAttributes, table=_disabled_attributes,
        help=f"Turn pieces of the fast path off, to measure them: {', '.join(PIECES)}.")
    group.add_argument(
        "--fast-cuda-graph-capture-timeout", type=float, default=300.0, metavar="SECONDS",
        help="Stop, naming the rank, when the full-iteration graph's capture has not "
        "finished after this long (default 300).")
    group.add_argument(
        "--fast-multi-gpu-path", action="store_true",
        help="On one GPU, take the path of a launch on several data-parallel GPUs, to "
        "measure it.")
    group.set_defaults(**dict(SWITCH_DEFAULTS))
    return parser


def _path_name(args) -> str:
    return "Transformer Engine's layers" if te_layers_selected(args) else "fast path"


def _planned_world_size(args) -> int:
    """The world size the run is for: a dry run's ``--dry-run-world-size`` when given; with
    ``--fast-multi-gpu-path`` at least two data-parallel ranks' worth."""
    if getattr(args, "dry_run", False) and getattr(args, "dry_run_world_size", None):
        world = int(args.dry_run_world_size)
    else:
        world = int(getattr(args, "world_size", 1) or 1)
    if getattr(args, "fast_multi_gpu_path", False):
        world = max(world, 2 * _model_parallel_size(args))
    return world


def _model_parallel_size(args) -> int:
    size = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "context_parallel_size"):
        size *= getattr(args, name, 1) or 1
    return size


def _planned_data_parallel_size(args) -> int:
    return max(1, _planned_world_size(args) // _model_parallel_size(args))


def _one_micro_batch_per_step(args) -> bool:
    """Whether each step's gradients come from one micro-batch (no accumulation)."""
    micro = getattr(args, "micro_batch_size", None) or 1
    global_batch = getattr(args, "global_batch_size", None) or micro
    return global_batch == micro and not getattr(args, "rampup_batch_size", None)


def cuda_graph_unsupported_reason(args) -> Optional[str]:
    """Why the full-iteration CUDA graph is not switched on automatically (None: it is)."""
    if getattr(args, "cpu", False):
        return "CPU mode"
    if te_layers_selected(args):
        # asked for (--fast-cuda-graphs iteration, or megatron's --cuda-graph-impl
        # full_iteration) it runs; not by default: with TE's layers at a small shape (head
        # size 16) launches under it failed where the same launch without it trained
        # (docs/speed.md)
        return ("not by default for Transformer Engine's layers (--fast-cuda-graphs "
                "iteration asks for it; docs/speed.md)")
    if not fast_path_selected(args):
        return "the fast spec is not used"
    if getattr(args, "cuda_graph_impl", "none") not in ("none", None):
        return f"--cuda-graph-impl {args.cuda_graph_impl} was given"
    if (conflict := graphed_recompute_conflict(args)) is not None:
        return conflict
    if _planned_world_size(args) != 1:
        return "more than one GPU (full-iteration graphs are validated on one GPU only)"
    if getattr(args, "check_for_spiky_loss", False):
        return "--check-for-spiky-loss needs a host sync inside the step"
    if getattr(args, "overlap_param_gather", False):
        return ("--overlap-param-gather (megatron starts the all-gather in one step and "
                "finishes it in the next)")
    if (getattr(args, "tensor_model_parallel_size", 1) or 1) != 1 or (
        getattr(args, "pipeline_model_parallel_size", 1) or 1
    ) != 1:
        return "model parallelism"
    return None


def recompute_granularity(args) -> Optional[str]:
    """``--recompute-granularity``, or "selective" for ``--recompute-activations`` (which
    megatron turns into it once its arguments are validated, after the plan)."""
    granularity = getattr(args, "recompute_granularity", None)
    if granularity is None and getattr(args, "recompute_activations", False):
        return "selective"
    return granularity


def graphed_recompute_conflict(args) -> Optional[str]:
    """Why megatron refuses this launch's selective recompute inside a graph of the whole
    step (None: it does not): a recomputed module that draws random numbers (dropout, MoE
    input jitter) cannot be replayed from a CUDA graph. Megatron's check, from the same
    arguments (``TransformerConfig.__post_init__``; no modules named means core attention)."""
    if recompute_granularity(args) != "selective":
        return None
    modules = getattr(args, "recompute_modules", None)
    modules = {"core_attn"} if modules is None else set(modules)
    if (getattr(args, "attention_dropout", 0.0) or 0.0) > 0.0 and "core_attn" in modules:
        return ("selective recompute of core attention with attention dropout (megatron does "
                "not recompute dropout inside a CUDA graph)")
    if (getattr(args, "hidden_dropout", 0.0) or 0.0) > 0.0 and modules & {"mlp", "moe"}:
        return ("selective recompute of the MLP with hidden dropout (megatron does not "
                "recompute dropout inside a CUDA graph)")
    if getattr(args, "moe_input_jitter_eps", None) is not None and "moe" in modules:
        return ("selective recompute of the MoE layer with --moe-input-jitter-eps (megatron "
                "does not recompute random numbers inside a CUDA graph)")
    return None


def layer_graphs_unsupported_reason(args) -> Optional[str]:
    """Why per-layer CUDA graphs cannot hold this run's layers (None: they can).

    Checked after the full-iteration graph is decided. These are the runs where megatron's
    per-layer graphs (``--cuda-graph-impl local``) would not run or would not hold the fused
    layer; ``layer_graphs_default_off_reason`` adds the layouts where they run but stay off
    unless asked for.
    """
    if getattr(args, "cpu", False):
        return "CPU mode"
    if not fast_path_selected(args):
        return "the fast spec is not used"
    if not getattr(args, "fast_spec_fused_layer", True):
        return ("the fused layer is off (--fast-disable fused-layer, or --overlap-param-gather; "
                "megatron's own --cuda-graph-impl local graphs megatron's layer)")
    impl = getattr(args, "cuda_graph_impl", "none") or "none"
    if impl == "full_iteration":
        return "the full-iteration CUDA graph holds the whole step"
    if impl not in ("none", "local"):
        return f"--cuda-graph-impl {impl} was given"
    granularity = recompute_granularity(args)
    if granularity:
        # megatron: full recompute only with the full-iteration graph; the fused layer does
        # not recompute (selective recompute keeps megatron's layer) either way
        return f"--recompute-granularity {granularity}"
    if getattr(args, "cpu_offloading", False) or (
            getattr(args, "cpu_offloading_num_layers", 0) or 0) > 0:
        return "CPU offloading"
    if getattr(args, "fine_grained_activation_offloading", False):
        return "fine-grained activation offloading"
    if getattr(args, "reset_attention_mask", False):
        return "--reset-attention-mask (the fused layer needs causal attention)"
    return None


def layer_graphs_default_off_reason(args) -> Optional[str]:
    """Why per-layer graphs, which could run here, are not switched on by default."""
    if (getattr(args, "tensor_model_parallel_size", 1) or 1) != 1:
        return ("tensor parallelism (its collectives would run inside the graphs; not yet "
                "measured on several GPUs: --fast-cuda-graphs layers asks for them)")
    if (getattr(args, "pipeline_model_parallel_size", 1) or 1) != 1:
        return ("pipeline parallelism (one set of graphs and buffers per micro-batch in "
                "flight: --fast-cuda-graphs layers asks for them)")
    return None


def bf16_grad_buffer_unsupported_reason(args) -> Optional[str]:
    """Why a bf16 gradient buffer would not equal the fp32 one here (None: it would).

    With bf16 parameters every gradient autograd delivers is a bf16 tensor (a parameter used
    twice, like tied embeddings, gets the bf16 sum of its uses). An fp32 buffer that is
    zeroed each step and receives one such gradient — one micro-batch, no data-parallel
    sum — holds exactly the bf16 value widened, so a bf16 buffer holds the same numbers.
    """
    from megagpt.flags import explicit_flags

    if not getattr(args, "bf16", False):
        return "not bf16"
    if getattr(args, "cpu", False):
        return "CPU mode"
    if not fast_path_selected(args):
        return "the fast spec is not used"
    given = explicit_flags(getattr(args, "entry_argv", None) or [])
    for flag in ("--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32",
                 "--main-grads-dtype"):
        if flag in given:
            return f"{flag} was given"
    if _planned_data_parallel_size(args) != 1:
        return "more than one data-parallel rank (gradients are summed across ranks)"
    if not _one_micro_batch_per_step(args):
        return "more than one micro-batch per step (gradients are accumulated)"
    if getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False):
        return "FSDP"
    return None


def wgrad_fusion_unused_reason(args) -> Optional[str]:
    """Why megatron's gradient-accumulation fusion (apex's ``fused_weight_gradient_mlp_cuda``
    in megatron's own linear layers) has nothing to fuse in this launch (None: some of
    megatron's linears run their own backward): the fast spec's fused layers form their weight
    gradients themselves, and its chunked LM loss forms the output layer's."""
    if not fast_path_selected(args) or not getattr(args, "fast_spec_fused_layer", True):
        return None
    from .lm_loss import get_output_processor

    if (get_output_processor(args) is None
            or (getattr(args, "tensor_model_parallel_size", 1) or 1) != 1
            or getattr(args, "sequence_parallel", False) or getattr(args, "use_mup", False)):
        return None  # megatron's output layer runs (lm_loss.fused_lm_head_unsupported_reason)
    return "the fast spec's fused layers and chunked LM loss form their weight gradients"


def grad_write_unsupported_reason(args) -> Optional[str]:
    """Why gradients cannot be written instead of added in this run (None: they can)."""
    if not fast_path_selected(args):
        return "the fast spec is not used"
    if _planned_data_parallel_size(args) != 1:
        return "more than one data-parallel rank"
    if not _one_micro_batch_per_step(args):
        return "more than one micro-batch per step (gradients are accumulated)"
    if getattr(args, "gradient_accumulation_fusion", False):
        return "gradient-accumulation fusion adds into the buffer itself"
    if getattr(args, "use_distributed_optimizer", False):
        return "the distributed optimizer"
    if getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False):
        return "FSDP"
    if getattr(args, "cuda_graph_impl", "none") == "local":
        # the captured backward adds each gradient into main_grad itself, not through the
        # DDP hook that writes instead
        return "per-layer CUDA graphs (megatron's --cuda-graph-impl local)"
    return None


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


def install_fast_path_patches(args, log: Optional[Callable[[str], None]] = None) -> None:
    """Install the fast path's replacements inside megatron's modules (this process).

    Called by ``pretrain_gpt.run`` before ``megatron.training.pretrain`` builds the optimizer,
    not at parse time, so that ``--help`` and ``--dry-run`` leave megatron untouched:

    - the full-iteration graph's capture under a deadline (``capture_watchdog``): a capture
      that does not finish stops the run naming its rank, rather than hang;

    - gradients written (``fast_grad_write``): megatron's DDP hook copies, its buffer is not
      zeroed, parameters without a gradient are zeroed at ``finish_grad_sync``
      (``megagpt.fast_spec.grad_write``);
    - optimizer: if ``fast_optimizer``, torch's fused AdamW as megatron's Adam class and,
      where megatron is on its no-TE/no-apex fallbacks, torch._foreach_* versions of the
      gradient-norm / scale / param-copy kernels
      (``megagpt.fast_spec.optim.install_fast_optimizer``). Fused AdamW is left out, with a
      logged reason, for ``--use-precision-aware-optimizer``, ``--optimizer-cpu-offload``,
      optimizers other than adam, and the distributed optimizer where TE or apex is
      installed (megatron's checkpoints of it then follow their FusedAdam);
    - flat AdamW step (``fast_flat_adam``, with fused AdamW): where megatron's optimizer is
      its bf16 ``Float16OptimizerWithFloat16Params`` over one gradient buffer, one pass over
      flat buffers replaces its five (``megagpt.fast_spec.flat_adam``; decided, and logged,
      once the optimizer exists);
    - asynchronous step (``fast_async_step``, with the fast optimizer): the gradient norm
      stays on the GPU and megatron's per-step waits for the host are skipped where they are
      identities (``megagpt.fast_spec.async_step``).
    """
    log = log or (lambda s: None)
    if getattr(args, "cuda_graph_impl", "none") == "full_iteration" and not getattr(
            args, "cpu", False):
        from . import capture_watchdog

        capture_watchdog.install(float(getattr(args, "fast_cuda_graph_capture_timeout", 300)),
                                 log)
    if getattr(args, "fast_grad_write", False):
        from . import grad_write

        grad_write.install(log)
    if not getattr(args, "fast_optimizer", True):
        log("fast optimizer: off (--fast-disable optimizer)")
        return
    from .optim import install_fast_optimizer, megatron_uses_local_fallbacks

    left_out = fused_adam_left_out_reason(args, megatron_uses_local_fallbacks)
    fused_adam = left_out is None
    if left_out is not None:
        log(f"fast optimizer: {left_out}")
    async_step = bool(getattr(args, "fast_async_step", True))
    install_fast_optimizer(fused_adam=fused_adam, multi_tensor=True, tensor_clip=async_step,
                           log=log)
    if fused_adam and getattr(args, "fast_flat_adam", True):
        from . import flat_adam

        flat_adam.install(log)
    elif fused_adam:
        log("fast optimizer: megatron's five-pass bf16 step kept (--fast-disable flat-adam)")
    if async_step:
        from . import async_step as async_step_module

        async_step_module.install(log)
    else:
        log("fast path: host synchronisations inside the step kept (--fast-disable async-step)")

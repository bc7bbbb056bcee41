"""User-visible switches of the fast path (training without Transformer Engine).

``add_fast_path_arguments(parser)`` adds, to megatron's argparse parser (or a group of it):

  --no-fast-spec                 use megatron's local layer spec instead of the fast spec
  --no-fast-spec-fused-layer     keep megatron's TransformerLayer (only SDPA attention changes)
  --fast-spec-compile / --no-fast-spec-compile
                                 torch.compile the fused layer and the chunked loss kernels
                                 (default: on exactly when CUDA graphs hold the layers;
                                 without a graph the step is CPU-bound and eager is as fast)
  --no-fast-one-block-rows       compiled layer: leave inductor's limit of 1024 elements for
                                 rows reduced in one block (by default rows of up to 4096,
                                 the norms at hidden 2048..4096, are read once, not twice)
  --no-fast-hash-dropout         compiled layer: residual dropouts through F.dropout (one
                                 Philox number per element) instead of masks hashed from
                                 each element's index and a seed (fast_spec.hash_dropout)
  --fast-cuda-graph / --no-fast-cuda-graph
                                 capture forward+backward of each iteration as one CUDA graph
                                 (megatron's --cuda-graph-impl full_iteration); default: on for
                                 single-GPU runs of the fast spec, off otherwise
  --fast-layer-graphs / --no-fast-layer-graphs
                                 capture each layer's forward and backward as CUDA graphs
                                 (megatron's --cuda-graph-impl local) holding the compiled
                                 fused layer, where the full-iteration graph is off; default:
                                 on for launches without tensor or pipeline parallelism
  --fast-multi-gpu-path          on one GPU, take the path a launch on several GPUs takes
                                 (for measuring it where one GPU is all there is)
  --no-fast-optimizer            keep megatron's no-TE/no-apex optimizer fallbacks
                                 (foreach AdamW, per-tensor norm with one sync per tensor)
  --no-fast-lm-loss              megatron's LM head + cross entropy instead of the chunked one
  --no-fast-lm-grad-in-forward   chunked loss: recompute each chunk's logits in backward
                                 instead of forming the LM head's gradients in forward
  --fast-bf16-grad-buffer / --no-fast-bf16-grad-buffer
                                 keep gradients in a bf16 buffer (megatron's
                                 --grad-reduce-in-bf16); default: on where that gives the same
                                 values as the fp32 buffer (bf16, one micro-batch per step,
                                 one data-parallel rank)
  --fast-grad-write / --no-fast-grad-write
                                 write each gradient into megatron's gradient buffer instead
                                 of zeroing the buffer and adding to it (the fused layer's
                                 weight GEMMs write straight into it); default: on where
                                 nothing is accumulated there (one micro-batch per step, one
                                 data-parallel rank)
  --fast-wgrad-fusion            fused layer: weight gradients accumulated into main_grad by
                                 their GEMMs instead of autograd + megatron's DDP hook (off)
  --no-fast-flat-adam            keep megatron's five-pass bf16 optimizer step (cast, norm,
                                 clip, AdamW, copy) instead of one pass over flat buffers
  --no-fast-async-step           keep megatron's host synchronisations inside each step
                                 (gradient norm read back for clipping, single-rank
                                 all-reduces followed by .item())

``apply_fast_path_defaults(args, log)`` runs after parsing, before the model and optimizer
are built, and resolves the automatic defaults: ``plan.plan_fast_path`` decides each, with
its reason, and ``plan.apply_plan`` writes them.
``install_fast_path_patches(args, log)`` installs the optimizer and step replacements inside
megatron's modules; the entry calls it when it launches training.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional


def add_fast_path_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the fast-path switches to ``parser`` (an ArgumentParser or an argument group)."""
    if isinstance(parser, argparse.ArgumentParser):
        group = parser.add_argument_group(
            title="fast path without Transformer Engine (megagpt.fast_spec)"
        )
    else:  # already an argument group: argparse deprecates nesting groups
        group = parser
    group.add_argument(
        "--no-fast-spec",
        action="store_false",
        dest="fast_spec",
        help="Without TE, build layers from megatron's local spec instead of megagpt's fast "
        "spec (SDPA core attention + a fused dense layer).",
    )
    group.add_argument(
        "--no-fast-spec-fused-layer",
        action="store_false",
        dest="fast_spec_fused_layer",
        help="Fast spec: keep megatron's TransformerLayer module path; only the core "
        "attention is replaced by torch scaled_dot_product_attention.",
    )
    group.add_argument(
        "--fast-spec-compile",
        action=argparse.BooleanOptionalAction,
        dest="fast_spec_compile",
        default=None,
        help="torch.compile the fast spec's fused layer and the chunked LM loss kernels. "
        "Default: on when CUDA graphs hold the layers (the full-iteration graph or per-layer "
        "graphs), else off (without a graph the step is bound by CPU launch overhead and "
        "compiled code launches no faster).",
    )
    group.add_argument(
        "--no-fast-one-block-rows",
        action="store_false",
        dest="fast_one_block_rows",
        help="Compiled fused layer: keep inductor's own limit (1024 elements) for rows "
        "reduced by one block of threads. By default rows of up to 4096 elements are, so "
        "that the layer norms at hidden sizes 1025..4096 read each row once instead of twice "
        "(megagpt.fast_spec.norm_rows).",
    )
    group.add_argument(
        "--no-fast-hash-dropout",
        action="store_false",
        dest="fast_hash_dropout",
        help="Compiled fused layer: draw the residual dropouts' masks with F.dropout (inductor "
        "draws a Philox number per element) instead of hashing each element's index with a "
        "seed drawn per dropout (megagpt.fast_spec.hash_dropout; the same keep rate, fewer "
        "integer operations per element).",
    )
    group.add_argument(
        "--fast-cuda-graph",
        action=argparse.BooleanOptionalAction,
        dest="fast_cuda_graph",
        default=None,
        help="Capture each iteration's forward and backward as one CUDA graph (sets "
        "megatron's --cuda-graph-impl full_iteration and --no-check-for-nan-in-loss-and-grad; "
        "losses are still logged). Default: on for single-GPU runs of the fast spec.",
    )
    group.add_argument(
        "--fast-cuda-graph-capture-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        dest="fast_cuda_graph_capture_timeout",
        help="The full-iteration CUDA graph's capture (with its barriers and first replay) "
        "must finish within this many seconds, or the run stops with a line naming the "
        "rank whose capture did not finish, rather than hang (default 300).",
    )
    group.add_argument(
        "--fast-layer-graphs",
        action=argparse.BooleanOptionalAction,
        dest="fast_layer_graphs",
        default=None,
        help="Capture each transformer layer's forward and backward as CUDA graphs "
        "(megatron's --cuda-graph-impl local), holding the compiled fused layer, where the "
        "full-iteration graph is off (launches on several GPUs): the host then launches "
        "two graphs per layer instead of its ~100 kernels. Default: on without tensor and "
        "pipeline parallelism; asked for under them it runs, with their collectives inside "
        "the graphs (tensor parallelism) or one set of graphs per micro-batch in flight "
        "(pipeline parallelism).",
    )
    group.add_argument(
        "--fast-step-nan-checks",
        action="store_true",
        dest="fast_step_nan_checks",
        help="Under per-layer CUDA graphs, keep megatron's NaN/Inf checks inside the step "
        "(each micro-batch's loss, each gradient bucket: every one waits for the GPU, after "
        "which it idles through the host's next launches). By default they are off there, as "
        "under the full-iteration graph, and the gradient norm of every step is checked "
        "instead, one step late and before any checkpoint is saved.",
    )
    group.add_argument(
        "--fast-multi-gpu-path",
        action="store_true",
        dest="fast_multi_gpu_path",
        help="A measuring switch: on one GPU, resolve the fast path's defaults as for a "
        "launch on two data-parallel ranks (no full-iteration graph, fp32 gradient "
        "accumulation, gradients added rather than written), so that the path every "
        "several-GPU launch takes can be timed where one GPU is all there is. Add the "
        "launch's own flags (--use-distributed-optimizer --overlap-grad-reduce) as it would.",
    )
    group.add_argument(
        "--no-fast-optimizer",
        action="store_false",
        dest="fast_optimizer",
        help="Without TE/apex, keep megatron's fallback optimizer kernels (torch foreach "
        "AdamW, per-tensor gradient norm with one host sync per tensor) instead of torch's "
        "fused AdamW and torch._foreach_* norm/scale/copy.",
    )
    group.add_argument(
        "--no-fast-lm-loss",
        action="store_false",
        dest="fast_lm_loss",
        help="Compute the LM head and cross entropy as megatron does (full logits, fp32 "
        "softmax) instead of megagpt's chunked LM-head cross entropy (tensor-parallel "
        "size 1 only; other layouts use megatron's path either way).",
    )
    group.add_argument(
        "--no-fast-lm-grad-in-forward",
        action="store_false",
        dest="fast_lm_grad_in_forward",
        help="Chunked LM loss: recompute each chunk's logits in the backward pass. By "
        "default the LM head's gradients are formed in the forward pass while each chunk's "
        "logits are at hand (no recompute; pretrain_gpt's masked-sum loss; not under "
        "pipeline parallelism, where each micro-batch in flight would hold an fp32 weight "
        "gradient).",
    )
    group.add_argument(
        "--fast-bf16-grad-buffer",
        action=argparse.BooleanOptionalAction,
        dest="fast_bf16_grad_buffer",
        default=None,
        help="Keep the gradient buffer in bf16 (megatron's --grad-reduce-in-bf16). Default: "
        "on for fast-path bf16 runs with one micro-batch per step and one data-parallel rank, "
        "where nothing is accumulated or reduced in the buffer and its values equal the fp32 "
        "buffer's (saves 2 bytes per parameter of peak memory).",
    )
    group.add_argument(
        "--fast-grad-write",
        action=argparse.BooleanOptionalAction,
        dest="fast_grad_write",
        default=None,
        help="Write each step's gradients into megatron's gradient buffer (the DDP hook "
        "copies, the fused layer's weight GEMMs write their product there) instead of "
        "zeroing the whole buffer every step and adding to it; parameters that get no "
        "gradient are zeroed at the end of the backward pass. Default: on for the fast path "
        "with one micro-batch per step and one data-parallel rank, where nothing is "
        "accumulated in the buffer and the values are the same.",
    )
    group.add_argument(
        "--fast-wgrad-fusion",
        action=argparse.BooleanOptionalAction,
        dest="fast_wgrad_fusion",
        default=False,
        help="Fused layer: the four weight GEMMs accumulate their gradients into megatron's "
        "gradient buffer directly (gradient-accumulation fusion, as TE/apex linears do) "
        "instead of autograd + megatron's DDP hook (one tensor-parallel rank). Off by "
        "default: it measured within run-to-run noise, with and without gradient "
        "accumulation (docs/benchmarks.md).",
    )
    group.add_argument(
        "--no-fast-flat-adam",
        action="store_false",
        dest="fast_flat_adam",
        help="Keep megatron's bf16 optimizer step (cast gradients to fp32, norm, clip, AdamW, "
        "copy weights back: five passes over memory). By default, where it applies, one "
        "compiled kernel reads the gradient buffer and updates the fp32 master weights, "
        "both moments and the bf16 weights in one pass (megagpt.fast_spec.flat_adam).",
    )
    group.add_argument(
        "--no-fast-async-step",
        action="store_false",
        dest="fast_async_step",
        help="Keep megatron's host synchronisations inside each training step (the gradient "
        "norm read back to decide clipping, all-reduces over one rank followed by .item()). "
        "By default the fast path keeps the norm on the GPU and skips those waits.",
    )
    return parser


def fast_path_selected(args) -> bool:
    """Whether this run builds layers from the fast spec (``plan.layer_path``)."""
    from .plan import FAST, layer_path

    return layer_path(args)[0] == FAST


def te_layers_selected(args) -> bool:
    """Whether this run builds Transformer Engine's dense layer spec (``plan.layer_path``:
    no --spec, no MoE block)."""
    from .plan import TRANSFORMER_ENGINE, layer_path

    return layer_path(args)[0] == TRANSFORMER_ENGINE


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
        # asked for (--fast-cuda-graph, or megatron's --cuda-graph-impl full_iteration) it
        # runs; not by default: with TE's layers at a small shape (head size 16) launches
        # under it failed where the same launch without it trained (docs/speed.md)
        return ("not by default for Transformer Engine's layers (--fast-cuda-graph asks for "
                "it; docs/speed.md)")
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
        return ("the fused layer is off (--no-fast-spec-fused-layer, or --overlap-param-gather; "
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
                "measured on several GPUs: --fast-layer-graphs asks for them)")
    if (getattr(args, "pipeline_model_parallel_size", 1) or 1) != 1:
        return ("pipeline parallelism (one set of graphs and buffers per micro-batch in "
                "flight: --fast-layer-graphs asks for them)")
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


def apply_fast_path_defaults(args, log: Optional[Callable[[str], None]] = None,
                             installed=None):
    """Resolve the fast path's automatic defaults in a parsed megatron namespace: the plan
    (``plan.plan_fast_path``) applied (``plan.apply_plan``); returns the plan. Call after
    parsing, before megatron's ``validate_args`` and before the model and optimizer are
    built; it patches nothing in megatron (``install_fast_path_patches`` does, at launch)."""
    from .plan import apply_plan, plan_fast_path

    plan = plan_fast_path(args, installed)
    apply_plan(plan, args, log=log)
    return plan


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
        log("fast optimizer: off (--no-fast-optimizer)")
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
        log("fast optimizer: megatron's five-pass bf16 step kept (--no-fast-flat-adam)")
    if async_step:
        from . import async_step as async_step_module

        async_step_module.install(log)
    else:
        log("fast path: host synchronisations inside the step kept (--no-fast-async-step)")

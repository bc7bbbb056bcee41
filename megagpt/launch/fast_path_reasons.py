"""Why each piece of the fast path is on or off for a launch: one function per piece, from
the arguments as the resolution has decided them so far (``*_unsupported_reason``: None
where the piece runs). The fast path's steps (``fast_path``) ask them in order.
"""

from __future__ import annotations

from typing import Callable, Optional

from .layer_path import fast_path_selected, te_layers_selected


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
        # (bench/notes/transformer-engine.md)
        return ("not by default for Transformer Engine's layers (--fast-cuda-graphs "
                "iteration asks for it; docs/transformer-engine-and-apex.md)")
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


def bf16_grad_buffer_unsupported_reason(args, given: frozenset[str] = frozenset()
                                        ) -> Optional[str]:
    """Why a bf16 gradient buffer would not equal the fp32 one here, or would not load the
    checkpoint this run resumes (None: it would do both).

    With bf16 parameters every gradient autograd delivers is a bf16 tensor (a parameter used
    twice, like tied embeddings, gets the bf16 sum of its uses). An fp32 buffer that is
    zeroed each step and receives one such gradient — one micro-batch, no data-parallel
    sum — holds exactly the bf16 value widened, so a bf16 buffer holds the same numbers.
    ``given``: the launch's explicit flags (a precision of the gradients asked for stays).
    """
    if not getattr(args, "bf16", False):
        return "not bf16"
    if getattr(args, "cpu", False):
        return "CPU mode"
    if not fast_path_selected(args):
        return "the fast spec is not used"
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
    return _float32_buckets_reason(args)


def _float32_buckets_reason(args) -> Optional[str]:
    """Why the distributed optimizer's checkpoints keep float32 gradients: megatron's default
    format keeps its state by gradient bucket and names each bucket by its parameter and
    gradient dtypes, so bf16 buckets load only into bf16 buckets. A resume follows the
    buckets of the checkpoint it loads; a run that saves in that format keeps float32 ones,
    those of the same run on several GPUs and of TE's and megatron's layers, so that its
    checkpoints resume there (on one GPU the distributed optimizer saves no memory: it is
    there for such checkpoints). The numbers are the same either way (one micro-batch, one
    rank)."""
    from megagpt.resilience import checkpoint_guard

    found = checkpoint_guard.bucketed_gradient_buffer(args)
    if found is not None:
        if not found[1].endswith("/float32"):
            return None  # bf16 buckets: resumed as they were saved
        return (f"resuming {found[0]}, whose distributed optimizer keeps its state in buckets "
                "of float32 gradients (megatron's default format names the buckets by dtype)")
    if checkpoint_guard.saves_by_bucket(args):
        return ("the distributed optimizer saves by gradient bucket (megatron's default "
                "format names the buckets by dtype): float32 buckets, as on several GPUs and "
                "under TE's layers, so that its checkpoints resume there")
    return None


def wgrad_fusion_unused_reason(args, chunked_loss: bool) -> Optional[str]:
    """Why megatron's gradient-accumulation fusion (apex's ``fused_weight_gradient_mlp_cuda``
    in megatron's own linear layers) has nothing to fuse in this launch (None: some of
    megatron's linears run their own backward): the fast spec's fused layers form their weight
    gradients themselves, and its chunked LM loss (``chunked_loss``) forms the output
    layer's."""
    if not fast_path_selected(args) or not getattr(args, "fast_spec_fused_layer", True):
        return None
    if (not chunked_loss or (getattr(args, "tensor_model_parallel_size", 1) or 1) != 1
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

"""What is installed, and the settings of a launch adapted to it: the steps of the resolution
that make a plain ``pip install`` of the megatron-core wheel (no TE, no apex, none of
megatron's CUDA extensions) run megatron's defaults, and refuse what nothing installed can
run.

- ``adapt_to_installed``: settings megatron turns on by default that need what is missing
  (``ADAPTATIONS``: apex's persistent layer norm, the fused masked softmax, gradient-
  accumulation fusion in megatron's own linears, TE's fused RoPE), each turned off with one
  log line; under TE's layers without apex, megatron's own linears built without
  gradient-accumulation fusion (``MEGATRON_LINEARS_WGRAD``, which
  ``compat.megatron_linears_without_wgrad_fusion`` does).
- ``refuse_what_is_missing``: settings no adaptation rescues (``check_required_packages``),
  refused before any work with what is missing.

A setting the user asked for explicitly (on the command line or in ``--config``) is never
changed silently: if it needs something missing, ``MissingDependencyError`` says what. Which
layers run for what is installed is ``layers``'; FP8's ``fp8``'.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

from megagpt.compat import Installed, MissingDependencyError
from megagpt.errors import UserError

from .plan import Decision, Reason, Why

# megatron's own linear layers built without gradient-accumulation fusion under TE's layers
# (``compat.megatron_linears_without_wgrad_fusion``)
# (made only there; its value: the fusion, off)
MEGATRON_LINEARS_WGRAD: Decision[bool] = Decision("megatron's linears' wgrad fusion", bool)


@dataclass(frozen=True)
class Adaptation:
    """One setting that depends on an optional package."""

    attr: str  # attribute on megatron's args namespace
    flags: tuple[str, ...]  # command-line spellings that set it explicitly
    unusable: Callable[[object, Installed], bool]  # (args, installed) -> needs what is missing
    safe_value: object
    why: str  # what it needs that is missing

    @property
    def decision(self) -> Decision[bool]:
        """The launch's choice of it, named by the flag it amounts to."""
        return Decision(self.flags[0], bool)


ADAPTATIONS: tuple[Adaptation, ...] = (
    Adaptation(
        "no_persist_layer_norm", ("--no-persist-layer-norm",),
        lambda a, i: not a.no_persist_layer_norm and not i.fused_layer_norm,
        True,
        "persistent fused layer norm needs NVIDIA apex",
    ),
    Adaptation(
        "masked_softmax_fusion", ("--no-masked-softmax-fusion",),
        lambda a, i: a.masked_softmax_fusion and not i.masked_softmax_kernels
        and a.transformer_impl != "transformer_engine",
        False,
        "fused masked softmax needs the scaled_masked_softmax_cuda extension",
    ),
    Adaptation(
        "gradient_accumulation_fusion", ("--no-gradient-accumulation-fusion",),
        lambda a, i: (a.gradient_accumulation_fusion and not i.gradient_accumulation_kernels
                      and a.transformer_impl != "transformer_engine"),
        False,
        "gradient-accumulation fusion in megatron's linear layers needs apex's "
        "fused_weight_gradient_mlp_cuda",
    ),
    Adaptation(
        # megatron's only fused RoPE kernels are TE's; with them missing its TransformerConfig
        # refuses the default ("apply_rope_fusion is not available") for every RoPE model
        "apply_rope_fusion", ("--no-rope-fusion",),
        lambda a, i: (a.apply_rope_fusion and not i.transformer_engine
                      and (a.position_embedding_type == "rope"
                           or getattr(a, "use_rotary_position_embeddings", False))),
        False,
        "fused RoPE needs Transformer Engine's kernels",
    ),
)


def te_layers_fuse_wgrad_alone(args, installed: Installed) -> bool:
    """Whether TE's layers fuse the weight-gradient accumulation while megatron's own linear
    layers of the same model (the output layer) cannot: apex's kernel is missing."""
    return (args.transformer_impl == "transformer_engine" and args.gradient_accumulation_fusion
            and not installed.gradient_accumulation_kernels)


def _optional_packages_asked_for(args) -> list[tuple[str, str, str]]:
    """(the flag, the module it needs, how to get it) for each optional package this
    launch's flags need; megatron finds each missing only deep in the start-up or in
    training."""
    asked = []
    if getattr(args, "enable_ft_package", False):
        asked.append(("--enable-ft-package", "nvidia_resiliency_ext",
                      "pip install nvidia-resiliency-ext"))
    if getattr(args, "moe_token_dispatcher_type", None) == "flex":
        asked.append(("--moe-token-dispatcher-type flex", "deep_ep",
                      "DeepEP, built from source (github.com/deepseek-ai/DeepEP); or use "
                      "--moe-token-dispatcher-type alltoall"))
    if getattr(args, "use_megatron_fsdp", False):
        asked.append(("--use-megatron-fsdp", "einops", "pip install einops"))
    instances = getattr(args, "num_distributed_optimizer_instances", 1) or 1
    if instances > 1:
        asked.append((f"--num-distributed-optimizer-instances {instances}", "einops",
                      "pip install einops"))
    return asked


def experts_add_bias_out_of_place(args) -> bool:
    """Whether this launch's MoE experts can add their linear biases: Transformer Engine's
    grouped experts (TEGroupedMLP: ``--moe-grouped-gemm`` under TE's layers) add them out of
    place. megatron's sequential experts (SequentialMLP, with megatron's linears or TE's
    alike) add each expert's bias in place to its row-parallel linear's output, a view that
    autograd refuses to modify (RuntimeError in the first forward)."""
    return args.transformer_impl == "transformer_engine" and bool(args.moe_grouped_gemm)


def experts_bias_refusal(args, installed: Installed) -> UserError:
    """The one line for MoE experts with linear biases that would run sequentially."""
    why = ("megatron's sequential experts add each expert's bias in place to a view, which "
           "autograd refuses in the first forward; Transformer Engine's grouped experts add it "
           "out of place")
    if not installed.transformer_engine:
        return MissingDependencyError(
            f"--num-experts {args.num_experts} with linear biases needs Transformer Engine: "
            f"{why}. Add --disable-bias-linear (as MoE models usually do), or install "
            "Transformer Engine (pip install 'megagpt[te]') and add --moe-grouped-gemm.")
    from megagpt.flags import megatron_local_spec_asked

    asked_local = ("--spec local" if megatron_local_spec_asked(args)
                   else "--transformer-impl local")
    local = (f" and drop {asked_local}" if args.transformer_impl != "transformer_engine"
             else "")
    return UserError(
        f"--num-experts {args.num_experts} with linear biases needs --moe-grouped-gemm under "
        f"Transformer Engine's layers: {why}. Add --moe-grouped-gemm{local}, or "
        "--disable-bias-linear (as MoE models usually do).")


def check_required_packages(args, installed: Installed) -> None:
    """Settings that no adaptation can rescue: fail before any work with what is missing."""
    if args.context_parallel_size > 1 and not installed.transformer_engine:
        raise MissingDependencyError(
            f"--context-parallel-size {args.context_parallel_size} needs Transformer Engine: "
            "megatron's local attention (DotProductAttention) cannot split a sequence across "
            "ranks. Install it (pip install 'megagpt[te]') or use tensor/pipeline/data "
            "parallelism instead.")
    if (getattr(args, "layernorm_zero_centered_gamma", False)
            and not installed.transformer_engine and not installed.apex):
        # megatron's torch LayerNorm asserts on it while the model is built, in megatron's
        # local spec and the fast spec alike
        raise MissingDependencyError(
            "--apply-layernorm-1p needs Transformer Engine or apex: megatron's torch LayerNorm "
            "has no zero-centred gamma. Install Transformer Engine (pip install 'megagpt[te]') "
            "or drop the flag.")
    if (getattr(args, "num_experts", None) and args.add_bias_linear
            and not (installed.transformer_engine and experts_add_bias_out_of_place(args))):
        raise experts_bias_refusal(args, installed)
    if getattr(args, "multi_latent_attention", False) and not installed.transformer_engine:
        # megatron's MLA hands its core attention k_channels/v_channels, which only
        # Transformer Engine's accepts (a TypeError while the model is built)
        raise MissingDependencyError(
            "--multi-latent-attention needs Transformer Engine: megatron's local attention "
            "(DotProductAttention) takes no separate key/value head sizes. Install it "
            "(pip install 'megagpt[te]') or drop the flag.")
    if (getattr(args, "init_model_with_meta_device", False) and not installed.transformer_engine
            and not getattr(args, "use_torch_fsdp2", False)
            and not getattr(args, "use_megatron_fsdp", False)):
        # megatron builds the model on the meta device and then allocates each tensor with
        # empty_like (to_empty_if_meta_device): TE's modules initialise theirs then, the
        # local ones never do (NaN at the first iteration)
        raise MissingDependencyError(
            "--init-model-with-meta-device needs Transformer Engine (its modules initialise "
            "their weights when megatron allocates them) or FSDP (--use-megatron-fsdp, "
            "--use-torch-fsdp2); megatron's local modules would train on uninitialised "
            "memory. Drop the flag or install Transformer Engine (pip install 'megagpt[te]').")
    for flag, module, how in _optional_packages_asked_for(args):
        if importlib.util.find_spec(module) is None:
            raise MissingDependencyError(f"{flag} needs the {module} package, which is not "
                                         f"installed ({how})")


def sequence_parallel_norms_missing(args, installed: Installed, fast_spec_used: bool
                                    ) -> UserError | None:
    """The refusal of ``--sequence-parallel`` where no norm of this launch serves it (None:
    one does): megatron's torch norm asserts on it while the model is built; the fast spec's,
    TE's and apex's norms take it. ``fast_spec_used``: whether the launch's layers are the
    fast spec's (its layer choice)."""
    if not (getattr(args, "sequence_parallel", False)
            and (getattr(args, "tensor_model_parallel_size", 1) or 1) > 1
            and not installed.transformer_engine and not installed.apex and not fast_spec_used):
        return None
    return MissingDependencyError(
        "--sequence-parallel without Transformer Engine or apex needs the fast "
        "spec's norms (megatron's torch LayerNorm refuses sequence parallelism), and "
        "the fast spec is not used in this run (--no-fast-spec, --spec, MoE or "
        "another reason the log gives). Use the fast spec, install Transformer "
        "Engine (pip install 'megagpt[te]'), or drop --sequence-parallel.")


def adapt_to_installed(p) -> None:
    """The settings that need what is missing, adapted (a step of the launch's resolution, over
    its planner ``p``). An explicit request that cannot be honoured is refused
    (``MissingDependencyError``), never changed."""
    installed = p.installed
    for adaptation in ADAPTATIONS:
        if not adaptation.unusable(p.v, installed):
            continue
        p.set(adaptation.attr, adaptation.safe_value)
        p.choose(adaptation.decision, True, Reason(Why.INSTALLED, adaptation.why))
        p.log(f"compat: {adaptation.why}; {adaptation.flags[0]}")
    if te_layers_fuse_wgrad_alone(p.v, installed):
        p.choose(MEGATRON_LINEARS_WGRAD, False, Reason(
            Why.INSTALLED, "apex's fused_weight_gradient_mlp_cuda is not installed; "
            "Transformer Engine's layers fuse the accumulation themselves"))
        p.log("compat: gradient-accumulation fusion in Transformer Engine's layers; megatron's "
              "own linear layers (the output layer) accumulate through autograd: apex's "
              "fused_weight_gradient_mlp_cuda is not installed")




def refuse_what_is_missing(p) -> None:
    """``check_required_packages`` as a step of the launch's resolution."""
    check_required_packages(p.v, p.installed)

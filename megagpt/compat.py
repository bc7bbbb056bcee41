"""Compatibility with what is installed: the megatron-core wheel with or without TE / apex.

Upstream's entry needs these changes before its first step on a plain ``pip install`` of the
wheel (no TE, no apex, none of megatron's CUDA extensions, no Makefile for its dataset
helpers). They are made here, once, with one log line for each setting adapted:

1. ``initialize_megatron`` runs ``make`` on the dataset helpers; the wheel ships the
   compiled ``helpers_cpp`` but no Makefile, so the compile step is skipped when the
   extension imports.
2. ``--transformer-impl`` defaults to ``transformer_engine``: without TE, ``local``; with
   TE, the faster of TE's layers and the fast spec for the layout (``megagpt.layer_impl``).
3. The persistent fused layer norm needs apex: ``--no-persist-layer-norm``.
4. The fused masked softmax needs its CUDA extension: ``--no-masked-softmax-fusion``.
5. Gradient-accumulation fusion: TE's layers fuse it themselves; megatron's own linear layers
   need apex's ``fused_weight_gradient_mlp_cuda``. Without apex it is off for them
   (``--no-gradient-accumulation-fusion`` where no TE layer is built; under TE's layers
   ``megatron_linears_without_wgrad_fusion`` builds megatron's linears without it).
6. Fused RoPE (on by default for ``--position-embedding-type rope``) is TE's kernel only:
   without TE, ``--no-rope-fusion``.

A setting the user asked for explicitly (on the command line or in ``--config``) is never
changed silently: if it needs something missing, ``MissingDependencyError`` says what.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

from megagpt.errors import UserError
from megagpt.megatron_change import REPLACES, WRAPS, Change


class MissingDependencyError(UserError, RuntimeError):
    """The user explicitly asked for a feature whose package is not installed."""


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class Installed:
    """Optional accelerators found in this Python environment."""

    transformer_engine: bool
    apex: bool  # NVIDIA apex built from source (the PyPI package "apex" is unrelated)
    fused_layer_norm: bool  # apex's fast / persistent layer norm kernels
    masked_softmax_kernels: bool  # megatron's scaled_masked_softmax_cuda extension
    # apex's fused_weight_gradient_mlp_cuda: what megatron's own linear layers need for
    # gradient-accumulation fusion (TE's layers fuse it with their own kernels)
    gradient_accumulation_kernels: bool
    # whether megatron's optimizer modules bound TE's or apex's FusedAdam and multi-tensor
    # kernels when they were imported (False: megatron's torch fallbacks); None: as TE or
    # apex being installed says. Where TE is installed but cannot load (no CUDA), megatron
    # took its fallbacks: detect() asks megatron.
    megatron_fused_optimizer: bool | None = None

    def __post_init__(self):
        if self.megatron_fused_optimizer is None:
            object.__setattr__(self, "megatron_fused_optimizer",
                               self.transformer_engine or self.apex)

    @classmethod
    def detect(cls) -> "Installed":
        from megagpt.train_step.optimizer import megatron_uses_local_fallbacks

        te = _importable("transformer_engine") and _importable("transformer_engine.pytorch")
        apex = _importable("apex") and _importable("apex.normalization")
        return cls(
            transformer_engine=te,
            apex=apex,
            fused_layer_norm=apex and _importable("fast_layer_norm"),
            masked_softmax_kernels=_importable("scaled_masked_softmax_cuda"),
            gradient_accumulation_kernels=_importable("fused_weight_gradient_mlp_cuda"),
            megatron_fused_optimizer=not megatron_uses_local_fallbacks(),
        )

    def summary(self) -> str:
        def yes(flag: bool) -> str:
            return "yes" if flag else "no"

        line = (f"transformer-engine={yes(self.transformer_engine)} apex={yes(self.apex)} "
                f"fused-softmax-kernels={yes(self.masked_softmax_kernels)}")
        if self.transformer_engine:
            from megagpt.te_cudnn import cudnn_te_loads

            line += f" (TE loads {cudnn_te_loads()})"
        return line


# megatron's FusedLayerNorm.__init__: the hidden sizes its persistent kernel takes (others
# get fused_layer_norm_cuda's kernel)
PERSISTENT_HIDDEN_SIZES = frozenset({
    1024, 1536, 2048, 2304, 3072, 3840, 4096, 5120, 6144, 8192, 10240, 12288, 12800, 15360,
    16384, 18432, 20480, 24576, 25600, 30720, 32768, 40960, 49152, 65536})

# The choice of apex's persistent layer norm kernel for megatron's local modules (the plan's
# name, ``megagpt.launch.apex_kernels`` decides it)
PERSISTENT_LAYER_NORM = "persistent layer norm"


@dataclass(frozen=True)
class Adaptation:
    """One setting that depends on an optional package."""

    attr: str  # attribute on megatron's args namespace
    flags: tuple[str, ...]  # command-line spellings that set it explicitly
    unusable: Callable[[object, Installed], bool]  # (args, installed) -> needs what is missing
    safe_value: object
    message: str  # why it was changed, or why the explicit request cannot be honoured


ADAPTATIONS: tuple[Adaptation, ...] = (
    Adaptation(
        "no_persist_layer_norm", ("--no-persist-layer-norm",),
        lambda a, i: not a.no_persist_layer_norm and not i.fused_layer_norm,
        True,
        "persistent fused layer norm needs NVIDIA apex; --no-persist-layer-norm",
    ),
    Adaptation(
        "masked_softmax_fusion", ("--no-masked-softmax-fusion",),
        lambda a, i: a.masked_softmax_fusion and not i.masked_softmax_kernels
        and a.transformer_impl != "transformer_engine",
        False,
        "fused masked softmax needs the scaled_masked_softmax_cuda extension; "
        "--no-masked-softmax-fusion",
    ),
    Adaptation(
        "gradient_accumulation_fusion", ("--no-gradient-accumulation-fusion",),
        lambda a, i: (a.gradient_accumulation_fusion and not i.gradient_accumulation_kernels
                      and a.transformer_impl != "transformer_engine"),
        False,
        "gradient-accumulation fusion in megatron's linear layers needs apex's "
        "fused_weight_gradient_mlp_cuda; --no-gradient-accumulation-fusion",
    ),
    Adaptation(
        # megatron's only fused RoPE kernels are TE's; with them missing its TransformerConfig
        # refuses the default ("apply_rope_fusion is not available") for every RoPE model
        "apply_rope_fusion", ("--no-rope-fusion",),
        lambda a, i: (a.apply_rope_fusion and not i.transformer_engine
                      and (a.position_embedding_type == "rope"
                           or getattr(a, "use_rotary_position_embeddings", False))),
        False,
        "fused RoPE needs Transformer Engine's kernels; --no-rope-fusion",
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
    if getattr(args, "fp8", None):
        _check_fp8(args, installed)
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


def _check_fp8(args, installed: Installed) -> None:
    """``--fp8-format``: a GPU with FP8 tensor cores, and layers that run it — the fast
    spec's FP8 linears, or Transformer Engine's."""
    from megagpt.fast_spec.fp8_support import fp8_hardware_reason, fp8_shape_reason
    from megagpt.fast_spec.spec import fast_spec_unsupported_reason

    hardware = fp8_hardware_reason(args)
    if hardware is not None:
        raise UserError(f"--fp8-format {args.fp8}: {hardware}")
    shape = fp8_shape_reason(args)
    if shape is not None:
        raise UserError(f"--fp8-format {args.fp8}: {shape}")
    if installed.transformer_engine:
        return  # megagpt.layer_impl picks TE's FP8 layers where the fast spec cannot
    reason = fast_spec_unsupported_reason(args)
    if reason is not None:
        raise MissingDependencyError(
            f"--fp8-format {args.fp8}: the fast spec's FP8 linears cannot run this launch "
            f"({reason.removeprefix(f'--fp8-format {args.fp8} on the fast spec: ')}); "
            "Transformer Engine's FP8 layers can (pip install 'megagpt[te]')")


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
    """The launch's layers and the settings that need what is missing (a step of the launch's
    resolution, over its planner ``p``: ``megagpt.launch.planner``). An explicit request that
    cannot be honoured is refused (``MissingDependencyError``), never changed."""
    from megagpt.layer_impl import choose_transformer_impl

    installed = p.installed
    if ("--transformer-impl" in p.given and p.v.transformer_impl == "transformer_engine"
            and not installed.transformer_engine):
        raise MissingDependencyError(
            "--transformer-impl transformer_engine was given, but Transformer Engine is "
            "not installed. Install it (pip install 'megagpt[te]') or drop the flag: "
            "without it the entry uses its own fast path.")
    choice = choose_transformer_impl(p.v, p.given, installed)
    p.set("transformer_impl", choice.impl)
    p.choose("transformer impl", choice.impl, choice.reason)
    p.log(f"compat: {choice.describe()}")
    for adaptation in ADAPTATIONS:
        if not adaptation.unusable(p.v, installed):
            continue
        p.set(adaptation.attr, adaptation.safe_value)
        p.choose(adaptation.flags[0], True, adaptation.message.rsplit("; --", 1)[0])
        p.log(f"compat: {adaptation.message}")
    if te_layers_fuse_wgrad_alone(p.v, installed):
        p.choose(MEGATRON_LINEARS_WGRAD, "through autograd",
                 "apex's fused_weight_gradient_mlp_cuda is not installed; Transformer Engine's "
                 "layers fuse the accumulation themselves")
        p.log("compat: gradient-accumulation fusion in Transformer Engine's layers; megatron's "
              "own linear layers (the output layer) accumulate through autograd: apex's "
              "fused_weight_gradient_mlp_cuda is not installed")


# the choice under which megatron's own linear layers are built without gradient-accumulation
# fusion (megatron_linears_without_wgrad_fusion)
MEGATRON_LINEARS_WGRAD = "megatron's linears' wgrad"


def refuse_what_is_missing(p) -> None:
    """``check_required_packages`` as a step of the launch's resolution."""
    check_required_packages(p.v, p.installed)


# megatron 0.19's parser offers --rerun-mode report_stats (RerunStateMachineConfig), but its
# RerunMode enum names that mode "report_determinism_stats": initialize_megatron's
# RerunMode(args.rerun_mode) raises ValueError for the parser's spelling.
RERUN_MODE_SPELLINGS = {"report_stats": "report_determinism_stats"}


def bias_activation_fusion_conflict(args) -> str | None:
    """Why megatron's default fusion of the MLP's bias into its activation cannot run with
    this launch's activation (None: it can). The fusion is on unless ``--no-bias-gelu-fusion``
    is given (no flag asks for it), and megatron turns it off itself only where the linears
    have no bias. Otherwise megatron refuses a squared ReLU with it when the model's config is
    built, and MoE experts with GeLU stop on it at the first step."""
    if args.swiglu or not args.bias_gelu_fusion or not args.add_bias_linear:
        return None
    if args.squared_relu:
        return "megatron fuses a bias only into GeLU, SwiGLU and quick-GeGLU (--squared-relu)"
    if args.num_experts and not args.quick_geglu:
        # SequentialMLP and TEGroupedMLP hand every expert the router's probabilities, and
        # megatron fuses those with a bias only for SwiGLU and quick-GeGLU
        return ("megatron's MoE experts fuse the bias and the router's probabilities only into "
                "SwiGLU and quick-GeGLU; the MLP applies the exact GeLU instead of the fused "
                "tanh approximation")
    return None


def adapt_megatron_quirks(p) -> None:
    """Settings megatron's parser accepts that its own code then rejects (a step of the
    launch's resolution, over its planner ``p``)."""
    args = p.v
    mode = getattr(args, "rerun_mode", None)
    if mode in RERUN_MODE_SPELLINGS:
        p.set("rerun_mode", RERUN_MODE_SPELLINGS[mode])
        p.choose("--rerun-mode", args.rerun_mode, "megatron's parser and its RerunMode enum "
                 "spell it differently")
        p.log(f"compat: --rerun-mode {mode} is megatron's RerunMode {args.rerun_mode!r} (its "
              "parser and its enum spell it differently)")
    conflict = bias_activation_fusion_conflict(args)
    if conflict:
        p.set("bias_gelu_fusion", False)
        p.choose("--no-bias-gelu-fusion", True, conflict)
        p.log(f"compat: --no-bias-gelu-fusion: {conflict}")
    if (args.num_experts and getattr(args, "moe_grouped_gemm", False)
            and args.transformer_impl != "transformer_engine"):
        # megatron's local backend (LocalSpecProvider.grouped_mlp_modules) builds its
        # sequential experts whatever the flag says
        p.log("compat: --moe-grouped-gemm under megatron's local modules: megatron runs the "
              "experts one after another (SequentialMLP, a GEMM per expert); only Transformer "
              "Engine's layers group them")
    if (args.num_experts and args.add_bias_linear and args.bias_dropout_fusion
            and experts_add_bias_out_of_place(args)):
        # megatron's TEGroupedMLP asserts on it while the model is built
        p.set("bias_dropout_fusion", False)
        p.choose("--no-bias-dropout-fusion", True, "Transformer Engine's grouped experts with "
                 "linear biases add the bias themselves")
        p.log("compat: --no-bias-dropout-fusion: Transformer Engine's grouped experts with "
              "linear biases add the bias themselves, and megatron builds them only without "
              "its bias-dropout fusion")


COMPILE_HELPERS = Change(
    "megatron.core.datasets.utils.compile_helpers", REPLACES, __name__,
    does="nothing: the dataset helpers are built",
    why="initialize_megatron runs make on megatron/core/datasets, which the wheel ships without "
        "a Makefile (its helpers_cpp is prebuilt): make fails and the run exits; skipped only "
        "where helpers_cpp imports",
    fingerprint="02c160f0fa9c")


def dataset_helpers_built() -> bool:
    """Whether megatron's dataset helpers (``helpers_cpp``) import: the wheel ships them
    prebuilt."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def dataset_helpers_prebuilt() -> Iterator[None]:
    """``initialize_megatron``'s ``make -C megatron/core/datasets`` a no-op for the duration
    of the block.

    The wheel ships ``helpers_cpp`` prebuilt and no Makefile; upstream's compile step
    then fails and calls ``sys.exit(1)``. Only skipped when the extension imports, so a
    source checkout that really needs compiling still compiles.
    """
    import megatron.core.datasets.utils as dataset_utils

    from megagpt import megatron_wrappers

    if not dataset_helpers_built():
        yield
        return

    def already_built(_):
        def compile_helpers():
            """helpers_cpp is already built (megatron-core wheel); nothing to compile."""
        return compile_helpers

    with megatron_wrappers.wrapped(dataset_utils, [("compile_helpers", __name__, already_built)]):
        yield


# What ``distributed_optimizer_resuming`` changes in megatron, in the order it installs it
# (without TE or apex: with them, nothing).
_DISTRIBUTED_OPTIMIZER = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer."
SHARDED_STATE_DICT = Change(
    _DISTRIBUTED_OPTIMIZER + "sharded_state_dict", WRAPS, __name__,
    does="a fresh optimizer asked for a state dict to load into first takes megatron's own "
         "dummy step (_init_optimizer_states_with_dummy_values)",
    why="without TE/apex its state_dict() reads the step from torch's optimizer state, which "
        "an optimizer built to resume has not made yet (assert len(steps) == 1): every resume "
        "of a distributed-optimizer checkpoint stopped",
    fingerprint="044b9c3b3b9a", needle="state_dict = self.state_dict()")
SET_MAIN_PARAM_AND_OPTIMIZER_STATES = Change(
    _DISTRIBUTED_OPTIMIZER + "_set_main_param_and_optimizer_states", WRAPS, __name__,
    does="keeps the restored step and copies under no_grad",
    why="loading, it copies the checkpoint's values into every tensor of a parameter's state, "
        "which for torch's optimizer includes the step the checkpoint keeps in the parameter "
        "groups (KeyError: 'step'), and into leaf tensors that require gradients outside "
        "no_grad (RuntimeError)",
    fingerprint="20b6b8ac2fd8", needle="dst_tensors[key].copy_(tensors[key])")
DISTRIBUTED_LOAD_STATE_DICT = Change(
    _DISTRIBUTED_OPTIMIZER + "load_state_dict", WRAPS, __name__,
    does="gives each parameter's state its own step tensor",
    why="without TE/apex it gives every parameter's state one shared step tensor, which "
        "torch's AdamW then advances once per parameter per step: Adam's bias correction "
        "after a resume ran ahead of the uninterrupted run's",
    fingerprint="707490502424", needle='s["step"] = step')


@contextlib.contextmanager
def distributed_optimizer_resuming(log: Callable[[str], None] = lambda s: None
                                   ) -> Iterator[None]:
    """Let megatron's distributed optimizer load a checkpoint without TE or apex, for the
    duration of the block.

    Building the state dict it loads into, ``DistributedOptimizer.sharded_state_dict`` asks
    ``state_dict()`` for the optimizer's step; without TE/apex that reads the step of each
    parameter's state in torch's optimizer, which a freshly built optimizer does not have
    yet, and ``assert len(steps) == 1`` stops every resume (any layout, any checkpoint
    format). megatron's own remedy for its FSDP format is
    ``_init_optimizer_states_with_dummy_values`` (one step on zero gradients, so that the
    state exists to be overwritten by the load); the wrapper runs it first when a fresh
    torch optimizer is asked for a state dict to load into. Then the loaded values are
    copied into the state by ``_set_main_param_and_optimizer_states``, which expects every
    tensor of the state in the checkpoint (torch's per-parameter ``step`` is not: it is
    restored from the parameter groups) and copies into leaf tensors that require gradients
    outside ``no_grad``; its wrapper keeps ``step`` and copies under ``no_grad``. And
    ``load_state_dict`` puts one step tensor into every parameter's state; torch's AdamW
    increments each state's step in place, so the shared one ran ahead by the number of
    parameters per step, and so did Adam's bias correction: its wrapper gives each state
    its own copy. Resumed under the same layout, a run then continues bit for bit on the
    CPU in fp32 (under another, to float32 rounding: it sums in another order).
    With TE or apex installed, nothing changes.
    """
    from megatron.core.optimizer import distrib_optimizer

    from megagpt import megatron_wrappers

    if distrib_optimizer.HAVE_APEX_OR_TE:
        yield
        return
    with megatron_wrappers.wrapped(distrib_optimizer.DistributedOptimizer, [
            ("sharded_state_dict", __name__,
             lambda original: _loading_into_dummy_states(original, log)),
            ("_set_main_param_and_optimizer_states", __name__, _keeping_the_restored_step),
            ("load_state_dict", __name__, _a_step_per_state)]):
        yield


def _loading_into_dummy_states(original: Callable, log: Callable[[str], None]) -> Callable:
    import inspect

    import torch

    signature = inspect.signature(original)

    @functools.wraps(original)
    def sharded_state_dict(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        inner = getattr(self, "optimizer", None)
        if (bound.arguments.get("is_loading") and isinstance(inner, torch.optim.Optimizer)
                and not inner.state
                and any(p.numel() for g in inner.param_groups for p in g["params"])):
            self._init_optimizer_states_with_dummy_values()
            if not getattr(self, "_megagpt_said_resume", False):
                self._megagpt_said_resume = True
                log("resume: the distributed optimizer's state loads through workarounds "
                    "of megatron's loader (no TE/apex: megagpt.compat)")
        return original(self, *args, **kwargs)

    return sharded_state_dict


def _keeping_the_restored_step(set_states: Callable) -> Callable:
    import torch

    @functools.wraps(set_states)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        # megatron copies the loaded values into every tensor of the parameter's state, but
        # torch's optimizer keeps its "step" there too, which the checkpoint holds in the
        # parameter groups (load_state_dict has put it back from there); what arrives here
        # under "step" is not it (the fully reshardable format has none, the other one the
        # value of the state the load was prepared with): the restored step keeps its value.
        # And the copies go into leaf tensors that require gradients: outside no_grad torch
        # refuses them.
        with torch.no_grad():
            if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                return set_states(self, model_param, tensors)
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            kept = {key: value for key, value in self.optimizer.state[main_param].items()
                    if isinstance(value, torch.Tensor) and (key == "step" or key not in tensors)}
            return set_states(self, model_param, {**tensors, **kept})

    return _set_main_param_and_optimizer_states


def _a_step_per_state(load: Callable) -> Callable:
    import torch

    @functools.wraps(load)
    def load_state_dict(self, state_dict):
        # megatron sets s["step"] = step, one tensor, for every parameter's state
        result = load(self, state_dict)
        inner = getattr(self, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            for state in inner.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()
        return result

    return load_state_dict


def _built_without_wgrad_fusion(init: Callable) -> Callable:
    @functools.wraps(init)
    def __init__(self, *args, config, **kwargs):
        # the layer reads the setting from its config only while it is built (to refuse a
        # missing kernel, and into self.gradient_accumulation_fusion, which its forward
        # uses); the model's other layers share this config, so it is put back at once
        fused = config.gradient_accumulation_fusion
        config.gradient_accumulation_fusion = False
        try:
            init(self, *args, config=config, **kwargs)
        finally:
            config.gradient_accumulation_fusion = fused
    return __init__


# What ``megatron_linears_without_wgrad_fusion`` changes in megatron, in the order it installs
# it.
COLUMN_PARALLEL_LINEAR = Change(
    "megatron.core.tensor_parallel.layers.ColumnParallelLinear.__init__", WRAPS, __name__,
    does="builds the layer with gradient-accumulation fusion off: it accumulates through "
         "autograd",
    why="with --gradient-accumulation-fusion (megatron's default) it refuses to be built "
        "unless apex's fused_weight_gradient_mlp_cuda imports, which TE does not provide: "
        "under TE's layers without apex (whose own layers fuse it) the output layer stopped "
        "every launch",
    fingerprint="ef7f6993d7de",
    needle="if config.gradient_accumulation_fusion and not _grad_accum_fusion_available")
ROW_PARALLEL_LINEAR = Change(
    "megatron.core.tensor_parallel.layers.RowParallelLinear.__init__", WRAPS, __name__,
    does="builds the layer with gradient-accumulation fusion off",
    why="as ColumnParallelLinear: its backward needs apex's fused_weight_gradient_mlp_cuda "
        "when built with gradient-accumulation fusion",
    fingerprint="a3ed8d3e583e",
    needle="self.gradient_accumulation_fusion = config.gradient_accumulation_fusion")
MEGATRON_CHANGES = (COMPILE_HELPERS, SHARDED_STATE_DICT, SET_MAIN_PARAM_AND_OPTIMIZER_STATES,
                    DISTRIBUTED_LOAD_STATE_DICT, COLUMN_PARALLEL_LINEAR, ROW_PARALLEL_LINEAR)


@contextlib.contextmanager
def megatron_linears_without_wgrad_fusion() -> Iterator[None]:
    """For the duration of the block, build megatron's own parallel linear layers without
    gradient-accumulation fusion, which they would refuse to be built with under TE's layers
    without apex ("the custom CUDA extension fused_weight_gradient_mlp_cuda module is not
    found"): their weight gradients reach megatron's gradient buffer through autograd and its
    DDP hook, while TE's layers keep accumulating theirs in their GEMMs. Where it is needed
    is the launch's ``MEGATRON_LINEARS_WGRAD`` choice (``te_layers_fuse_wgrad_alone``)."""
    from megatron.core.tensor_parallel import layers

    from megagpt import megatron_wrappers

    with megatron_wrappers.wrapped_all([(cls, "__init__", __name__, _built_without_wgrad_fusion)
                                        for cls in (layers.ColumnParallelLinear,
                                                    layers.RowParallelLinear)]):
        yield


def quiet_fallback_warnings() -> None:
    """megatron warns once per module that TE/apex are missing; Installed.summary says it once."""
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(are|is) not installed.*")
    warnings.filterwarnings("ignore", message=r".*Apex is not installed.*")
    from megagpt.run_log import quiet

    quiet.install()  # the other messages that do not apply to this install

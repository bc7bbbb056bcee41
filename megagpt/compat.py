"""Compatibility with what is installed: the megatron-core wheel with or without TE / apex.

``Installed`` is what this Python environment has (TE, apex, megatron's CUDA extensions,
which optimizer kernels megatron bound); the launch's resolution decides from it
(``megagpt.launch.installed``, ``layers``, ``fp8``). Here are the changes inside megatron
that a plain ``pip install`` of the wheel needs while it runs (the launch's megatron changes
enter them):

1. ``initialize_megatron`` runs ``make`` on the dataset helpers; the wheel ships the
   compiled ``helpers_cpp`` but no Makefile, so the compile step is skipped when the
   extension imports (``dataset_helpers_prebuilt``).
2. megatron's distributed optimizer cannot load a checkpoint without TE or apex
   (``distributed_optimizer_resuming``).
3. Under TE's layers without apex, megatron's own linear layers are built without
   gradient-accumulation fusion (``megatron_linears_without_wgrad_fusion``).
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

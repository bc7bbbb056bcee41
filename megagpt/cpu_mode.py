"""CPU development mode: run megatron.training.pretrain on a CPU with gloo, in fp32.

Megatron assumes CUDA throughout: tensors are created with ``device="cuda"`` or
``device=torch.cuda.current_device()``, streams and events are used for overlap, and
RNG state is read from the CUDA generator. Rather than patch each of those call sites
(there are dozens across training/, optimizer/, distributed/), CPU mode does four things:

1. ``CudaToCpu`` — a ``TorchFunctionMode`` that rewrites every CUDA device argument of a
   torch call (factory functions, ``Tensor.to``, ``Tensor.cuda``) to the CPU.
2. ``torch.cuda`` shims — device queries, streams, events, RNG state and memory
   statistics become CPU-safe stand-ins while CPU mode is active; ``torch.load`` maps
   what it reads to the CPU where its caller names no place (a checkpoint saved on a GPU).
3. A few argument settings (gloo, fp32, no-op CUDA RNG tracker) chosen in ``adapt_args``.
4. Where Transformer Engine (or apex) is installed, megatron's optimizer modules get its own
   torch fallbacks back in place of their CUDA-only kernels (``_torch_optimizer_kernels``).

Every megatron-core site this changes is declared here (``MEGATRON_CHANGES``), and every one
it covers is listed in ``megagpt.megatron_ledger`` (owner ``megagpt.cpu_mode``), with the text
it depends on; ``tests/test_megatron_ledger.py`` fails when an upgrade changes or removes one,
so a stale workaround is noticed. Nothing here
is for speed: it exists so the same entry, hooks and ``pretrain`` run on a laptop, in tests
and in CI.
"""

from __future__ import annotations

import contextlib
import types
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from megagpt import megatron_wrappers
from megagpt.errors import UserError
from megagpt.megatron_change import REPLACES, TRAINING, WRAPS, Change


# The torch.cuda.memory_stats counters megatron's training_log writes to TensorBoard.
MEMORY_STAT_KEYS = ("reserved_bytes.all.current", "allocated_bytes.all.current",
                    "allocated_bytes.all.peak", "allocation.all.current")


# ---------------------------------------------------------------------------
# 1. Device rewriting
# ---------------------------------------------------------------------------

def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # An int device means a CUDA ordinal (torch.cuda.current_device() returns 0 here).
    return isinstance(device, int) and not isinstance(device, bool)


_CPU = torch.device("cpu")


_BACKWARD_FUNCTIONS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)


@contextlib.contextmanager
def _current_device_is_the_cpu():
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


class CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to the CPU."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _BACKWARD_FUNCTIONS:
            # the engine runs the backward functions inside this handler, where the mode is
            # off: there the current device (0, a CUDA ordinal) must itself name the CPU
            with _current_device_is_the_cpu():
                return func(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # clip_grads asserts grads are 'torch.cuda.FloatTensor'; report CPU tensors as such.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func in (torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros) and args:
            args = tuple(_CPU if (i > 0 and _is_cuda_device(a)) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------
# 2. torch.cuda stand-ins
# ---------------------------------------------------------------------------

class _NullStream:
    """A stream that is always idle: work on the CPU runs in order anyway."""

    def __init__(self, *args, **kwargs):
        self.device = _CPU

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_NULL_STREAM = _NullStream()


def _returning(value):
    """A fresh function returning ``value`` (torch.compile's rule table rejects one function
    object registered under several torch.cuda names, so each stand-in is its own)."""
    def stand_in(*args, **kwargs):
        return value() if callable(value) else value
    return stand_in


def _cuda_stand_ins() -> dict[str, object]:
    props = types.SimpleNamespace(name="cpu", major=0, minor=0, total_memory=0,
                                  multi_processor_count=0)
    rng_state = _cuda_rng_state_stand_in
    stand_ins = {
        "device_count": 1,
        "current_device": 0,
        "get_device_properties": props,
        "get_device_capability": (0, 0),
        "get_device_name": "cpu",
        "current_stream": _NULL_STREAM,
        "default_stream": _NULL_STREAM,
        "stream": contextlib.nullcontext,
        "get_rng_state": rng_state,
        "get_rng_state_all": lambda: [rng_state()],
        "memory_stats": lambda: dict.fromkeys(MEMORY_STAT_KEYS, 0),
    }
    for zero in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        stand_ins[zero] = 0
    for noop in ("set_device", "synchronize", "empty_cache", "set_stream", "set_rng_state",
                 "set_rng_state_all", "manual_seed", "manual_seed_all",
                 "reset_peak_memory_stats", "reset_max_memory_allocated"):
        stand_ins[noop] = None
    functions = {name: _returning(value) for name, value in stand_ins.items()}
    functions["Stream"] = _NullStream
    functions["Event"] = _NullEvent
    return functions


class CpuRngTracker:
    """Megatron's RNG tracker for the CPU: named generator states that ``fork`` swaps in.

    Megatron keeps separate CUDA RNG streams for tensor-parallel regions (so dropout
    differs across TP ranks but matches across DP ranks). On the CPU every op draws from
    the CPU generator, so ``fork`` swaps the CPU generator's state instead. States are
    real tensors, saved and restored with checkpoints like the CUDA ones.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()
        self._is_initialized = False

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name, seed):
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _cuda_rng_state_stand_in(*args, **kwargs) -> torch.Tensor:
    """What megatron's recompute saves as "the CUDA generator's state" on the CPU."""
    return torch.zeros(16, dtype=torch.uint8)


# What ``_cpu_rng_tracker`` changes in megatron, in the order it installs it.
_RANDOM = "megatron.core.tensor_parallel.random."
RNG_TRACKER = (
    Change(_RANDOM + "_CUDA_RNG_STATE_TRACKER", REPLACES, __name__,
           does="CpuRngTracker",
           why="megatron's tracker forks CUDA generator states; CpuRngTracker forks the CPU "
               "generator's, saved and loaded with checkpoints as megatron's are",
           fingerprint="94e958de6074"),
    Change(_RANDOM + "_CUDA_RNG_STATE_TRACKER_INITIALIZED", REPLACES, __name__,
           does="True", why="set with the CPU tracker, so megatron does not build its own",
           fingerprint="95ac81d57dc3"),
    Change(_RANDOM + "_get_cuda_rng_state", REPLACES, __name__,
           does="a stand-in state (the CPU generator's, which dropout draws from here, is "
                "saved beside it)",
           why="activation recompute saves a CUDA generator state",
           fingerprint="0c2b8f05b864", needle="torch.cuda.random.get_rng_state(device=device)"),
    Change(_RANDOM + "_set_cuda_rng_state", REPLACES, __name__,
           does="nothing",
           why="activation recompute restores the CUDA generator state it saved; in CPU mode "
               "there is none to restore",
           fingerprint="dea947ca0b7d"),
)


@contextlib.contextmanager
def _cpu_rng_tracker():
    """megatron's CUDA RNG tracker, and the CUDA generator state activation recompute saves
    and restores, stood in for by CPU ones while the block runs."""
    import megatron.core.tensor_parallel.random as mrandom

    def no_cuda_state_to_set(*args, **kwargs):
        return None

    replacements = {
        "_CUDA_RNG_STATE_TRACKER": CpuRngTracker(),
        "_CUDA_RNG_STATE_TRACKER_INITIALIZED": True,
        "_get_cuda_rng_state": _cuda_rng_state_stand_in,
        "_set_cuda_rng_state": no_cuda_state_to_set,
    }
    with megatron_wrappers.wrapped(mrandom, [(name, __name__, megatron_wrappers.replacing(value))
                                             for name, value in replacements.items()]):
        yield


class CpuModeError(UserError, ValueError):
    """A setting that cannot run on a CPU was asked for."""


@contextlib.contextmanager
def generating():
    """``active()`` for megatron.core.inference too: its text-generation controller seeds a
    ``torch.Generator(device=torch.cuda.current_device())``, which needs a device torch can
    make a generator on; inside this context the current device is ``"cpu"`` (``active``
    alone answers 0, for megatron code that uses it as a CUDA ordinal)."""
    with active(), _current_device_is_the_cpu():
        yield


def _forking(original_get_process):
    """megatron starts its persistent checkpoint writer through a fork server, or, when it
    restarts it for the final save, by spawn: fork it instead, so it has these stand-ins."""
    def _get_process(cls, rank, mp_mode="spawn", *args, **kwargs):
        return original_get_process.__func__(cls, rank, "fork", *args, **kwargs)

    return classmethod(_get_process)


def _loading_onto_the_cpu(load: Callable) -> Callable:
    """``torch.load`` that puts tensors saved on a GPU on the CPU where its caller gives no
    ``map_location``. torch's distributed checkpoint reads the objects of a checkpoint (not
    its tensors) with a bare ``torch.load``, which restores a GPU run's CUDA tensors onto
    the GPU: on a CPU-only machine that fails, and on a machine with a GPU the rebuilt tensor
    is a CPU one (``CudaToCpu``) over CUDA storage, which torch refuses."""
    def load_onto_the_cpu(f, map_location=None, *args, **kwargs):
        return load(f, _CPU if map_location is None else map_location, *args, **kwargs)
    return load_onto_the_cpu


# What ``active`` changes in megatron besides the RNG tracker, in the order it installs it.
INITIALIZE_MEGATRON = Change(
    TRAINING + "initialize_megatron", WRAPS, __name__,
    does="passes allow_no_cuda=True",
    why="it asserts CUDA unless allow_no_cuda=True, which pretrain does not pass",
    fingerprint="1894d53ca729",
    needle='assert torch.cuda.is_available(), "Megatron requires CUDA."')
SET_JIT_FUSION_OPTIONS = Change(
    TRAINING + "set_jit_fusion_options", REPLACES, __name__,
    does="nothing",
    why="it warms up GPU fusion kernels; on a CPU it is skipped (torch.compile is off in CPU "
        "mode)",
    fingerprint="c1be95915ed4")
GET_PROCESS = Change(
    "megatron.core.dist_checkpointing.strategies.async_utils.PersistentAsyncCaller"
    "._get_process", REPLACES, __name__,
    does="forks the persistent checkpoint writer",
    why="it starts the writer by fork server or spawn; CPU mode's stand-ins reach it only in a "
        "forked process",
    fingerprint="d3c7da2097b2")
_FALLBACK = ("TE's multi-tensor kernel reads CUDA memory only (a CPU tensor is an illegal "
             "memory access on the GPU)")
# where megatron bound TE's or apex's kernels (``_torch_optimizer_kernels``), in its order
TORCH_FALLBACKS = tuple(
    Change(target, REPLACES, __name__, does=does, why=why, fingerprint=fingerprint)
    for target, does, why, fingerprint in (
        ("megatron.core.optimizer.Adam", "torch's AdamW, megatron's own fallback",
         "TE's FusedAdam steps CUDA tensors only", "8a40ef85203f"),
        ("megatron.core.optimizer.SGD", "torch's SGD", "TE's FusedSGD likewise", "dc17bf751abe"),
        ("megatron.core.optimizer.USING_PYTORCH_OPTIMIZER", "True",
         "with torch's optimizers, megatron then passes them their arguments", "e901a03a490f"),
        ("megatron.core.optimizer.clip_grads.multi_tensor_applier",
         "megatron's local fallback", _FALLBACK, "b93615652a38"),
        ("megatron.core.optimizer.clip_grads.l2_norm_impl",
         "megatron's local fallback", _FALLBACK, "27093e9af287"),
        ("megatron.core.optimizer.clip_grads.multi_tensor_scale_impl",
         "megatron's local fallback", _FALLBACK, "19c4e8618112"),
        ("megatron.core.optimizer.clip_grads.multi_tensor_scale_tensor_impl",
         "None, megatron's own without TE", _FALLBACK, "f2ef0c158231"),
        ("megatron.core.optimizer.optimizer.multi_tensor_applier",
         "megatron's local fallback", _FALLBACK, "2aff861f79ca"),
        ("megatron.core.optimizer.optimizer.multi_tensor_scale_impl",
         "megatron's local fallback", _FALLBACK, "19c4e8618112"),
        ("megatron.training.utils.common_utils.multi_tensor_applier",
         "megatron's local fallback", _FALLBACK, "5b95ab86582a"),
        ("megatron.training.utils.common_utils.multi_tensor_l2norm",
         "megatron's local fallback", _FALLBACK, "900df480fbd2")))
MEGATRON_CHANGES = (*RNG_TRACKER, INITIALIZE_MEGATRON, SET_JIT_FUSION_OPTIONS, GET_PROCESS,
                    *TORCH_FALLBACKS)


def _torch_optimizer_kernels(restore: bool) -> list[tuple[object, list]]:
    """megatron's own torch fallbacks in place of the Transformer Engine (or apex) kernels its
    optimizer modules bind at import when TE imports: FusedAdam and the multi-tensor norm,
    scale and copy kernels run on CUDA memory only, and given the CPU tensors of a CPU run
    they read host addresses on the GPU (an illegal memory access). ``restore``: whether
    megatron bound those kernels (nothing to do where it took the fallbacks itself).
    ``(module, [(name, owner, wrapper), ...])`` for ``megatron_wrappers.wrapped``."""
    import megatron.core.optimizer as mopt
    import megatron.core.optimizer.clip_grads as mclip
    import megatron.core.optimizer.optimizer as moo
    import megatron.training.utils.common_utils as mcommon
    from megatron.core import utils as mutils

    if not restore:
        return []
    applier = mutils.local_multi_tensor_applier
    l2norm, scale = mutils.local_multi_tensor_l2_norm, mutils.local_multi_tensor_scale
    swaps = {
        mopt: {"Adam": torch.optim.AdamW, "SGD": torch.optim.SGD,
               "USING_PYTORCH_OPTIMIZER": True},
        mclip: {"multi_tensor_applier": applier, "l2_norm_impl": l2norm,
                "multi_tensor_scale_impl": scale, "multi_tensor_scale_tensor_impl": None},
        moo: {"multi_tensor_applier": applier, "multi_tensor_scale_impl": scale},
        mcommon: {"multi_tensor_applier": applier, "multi_tensor_l2norm": l2norm},
    }
    return [(module, [(name, __name__, megatron_wrappers.replacing(value))
                      for name, value in names.items()])
            for module, names in swaps.items()]


@contextlib.contextmanager
def active(optimizer_fallbacks: bool | None = None):
    """Run the enclosed megatron code on the CPU (see the module docstring), these changes
    in this order: megatron's CUDA RNG tracker, its start-up and jit warm-up, the checkpoint
    writer's start, megatron's torch fallbacks in its optimizer modules (``optimizer_fallbacks``:
    where megatron bound TE's or apex's CUDA-only kernels; None: asked of megatron; the launch
    passes its ``CPU optimizer`` choice), then torch's: ``torch.cuda``'s stand-ins,
    ``torch.load`` onto the CPU, torch.compile off and the device rewriting of every torch
    call (``CudaToCpu``)."""
    import megatron.training.training as mtraining
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    def allowing_no_cuda(initialize_megatron):
        def initialize_megatron_without_cuda(*args, **kwargs):
            kwargs["allow_no_cuda"] = True
            return initialize_megatron(*args, **kwargs)
        return initialize_megatron_without_cuda

    megatron_changes = [
        ("initialize_megatron", __name__, allowing_no_cuda),
        ("set_jit_fusion_options", __name__,
         megatron_wrappers.replacing(lambda *a, **k: None)),
    ]
    if optimizer_fallbacks is None:
        from megagpt.train_step.optimizer import megatron_uses_local_fallbacks

        optimizer_fallbacks = not megatron_uses_local_fallbacks()
    with contextlib.ExitStack() as changes:
        changes.enter_context(_cpu_rng_tracker())
        changes.enter_context(megatron_wrappers.wrapped(mtraining, megatron_changes))
        changes.enter_context(megatron_wrappers.wrapped(
            PersistentAsyncCaller, [("_get_process", __name__, _forking)]))
        for module, swaps in _torch_optimizer_kernels(optimizer_fallbacks):
            changes.enter_context(megatron_wrappers.wrapped(module, swaps))
        changes.enter_context(_torch_on_the_cpu())
        changes.enter_context(CudaToCpu())
        yield


@contextlib.contextmanager
def _torch_on_the_cpu():
    """``torch.cuda``'s stand-ins, ``torch.load`` onto the CPU and torch.compile off, for the
    duration of the block."""
    import torch._dynamo

    saved_cuda = {name: getattr(torch.cuda, name) for name in _cuda_stand_ins()}
    saved_load = torch.load
    saved_dynamo_disable = torch._dynamo.config.disable
    try:
        for name, stand_in in _cuda_stand_ins().items():
            setattr(torch.cuda, name, stand_in)
        torch.load = _loading_onto_the_cpu(saved_load)
        # torch.compile on a CPU needs a C++ toolchain and minutes of compiling, for no gain
        # in a development run; megatron's jit_fuser and the fast spec then run eagerly.
        torch._dynamo.config.disable = True
        yield
    finally:
        for name, original in saved_cuda.items():
            setattr(torch.cuda, name, original)
        torch.load = saved_load
        torch._dynamo.config.disable = saved_dynamo_disable

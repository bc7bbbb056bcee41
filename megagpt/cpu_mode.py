"""CPU development mode: run megatron.training.pretrain on a CPU with gloo, in fp32.

Megatron assumes CUDA throughout: tensors are created with ``device="cuda"`` or
``device=torch.cuda.current_device()``, streams and events are used for overlap, and
RNG state is read from the CUDA generator. Rather than patch each of those call sites
(there are dozens across training/, optimizer/, distributed/), CPU mode does three things:

1. ``CudaToCpu`` — a ``TorchFunctionMode`` that rewrites every CUDA device argument of a
   torch call (factory functions, ``Tensor.to``, ``Tensor.cuda``) to the CPU.
2. ``torch.cuda`` shims — device queries, streams, events, RNG state and memory
   statistics become CPU-safe stand-ins while CPU mode is active.
3. A few argument settings (gloo, fp32, no-op CUDA RNG tracker) chosen in ``adapt_args``.

Every megatron-core site this covers is listed in ``COVERED_SITES`` with the text it
depends on; ``tests/test_cpu_mode.py`` fails when an upgrade removes one, so a stale
workaround is noticed. Nothing here is for speed: it exists so the same entry, hooks
and ``pretrain`` run on a laptop, in tests and in CI.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from megagpt.errors import UserError


@dataclass(frozen=True)
class CoveredSite:
    """A megatron-core function that CPU mode makes work, and the CUDA use it relies on."""

    module: str
    function: str
    needle: str  # text in the function's source that the workaround exists for
    workaround: str


COVERED_SITES: tuple[CoveredSite, ...] = (
    CoveredSite("megatron.training.initialize", "initialize_megatron",
                'assert torch.cuda.is_available(), "Megatron requires CUDA."',
                "pretrain's initialize_megatron is called with allow_no_cuda=True"),
    CoveredSite("megatron.training.initialize", "_initialize_distributed",
                "if device_count > 0 and not skip_model_parallel_init:",
                "torch.cuda.device_count() reports one device so model-parallel groups are built"),
    CoveredSite("megatron.training.initialize", "_set_random_seed",
                "if torch.cuda.device_count() > 0:",
                "the CUDA RNG tracker is CpuRngTracker, which forks CPU generator states"),
    CoveredSite("megatron.core.tensor_parallel.random.CudaRNGStatesTracker", "add",
                "torch.cuda.get_rng_state()", "CpuRngTracker.add keeps a CPU generator state"),
    CoveredSite("megatron.training.checkpointing", "load_checkpoint",
                "if not rng_state['rng_tracker_states']:",
                "CpuRngTracker has real states, so a checkpoint's RNG state loads"),
    CoveredSite("megatron.training.training", "pretrain",
                "device='cuda'", "CudaToCpu rewrites the device of the start-time all-reduce"),
    CoveredSite("megatron.training.training", "pretrain",
                "set_jit_fusion_options(tp_size=args.tensor_model_parallel_size)",
                "skipped: it warms up GPU fusion kernels; torch.compile is off in CPU mode"),
    CoveredSite("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining",
                'device="cuda"', "CudaToCpu rewrites the device of the token counter"),
    CoveredSite("megatron.core.utils.GlobalMemoryBuffer", "get_tensor",
                "torch.cuda.current_device()", "CudaToCpu maps the current device (0) to the CPU"),
    CoveredSite("megatron.core.distributed.param_and_grad_buffer._ParamAndGradBuffer", "__init__",
                "torch.cuda.current_device()", "CudaToCpu places the gradient buffers on the CPU"),
    CoveredSite("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32",
                "device='cuda'", "CudaToCpu rewrites the device of the norm reduction"),
    CoveredSite("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32",
                "assert param.grad.type() == 'torch.cuda.FloatTensor'",
                "Tensor.type() of a CPU float tensor reports the CUDA type name"),
    CoveredSite("megatron.core.tensor_parallel.layers."
                "LinearWithGradAccumulationAndAsyncCommunication",
                "backward", "device=torch.cuda.current_device()",
                "in backward (run with the mode off) torch.cuda.current_device() names the CPU"),
    CoveredSite("megatron.training.checkpointing", "get_rng_state",
                "torch.cuda.get_rng_state()", "torch.cuda.get_rng_state returns the CPU-mode stand-in"),
    CoveredSite("megatron.core.tensor_parallel.random", "_get_cuda_rng_state",
                "torch.cuda.random.get_rng_state(device=device)",
                "activation recompute saves the CPU-mode stand-in instead of a CUDA generator "
                "state (the CPU generator's state, which dropout draws from here, is saved "
                "beside it)"),
    CoveredSite("megatron.training.initialize", "initialize_megatron",
                "init_persistent_async_worker(args.rank, 'forkserver')",
                "--async-save: the persistent checkpoint writer is forked, so it inherits these "
                "stand-ins (a fork server's fresh interpreter has none)"),
    CoveredSite("megatron.core.dist_checkpointing.strategies.async_utils.PersistentAsyncCaller",
                "schedule_async_call", "PersistentAsyncCaller._get_process(torch.distributed.get_rank())",
                "the writer restarted for the final save (megatron closes it when train() "
                "returns) is forked too, not spawned"),
    CoveredSite("megatron.core.dist_checkpointing.strategies.async_utils.PersistentAsyncCaller",
                "async_loop", "torch.cuda.set_device(rank % torch.cuda.device_count())",
                "the forked writer sees torch.cuda.device_count() == 1 (0 without CPU mode: a "
                "division by zero, after which the trainer waits for the writer forever)"),
    CoveredSite("megatron.training.training", "training_log",
                'mem_stats["reserved_bytes.all.current"]',
                "--log-memory-to-tensorboard: torch.cuda.memory_stats reports zeros for the "
                "counters megatron logs"),
)

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


def _install_rng_tracker() -> tuple:
    import megatron.core.tensor_parallel.random as mrandom

    saved = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED,
             mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom._get_cuda_rng_state = _cuda_rng_state_stand_in
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    return saved


def _restore_rng_tracker(saved: tuple) -> None:
    import megatron.core.tensor_parallel.random as mrandom

    (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED,
     mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state) = saved


# ---------------------------------------------------------------------------
# 3. Arguments and process setup
# ---------------------------------------------------------------------------

# Settings CPU mode cannot honour, with the message that names them.
_UNSUPPORTED = (
    ("bf16", "--bf16: bfloat16 training needs a GPU (megatron's mixed-precision optimizer "
             "checks for CUDA tensors); CPU mode trains in fp32"),
    ("fp16", "--fp16: half-precision training needs a GPU; CPU mode trains in fp32"),
    ("fp8", "--fp8-format: FP8 needs Transformer Engine on a GPU"),
)


class CpuModeError(UserError, ValueError):
    """A setting that cannot run on a CPU was asked for."""


def adapt_args(args, log: Callable[[str], None]) -> None:
    """Adjust parsed megatron arguments for a CPU run; raise CpuModeError on impossible ones."""
    problems = [msg for attr, msg in _UNSUPPORTED if getattr(args, attr, None)]
    if problems:
        raise CpuModeError("CPU mode (--cpu) cannot run with: " + "; ".join(problems))
    settings = {
        "distributed_backend": "gloo",
        "use_cpu_initialization": True,
        # Kernels that exist only on GPUs.
        "gradient_accumulation_fusion": False,
        "masked_softmax_fusion": False,
        "bias_gelu_fusion": False,
        "bias_swiglu_fusion": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
        "no_persist_layer_norm": True,
        "cross_entropy_loss_fusion": False,
    }
    for name, value in settings.items():
        if hasattr(args, name) and getattr(args, name) != value:
            setattr(args, name, value)
    if getattr(args, "transformer_impl", "local") != "local":
        log("cpu mode: --transformer-impl local (Transformer Engine kernels need a GPU)")
        args.transformer_impl = "local"
    log("cpu mode: gloo, fp32, CPU initialisation, GPU-only fusions off")


@contextlib.contextmanager
def _checkpoint_writer_forked():
    """megatron starts its persistent checkpoint writer through a fork server, or, when it
    restarts it for the final save, by spawn: fork it instead, so it has these stand-ins."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    original = PersistentAsyncCaller.__dict__["_get_process"]

    def _get_process(cls, rank, mp_mode="spawn", *args, **kwargs):
        return original.__func__(cls, rank, "fork", *args, **kwargs)

    PersistentAsyncCaller._get_process = classmethod(_get_process)
    try:
        yield
    finally:
        PersistentAsyncCaller._get_process = original


@contextlib.contextmanager
def active():
    """Run the enclosed megatron code on the CPU (see the module docstring)."""
    import megatron.training.training as mtraining

    import torch._dynamo

    saved_cuda = {name: getattr(torch.cuda, name) for name in _cuda_stand_ins()}
    saved_init = mtraining.initialize_megatron
    original_init = saved_init
    saved_jit_options = mtraining.set_jit_fusion_options
    saved_dynamo_disable = torch._dynamo.config.disable
    saved_tracker = _install_rng_tracker()

    def initialize_megatron_without_cuda(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original_init(*args, **kwargs)

    try:
        for name, stand_in in _cuda_stand_ins().items():
            setattr(torch.cuda, name, stand_in)
        mtraining.initialize_megatron = initialize_megatron_without_cuda
        mtraining.set_jit_fusion_options = lambda *a, **k: None
        # torch.compile on a CPU needs a C++ toolchain and minutes of compiling, for no gain
        # in a development run; megatron's jit_fuser and the fast spec then run eagerly.
        torch._dynamo.config.disable = True
        with _checkpoint_writer_forked(), CudaToCpu():
            yield
    finally:
        for name, original in saved_cuda.items():
            setattr(torch.cuda, name, original)
        mtraining.initialize_megatron = saved_init
        mtraining.set_jit_fusion_options = saved_jit_options
        torch._dynamo.config.disable = saved_dynamo_disable
        _restore_rng_tracker(saved_tracker)

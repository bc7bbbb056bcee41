"""Everything a launch changes inside megatron and torch, as one ordered table: one context
around megatron's ``pretrain``, its pieces entered in the table's order and undone on exit.

``PIECES`` is the table. A piece is one owner's context (``enter``: built from the launch,
megatron's validated arguments and what the entry hands ``launched``), entered where its
condition holds (``when``); its ``changes`` are the records of what it installs on megatron's
attributes (``megagpt.megatron_change.Change``, each declared beside the code that makes
it), in the order it installs them, each with the condition under which it does. Where two
changes wrap one megatron function, the one installed first is inside, next to megatron's
(``megagpt.megatron_wrappers``): a record names the owners it must wrap (``outside``), and a
piece says why it stands where it does (``order``). ``pieces`` and ``launched`` enter it;
``entered`` says, for a launch, what it enters and installs, without entering anything;
``megagpt.megatron_ledger`` lists its records; ``docs/step.md`` is written from it
(``python -m megagpt.launch.step_doc``). ``tests/test_step_table.py`` enters the pieces of
several launches for real and holds what they install against ``entered``.

The conditions (``When``) and the adapters that build each piece's arguments are the one
place the table reads the launch.

Outside this context the project changes megatron only around one call (the ledger's
``AROUND_A_CALL``): megatron's ``validate_args`` where no GPU answers, the preflight's
schedule check, the scheduling of an asynchronous save, the tools' generation on the CPU
(``cpu_mode.generating``, with CPU mode's records below); and megatron's own global
tokenizer, which megatron clears itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator, Optional

from megagpt import compat, cpu_mode, diagnostics, resilience, run_log
from megagpt.diagnostics import stragglers, timeouts
from megagpt.megatron_change import Change
from megagpt.resilience import (checkpoint_guard, checkpoint_integrity, config_snapshot,
                                divergence, fidelity, interrupt, optimizer_groups,
                                precision_change, worker_deaths)
from megagpt.train_step import async_step, capture_watchdog, flat_adam, grad_write
from megagpt.train_step import optimizer as fast_optimizer

from . import writer
from .cpu import CPU_OPTIMIZER, CpuOptimizer
from .cuda_graphs import CUDA_GRAPH, NAN_CHECK, CudaGraph, NanCheck
from .diagnostics import DIAGNOSTICS
from .fast_path import GRAD_WRITE
from .fp8 import FP8
from .installed import MEGATRON_LINEARS_WGRAD
from .optimizer_kernels import ASYNC_STEP, OPTIMIZER, OptimizerKernels
from .plan import Launch


# --- the table's types ----------------------------------------------------------------------

@dataclass(frozen=True)
class When:
    """A condition over the launch as it is entered: ``holds(launch, cpu)``, ``cpu`` being
    megatron's validated ``--cpu``; ``text`` says it in a few words."""

    text: str
    holds: Callable[[Launch, bool], bool]

    def __and__(self, other: "When") -> "When":
        return When(f"{self.text}, {other.text}",
                    lambda launch, cpu: self.holds(launch, cpu) and other.holds(launch, cpu))


@dataclass(frozen=True)
class Entering:
    """What a piece's context is built from (``launched``'s arguments)."""

    launch: Launch
    args: object  # megatron's validated arguments
    container: object  # megatron's config container, which the configuration snapshot writes
    log: Callable[[str], None]
    memory_knobs: object  # for the out-of-memory line (``launched``)

    def holds(self, when: "When") -> bool:
        return when.holds(self.launch, bool(self.args.cpu))


@dataclass(frozen=True)
class Piece:
    """One context of the table (see the module docstring)."""

    name: str
    owner: str  # the module whose context it is
    does: str
    when: When
    enter: Callable[[Entering], ContextManager]
    changes: tuple[tuple[Change, When], ...]  # what it installs, in order, and when
    order: str  # why it stands where it does
    # the line logged where the piece is not entered (None: nothing to say)
    left_out: Callable[[Entering], Optional[str]] = lambda e: None


def each(when: When, *changes: Change) -> tuple[tuple[Change, When], ...]:
    """Rows of a piece's ``changes``: each of ``changes``, made ``when``."""
    return tuple((change, when) for change in changes)


# --- when each applies: the one place the table reads the launch ------------------------------

ALWAYS = When("always", lambda launch, cpu: True)
ON_THE_CPU = When("with --cpu", lambda launch, cpu: cpu)
HELPERS_BUILT = When("where megatron's dataset helpers are prebuilt (the wheel)",
                     lambda launch, cpu: compat.dataset_helpers_built())
MEGATRONS_TORCH_FALLBACKS = When(
    "where megatron's optimizer took its torch fallbacks (neither TE nor apex)",
    lambda launch, cpu: not launch.installed.megatron_fused_optimizer)
NO_TENSOR_SCALE_KERNEL = When(
    "where megatron has no tensor-scale kernel (TE's)",
    lambda launch, cpu: not (launch.installed.transformer_engine
                             and launch.installed.megatron_fused_optimizer))
WGRAD_THROUGH_AUTOGRAD = When("under TE's layers without apex",
                              lambda launch, cpu: launch.made(MEGATRON_LINEARS_WGRAD))
FULL_ITERATION_GRAPH = When(
    "with the full-iteration CUDA graph, on a GPU",
    lambda launch, cpu: launch[CUDA_GRAPH] is CudaGraph.FULL_ITERATION and not cpu)
GRADIENTS_WRITTEN = When("where gradients are written: one micro-batch, one data-parallel rank",
                         lambda launch, cpu: launch[GRAD_WRITE])
FAST_OPTIMIZER = When("with the fast optimizer (not --fast-disable optimizer)",
                      lambda launch, cpu: launch[OPTIMIZER] is not OptimizerKernels.MEGATRONS)
FUSED_ADAMW = When("with torch's fused AdamW",
                   lambda launch, cpu: launch[OPTIMIZER].fused)
FLAT_ADAMW = When("with the flat AdamW step",
                  lambda launch, cpu: launch[OPTIMIZER] is OptimizerKernels.FLAT_ADAMW)
ASYNCHRONOUS = When("with the asynchronous step (not --fast-disable async-step)",
                    lambda launch, cpu: launch[ASYNC_STEP])
GRAD_NORM_GUARD = When(
    "where the NaN check is the gradient norm (megatron's in-step checks off)",
    lambda launch, cpu: launch[NAN_CHECK] is NanCheck.GRADIENT_NORM)
DIAGNOSED = When("where the launch chose its diagnostics",
                 lambda launch, cpu: launch.made(DIAGNOSTICS))
CPU_FALLBACKS = When(
    "where megatron bound TE's or apex's kernels",
    lambda launch, cpu: launch[CPU_OPTIMIZER] is CpuOptimizer.MEGATRONS_FALLBACKS)


# --- each piece's arguments, from the launch --------------------------------------------------

def _capture_deadline(e: Entering) -> ContextManager:
    timeout = float(getattr(e.args, "fast_cuda_graph_capture_timeout", 300))
    return capture_watchdog.deadline(timeout, e.log)


def _optimizer_kernels(e: Entering) -> ContextManager:
    fused = e.holds(FUSED_ADAMW)
    if not fused:
        e.log(f"fast optimizer: {e.launch.choice(OPTIMIZER).reason}")
    return fast_optimizer.fast_kernels(
        e.launch.installed.megatron_fused_optimizer, fused_adam=fused, multi_tensor=True,
        tensor_clip=e.holds(ASYNCHRONOUS), log=e.log)


def _five_pass_step_kept(e: Entering) -> Optional[str]:
    if not e.holds(FUSED_ADAMW):
        return None
    return (f"fast optimizer: megatron's five-pass step kept "
            f"({e.launch.choice(OPTIMIZER).reason})")


def _host_waits_kept(e: Entering) -> Optional[str]:
    if not e.holds(FAST_OPTIMIZER):
        return None
    return "fast path: host synchronisations inside the step kept (--fast-disable async-step)"


def _resilience(e: Entering) -> ContextManager:
    return resilience.active(e.args, writer.load_earlier, e.container,
                             grad_norm_guard=e.holds(GRAD_NORM_GUARD),
                             ckpt_step_given="--ckpt-step" in e.launch.given)


def _diagnostics(e: Entering) -> ContextManager:
    return diagnostics.active(e.args, e.launch[DIAGNOSTICS],
                              e.memory_knobs)


def _cpu_mode(e: Entering) -> ContextManager:
    return cpu_mode.active(optimizer_fallbacks=e.holds(CPU_FALLBACKS))


# --- the table ------------------------------------------------------------------------------

PIECES: tuple[Piece, ...] = (
    # 1. the wheel's needs (compat)
    Piece("dataset helpers prebuilt", compat.__name__,
          "initialize_megatron does not try to compile the wheel's prebuilt dataset helpers",
          ALWAYS, lambda e: compat.dataset_helpers_prebuilt(),
          each(HELPERS_BUILT, compat.COMPILE_HELPERS),
          "first: what the installed wheel needs before anything of megatron runs"),
    Piece("distributed optimizer resumes", compat.__name__,
          "megatron's distributed optimizer loads a checkpoint without TE or apex",
          ALWAYS, lambda e: compat.distributed_optimizer_resuming(e.log),
          each(MEGATRONS_TORCH_FALLBACKS, compat.SHARDED_STATE_DICT,
               compat.SET_MAIN_PARAM_AND_OPTIMIZER_STATES, compat.DISTRIBUTED_LOAD_STATE_DICT),
          "the wheel's needs: next to megatron's loader, inside resilience's wrappers of it"),
    Piece("megatron's linears without wgrad fusion", compat.__name__,
          "megatron's own linear layers are built without gradient-accumulation fusion",
          WGRAD_THROUGH_AUTOGRAD, lambda e: compat.megatron_linears_without_wgrad_fusion(),
          each(ALWAYS, compat.COLUMN_PARALLEL_LINEAR, compat.ROW_PARALLEL_LINEAR),
          "the wheel's needs: before the model is built"),
    # 2. the fast path's step, as the launch chose it (train_step)
    Piece("capture deadline", capture_watchdog.__name__,
          "the full-iteration graph's capture runs under a deadline",
          FULL_ITERATION_GRAPH, _capture_deadline,
          each(ALWAYS, capture_watchdog.FULL_CUDA_GRAPH_CALL),
          "the fast path's step: nothing else wraps the graph's call"),
    Piece("gradients written", grad_write.__name__,
          "each gradient is written into megatron's buffer instead of added to its zeros",
          GRADIENTS_WRITTEN, lambda e: grad_write.writing(e.log),
          each(ALWAYS, grad_write.BACKWARD_POST_HOOK, grad_write.ZERO_GRAD_BUFFER,
               grad_write.FINISH_GRAD_SYNC),
          "the fast path's step: before the model is wrapped in DDP, whose hooks it makes"),
    Piece("optimizer kernels", fast_optimizer.__name__,
          "torch's fused AdamW and foreach kernels in megatron's optimizer modules",
          FAST_OPTIMIZER, _optimizer_kernels,
          (*each(FUSED_ADAMW, fast_optimizer.ADAM, fast_optimizer.USING_PYTORCH_OPTIMIZER),
           *each(MEGATRONS_TORCH_FALLBACKS, fast_optimizer.L2_NORM, fast_optimizer.CLIP_SCALE,
                 fast_optimizer.OPTIMIZER_SCALE),
           *each(ALWAYS, fast_optimizer.COPY_THIS_TO_THAT, fast_optimizer.COPY_MODEL_GRADS),
           *each(ASYNCHRONOUS & NO_TENSOR_SCALE_KERNEL, fast_optimizer.CLIP_SCALE_TENSOR)),
          "the fast path's step: before setup_model_and_optimizer builds the optimizer, and "
          "under CPU mode's fallbacks, which replace these where a CPU run needs them",
          left_out=lambda e: "fast optimizer: off (--fast-disable optimizer)"),
    Piece("flat AdamW step", flat_adam.__name__,
          "the optimizer megatron builds steps in one pass over flat buffers",
          FLAT_ADAMW, lambda e: flat_adam.flat_steps(e.log),
          each(ALWAYS, flat_adam.SETUP_MODEL_AND_OPTIMIZER),
          "the fast path's step: inside the asynchronous step's setup_model_and_optimizer, "
          "which reads the optimizer this one has finished",
          left_out=_five_pass_step_kept),
    Piece("asynchronous step", async_step.__name__,
          "no host synchronisation inside a step",
          FAST_OPTIMIZER & ASYNCHRONOUS, lambda e: async_step.without_host_waits(e.log),
          each(ALWAYS, async_step.REDUCE_MAX_STAT, async_step.LOGICAL_AND,
               async_step.ALL_GATHER_ITEM, async_step.TRAINING_LOG,
               async_step.SETUP_MODEL_AND_OPTIMIZER),
          "the fast path's step, last: outside the flat step's setup_model_and_optimizer, "
          "inside resume fidelity's training_log",
          left_out=_host_waits_kept),
    # 3. resilience (megagpt.resilience.active)
    Piece("resilience", resilience.__name__,
          "resume fidelity, one-line checkpoint errors, the configuration snapshot, "
          "checkpoint checksums, optimizer checkpoints of another precision or install, and "
          "the divergence guard",
          ALWAYS, _resilience,
          (*each(ALWAYS, fidelity.TRAINING_LOG, fidelity.DATA_ITERATORS,
                 worker_deaths.DATA_ITERATORS, checkpoint_guard.SAVE_CHECKPOINT,
                 config_snapshot.SAVE_CHECKPOINT, checkpoint_guard.LOAD_CHECKPOINT,
                 checkpoint_integrity.SAVE_CHECKPOINT, checkpoint_integrity.LOAD_CHECKPOINT),
           *each(GRAD_NORM_GUARD, divergence.TRAIN_STEP, divergence.SAVE_CHECKPOINT),
           *each(ALWAYS, precision_change.FP32_LOAD_STATE_DICT,
                 *optimizer_groups.LOAD_STATE_DICTS)),
          "after the fast path's step: resume fidelity's training_log outside the "
          "asynchronous step's (it rebinds the arguments megatron's function receives)"),
    # 4. the diagnostics (megagpt.diagnostics.active)
    Piece("diagnostics", diagnostics.__name__,
          "the collective timeout tightened after the warm-up and relaxed during saves, the "
          "straggler report, a failed collective, a hang or an out-of-memory error as one line",
          DIAGNOSED, _diagnostics,
          each(ALWAYS, stragglers.TRAIN_STEP, stragglers.FINALIZE_MODEL_GRADS,
               diagnostics.POST_TRAINING_STEP_CALLBACKS, timeouts.SAVE_CHECKPOINT),
          "after resilience: the relaxed timeout outside every save wrapper (the checksums' "
          "gather and the divergence guard's check are part of the save), the step's clock "
          "outside the divergence guard (its host read counts in the step)"),
    # 5. Ctrl-C, and the run's log and files
    Piece("Ctrl-C saves", interrupt.__name__,
          "Ctrl-C is megatron's exit signal where the run saves (a SIGINT handler that sets "
          "megatron's signal handler's flag; no megatron attribute changes)",
          ALWAYS, lambda e: interrupt.saving_on_ctrl_c(e.args, e.log), (),
          "megatron's globals, its signal handler among them, are set before the context"),
    Piece("run log", run_log.__name__,
          "the entry's iteration line through megatron's print_rank_last, megatron's argument "
          "table and the training plot in the run folder",
          ALWAYS, lambda e: run_log.active(e.args, e.log, fp8=e.launch[FP8] is not None),
          (*each(ALWAYS, run_log.PRINT_RANK_LAST), *each(ON_THE_CPU, run_log.REPORT_MEMORY)),
          "nothing else wraps what it wraps"),
    # 6. CPU mode, last
    Piece("CPU mode", cpu_mode.__name__,
          "megatron's and torch's stand-ins for CUDA (megagpt.cpu_mode)",
          ON_THE_CPU, _cpu_mode,
          (*each(ALWAYS, *cpu_mode.RNG_TRACKER, cpu_mode.INITIALIZE_MEGATRON,
                 cpu_mode.SET_JIT_FUSION_OPTIONS, cpu_mode.GET_PROCESS),
           *each(CPU_FALLBACKS, *cpu_mode.TORCH_FALLBACKS)),
          "last: its torch fallbacks replace whatever megatron's optimizer module holds "
          "(CUDA-only kernels cannot step a CPU run's tensors), and its device rewriting sees "
          "every call"),
)

# every change the table can enter, in its order
CHANGES: tuple[Change, ...] = tuple(change for piece in PIECES for change, _ in piece.changes)


def entered(launch: Launch, cpu: bool) -> list[tuple[Piece, tuple[Change, ...]]]:
    """The pieces ``launch`` enters, in order, each with the changes it installs, in order
    (``cpu``: megatron's validated ``--cpu``); nothing is entered."""
    return [(piece, tuple(change for change, when in piece.changes
                          if when.holds(launch, cpu)))
            for piece in PIECES if piece.when.holds(launch, cpu)]


def pieces(launch: Launch, args, container=None,
           log: Callable[[str], None] = lambda line: None, memory_knobs=None
           ) -> list[tuple[str, ContextManager]]:
    """(name, context) of each piece the launch enters, in the table's order
    (``memory_knobs``: for the out-of-memory line, as ``launched`` takes it)."""
    entering = Entering(launch, args, container, log, memory_knobs)
    out: list[tuple[str, ContextManager]] = []
    for piece in PIECES:
        if entering.holds(piece.when):
            out.append((piece.name, piece.enter(entering)))
        elif (line := piece.left_out(entering)) is not None:
            log(line)
    return out


@contextlib.contextmanager
def launched(launch: Launch, args, container=None,
             log: Optional[Callable[[str], None]] = None, memory_knobs=None) -> Iterator[None]:
    """Every change ``launch`` makes inside megatron and torch, for the duration of the block
    (``args``: its validated arguments; ``container``: megatron's config container, which the
    configuration snapshot writes beside each checkpoint; ``memory_knobs(args)``: the dry
    run's estimate and what lowers it, which the out-of-memory line names — the entry hands
    in ``megagpt.preflight.memory_knobs.memory_knobs``, a floor above this package)."""
    with contextlib.ExitStack() as changes:
        for _, change in pieces(launch, args, container, log or (lambda line: None),
                                memory_knobs):
            changes.enter_context(change)
        yield

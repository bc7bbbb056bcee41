"""Everything a launch changes inside megatron and torch: one context around megatron's
``pretrain``, entered in the order stated here, and undone on exit.

What is entered is the launch's choice (``Launch``); the order is this one, and where two
pieces wrap one megatron function the one entered first is inside, next to megatron's
(``megatron_wrappers`` composes in the order of installation):

  1. the wheel's needs (``compat``): the dataset helpers prebuilt; the distributed
     optimizer's resume without TE or apex; megatron's own linears built without
     gradient-accumulation fusion where the launch chose it (TE's layers without apex);
  2. the fast path's step (``train_step``), as the launch chose it: the deadline on the
     full-iteration graph's capture; gradients written; the optimizer's kernels; the flat
     AdamW step; the asynchronous step (outside the flat step's ``setup_model_and_optimizer``:
     it reads the optimizer that one has finished);
  3. resilience (``resilience.active``): resume fidelity (outside the asynchronous step's
     ``training_log``: it rebinds the arguments megatron's function receives), the
     configuration snapshot, one-line load errors, a mixed-precision checkpoint resumed in
     fp32, and where the launch's NaN check is the gradient norm the divergence guard
     (outside the snapshot's ``save_checkpoint``: no snapshot of a save it refuses);
  4. the diagnostics (``diagnostics.active``): the collective timeout tightened after the
     warm-up and relaxed during saves (outside resilience's ``save_checkpoint``: the
     checksums' gather and the divergence guard's check are part of the save), the straggler
     report (outside the divergence guard's ``train_step``: its host read of the gradient
     norm counts in the step), a failed collective, a hang or an out-of-memory error as one
     line;
  5. Ctrl-C as megatron's exit signal where the run saves (``resilience.interrupt``), and the
     run's log and files (``run_log.active``: the iteration line through megatron's
     ``print_rank_last``, megatron's argument table and the plot in the run folder);
  6. CPU mode (``cpu_mode.active``, with ``--cpu``): megatron's and torch's stand-ins, last:
     its torch fallbacks then replace whatever megatron's optimizer module holds (CUDA-only
     kernels cannot step a CPU run's tensors), and its device rewriting sees every call.

Outside this context the project changes megatron only around a check: megatron's
``validate_args`` where no GPU answers (``arguments.validate_arguments``), the preflight's
schedule check (``preflight.schedule_check``) and the tools' generation on the CPU
(``cpu_mode.generating``); and megatron's own global tokenizer, which megatron clears itself
(``arguments.set_megatron_globals``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Optional

from megagpt import compat, cpu_mode, diagnostics, resilience, run_log
from megagpt.diagnostics import settings as diagnostics_settings
from megagpt.resilience import interrupt
from megagpt.train_step import async_step, capture_watchdog, flat_adam, grad_write
from megagpt.train_step import optimizer as fast_optimizer

from . import fast_path as chosen
from . import writer
from .planner import Launch


def pieces(launch: Launch, args, container=None,
           log: Callable[[str], None] = lambda line: None, memory_knobs=None
           ) -> list[tuple[str, ContextManager]]:
    """(name, context) of each change the launch makes, in the order they are entered
    (``memory_knobs``: for the out-of-memory line, as ``launched`` takes it)."""
    out: list[tuple[str, ContextManager]] = [
        ("dataset helpers prebuilt", compat.dataset_helpers_prebuilt()),
        ("distributed optimizer resumes", compat.distributed_optimizer_resuming(log)),
    ]
    if _made(launch, compat.MEGATRON_LINEARS_WGRAD):
        out.append(("megatron's linears without wgrad fusion",
                    compat.megatron_linears_without_wgrad_fusion()))
    if launch.value(chosen.CUDA_GRAPH) == chosen.FULL_ITERATION and not args.cpu:
        timeout = float(getattr(args, "fast_cuda_graph_capture_timeout", 300))
        out.append(("capture deadline", capture_watchdog.deadline(timeout, log)))
    if launch.value(chosen.GRAD_WRITE):
        out.append(("gradients written", grad_write.writing(log)))
    optimizer = launch.value(chosen.OPTIMIZER)
    asynchronous = bool(launch.value(chosen.ASYNC_STEP))
    if optimizer == chosen.MEGATRONS:
        log("fast optimizer: off (--fast-disable optimizer)")
    else:
        fused = optimizer in (chosen.FUSED_ADAMW, chosen.FLAT_ADAMW)
        if not fused:
            log(f"fast optimizer: {launch.choice(chosen.OPTIMIZER).reason}")
        out.append(("optimizer kernels", fast_optimizer.fast_kernels(
            launch.installed.megatron_fused_optimizer, fused_adam=fused, multi_tensor=True,
            tensor_clip=asynchronous, log=log)))
        if optimizer == chosen.FLAT_ADAMW:
            out.append(("flat AdamW step", flat_adam.flat_steps(log)))
        elif fused:
            log(f"fast optimizer: megatron's five-pass step kept "
                f"({launch.choice(chosen.OPTIMIZER).reason})")
        if asynchronous:
            out.append(("asynchronous step", async_step.without_host_waits(log)))
        else:
            log("fast path: host synchronisations inside the step kept "
                "(--fast-disable async-step)")
    out.append(("resilience", resilience.active(
        args, writer.load_earlier, container,
        grad_norm_guard=launch.value(chosen.NAN_CHECK) == chosen.GRADIENT_NORM,
        ckpt_step_given="--ckpt-step" in launch.given)))
    if _made(launch, diagnostics_settings.DIAGNOSTICS):
        out.append(("diagnostics", diagnostics.active(
            args, launch.value(diagnostics_settings.DIAGNOSTICS), memory_knobs)))
    out.append(("Ctrl-C saves", interrupt.saving_on_ctrl_c(args, log)))
    out.append(("run log", run_log.active(args, log)))
    if args.cpu:
        fallbacks = launch.value(cpu_mode.CPU_OPTIMIZER) == cpu_mode.MEGATRONS_FALLBACKS
        out.append(("CPU mode", cpu_mode.active(optimizer_fallbacks=fallbacks)))
    return out


def _made(launch: Launch, name: str) -> bool:
    return any(c.name == name for c in launch.choices)


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

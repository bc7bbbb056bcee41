"""The resilience of a launch, decided before megatron validates (steps of the resolution):
which writer saves asynchronously (``choose_writer``), SIGTERM saving and exiting where the
run saves (``choose_exit_signal_handler``) and the rerun mode on a fault
(``choose_rerun_mode``). What they do while the run trains is ``megagpt.resilience``'s.
"""

from __future__ import annotations

import signal

from megagpt.resilience import async_save

from .plan import Decision, Reason, Why

ASYNC_SAVE: Decision[str] = Decision("async save", str)
EXIT_SIGNAL: Decision[str] = Decision("exit signal", str)
RERUN_MODE: Decision[str] = Decision("rerun mode", str)


def choose_writer(p, nvrx_installed: bool | None = None) -> None:
    """The writer and the worker for ``--async-save`` (``resilience.async_save`` says why)."""
    args = p.v
    if not args.async_save or args.ckpt_format == "torch":
        return  # megatron's legacy format has no asynchronous save; it says so itself
    nvrx = async_save.resiliency_ext_installed() if nvrx_installed is None else nvrx_installed
    explicit = "--async-strategy" in p.given
    if args.async_strategy == "nvrx" and not nvrx:
        if explicit:
            raise async_save.AsyncSaveError(
                "--async-strategy nvrx needs nvidia-resiliency-ext, which is not installed: "
                "pip install 'megagpt[resilience]', or --async-strategy mcore (megatron's own "
                "writer)")
        p.set("async_strategy", "mcore")
        why = Reason(Why.INSTALLED, "nvidia-resiliency-ext is not installed; pip install "
                     "'megagpt[resilience]' for its writer")
    elif args.async_strategy == "nvrx" and getattr(args, "cpu", False):
        if explicit:
            raise async_save.AsyncSaveError(
                "--async-strategy nvrx: nvidia-resiliency-ext's writer process needs a GPU; "
                "in CPU mode use --async-strategy mcore")
        p.set("async_strategy", "mcore")
        why = Reason(Why.CPU, "CPU mode: nvidia-resiliency-ext's writer process needs a GPU")
    else:
        why = None
    worker = ""
    if not args.use_persistent_ckpt_worker:
        p.set("use_persistent_ckpt_worker", True)
        worker = (" in a persistent writer process (--use-persistent-ckpt-worker; without it "
                  "megatron 0.19 saves synchronously)")
    writer = ("nvidia-resiliency-ext's writer" if args.async_strategy == "nvrx"
              else "megatron's own writer (--async-strategy mcore)")
    if why is not None:
        reason = why
    elif worker:
        reason = Reason(Why.MEGATRON, "megatron 0.19 saves asynchronously only from a "
                        "persistent writer process")
    else:
        reason = Reason(Why.GIVEN, "as given")
    p.choose(ASYNC_SAVE, writer + (" in a persistent process" if worker else ""), reason)
    if why or worker:
        p.log(f"async save: {writer}{worker}" + (f"; {why}" if why else ""))


def choose_exit_signal_handler(p) -> None:
    """Turn on the exit-signal handler when the run saves checkpoints (megatron installs the
    handler when its globals are set; ``resilience.preemption`` says why)."""
    args = p.v
    name = signal.Signals(args.exit_signal).name
    if args.save and not args.exit_signal_handler:
        p.set("exit_signal_handler", True)
        p.choose(EXIT_SIGNAL, f"{name} saves and exits", Reason(
            Why.GIVEN, "--save is given (--exit-signal-handler)"))
        p.log(f"preemption: {name} saves a checkpoint to {args.save} and exits "
              "(--exit-signal-handler, on because --save is given)")
    elif args.exit_signal_handler and not args.save:
        p.log(f"preemption: {name} stops the run after the current iteration; "
              "nothing is saved (no --save)")


def choose_rerun_mode(p) -> None:
    """Stop on the first fault without saving, unless the user chose a rerun mode (after the
    fast path's steps: its CUDA graphs turn megatron's in-step checks off;
    ``resilience.divergence`` says why)."""
    args = p.v
    mode_given = "--rerun-mode" in p.given
    if not args.check_for_nan_in_loss_and_grad:
        if "--no-check-for-nan-in-loss-and-grad" in p.given:
            p.log("divergence: NaN/Inf checks are off (--no-check-for-nan-in-loss-and-grad)")
        else:
            # The fast path's CUDA graph cannot hold megatron's in-step checks; the gradient
            # norm, computed after the graph, is checked instead (grad_norm_guard).
            p.log("divergence: NaN/Inf in the gradient norm stops the run, naming that iteration "
                  "(checked after each step, or one step late while the norm stays on the GPU, and "
                  "always before a checkpoint is saved; megatron's in-step checks are off)")
        if not mode_given:
            # nothing is validated with the checks off, and a rerun state machine that is
            # not disabled all-reduces (and waits for) a flag before every step
            p.set("rerun_mode", "disabled")
            p.choose(RERUN_MODE, "disabled", Reason(
                Why.CONFLICT, "megatron's in-step checks are off: nothing to rerun, and its "
                "state machine would wait for a flag before every step"))
        return
    if mode_given or args.rerun_mode != "validate_results":
        return
    p.set("rerun_mode", "disabled")
    p.choose(RERUN_MODE, "disabled", Reason(
        Why.DEFAULT, "a fault stops the run at its iteration and saves nothing (--rerun-mode "
        "validate_results reruns it and saves)"))
    p.log("divergence: NaN/Inf in the loss or gradients stops the run at that iteration; "
          "no checkpoint is written (--rerun-mode disabled)")

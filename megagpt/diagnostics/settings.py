"""What a launch sets up for hangs, slow ranks and out-of-memory errors: one plan.

``plan_diagnostics(args, environ)`` reads the parsed arguments and the environment and
returns a frozen ``DiagnosticsPlan``; it changes nothing. The launch's resolution records it
(``megagpt.launch.diagnostics``): its argument changes and log lines go to the launch's writer,
and the plan itself is the launch's ``DIAGNOSTICS`` decision, which the training-time hooks
(``diagnostics.active``) and the dry run read.
What can only be decided once training runs (the collective timeout after the warm-up
iterations, which depends on the measured step time) is done by ``megagpt.diagnostics``'s
training-time hooks from the plan's policies, which the plan carries.

The choices:
  - torch's flight recorder on, its dumps written into the run's own folder (``--save``, else
    ``--tensorboard-dir``: ``flight_recorder/`` there), through megatron's
    ``--flight-recorder-dump-path`` (megatron
    then sets ``TORCH_FR_DUMP_TEMP_FILE``, ``TORCH_NCCL_TRACE_BUFFER_SIZE`` and
    ``TORCH_NCCL_DUMP_ON_TIMEOUT`` before it creates the process groups);
  - the collective timeout: ``--distributed-timeout-minutes`` for the warm-up iterations
    (compilation, graph capture, checkpoint loading), then one derived from the measured
    step time with a floor (``TimeoutPolicy``);
  - the straggler report's threshold and window (``StragglerPolicy``);
  - megatron's memory snapshot (``--record-memory-history``) written into the run's folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from megagpt.errors import UserError

# The collective timeout after the warm-up: this many times the slowest warm step (a step
# that takes ten times its usual time is not a slow step but a stuck one), and never less
# than the floor (a save, an evaluation or a data-loader stall between two collectives must
# not trip it).
STEP_TIMEOUT_MULTIPLE = 10
DEFAULT_TIMEOUT_FLOOR_S = 120.0
DEFAULT_WARMUP_ITERATIONS = 3
DEFAULT_STRAGGLER_PERCENT = 10.0
DEFAULT_STRAGGLER_WINDOW = 5

FLIGHT_RECORDER_FOLDER = "flight_recorder"
DUMP_FILE_PREFIX = "rank_"  # torch writes <prefix><global rank>
MEMORY_SNAPSHOT_FILE = "memory_snapshot.pickle"
MEGATRON_SNAPSHOT_DEFAULT = "snapshot.pickle"  # megatron's --memory-snapshot-path default

# The environment variables through which a user already points torch's recorder elsewhere
# (megatron keeps them over its flag's value: the environment comes first).
DUMP_PATH_VARIABLES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
BUFFER_SIZE_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


class DiagnosticsArgumentError(UserError, ValueError):
    """A diagnostics option (or megatron's straggler detector) that cannot be honoured."""


def add_arguments(group) -> None:
    """The entry's options for hangs and slow ranks (``megagpt.command_line.arguments`` adds
    them)."""
    group.add_argument("--no-flight-recorder", action="store_true",
                       help="Do not record collectives with torch's flight recorder (on by "
                            "default; its dumps go to --save's flight_recorder/ on a hang).")
    group.add_argument("--collective-timeout", type=str, default="auto", metavar="auto|off|S",
                       help="Collective timeout after the warm-up iterations: auto (the "
                            f"default: {STEP_TIMEOUT_MULTIPLE} x the slowest warm step, at "
                            "least --collective-timeout-floor), a number of seconds, or off "
                            "(keep --distributed-timeout-minutes throughout).")
    group.add_argument("--collective-timeout-floor", type=float,
                       default=DEFAULT_TIMEOUT_FLOOR_S, metavar="S",
                       help="The least timeout auto chooses, in seconds (default "
                            f"{DEFAULT_TIMEOUT_FLOOR_S:g}).")
    group.add_argument("--collective-timeout-warmup-iters", type=int,
                       default=DEFAULT_WARMUP_ITERATIONS, metavar="N",
                       help="Iterations after each (re)start that keep "
                            "--distributed-timeout-minutes (default "
                            f"{DEFAULT_WARMUP_ITERATIONS}).")
    group.add_argument("--straggler-threshold", type=float, default=DEFAULT_STRAGGLER_PERCENT,
                       metavar="PERCENT",
                       help="Name a rank whose compute per step is this much slower than the "
                            f"median rank's (default {DEFAULT_STRAGGLER_PERCENT:g} %; 0: no "
                            "straggler report).")
    group.add_argument("--straggler-window", type=int, default=DEFAULT_STRAGGLER_WINDOW,
                       metavar="N",
                       help="Log intervals the straggler report takes the median over "
                            f"(default {DEFAULT_STRAGGLER_WINDOW}).")


# ---------------------------------------------------------------------------
# Policies the training-time hooks follow
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class TimeoutPolicy:
    """The collective timeout over a run: ``launch_s`` until the warm-up iterations are done,
    then ``fixed_s``, or (``fixed_s`` None) the larger of ``floor_s`` and
    ``STEP_TIMEOUT_MULTIPLE`` times the slowest warm step after the first."""

    launch_s: float
    warmup_iterations: int  # of each launch: a resumed run compiles and loads again
    floor_s: float
    fixed_s: float | None = None
    tightens: bool = True  # False: off, or megatron's own --distributed-timeout-seconds-after-init

    def after_warmup(self, steady_step_seconds: list[float]) -> float:
        """The timeout after the warm-up, from the warm iterations after the first (the first
        compiles and captures: it says nothing about the others)."""
        if self.fixed_s is not None:
            return self.fixed_s
        return max(self.floor_s, STEP_TIMEOUT_MULTIPLE * max(steady_step_seconds, default=0.0))

    def describe(self, estimated_step_s: float | None = None) -> str:
        """One line for the log and the dry run."""
        launch = duration_text(self.launch_s) + " (--distributed-timeout-minutes)"
        if not self.tightens:
            return f"collective timeout: {launch} throughout"
        head = f"collective timeout: {launch} for the first {self.warmup_iterations} " \
               f"iteration{'s' if self.warmup_iterations > 1 else ''} of each launch, then "
        if self.fixed_s is not None:
            return head + f"{duration_text(self.fixed_s)} (--collective-timeout)"
        line = head + (f"max({duration_text(self.floor_s)}, {STEP_TIMEOUT_MULTIPLE} × the slowest "
                       "warm step after the first)")
        if estimated_step_s is not None:
            line += (f" = {duration_text(self.after_warmup([estimated_step_s]))}"
                     f" at the estimated {duration_text(estimated_step_s)} step")
        return line


@dataclass(frozen=True)
class StragglerPolicy:
    """A rank is named when its compute per step, as the median of the last ``window`` log
    intervals, is ``threshold`` (a fraction) or more above the median rank's."""

    threshold: float
    window: int

    @property
    def enabled(self) -> bool:
        return self.threshold > 0


@dataclass(frozen=True)
class DiagnosticsPlan:
    args: tuple[tuple[str, object], ...]  # (megatron argument, value), in the order decided
    environ: tuple[tuple[str, str], ...]
    log: tuple[str, ...]
    dump_prefix: str | None  # where torch writes rank r's dump: dump_prefix + str(r)
    timeout: TimeoutPolicy
    stragglers: StragglerPolicy

    def __str__(self) -> str:  # the launch's choice, as --dry-run prints it
        recorder = "flight recorder on" if self.dump_prefix else "flight recorder off"
        stragglers = (f"stragglers at {100 * self.stragglers.threshold:g} %"
                      if self.stragglers.enabled else "no straggler report")
        return f"{recorder}, {stragglers}"

    @property
    def dump_folder(self) -> str | None:
        if self.dump_prefix is None:
            return None
        return os.path.dirname(self.dump_prefix) or "."


# ---------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------

def plan_diagnostics(args, environ: Optional[Mapping[str, str]] = None) -> DiagnosticsPlan:
    """The diagnostics of this launch, from parsed arguments and the environment."""
    environ = os.environ if environ is None else environ
    refuse_megatron_straggler_detector(args)
    changes: list[tuple[str, object]] = []
    lines: list[str] = []

    prefix, recorder_line, recorder_changes = _flight_recorder(args, environ)
    changes += recorder_changes
    lines.append(recorder_line)

    timeout = timeout_policy(args)
    lines.append(timeout.describe())

    stragglers = straggler_policy(args)
    lines.append(f"stragglers: a rank {100 * stragglers.threshold:g} % or more slower than "
                 f"the median rank (compute per step, median of {stragglers.window} log "
                 "intervals) is named at the log interval" if stragglers.enabled
                 else "stragglers: not reported (--straggler-threshold 0)")

    snapshot = _memory_snapshot_path(args)
    if snapshot is not None:
        changes.append(("memory_snapshot_path", snapshot))
        lines.append(f"memory: --record-memory-history writes {snapshot} at each log interval "
                     "and a snapshot at an out-of-memory error beside it (torch's memory "
                     "viewer reads both)")
    return DiagnosticsPlan(tuple(changes), (), tuple(lines), prefix, timeout, stragglers)


def run_folder(args) -> str | None:
    """Where a run keeps what it writes besides the log (``megagpt.run_log``'s run folder:
    ``--save``, else ``--tensorboard-dir``)."""
    from megagpt.run_log.run_folder import run_folder as folder_of

    folder = folder_of(args)
    return str(folder) if folder is not None else None


def _flight_recorder(args, environ) -> tuple[str | None, str, list]:
    """(dump prefix, log line, argument changes) for torch's flight recorder."""
    if getattr(args, "no_flight_recorder", False):
        return None, "flight recorder: off (--no-flight-recorder)", []
    buffer_size = next((environ[v] for v in BUFFER_SIZE_VARIABLES if v in environ), None)
    if buffer_size is not None and buffer_size.strip() == "0":
        return None, "flight recorder: off (a trace buffer of 0 entries in the environment)", []
    from_environment = next((environ[v] for v in DUMP_PATH_VARIABLES if environ.get(v)), None)
    given = from_environment or args.flight_recorder_dump_path
    changes = [("flight_recorder_include_stack_trace", True)]  # the line names the call site
    if given:
        # megatron's rule: a directory gets its own prefix, anything else is the prefix
        prefix = os.path.join(given, "_dump_") if os.path.isdir(given) else given
        why = "environment" if from_environment else "--flight-recorder-dump-path"
        if not from_environment:
            changes.append(("flight_recorder_dump_path", prefix))
    else:
        folder = os.path.join(run_folder(args) or ".", FLIGHT_RECORDER_FOLDER)
        prefix = os.path.join(folder, DUMP_FILE_PREFIX)
        why = "the run's folder" if run_folder(args) else \
            "the working directory: no --save or --tensorboard-dir"
        changes.append(("flight_recorder_dump_path", prefix))
    size = buffer_size or str(args.flight_recorder_trace_buffer_size)
    line = (f"flight recorder: on, the last {size} collectives of every process group; a hang "
            f"dumps them to {prefix}<rank> ({why})")
    return prefix, line, changes


def timeout_policy(args) -> TimeoutPolicy:
    launch_s = 60.0 * args.distributed_timeout_minutes
    warmup = args.collective_timeout_warmup_iters
    floor = args.collective_timeout_floor
    if warmup < 1:
        raise DiagnosticsArgumentError(
            f"--collective-timeout-warmup-iters {warmup}: at least 1 (the first iteration "
            "compiles, captures graphs and loads checkpoints under the launch timeout)")
    if floor <= 0:
        raise DiagnosticsArgumentError(f"--collective-timeout-floor {floor:g}: a number of "
                                       "seconds above 0")
    after_init = getattr(args, "distributed_timeout_seconds_after_init", None)
    value = str(args.collective_timeout).strip().lower()
    if after_init is not None:
        if value != "auto":
            raise DiagnosticsArgumentError(
                f"--collective-timeout {args.collective_timeout} and megatron's "
                f"--distributed-timeout-seconds-after-init {after_init} both set the timeout "
                "after the first iterations: give one")
        # megatron applies its own after the first iteration; the entry stands aside
        return TimeoutPolicy(launch_s, 1, floor, fixed_s=float(after_init), tightens=False)
    if value == "off":
        return TimeoutPolicy(launch_s, warmup, floor, tightens=False)
    if value == "auto":
        return TimeoutPolicy(launch_s, warmup, floor)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise DiagnosticsArgumentError(
            f"--collective-timeout {args.collective_timeout}: auto, off or a number of seconds "
            "above 0")
    return TimeoutPolicy(launch_s, warmup, floor, fixed_s=seconds)


def straggler_policy(args) -> StragglerPolicy:
    threshold, window = args.straggler_threshold, args.straggler_window
    if threshold < 0:
        raise DiagnosticsArgumentError(f"--straggler-threshold {threshold:g}: a percentage, "
                                       "0 or more (0: no report)")
    if window < 1:
        raise DiagnosticsArgumentError(f"--straggler-window {window}: at least 1 log interval")
    return StragglerPolicy(threshold / 100.0, window)


def refuse_megatron_straggler_detector(args) -> None:
    """megatron's ``--log-straggler`` does not serve this entry; say why and what does."""
    if not getattr(args, "log_straggler", False):
        return
    raise DiagnosticsArgumentError(
        "--log-straggler: megatron's StragglerDetector times only the code an entry wraps in "
        "its start/stop calls (pretrain_gpt.py's hooks wrap none, so at the first log interval "
        "it divides by the zero seconds it timed), reads power and temperature through pynvml, "
        "is off without CUDA and listens on --straggler-ctrlr-port on rank 0. This entry names "
        "slow ranks itself at every log interval: drop the flag (--straggler-threshold sets "
        "the report's threshold; docs/debugging.md)")


def _memory_snapshot_path(args) -> str | None:
    """megatron's snapshot path, moved into the run's folder when it is megatron's default."""
    if not getattr(args, "record_memory_history", False):
        return None
    if args.memory_snapshot_path != MEGATRON_SNAPSHOT_DEFAULT or not run_folder(args):
        return args.memory_snapshot_path
    return os.path.join(run_folder(args), MEMORY_SNAPSHOT_FILE)


def duration_text(seconds: float) -> str:
    if seconds >= 300 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:.0f} s" if seconds >= 100 else f"{seconds:.3g} s"


"""``resolve(argv, installed, environ) -> Launch``: what a command line comes to on this
machine, decided once and changing nothing.

The command line is parsed once (``arguments.parse_command_line``) and its explicit flags read
once (``Launch.given``); then every step below runs in turn over one planner
(``planner.Planner``), reading what the steps before it decided and recording its own choices
with their reasons. ``writer.write`` applies the result to megatron's arguments and the
environment before megatron's ``validate_args``; what runs (the builders, the loss, the
megatron changes, the dry run) reads the ``Launch``.

The steps, in order (a step reads only what the steps above it decided):

  entry        how the processes meet: a launcher-free process's environment and in-memory
               store (``rendezvous``); a dry run's GPU count
  compat       the layers for what is installed (``layers.choose_transformer_impl``), the
               settings that need what is missing (``installed``); what no adaptation can
               rescue is refused, FP8 that nothing here runs too (``fp8``); apex's kernels
               that measured slower are left (``apex_kernels``)
  cpu mode     the settings of a ``--cpu`` run (``cpu``)
  compat       settings megatron's parser accepts and its code rejects (``megatron_quirks``)
  resilience   the asynchronous checkpoint writer (``resilience.choose_writer``)
  entry        the default tokenizer, the entry's limits, megatron's missing eval interval
  fast path    every choice of the fast path (``fast_path.STEPS``)
  resilience   the exit-signal handler with ``--save``, the rerun mode (after the fast path,
               whose CUDA graphs turn megatron's in-step checks off)
  diagnostics  torch's flight recorder into the run's folder, the collective timeout after the
               warm-up, the straggler report, megatron's memory snapshot path
  entry        CUDA_DEVICE_MAX_CONNECTIONS under tensor or context parallelism
  run log      megatron's settings that would print what does not apply here (one_logger)

A new concern adds its step to ``STEPS`` where what it reads has been decided.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Mapping, Optional

from megagpt import compat
from megagpt.command_line.arguments import parse_command_line
from megagpt.flags import explicit_flags

from . import (apex_kernels, cpu, diagnostics, entry_defaults, fast_path, fp8, installed, layers,
               megatron_quirks, rendezvous, resilience, run_log)
from .plan import Launch
from .planner import Planner

Step = Callable[[Planner], None]

STEPS: tuple[tuple[str, Step], ...] = (
    ("entry", rendezvous.choose_rendezvous),
    ("entry", entry_defaults.planned_world),
    ("compat", layers.choose_transformer_impl),
    ("compat", installed.adapt_to_installed),
    ("compat", installed.refuse_what_is_missing),
    ("compat", fp8.refuse_fp8_that_cannot_run),
    ("compat", apex_kernels.choose_persistent_layer_norm),
    ("cpu mode", cpu.adapt),
    ("compat", megatron_quirks.adapt_megatron_quirks),
    ("resilience", resilience.choose_writer),
    ("entry", entry_defaults.default_tokenizer),
    ("entry", entry_defaults.refuse_what_the_entry_cannot_run),
    ("entry", entry_defaults.eval_interval),
    *((fast_path.SECTION, step) for step in fast_path.STEPS),
    ("resilience", resilience.choose_exit_signal_handler),
    ("resilience", resilience.choose_rerun_mode),
    ("diagnostics", diagnostics.choose_diagnostics),
    ("entry", entry_defaults.device_connections),
    ("run log", run_log.choose_quiet_settings),
)


def run_steps(p: Planner, steps: Iterable[tuple[str, Step]]) -> Launch:
    """Each step over ``p`` in turn, under its section; the launch they decided."""
    for section, step in steps:
        p.section = section
        step(p)
    return p.launch()


def resolve(argv: Optional[list[str]] = None, installed=None,
            environ: Optional[Mapping[str, str]] = None,
            extra_args_provider: Optional[Callable] = None) -> Launch:
    """The launch ``argv`` asks for on this machine (changes nothing; ``UserError`` where it
    cannot run). ``installed``: ``compat.Installed`` (None: detected); ``environ``: the
    environment the launch starts in (None: ``os.environ``)."""
    args = parse_command_line(argv, extra_args_provider)
    installed = compat.Installed.detect() if installed is None else installed
    p = Planner(args, frozenset(explicit_flags(args.entry_argv)), installed,
                os.environ if environ is None else environ)
    p.log(f"installed: {installed.summary()}")
    return run_steps(p, STEPS)


def parse_arguments(argv: Optional[list[str]] = None,
                    extra_args_provider: Optional[Callable] = None):
    """megatron's arguments for ``argv`` as its launch writes them (not yet validated), for
    tools and tests that want the arguments alone; the entry keeps the ``Launch``."""
    from megagpt.log import log

    from .writer import write

    return write(resolve(argv, extra_args_provider=extra_args_provider), log=log)

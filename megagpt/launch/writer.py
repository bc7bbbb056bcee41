"""The one writer of a launch: what the resolution decided, into megatron's arguments and the
environment; and the two writes once megatron has validated them. ``written_for_the_block``
is the same write for a library call (the dry run's plan, a tool's model arguments), its
environment put back after.

``write(launch)`` applies a ``Launch`` in this order, before megatron's ``validate_args``:

  1. megatron's arguments (a copy of the parsed ones, or ``args`` where given), each once,
     in the order the resolution decided them;
  2. the environment (NCCL and CUDA read it when they start, later);
  3. the log lines, in the order the steps wrote them.

After ``validate_args`` megatron's arguments are written in two places only, both about the
checkpoint a resume loads, which megatron reads nowhere before it loads:

  ``after_validation(launch, args, log)``, before ``pretrain``: the checkpoint to resume
      (``--ckpt-step``, and ``--dist-ckpt-strictness`` for TE's layers), decided against the
      validated arguments and megatron's padded vocabulary (set with its globals)
      (``resilience.checkpoint_guard``);
  ``load_earlier(args, iteration)``, inside megatron's ``load_checkpoint`` once the process
      groups exist: where the checksums of the checkpoint to load do not match, the newest
      earlier intact one (``resilience.checkpoint_integrity``, which every rank decides
      together). megatron's ``load_checkpoint`` takes no iteration: it reads
      ``args.ckpt_step`` (``_load_base_checkpoint``), so the fallback is written there. The
      launch hands this function to the wrapper (``megatron_changes``).
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Callable, Iterator, MutableMapping, Optional

from .plan import Launch


def write(launch: Launch, args=None, environ: Optional[MutableMapping[str, str]] = None,
          log: Optional[Callable[[str], None]] = None):
    """``launch`` applied to ``args`` (default: a copy of the arguments it parsed) and
    ``environ`` (default ``os.environ``); returns the arguments."""
    args = copy.deepcopy(launch.parsed) if args is None else args
    environ = os.environ if environ is None else environ
    for name, value in launch.args:
        setattr(args, name, value)
    for name, value in launch.environ:
        environ[name] = value
    for line in launch.log:
        (log or (lambda line: None))(line)
    return args


def after_validation(launch: Launch, args, log: Callable[[str], None]) -> None:
    """The checkpoint a resume loads, checked against the validated ``args`` and written into
    them (the launch's one write after megatron's validation)."""
    from megagpt.resilience import checkpoint_guard

    for name, value in checkpoint_guard.prepare_load(args, launch.given, log).items():
        setattr(args, name, value)


def load_earlier(args, iteration: int) -> None:
    """The resume's fallback to ``iteration``, the newest earlier intact checkpoint, where
    the one it was to load is damaged: megatron's ``load_checkpoint`` reads the iteration from
    ``args.ckpt_step`` alone (the launch's second write after megatron's validation)."""
    args.ckpt_step = iteration


@contextlib.contextmanager
def written_for_the_block(launch: Launch, log: Optional[Callable[[str], None]] = None
                          ) -> Iterator:
    """``write(launch)`` for a library call inside a process that is not the launch (the dry
    run's plan, a tool's model arguments, a test): megatron's validation reads the launch's
    environment, which is set for the block and put back after. Left behind, its
    rendezvous variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR) would tell every
    process started from here later that a launcher started it (megagpt-check then skips
    its torchrun and waits for a MASTER_PORT nobody set). Yields the arguments."""
    before = {name: os.environ.get(name) for name, _ in launch.environ}
    try:
        yield write(launch, log=log)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

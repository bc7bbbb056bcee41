"""Preemption: SIGTERM (what SLURM and Kubernetes send before a kill) saves and exits.

Megatron has the mechanism: with ``--exit-signal-handler`` every rank records the signal,
the ranks agree after each iteration (an all-gather of one flag), save a checkpoint to
``--save`` and leave with status 0; the data-loader workers ignore the signal instead of
dying under the trainer. It is off by default. This entry turns it on whenever ``--save``
is given: a run that writes checkpoints should not lose the work since the last one to
a routine preemption. ``--exit-duration-in-mins`` and ``--exit-interval`` (megatron's)
save and exit the same way. The next launch with the same command continues from the
newest complete checkpoint (``--load`` = ``--save``; see ``checkpoint_guard``).

Under torchrun, SIGTERM to torchrun is forwarded to every worker, which then has 30 s
(torchrun's grace period) to save before it is killed; the checkpoint must fit in that.
"""

from __future__ import annotations

import signal
from typing import Callable


def apply_defaults(args, log: Callable[[str], None]) -> None:
    """Turn on the exit-signal handler when the run saves checkpoints.

    Works before or after megatron's globals are set: in the latter case the handler
    megatron would have installed in ``set_global_variables`` is installed here.
    """
    name = signal.Signals(args.exit_signal).name
    if args.save and not args.exit_signal_handler:
        args.exit_signal_handler = True
        _install_handler_if_globals_set(args)
        log(f"preemption: {name} saves a checkpoint to {args.save} and exits "
            "(--exit-signal-handler, on because --save is given)")
    elif args.exit_signal_handler and not args.save:
        log(f"preemption: {name} stops the run after the current iteration; "
            "nothing is saved (no --save)")


def _install_handler_if_globals_set(args) -> None:
    from megatron.training import global_vars

    if global_vars._GLOBAL_ARGS is not None and global_vars._GLOBAL_SIGNAL_HANDLER is None:
        global_vars._set_signal_handler(args.exit_signal)

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


def choose_exit_signal_handler(p) -> None:
    """Turn on the exit-signal handler when the run saves checkpoints (a step of the launch's
    resolution, over its planner ``p``: ``megagpt.launch.planner``; megatron installs the
    handler when its globals are set)."""
    args = p.v
    name = signal.Signals(args.exit_signal).name
    if args.save and not args.exit_signal_handler:
        p.set("exit_signal_handler", True)
        p.choose("exit signal", f"{name} saves and exits", "--save is given "
                 "(--exit-signal-handler)")
        p.log(f"preemption: {name} saves a checkpoint to {args.save} and exits "
              "(--exit-signal-handler, on because --save is given)")
    elif args.exit_signal_handler and not args.save:
        p.log(f"preemption: {name} stops the run after the current iteration; "
              "nothing is saved (no --save)")

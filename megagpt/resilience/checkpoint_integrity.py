"""Checkpoints that say when they are damaged: checksums at save, checked before a load,
and the loaded weights checked for NaN and Inf before the first step.

Two wrappers, installed by ``resilience.active`` around ``pretrain``:

``recording_checksums`` (megatron's ``save_checkpoint``)
    after every persistent save (for ``--async-save``: when the save is finalized), the
    ranks hash the files they wrote and rank 0 writes ``megagpt_checksums.json``
    (``checksums``). Never fails a save: a hashing error is one log line.
``verifying_checksums`` (megatron's ``load_checkpoint``)
    before megatron reads the checkpoint, the ranks check its files against the manifest,
    a share each. A file that does not match makes the checkpoint damaged: in the run's own
    ``--save`` directory it is moved to ``.megagpt-set-aside/`` and the tracker rewritten;
    the newest earlier complete and intact checkpoint is loaded instead (megatron's
    ``--ckpt-step``, written by the function the launch hands in: ``launch.writer
    .load_earlier``), with one log line naming the file. Where there is none, or the
    launch asked for that checkpoint with ``--ckpt-step``, a ``CheckpointError`` names the
    file. After the load, weights with NaN or Inf are a ``CheckpointError`` naming the
    checkpoint and the tensor, before any step could turn them into a diverging loss.

``--no-checkpoint-checksums`` turns both checksum passes off (the weight check stays).
"""

from __future__ import annotations

import functools
import os
from typing import Callable

from megagpt.megatron_change import TRAINING, WRAPS, Change
from megagpt.resilience import checkpoint_guard, checksums
from megagpt.resilience.checkpoint_guard import CheckpointError

FORMATS = ("torch_dist", "torch")  # the formats whose folders checkpoint_guard reads


def add_arguments(group) -> None:
    group.add_argument("--no-checkpoint-checksums", dest="checkpoint_checksums",
                       action="store_false",
                       help="Do not record a checksum of each checkpoint file at save, nor "
                            "check them before a load (docs/resume.md gives their cost).")


def enabled(args) -> bool:
    return getattr(args, "checkpoint_checksums", True) and args.ckpt_format in FORMATS


# ---------------------------------------------------------------------------
# At save
# ---------------------------------------------------------------------------

SAVE_CHECKPOINT = Change(
    TRAINING + "save_checkpoint", WRAPS, __name__,
    does="records the files' checksums after each persistent save",
    why="a shard overwritten in place keeps its length and loads as raw tensor bytes; the "
        "checksums let a load tell a damaged checkpoint; outside the snapshot's wrapper, so "
        "that the configuration snapshot is among the files hashed",
    fingerprint="42e813b3aa30", outside=("megagpt.resilience.config_snapshot",))
LOAD_CHECKPOINT = Change(
    TRAINING + "load_checkpoint", WRAPS, __name__,
    does="checks the files against their checksums first (a damaged checkpoint is set aside "
         "for the previous intact one), and the loaded weights for NaN and Inf after",
    why="megatron loads a damaged shard of the right length without noticing; outside the "
        "one-line errors' wrapper, which then names the checkpoint chosen here",
    fingerprint="ee0f61114e6f", outside=("megagpt.resilience.checkpoint_guard",))
MEGATRON_CHANGES = (SAVE_CHECKPOINT, LOAD_CHECKPOINT)


def recording_checksums(save_checkpoint, args, log: Callable[[str], None]):
    """Wrap megatron's ``save_checkpoint``: the manifest beside each persistent save."""

    @functools.wraps(save_checkpoint)
    def wrapper(iteration, *a, **kw):
        from megatron.training.checkpointing import get_checkpoint_name

        if kw.get("non_persistent_ckpt", False) or not args.save or not enabled(args):
            return save_checkpoint(iteration, *a, **kw)

        def record():
            folder = get_checkpoint_name(args.save, iteration, return_base_dir=True)
            try:
                summary = checksums.record_after_save(folder)
            except OSError as exc:  # the checkpoint itself is saved; say it is unchecked
                log(f"checksums: not recorded for {folder} ({exc}); it will load unchecked")
                return
            if summary is not None:
                log(f"checksums: {folder}: {summary.describe()}")

        if args.async_save:
            from megagpt.resilience.async_save import finalize_adds

            with finalize_adds(record):  # when the save is finalized, on every rank
                return save_checkpoint(iteration, *a, **kw)
        result = save_checkpoint(iteration, *a, **kw)
        record()
        return result

    wrapper._megagpt_original = save_checkpoint
    return wrapper


# ---------------------------------------------------------------------------
# Before and after a load
# ---------------------------------------------------------------------------

def _loaded_iteration(args, load_dir: str) -> int | str | None:
    """The iteration megatron's load_checkpoint will read from ``load_dir``."""
    if getattr(args, "ckpt_step", None):
        return int(args.ckpt_step)
    try:
        return checkpoint_guard.read_tracker(load_dir)
    except (OSError, ValueError):
        return None  # checkpoint_guard has repaired it or refused the launch


def _folder(load_dir: str, iteration: int | str) -> str:
    if iteration == "release":
        return os.path.join(load_dir, "release")
    return checkpoint_guard.iteration_dir(load_dir, iteration)


def _earlier_complete(load_dir: str, iteration: int) -> int | None:
    for candidate in sorted((i for i in checkpoint_guard.saved_iterations(load_dir)
                             if i < iteration), reverse=True):
        if checkpoint_guard.incompleteness(checkpoint_guard.iteration_dir(load_dir, candidate)) \
                is None:
            return candidate
    return None


def _barrier() -> None:
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


LoadEarlier = Callable[[object, int], None]  # (args, iteration): megatron loads that one


def choose_intact(args, load_dir: str, log: Callable[[str], None], load_earlier: LoadEarlier,
                  ckpt_step_given: bool = False) -> str | None:
    """Point megatron at the newest intact checkpoint of ``load_dir`` (every rank; a
    collective), through ``load_earlier`` where it is not the one megatron was to load.
    Returns its folder, or None when there is nothing to check. ``ckpt_step_given``: the
    user asked for the iteration (``--ckpt-step`` among the launch's explicit flags), rather
    than the resume's fallback writing it."""
    iteration = _loaded_iteration(args, load_dir)
    if iteration is None:
        return None  # nothing saved yet: megatron starts from scratch
    chosen_by_user = ckpt_step_given
    own = checkpoint_guard._same_dir(load_dir, getattr(args, "save", None))
    while True:
        folder = _folder(load_dir, iteration)
        mismatch, summary, recorded = checksums.verify_across_ranks(folder)
        if mismatch is None:
            if recorded:
                log(f"checksums: {folder} matches them ({summary.describe()})")
            else:
                log(f"checksums: {folder} has none ({checksums.MANIFEST}: saved by another "
                    "entry, with --no-checkpoint-checksums, or killed before writing it); "
                    "loaded unchecked")
            return folder
        earlier = _earlier_complete(load_dir, iteration) if isinstance(iteration, int) else None
        if chosen_by_user or earlier is None:
            why = ("--ckpt-step asked for it" if chosen_by_user
                   else "and no earlier complete checkpoint is there to fall back to")
            raise CheckpointError(f"--load {folder} is damaged: {mismatch}; {why}")
        if own:
            checkpoint_guard._set_aside(load_dir, (iteration,), lambda line: None)
            if checkpoint_guard._rank0():
                checkpoint_guard.write_tracker(load_dir, earlier)
            _barrier()
            where = f"moved to {os.path.join(load_dir, checkpoint_guard.SET_ASIDE)}"
        else:
            where = "left where it is (not this run's --save)"
        log(f"resume: {folder} is damaged: {mismatch}; {where}; loading iteration {earlier}, "
            "the newest earlier complete checkpoint, instead")
        load_earlier(args, earlier)
        iteration = earlier


def nonfinite_tensors(named_tensors) -> list[tuple[str, int, int]]:
    """(name, NaN count, Inf count) of every floating-point tensor that is not finite."""
    import torch

    bad = []
    for name, tensor in named_tensors:
        if not torch.is_floating_point(tensor) or bool(torch.isfinite(tensor).all()):
            continue
        while name.startswith("module."):  # megatron's DDP and Float16Module wrappers
            name = name[len("module."):]
        bad.append((name, int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())))
    return bad


def describe_nonfinite(bad: list[tuple[str, int, int]]) -> str:
    name, nans, infs = bad[0]
    counts = " and ".join(f"{n:,} {what}" for n, what in ((nans, "NaN"), (infs, "Inf")) if n)
    more = f", and {len(bad) - 1} more tensors" if len(bad) > 1 else ""
    return f"{name} holds {counts}{more}"


def _nonfinite_across_ranks(models) -> list[tuple[str, int, int]]:
    import torch

    local = [item for chunk in models for item in nonfinite_tensors(chunk.named_parameters())]
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, local)
        return [item for part in everyone for item in part]
    return local


def nonfinite_error(folder: str, bad, load_dir: str | None) -> CheckpointError:
    iteration = checkpoint_guard._ITER_DIR.match(os.path.basename(folder))
    earlier = (_earlier_complete(load_dir, int(iteration.group(1)))
               if load_dir and iteration else None)
    hint = (f"relaunch with --ckpt-step {earlier} to resume from the newest earlier one"
            if earlier is not None else "no earlier complete checkpoint is there")
    return CheckpointError(f"--load {folder} holds weights that are not finite "
                           f"({describe_nonfinite(bad)}): the checkpoint is damaged, or was "
                           f"saved by a run that had diverged; {hint}")


def verifying_checksums(load_checkpoint, args, log: Callable[[str], None],
                        load_earlier: LoadEarlier, ckpt_step_given: bool = False):
    """Wrap megatron's ``load_checkpoint`` (see the module docstring; ``load_earlier`` and
    ``ckpt_step_given`` as ``choose_intact`` takes them)."""

    @functools.wraps(load_checkpoint)
    def wrapper(ddp_model, *a, load_arg="load", **kw):
        load_dir = getattr(args, load_arg, None)
        folder = None
        if load_dir and args.ckpt_format in FORMATS:
            if enabled(args):
                folder = choose_intact(args, load_dir, log, load_earlier, ckpt_step_given)
            else:
                iteration = _loaded_iteration(args, load_dir)
                folder = _folder(load_dir, iteration) if iteration is not None else None
        result = load_checkpoint(ddp_model, *a, load_arg=load_arg, **kw)
        if folder is not None and not kw.get("skip_load_to_model_and_opt", False):
            bad = _nonfinite_across_ranks(ddp_model)
            if bad:
                raise nonfinite_error(folder, bad, load_dir)
        return result

    wrapper._megagpt_original = load_checkpoint
    return wrapper

"""Which checkpoint folder a ``--load`` names, and the configuration saved beside it.

``--load`` may name a run's ``--save`` directory (its tracker file names the iteration), one
``iter_XXXXXXX`` folder, or a ``release`` checkpoint (``tools/import_hf.py`` writes those).
In a run directory the tracker's iteration is used when it is complete, else the newest
complete one below it (``checkpoint_guard``'s rule for resuming). The folder's files are then
checked against the checksums recorded at save (``resilience.checksums``): in a run directory
a damaged checkpoint gives way to the newest earlier intact one, with a line on stderr (the
tools only read: nothing is moved); a damaged folder named itself is an error naming the
file. Nothing here imports torch beyond what ``checkpoint_guard`` needs to read an index: a
bad ``--load`` fails in a second (and in the time its checksums take).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import yaml

from megagpt.errors import UserError
from megagpt.resilience import checkpoint_guard, checksums, config_snapshot

RELEASE = "release"


class CheckpointError(UserError, ValueError):
    """--load names no usable checkpoint; the message says which path and why."""


@dataclass(frozen=True)
class SavedConfig:
    """What the trainer (or the importer) wrote beside a checkpoint."""

    entry: dict  # config_snapshot's "entry" section: model, tokenizer, layout, argv
    transformer: dict  # the container's model.transformer section ({} when absent)

    @property
    def model(self) -> dict:
        return self.entry.get("model") or {}

    @property
    def argv(self) -> list[str]:
        return [str(a) for a in self.entry.get("argv") or []]

    @property
    def tensor_parallel(self) -> int:
        return int((self.entry.get("layout") or {}).get("tensor_model_parallel_size") or 1)


def _is_checkpoint_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "metadata.json")) or \
        os.path.isfile(os.path.join(path, ".metadata"))


def checkpoint_folder(load: str) -> str:
    """The complete, intact checkpoint folder ``load`` names (see the module docstring)."""
    if not os.path.exists(load):
        raise CheckpointError(f"--load {load}: no such directory")
    if not os.path.isdir(load):
        raise CheckpointError(f"--load {load}: not a directory")
    if _is_checkpoint_folder(load):
        folder = load
    else:
        try:
            tracker = checkpoint_guard.read_tracker(load)
        except (OSError, ValueError) as exc:
            tracker = None
            if not checkpoint_guard.saved_iterations(load):
                raise CheckpointError(f"--load {load}: {exc}") from None
        if tracker == RELEASE:
            folder = os.path.join(load, RELEASE)
        elif tracker is None and not checkpoint_guard.saved_iterations(load):
            raise CheckpointError(
                f"--load {load}: no checkpoint there (no {checkpoint_guard.TRACKER}, no "
                f"iter_* folders); give a training run's --save directory or one iter_* folder")
        else:
            return _newest_intact(load, tracker)
    problem = checkpoint_guard.incompleteness(folder)
    if problem is not None:
        raise CheckpointError(f"--load {folder}: not a complete checkpoint ({problem})")
    mismatch, _ = checksums.verify(folder)
    if mismatch is not None:
        raise CheckpointError(f"--load {folder} is damaged: {mismatch}")
    return folder


def _newest_intact(load: str, tracker: int | None) -> str:
    """The newest complete checkpoint of a run directory whose files match their checksums
    (at or below the tracker's iteration)."""
    ceiling = tracker if isinstance(tracker, int) else float("inf")
    candidates = [i for i in checkpoint_guard.saved_iterations(load) if i <= ceiling]
    problems = []
    for iteration in sorted(candidates, reverse=True):
        folder = checkpoint_guard.iteration_dir(load, iteration)
        problem = checkpoint_guard.incompleteness(folder)
        if problem is None:
            mismatch, _ = checksums.verify(folder)
            if mismatch is None:
                if problems and any("damaged" in p for p in problems):
                    print(f"[megagpt] {'; '.join(problems)}: using {folder}, the newest "
                          "intact checkpoint", file=sys.stderr, flush=True)
                return folder
            problem = f"damaged: {mismatch}"
        problems.append(f"iter_{iteration:07d}: {problem}")
    raise CheckpointError(f"--load {load}: no complete checkpoint ({'; '.join(problems)})")


def read_saved_config(folder: str) -> SavedConfig | None:
    """The configuration saved beside the checkpoint in ``folder``, or None without one."""
    try:
        entry = config_snapshot.read(folder)
    except config_snapshot.SnapshotError as exc:
        raise CheckpointError(f"--load {folder}: {exc}") from None
    if entry is None:
        return None
    with open(os.path.join(folder, config_snapshot.FILENAME)) as f:
        snapshot = yaml.safe_load(f) or {}
    container = snapshot.get("container") or {}
    transformer = ((container.get("model") or {}).get("transformer") or {}) \
        if isinstance(container, dict) else {}
    return SavedConfig(entry, transformer if isinstance(transformer, dict) else {})

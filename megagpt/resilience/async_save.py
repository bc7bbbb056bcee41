"""``--async-save`` on a plain install: which writer saves, and where it runs.

Megatron 0.19 saves a ``torch_dist`` checkpoint asynchronously only through a persistent
writer process (``--use-persistent-ckpt-worker``; without it ``validate_args`` turns
``--async-save`` off with a warning and saves synchronously), and its default writer,
``--async-strategy nvrx``, is nvidia-resiliency-ext's: without that package the run stops
before its first step with ``ModuleNotFoundError``. The launch's ``choose_writer``
(``megagpt.launch.resilience``) makes ``--async-save`` mean what it says:

* nvidia-resiliency-ext installed (``pip install 'megagpt[resilience]'``): its writer, as
  megatron intends;
* not installed: megatron's own writer (``--async-strategy mcore``), with one log line;
  an explicit ``--async-strategy nvrx`` without the package is a one-line error;
* the persistent writer process is turned on, since that is what saves in the background.

How an asynchronous save completes (``dist_checkpointing.save`` and ``save_checkpoint``):
the writer process writes the shards and ``.metadata``; later, at an iteration boundary,
the trainer runs the finalize functions: ``metadata.json``, then the tracker
``latest_checkpointed_iteration.txt``. A kill before that leaves a directory without
``metadata.json``, which ``checkpoint_guard`` already treats as incomplete, and a tracker
that still names the previous checkpoint: the guarantees of synchronous saves hold.

In CPU mode the writer process is forked (``megagpt.cpu_mode``), so that it has CPU mode's
``torch.cuda`` stand-ins.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Callable

from megagpt.errors import UserError
from megagpt.megatron_change import WRAPS, Change

NVRX_MODULE = "nvidia_resiliency_ext.checkpointing.async_ckpt"


class AsyncSaveError(UserError, RuntimeError):
    """--async-save was asked for in a form this install cannot provide."""


def resiliency_ext_installed() -> bool:
    try:
        return importlib.util.find_spec(NVRX_MODULE) is not None
    except (ImportError, ValueError):
        return False


# The finalize functions asked for by the save wrappers now running, outermost first.
_PENDING: list[Callable[[], None]] = []


# What ``finalize_adds`` changes in megatron, around one save (not at the launch's entry).
SCHEDULE_ASYNC_SAVE = Change(
    "megatron.training.checkpointing.schedule_async_save", WRAPS, __name__,
    why="an asynchronous save's request takes finalize functions only before it is scheduled "
        "(megatron freezes it); the configuration snapshot is one, written once the writer has "
        "finished",
    when="inside each asynchronous persistent save (resilience.config_snapshot, "
         "resilience.checkpoint_integrity), undone after",
    does="adds the save wrappers' finalize functions to the request",
    fingerprint="bdf6754425e0")
MEGATRON_CHANGES = (SCHEDULE_ASYNC_SAVE,)


@contextlib.contextmanager
def finalize_adds(fn: Callable[[], None]):
    """Add ``fn`` to the finalize functions of the asynchronous save scheduled inside.

    The request's finalize functions run in the trainer once the writer has finished
    (after ``metadata.json`` and the tracker); they cannot be added after scheduling
    (megatron freezes the request), so the scheduling call is wrapped. Save wrappers nest
    (the configuration snapshot inside, the checksums outside, in the order they are installed):
    the innermost one's function runs first, as it would after a synchronous save.
    """
    import megatron.training.checkpointing as mckpt

    from megagpt import megatron_wrappers

    def adding_pending(original):
        @functools.wraps(original)
        def schedule_async_save(request):
            for pending in reversed(_PENDING):
                request.add_finalize_fn(pending)
            return original(request)

        return schedule_async_save

    _PENDING.append(fn)
    try:
        if len(_PENDING) > 1:  # an outer save wrapper has the scheduling wrapped already
            yield
            return
        with megatron_wrappers.wrapped(mckpt, [("schedule_async_save", __name__,
                                                adding_pending)]):
            yield
    finally:
        _PENDING.remove(fn)

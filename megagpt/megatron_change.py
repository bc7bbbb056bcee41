"""One thing the project does to a megatron name, or relies on it for: the record each owner
declares beside the code that does it.

A module that wraps or replaces megatron attributes lists its records in its
``MEGATRON_CHANGES``, beside its wrapper functions; ``megagpt.megatron_wrappers`` installs a
change only where its owner declares it there. The launch's table
(``megagpt.launch.megatron_changes``) names which of them a launch enters, in which order and
when; ``megagpt.megatron_ledger`` gathers every record (those the table enters, those made
around one call outside it, and what the project stands in for, covers or relies on) and
checks each against the installed megatron's source (``megagpt.megatron_source``).

How (``how``):

``wraps``
    the attribute becomes a function that calls megatron's. Where several owners wrap one
    function, ``megagpt.megatron_wrappers`` composes them in the order they are installed,
    the first innermost (next to megatron's function); ``outside`` names the owners whose
    wrappers of the same function this one must be outside of, and the launch's table is
    checked against it.
``replaces``
    the attribute is set to the project's own object; megatron's is not called.
``stands in for``
    a class or function of the project takes the place of megatron's with the same interface
    (through the layer spec, or handed to megatron); nothing inside megatron is changed, but
    the project's version must keep computing what megatron's does.
``covers``
    megatron code that CPU mode makes run on a CPU; ``needle`` is the CUDA use the
    workaround exists for.
``relies on``
    a private megatron name the project calls or sets.
"""

from __future__ import annotations

from dataclasses import dataclass

CHECKED_AGAINST = "0.19.2"

WRAPS, REPLACES, STANDS_IN, COVERS, RELIES_ON = (
    "wraps", "replaces", "stands in for", "covers", "relies on")
INSTALLED = (WRAPS, REPLACES)  # what megagpt.megatron_wrappers puts on megatron's attributes

TRAINING = "megatron.training.training."  # the module of megatron's training loop

# When a change the launch's table enters is in place: its piece and its condition there.
ENTERED = ("around megatron.training.pretrain, where the launch's table enters it "
           "(megagpt.launch.megatron_changes), undone after")


@dataclass(frozen=True)
class Change:
    """One megatron name the project changes or depends on (see the module docstring)."""

    target: str  # package.module[.Class].name, where the project reaches it
    how: str
    owner: str  # the megagpt module whose code does it (and declares this record)
    why: str
    when: str = ENTERED
    fingerprint: str = ""  # megatron_source.fingerprint(target) at ``checked``
    needle: str = ""  # text in megatron's source the change exists for
    checked: str = CHECKED_AGAINST
    does: str = ""  # what the wrapper or replacement does, in a few words
    outside: tuple[str, ...] = ()  # owners whose wrappers of ``target`` this one wraps

    @property
    def installed(self) -> bool:
        """Whether the change is put on megatron's attribute (``wraps`` or ``replaces``)."""
        return self.how in INSTALLED

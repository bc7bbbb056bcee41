"""The types of a launch's plan: what it decided, each decision with its reason.

A launch's resolution (``resolution.resolve``) returns a frozen ``Launch``. What it decides is
a ``Choice`` per ``Decision``: a decision is a name and the type of its values (an enum of this
package, a small frozen dataclass, a bool), declared by the module of the concern that makes
it (``layers.LAYERS``, ``fp8.FP8``, ``cuda_graphs.CUDA_GRAPH``, ...). What runs reads a value by
its decision, ``launch[fp8.FP8]``, and gets that type back; the reason is a ``Reason``, a
value a test can compare (what it rests on, ``Why``, and what it says), made into text only
when the plan is printed (``Launch.describe``, the dry run's table).
"""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass
from typing import Generic, Optional, TypeVar

T = TypeVar("T")


class Label(enum.Enum):
    """An enum whose values are the words the plan prints for its members."""

    def __str__(self) -> str:
        return self.value


class Why(enum.Enum):
    """What a reason rests on."""

    GIVEN = "the command line asks for it"
    DEFAULT = "the entry's default, where nothing rules it out"
    INSTALLED = "what is installed"
    LAYOUT = "the parallel layout, the GPUs, the batches"
    SHAPE = "the model's sizes"
    HARDWARE = "the GPU"
    CPU = "CPU mode"
    CONFLICT = "another setting or choice of this launch rules it out"
    ENVIRONMENT = "the environment the launch starts in"
    RESUME = "the checkpoint the run resumes"
    MEGATRON = "how megatron itself behaves"


@dataclass(frozen=True)
class Reason:
    """Why a decision came out as it did: ``why`` (what it rests on), ``text`` (what it says)
    and, where one decision's reason rests on another's, that one (``cause``), printed after
    it."""

    why: Why
    text: str
    cause: Optional["Reason"] = None

    def __str__(self) -> str:
        return self.text if self.cause is None else f"{self.text}: {self.cause}"


@dataclass(frozen=True)
class Decision(Generic[T]):
    """One decision a launch makes: its name as the plan prints it and the types its value
    takes (``Planner.choose`` refuses another)."""

    name: str
    kind: type | tuple[type, ...]


@dataclass(frozen=True)
class Choice(Generic[T]):
    section: str  # the concern that decided it: "compat", "fast path", ...
    decision: Decision[T]
    value: T
    reason: Reason

    @property
    def name(self) -> str:
        return self.decision.name

    def describe(self) -> str:
        value = self.value
        if isinstance(value, bool):
            value = "on" if value else "off"
        elif value is None:
            value = "off"
        return f"  {self.name:<17} {value} — {self.reason}"


@dataclass(frozen=True)
class Launch:
    """What a command line comes to on this machine (``resolution.resolve``)."""

    parsed: argparse.Namespace  # megatron's and the entry's arguments as parsed; never written
    given: frozenset[str]  # the long option names the command line gives (config expanded)
    installed: object  # compat.Installed
    choices: tuple[Choice, ...]
    args: tuple[tuple[str, object], ...]  # (argument, value) to write, in the order decided
    environ: tuple[tuple[str, str], ...]  # (variable, value) to set, in the order decided
    log: tuple[str, ...]  # what the writer logs, in order

    def get(self, decision: Decision[T]) -> Optional[Choice[T]]:
        """The choice this launch made for ``decision`` (None: it made none)."""
        return next((c for c in self.choices if c.decision == decision), None)

    def choice(self, decision: Decision[T]) -> Choice[T]:
        found = self.get(decision)
        if found is None:
            raise KeyError(decision.name)
        return found

    def __getitem__(self, decision: Decision[T]) -> T:
        return self.choice(decision).value

    def made(self, decision: Decision) -> bool:
        return self.get(decision) is not None

    def arg(self, name: str):
        """megatron's argument ``name`` as the launch writes it (as parsed where it writes
        none)."""
        return dict(self.args).get(name, getattr(self.parsed, name, None))

    def section(self, section: str) -> tuple[Choice, ...]:
        return tuple(c for c in self.choices if c.section == section)

    def describe(self) -> list[str]:
        """The launch for ``--dry-run``: each section's choices, one line each."""
        lines: list[str] = []
        for section in dict.fromkeys(c.section for c in self.choices):
            lines += [f"{section}:", *(c.describe() for c in self.section(section))]
        return lines

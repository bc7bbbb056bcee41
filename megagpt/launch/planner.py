"""A launch being resolved, and what it comes to.

``Planner`` is handed to every step of the resolution in turn (``resolution.STEPS``). A step
reads the arguments as decided so far (``p.v``: the parsed arguments with every earlier
step's values laid over them), what the command line gave (``p.given``), what is installed
and the environment as found, and records what it decides: a value for one of megatron's
arguments (``p.set``), a variable for the environment (``p.set_env``), a log line
(``p.log``) and a choice with its reason (``p.choose``). A step changes nothing else; a
launch that cannot run is refused by raising ``UserError`` with its one line.

``Launch`` is the frozen result: every choice with its reason, the argument values and
environment variables to write, each in the order decided, and the log lines in the order
written. ``writer.write_launch`` is the one place that applies it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Mapping, Optional

from .layer_path import fast_path_selected, layer_path, te_layers_selected


@dataclass(frozen=True)
class Choice:
    section: str  # the concern that decided it: "compat", "fast path", ...
    name: str
    value: object
    reason: str

    def describe(self) -> str:
        value = ("on" if self.value else "off") if isinstance(self.value, bool) else self.value
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

    def choice(self, name: str) -> Choice:
        for c in self.choices:
            if c.name == name:
                return c
        raise KeyError(name)

    def value(self, name: str):
        return self.choice(name).value

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


class _View:
    """The arguments as the resolution has decided them so far (read-only)."""

    def __init__(self, args, decided: dict):
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "_decided", decided)

    def __getattr__(self, name):
        decided = object.__getattribute__(self, "_decided")
        if name in decided:
            return decided[name]
        return getattr(object.__getattribute__(self, "_args"), name)

    def __setattr__(self, name, value):
        raise AttributeError("the resolution's view of the arguments is read-only")


class Planner:
    """One launch being resolved: the decisions so far (``decided``, seen through ``v``), the
    environment to set, the log lines and the choices, each appended in order."""

    def __init__(self, args, given: frozenset[str], installed,
                 environ: Optional[Mapping[str, str]] = None):
        self.args = args  # as parsed: what was asked; decisions read ``v``
        self.given = given
        self.installed = installed
        self.environ: Mapping[str, str] = {} if environ is None else environ
        self.decided: dict = {}
        self.v = _View(args, self.decided)
        self.env: dict = {}
        self.lines: list[str] = []
        self.choices: list[Choice] = []
        self.section = "launch"  # the concern of the step that runs (resolution sets it)
        self.full_off = None  # why the full-iteration graph is off (None: on or not asked)
        self.layers_off = None  # why per-layer graphs are off

    def get(self, name, default=None):
        return getattr(self.v, name, default)

    def set(self, name, value) -> None:
        self.decided[name] = value

    def set_env(self, name: str, value: str) -> None:
        self.env[name] = value

    def log(self, line: str) -> None:
        self.lines.append(line)

    def choose(self, name: str, value, reason: str) -> None:
        self.choices.append(Choice(self.section, name, value, reason))

    def chosen(self, name: str) -> Optional[Choice]:
        """The choice of that name made so far (None: not yet made)."""
        return next((c for c in self.choices if c.name == name), None)

    def layers(self) -> tuple[str, str]:
        """(path, reason) of the layers this launch builds (``layer_path``)."""
        impl = self.chosen("transformer impl")
        return layer_path(self.v, impl.reason if impl is not None else None)

    def fast(self) -> bool:
        return fast_path_selected(self.v)

    def te(self) -> bool:
        return te_layers_selected(self.v)

    def world(self) -> int:
        """The GPUs the launch is for (a dry run's planned count)."""
        from .fast_path_reasons import _planned_world_size

        return _planned_world_size(self.v)

    def launch(self) -> Launch:
        return Launch(self.args, self.given, self.installed, tuple(self.choices),
                      tuple(self.decided.items()), tuple(self.env.items()), tuple(self.lines))

"""A launch being resolved.

``Planner`` is handed to every step of the resolution in turn (``resolution.STEPS``). A step
reads the arguments as decided so far (``p.v``: the parsed arguments with every earlier
step's values laid over them), what the command line gave (``p.given``), what is installed
and the environment as found, and records what it decides: a value for one of megatron's
arguments (``p.set``), a variable for the environment (``p.set_env``), a log line
(``p.log``) and a choice with its reason (``p.choose``, typed by its ``plan.Decision``). A
step changes nothing else; a launch that cannot run is refused by raising ``UserError`` with
its one line.

``Planner.launch()`` is the frozen result (``plan.Launch``); ``writer.write`` is the one
place that applies it.
"""

from __future__ import annotations

from typing import Mapping, Optional

from .layers import LAYERS, TRANSFORMER_IMPL, LayerPath, layer_path
from .layout import planned_world_size
from .plan import Choice, Decision, Launch, Reason, T, Why


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

    def get(self, name, default=None):
        return getattr(self.v, name, default)

    def set(self, name, value) -> None:
        self.decided[name] = value

    def set_env(self, name: str, value: str) -> None:
        self.env[name] = value

    def log(self, line: str) -> None:
        self.lines.append(line)

    def choose(self, decision: Decision[T], value: T, reason: Reason) -> None:
        if not isinstance(value, decision.kind):
            raise TypeError(f"the {decision.name!r} decision takes {decision.kind}, not "
                            f"{value!r}")
        if not isinstance(reason, Reason):
            raise TypeError(f"the {decision.name!r} decision's reason is a Reason, not "
                            f"{reason!r}")
        self.choices.append(Choice(self.section, decision, value, reason))

    def chosen(self, decision: Decision[T]) -> Optional[Choice[T]]:
        """The choice of that decision made so far (None: not yet made)."""
        return next((c for c in self.choices if c.decision == decision), None)

    # --- what several steps read -----------------------------------------------------------

    def impl_reason(self) -> Reason:
        """Why megatron's ``--transformer-impl`` is what it is (``layers.TRANSFORMER_IMPL``)."""
        impl = self.chosen(TRANSFORMER_IMPL)
        return impl.reason if impl is not None else Reason(Why.GIVEN,
                                                           "--transformer-impl as given")

    def layers(self) -> tuple[LayerPath, Reason]:
        """(path, reason) of the layers this launch builds: the ``LAYERS`` decision once it is
        made, before it what the arguments so far come to (``layers.layer_path``)."""
        made = self.chosen(LAYERS)
        if made is not None:
            return made.value, made.reason
        impl = self.chosen(TRANSFORMER_IMPL)
        return layer_path(self.v, impl.reason if impl is not None else None)

    def fast(self) -> bool:
        return self.layers()[0] is LayerPath.FAST

    def te(self) -> bool:
        return self.layers()[0] is LayerPath.TRANSFORMER_ENGINE

    def world(self) -> int:
        """The GPUs the launch is for (a dry run's planned count)."""
        return planned_world_size(self.v)

    def launch(self) -> Launch:
        return Launch(self.args, self.given, self.installed, tuple(self.choices),
                      tuple(self.decided.items()), tuple(self.env.items()), tuple(self.lines))

"""megatron's settings that would only print what does not apply to this install (a step of
the resolution; ``run_log.quiet`` has the filters and says why)."""

from __future__ import annotations

from megagpt.run_log import quiet

from .plan import Decision, Reason, Why


def choose_quiet_settings(p) -> None:
    """``quiet.argument_changes`` as a step of the launch's resolution: written with the
    launch's other choices, before megatron validates."""
    for name, value in quiet.argument_changes(p.v).items():
        p.set(name, value)
        p.choose(Decision(f"--{name.replace('_', '-')}", type(value)), value, Reason(
            Why.INSTALLED, "one_logger is not installed: megatron would only print its "
            "internal link"))

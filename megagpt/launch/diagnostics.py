"""The diagnostics a launch records (a step of the resolution): torch's flight recorder into
the run's folder, the collective timeout after the warm-up, the straggler report,
megatron's memory snapshot path (``diagnostics.settings`` plans them; ``diagnostics.active``
runs them).
"""

from __future__ import annotations

from megagpt.diagnostics import settings

from .plan import Decision, Reason, Why

DIAGNOSTICS: Decision[settings.DiagnosticsPlan] = Decision("diagnostics", settings.DiagnosticsPlan)


def choose_diagnostics(p) -> None:
    """``settings.plan_diagnostics`` as a step of the launch's resolution."""
    plan = settings.plan_diagnostics(p.v, p.environ)
    for name, value in plan.args:
        p.set(name, value)
    for name, value in plan.environ:
        p.set_env(name, value)
    for line in plan.log:
        p.log(line)
    p.choose(DIAGNOSTICS, plan, Reason(Why.DEFAULT, plan.timeout.describe()))

"""One launch, decided once: what a command line comes to on this machine.

``resolve(argv, installed, environ)`` parses the command line once and runs every step of the
launch (``resolution.STEPS``), each returning its choices with their reasons and changing
nothing: a frozen ``Launch``. ``write(launch)`` is the one writer of megatron's arguments and
the environment, before megatron validates them; ``after_validation`` the one write after.
What runs reads the ``Launch``: the model (``megagpt.gpt_model``), the changes inside
megatron and torch (``megatron_changes.launched``) and the dry run, which prints it.
"""

from megagpt.launch.planner import Choice, Launch
from megagpt.launch.resolution import parse_arguments, resolve
from megagpt.launch.writer import after_validation, write

__all__ = ["Choice", "Launch", "after_validation", "parse_arguments", "resolve", "write"]

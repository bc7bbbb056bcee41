"""One launch, decided once: what a command line comes to on this machine.

``resolve(argv, installed, environ)`` parses the command line once and runs every step of the
launch (``resolution.STEPS``), each recording its choices with their reasons and changing
nothing: a frozen, typed ``Launch`` (``plan``). Each concern decides in a module of its own:
the layers (``layers``), FP8 (``fp8``), the CUDA graphs (``cuda_graphs``), the optimizer's
kernels (``optimizer_kernels``), attention (``attention_backend``), apex's kernels
(``apex_kernels``), what is installed (``installed``), CPU mode (``cpu``), resilience,
diagnostics, the rendezvous. ``write(launch)`` is the one writer of megatron's arguments and
the environment, before megatron validates them; ``after_validation`` the one write after.
What runs reads the ``Launch`` by its decisions (``launch[fp8.FP8]``): the model
(``megagpt.gpt_model``), the changes inside megatron and torch (``megatron_changes.launched``)
and the dry run, which prints it.
"""

from megagpt.launch.plan import Choice, Decision, Launch, Reason, Why
from megagpt.launch.resolution import parse_arguments, resolve
from megagpt.launch.writer import after_validation, write

__all__ = ["Choice", "Decision", "Launch", "Reason", "Why", "after_validation",
           "parse_arguments", "resolve", "write"]

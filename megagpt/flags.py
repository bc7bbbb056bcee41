"""What a command line says beyond its values: the long option names it gives (how a user's
explicit request is told from a default that megatron or the entry filled in), and whether
its ``--spec`` names megatron's local spec rather than a module to import."""

from __future__ import annotations

from typing import Iterable


def explicit_flags(argv: Iterable[str]) -> set[str]:
    """The long option names present in argv (``--flag`` and ``--flag=value`` forms)."""
    return {tok.split("=", 1)[0] for tok in argv if tok.startswith("--")}


# megatron's ``--spec`` help: "To use local spec specify local as the argument"; its
# validate_args asks for it with --attention-backend local
LOCAL_SPEC_ARGUMENT = ["local"]


def megatron_local_spec_asked(args) -> bool:
    """Whether ``--spec local`` asks for megatron's local spec (not a module to import)."""
    return list(getattr(args, "spec", None) or []) == LOCAL_SPEC_ARGUMENT

"""The long option names a command line gives: how a user's explicit request is told from
a default that megatron or the entry filled in."""

from __future__ import annotations

from typing import Iterable


def explicit_flags(argv: Iterable[str]) -> set[str]:
    """The long option names present in argv (``--flag`` and ``--flag=value`` forms)."""
    return {tok.split("=", 1)[0] for tok in argv if tok.startswith("--")}

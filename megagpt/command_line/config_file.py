"""``--config FILE.yaml``: a YAML mapping of megatron flag names, expanded into argv.

Accepted shapes (all load as they are)::

    num-layers: 24            # plain names
    --num-layers: 24          # upstream functional-test MODEL_ARGS style
    num_layers: 24            # underscores
    MODEL_ARGS: {--num-layers: 24, ...}   # a whole upstream model_config.yaml

Values: a scalar becomes ``--flag value``; ``true`` becomes ``--flag``; ``false`` and
``null`` leave the flag out (megatron's default stands); a list becomes
``--flag v1 v2 ...``. The file's options come first in argv and the command line after
them, so the command line wins (argparse keeps the last value given).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from megagpt.errors import UserError


class ConfigFileError(UserError, ValueError):
    """The --config file is missing, not YAML, or not a mapping of flags."""


def split_config_option(argv: list[str]) -> tuple[str | None, list[str]]:
    """Return (the --config path or None, argv without it)."""
    rest, path = [], None
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--config":
            if i + 1 >= len(argv):
                raise ConfigFileError("--config needs a file path")
            path = argv[i + 1]
            i += 2
            continue
        if tok.startswith("--config="):
            path = tok.split("=", 1)[1]
        else:
            rest.append(tok)
        i += 1
    return path, rest


def flag_name(key: str) -> str:
    """``num_layers`` / ``num-layers`` / ``--num-layers`` -> ``--num-layers``."""
    return "--" + key.lstrip("-").replace("_", "-")


def load_config_mapping(path: str | os.PathLike) -> dict:
    """Read the file and return its flag mapping (MODEL_ARGS unwrapped)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigFileError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigFileError(f"--config {path}: not valid YAML{where}: "
                              f"{getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: expected a mapping of flag names to values, "
                              f"got {type(data).__name__}")
    if "MODEL_ARGS" in data:
        data = data["MODEL_ARGS"] or {}
        if not isinstance(data, dict):
            raise ConfigFileError(f"--config {path}: MODEL_ARGS must be a mapping")
    return data


def mapping_to_argv(mapping: dict, source: str = "config") -> list[str]:
    """Turn a flag mapping into argv tokens (see the module docstring for the rules)."""
    argv: list[str] = []
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise ConfigFileError(f"{source}: key {key!r} is not a flag name")
        flag = flag_name(key)
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv.append(flag)
            argv.extend(str(v) for v in value)
        elif isinstance(value, dict):
            raise ConfigFileError(f"{source}: {key}: nested mappings are not flags")
        else:
            argv.extend([flag, str(value)])
    return argv


def expand_config_file(argv: list[str]) -> tuple[list[str], str | None]:
    """argv with ``--config FILE`` replaced by the file's flags (file first, CLI wins)."""
    path, rest = split_config_option(argv)
    if path is None:
        return rest, None
    return mapping_to_argv(load_config_mapping(path), source=path) + rest, path

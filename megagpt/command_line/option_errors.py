"""A misspelled flag or a bad value as one line: what is wrong, where it was given (the
command line, or ``--config FILE``'s line and key), and the closest known options.

argparse's answer to either is the whole usage (several hundred lines with megatron's
options) and ``error: unrecognized arguments: --hiden-size 128``. ``raise_one_line`` takes
the place of the parser's ``error`` method and raises an ``OptionError`` instead, which the
entry prints as one ``error:`` line; the suggestions come from every option the parser
knows, megatron's and the entry's.

That parse comes after importing torch and megatron (seconds). ``check_early`` runs before
those imports on the option list of the last full parse (``OptionCache``, in the user's
cache, keyed on the installed megatron and on this package's files) and names an unknown
option or a value that is not a number or not one of an option's choices at once.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from megagpt.errors import UserError

SUGGESTIONS = 2
CLOSENESS = 0.75  # difflib's ratio: --hiden-size to --hidden-size is 0.96, unrelated words < 0.6
TIE = 0.03


class OptionError(UserError, ValueError):
    """An option or a value the parser does not take; the message names it and where."""


# ---------------------------------------------------------------------------
# Where an option came from
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ConfigEntry:
    path: str
    line: int
    key: str  # as the file spells it: hiden-size, --hiden-size, hiden_size
    value: object

    def where(self) -> str:
        return f"--config {self.path}, line {self.line}: {self.key}"


def config_entries(path: str | None) -> dict[str, ConfigEntry]:
    """``{--flag: ConfigEntry}`` for each key of a ``--config`` file, with its line."""
    if not path:
        return {}
    import yaml

    from megagpt.command_line.config_file import flag_name

    try:
        root = yaml.compose(Path(path).read_text(encoding="utf-8"))
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}  # config_file reports these itself
    if not isinstance(root, yaml.MappingNode) or not isinstance(data, dict):
        return {}
    if "MODEL_ARGS" in data:
        inner = next((value for key, value in root.value if key.value == "MODEL_ARGS"), None)
        if not isinstance(inner, yaml.MappingNode) or not isinstance(data["MODEL_ARGS"], dict):
            return {}
        root, data = inner, data["MODEL_ARGS"]
    entries = {}
    for key_node, _ in root.value:
        key = key_node.value
        if isinstance(key, str):
            entries[flag_name(key)] = ConfigEntry(path, key_node.start_mark.line + 1, key,
                                                  data.get(key))
    return entries


def _spelled_like(suggestion: str, key: str) -> str:
    """A suggested ``--flag`` spelled as the config file spells its keys."""
    if key.startswith("--"):
        return suggestion
    bare = suggestion[2:]
    return bare.replace("-", "_") if "_" in key else bare


# ---------------------------------------------------------------------------
# Suggestions
# ---------------------------------------------------------------------------

def suggestions(flag: str, known) -> list[str]:
    """The known options closest to ``flag`` (same spelling with dashes first)."""
    known = [k for k in known if k.startswith("--")]
    normalised = "--" + flag.lstrip("-").lower().replace("_", "-")
    if normalised in known and normalised != flag:
        return [normalised]
    close = difflib.get_close_matches(normalised, known, n=SUGGESTIONS, cutoff=CLOSENESS)
    ratio = lambda name: difflib.SequenceMatcher(None, normalised, name).ratio()  # noqa: E731
    # a second name only when it is about as close as the first
    return [name for name in close if ratio(name) >= ratio(close[0]) - TIE]


def _did_you_mean(names: list[str]) -> str:
    return f" (did you mean {' or '.join(names)}?)" if names else ""


def unknown_option_message(flag: str, known, config: dict[str, ConfigEntry],
                           given_on_command_line: bool = True,
                           program: str = "pretrain_gpt.py") -> str:
    entry = config.get(flag)
    if entry is not None and not given_on_command_line:
        names = [_spelled_like(s, entry.key) for s in suggestions(flag, known)]
        return f"{entry.where()}: unknown option{_did_you_mean(names)}"
    return (f"{flag}: unknown option{_did_you_mean(suggestions(flag, known))}; "
            f"{program} --help lists them all")


# ---------------------------------------------------------------------------
# argparse's messages, one line each
# ---------------------------------------------------------------------------

_INVALID_VALUE = re.compile(r"^argument (\S+?)(?:/\S+)?: invalid (\S+) value: '(.*)'$")
_INVALID_CHOICE = re.compile(r"^argument (\S+?)(?:/\S+)?: invalid choice: '(.*)' \(choose from "
                             r"(.*)\)$")
_NEEDS_VALUE = re.compile(r"^argument (\S+?)(?:/\S+)?: expected (.*) arguments?$")
_ABOUT_ONE = re.compile(r"^argument (\S+?)(?:/\S+)?: (.*)$")
_TYPE_WORDS = {"int": "a whole number", "float": "a number"}


def value_message(flag: str, value: str, what: str, config: dict[str, ConfigEntry],
                  file_argv: list[str]) -> str:
    """``--flag value: what`` or, when the file gave that value, its line and key."""
    entry = config.get(flag)
    if entry is not None and _in_file(flag, value, file_argv):
        return f"{entry.where()}: {value}: {what}"
    return f"{flag} {value}: {what}"


def _in_file(flag: str, value: str, file_argv: list[str]) -> bool:
    return any(tok == flag and i + 1 < len(file_argv) and file_argv[i + 1] == value
               for i, tok in enumerate(file_argv))


def one_line(message: str, parser: argparse.ArgumentParser, argv: list[str],
             config: dict[str, ConfigEntry], file_argv: list[str]) -> str:
    """argparse's error ``message`` for ``argv`` (the file's options first) as one line."""
    known = list(parser._option_string_actions)
    cli_argv = argv[len(file_argv):]
    if message.startswith("unrecognized arguments: "):
        flags = [tok.split("=", 1)[0] for tok in message[len("unrecognized arguments: "):].split()
                 if tok.startswith("-") and not _is_number(tok)]
        if flags:
            cli = {tok.split("=", 1)[0] for tok in cli_argv}
            return "; ".join(unknown_option_message(f, known, config, f in cli, _program(parser))
                             for f in flags)
        return f"{message} (values without an option before them)"
    match = _INVALID_VALUE.match(message)
    if match:
        flag, kind, value = match.groups()
        return value_message(flag, value, f"not {_TYPE_WORDS.get(kind, f'a valid {kind}')}",
                             config, file_argv)
    match = _INVALID_CHOICE.match(message)
    if match:
        flag, value, choices = match.groups()
        options = [c.strip().strip("'") for c in choices.split(",")]
        close = difflib.get_close_matches(value, options, n=1, cutoff=0.6)
        return value_message(flag, value, f"not one of {', '.join(options)}"
                             + _did_you_mean(close), config, file_argv)
    match = _NEEDS_VALUE.match(message)
    if match:
        flag, count = match.groups()
        return f"{flag} needs {count} value{'s' if count not in ('one',) else ''} after it"
    match = _ABOUT_ONE.match(message)
    return f"{match.group(1)}: {match.group(2)}" if match else message


def _program(parser: argparse.ArgumentParser) -> str:
    """The tools name themselves (``prog="tools/generate.py"``); megatron's parser is named
    after whatever ran it, which for this parser is the entry."""
    return parser.prog if parser.prog.startswith("tools/") else "pretrain_gpt.py"


def _is_number(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False


def raise_one_line(parser: argparse.ArgumentParser, argv: list[str], config_path: str | None,
                   file_argv: list[str]) -> None:
    """Make ``parser`` raise an OptionError (one line) where it would print its usage."""
    config = config_entries(config_path)

    def error(message: str):
        raise OptionError(one_line(message, parser, argv, config, file_argv))

    parser.error = error


# ---------------------------------------------------------------------------
# Before the heavy imports: the option list of the last full parse
# ---------------------------------------------------------------------------

def describe_options(parser: argparse.ArgumentParser) -> dict[str, list]:
    """``{--flag: [values taken, type, choices]}``: what ``check_early`` needs of each."""
    described = {}
    for flag, action in parser._option_string_actions.items():
        nargs = action.nargs
        if nargs is None:
            nargs = 0 if isinstance(action, (argparse._StoreConstAction,
                                             argparse._CountAction,
                                             argparse._HelpAction,
                                             argparse._VersionAction)) else 1
        kind = action.type.__name__ if action.type in (int, float) else None
        choices = [str(c) for c in action.choices] if action.choices is not None and all(
            isinstance(c, (str, int, float)) for c in action.choices) else None
        described[flag] = [nargs, kind, choices]
    return described


class OptionCache:
    """The option list of this install, written by a full parse and read before one."""

    def __init__(self, root: Path | None = None):
        self.root = root if root is not None else _cache_root()

    def path(self) -> Path | None:
        key = _install_key()
        return None if key is None or self.root is None else self.root / f"options-{key}.json"

    def read(self) -> dict | None:
        path = self.path()
        try:
            return json.loads(path.read_text()) if path is not None else None
        except (OSError, ValueError):
            return None

    def write(self, options: dict) -> None:
        path = self.path()
        if path is None or path.exists():
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps(options))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache: the next launch parses in full, as this one did


def _cache_root() -> Path | None:
    try:
        from megagpt.data.cache import cache_root

        return cache_root() / "options"
    except Exception:  # noqa: BLE001 - no cache: nothing is checked early
        return None


def _install_key() -> str | None:
    """A key that changes whenever the options could: megatron's version, Python's, and the
    size and time of every file of this package and of the entry."""
    import hashlib
    from importlib import metadata

    try:
        parts = [metadata.version("megatron-core"), sys.version]
    except metadata.PackageNotFoundError:
        return None
    package = Path(__file__).resolve().parent
    files = sorted(package.rglob("*.py")) + sorted(package.parent.glob("*.py"))
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        parts.append(f"{f}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def early_problem(argv: list[str], options: dict[str, list], config_path: str | None,
                  file_argv: list[str]) -> str | None:
    """The first unknown option or bad number/choice in ``argv`` (the file's options first),
    as one line; None when none is found (the full parse checks the rest)."""
    config = config_entries(config_path)
    cli = {tok.split("=", 1)[0] for tok in argv[len(file_argv):]}
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--"):
            continue
        flag, eq, inline = token.partition("=")
        if flag not in options:
            return unknown_option_message(flag, list(options), config, flag in cli)
        nargs, kind, choices = options[flag]
        if nargs == 0 or nargs in ("*", "+", "?") or not isinstance(nargs, int):
            continue  # optional and variable counts: the full parse reads them
        values = [inline] if eq else argv[i:i + nargs]
        i += 0 if eq else nargs
        for value in values:
            what = _bad_value(value, kind, choices)
            if what:
                return value_message(flag, value, what, config, file_argv)
    return None


def _bad_value(value: str, kind: str | None, choices: list[str] | None) -> str | None:
    if kind == "int":
        try:
            int(value)
        except ValueError:
            return "not a whole number"
    elif kind == "float":
        try:
            float(value)
        except ValueError:
            return "not a number"
    if choices is not None and kind is None and value not in choices:
        close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
        return f"not one of {', '.join(choices)}" + _did_you_mean(close)
    return None


def check_early(argv: list[str]) -> None:
    """Print one ``error:`` line and exit 2 for a bad option the cached option list shows
    (before torch and megatron are imported); otherwise return and let the parse run."""
    from megagpt.command_line.config_file import (expand_config_file, load_config_mapping,
                                                  mapping_to_argv)
    from megagpt.command_line.fast_path_options import check_replaced_flags

    options = OptionCache().read()
    if options is None:
        return
    try:
        expanded, config_path = expand_config_file(list(argv))
        file_argv = mapping_to_argv(load_config_mapping(config_path), config_path) \
            if config_path else []
        check_replaced_flags(expanded)
    except UserError as exc:  # a --config file that does not load, an option renamed since
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    problem = early_problem(expanded, options, config_path, file_argv)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)

"""Megatron's assertions and ValueErrors about the user's input, as one line naming the flags.

Megatron checks arguments with bare ``assert`` statements (``assert args.save_interval is
not None``), with assertions whose message names a field rather than a flag, and with
``ValueError`` from its config dataclasses. Printed as they are, the user sees a stack trace
or ``AssertionError`` and nothing after it. ``explain(exc, args)`` gives one line instead:

* megatron's message, when it has one;
* otherwise the condition that failed, read from the ``assert`` statement's source;
* the flags the message or the condition refer to (``args.save_interval`` and a field
  named ``save_interval`` are both ``--save-interval``), with this run's values;
* the file and line of megatron's check, so that the rule can be looked up.
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
import re
import textwrap
import traceback

_WORD = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b|\b[a-z]{4,}\b")
_ARGS_ATTR = re.compile(r"\bargs\.([a-z_][a-z0-9_]*)")
# Names that are flags but also ordinary words in megatron's messages.
_COMMON_WORDS = {"load", "save", "seed", "split", "bf16", "fp16", "lr", "cpu", "config", "spec",
                 "test", "help"}


@functools.lru_cache(maxsize=1)
def _flags_by_dest() -> dict[str, str]:
    """``{dest: '--long-option'}`` for megatron's parser (megatron's checks name only its own
    arguments; the entry's options are megatron's by the time it validates)."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_megatron_arguments(parser)
    flags = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and action.dest not in flags:
            # the positive spelling names the setting (--no-x sets x=False)
            positive = [o for o in longs if not o.startswith("--no-")]
            flags[action.dest] = (positive or longs)[0]
    return flags


# What megatron raises on a launch's input while parsing and validating arguments or
# building configs: its assertions and ValueErrors, and also the RuntimeErrors of deprecated
# flags and missing optional packages, the OSErrors of missing files it reads, the TypeErrors
# of checks that index a flag left unset, ImportErrors, NotImplementedErrors.
INPUT_ERRORS = (AssertionError, ValueError, TypeError, RuntimeError, OSError, ImportError,
                NotImplementedError, KeyError, IndexError, ZeroDivisionError)


def raised_by_megatron(exc: BaseException, within: bool = False) -> bool:
    """Whether megatron's code raised ``exc`` (a check on the input); else it is ours, a bug.
    ``within``: megatron's or code it called (torch asked for a GPU, a file it opened)."""
    frames = traceback.extract_tb(exc.__traceback__)
    marker = f"{os.sep}megatron{os.sep}"
    if within:
        return any(marker in frame.filename for frame in frames)
    return bool(frames) and marker in frames[-1].filename


def flag_for(dest: str) -> str | None:
    """The command-line option that sets ``args.<dest>``, or None."""
    return _flags_by_dest().get(dest)


def _megatron_frame(tb) -> traceback.FrameSummary | None:
    """The innermost frame in megatron's code: where its check failed."""
    frames = traceback.extract_tb(tb)
    for frame in reversed(frames):
        if f"{os.sep}megatron{os.sep}" in frame.filename:
            return frame
    return frames[-1] if frames else None


def _failing_statement(exc: BaseException) -> ast.stmt | str | None:
    """The statement of megatron's that raised ``exc``: parsed, or its source text where it
    does not parse on its own."""
    frame = _megatron_frame(exc.__traceback__)
    if frame is None or frame.lineno is None:
        return None
    end = frame.end_lineno or frame.lineno
    lines = [linecache.getline(frame.filename, n) for n in range(frame.lineno, end + 1)]
    source = textwrap.dedent("".join(lines))
    try:
        return ast.parse(source).body[0]
    except (SyntaxError, IndexError):
        return " ".join(source.split()) or None


def failed_condition(exc: BaseException) -> str | None:
    """The test of the ``assert`` statement that raised ``exc``, as source text."""
    statement = _failing_statement(exc)
    if isinstance(statement, str):
        return statement
    if isinstance(statement, ast.Assert):
        return ast.unparse(statement.test)
    return None


def _assert_message_around(exc: BaseException) -> tuple[str, str] | None:
    """(message, condition) of the ``assert`` whose test itself raised ``exc`` (a TypeError
    from ``args.spec[0]`` where ``--spec`` is not given, say): what megatron meant to say."""
    statement = _failing_statement(exc)
    if (isinstance(statement, ast.Assert) and isinstance(statement.msg, ast.Constant)
            and isinstance(statement.msg.value, str)):
        return statement.msg.value, ast.unparse(statement.test)
    return None


def _where(exc: BaseException) -> str:
    frame = _megatron_frame(exc.__traceback__)
    if frame is None:
        return ""
    path = frame.filename
    marker = f"{os.sep}megatron{os.sep}"
    if marker in path:
        path = "megatron" + os.sep + path.split(marker, 1)[1]
    return f"{path}:{frame.lineno}"


def flags_named(text: str, args=None) -> list[str]:
    """``--flag value`` for each setting ``text`` refers to (``args.x`` or a field ``x``)."""
    dests = list(dict.fromkeys(_ARGS_ATTR.findall(text)))
    for word in _WORD.findall(text):
        if word not in dests and word not in _COMMON_WORDS:
            dests.append(word)
    named = []
    for dest in dests:
        flag = flag_for(dest)
        if flag is None:
            continue
        value = getattr(args, dest, None) if args is not None else None
        if isinstance(value, (list, tuple)):
            value = " ".join(map(str, value))
        named.append(f"{flag} {value}" if args is not None else flag)
    return named


def explain(exc: BaseException, args=None, what: str = "invalid arguments") -> str:
    """One line for an exception megatron raised on the user's input (``INPUT_ERRORS``)."""
    message = " ".join(str(exc).split())
    condition = failed_condition(exc) if isinstance(exc, AssertionError) else None
    meant = None if isinstance(exc, AssertionError) else _assert_message_around(exc)
    if meant is not None:
        message, condition = meant[0], meant[1]
    elif not isinstance(exc, (AssertionError, ValueError)) and message:
        message = f"{type(exc).__name__}: {message}"
    where = _where(exc)
    flags = flags_named(" ".join(filter(None, [message, condition])), args)
    if message:
        text = f"{what}: {message}"
        if condition and flags:
            text += f" (megatron's check `{condition}`)"
    elif condition:
        text = f"{what}: megatron requires `{condition}`, which is false for this launch"
    else:
        text = f"{what}: megatron raised {type(exc).__name__} without a message"
    if flags:
        text += "; given: " + ", ".join(flags)
    if where:
        text += f" [{where}]"
    return text

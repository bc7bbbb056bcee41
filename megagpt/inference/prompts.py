"""Prompts from the command line or a jsonl file (one ``{"prompt": "..."}`` per line).

A bad line stops the run with ``file:line: reason`` before any model is loaded; blank lines
are skipped (as the preprocessor skips them).
"""

from __future__ import annotations

from dataclasses import dataclass

from megagpt.data import readers
from megagpt.errors import UserError

PROMPT_KEY = "prompt"


class PromptError(UserError, ValueError):
    """A prompts file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    text: str
    where: str  # "--prompt" or "FILE:LINE", for messages about this prompt


def from_file(path: str) -> list[Prompt]:
    prompts = []
    try:
        for text, _, line in readers.iter_texts([path], PROMPT_KEY, input_format="jsonl"):
            prompts.append(Prompt(text, f"{path}:{line}"))
    except readers.RecordError as exc:
        raise PromptError(f"--prompts {path}:{exc.line}: {exc.reason}: {exc.detail} "
                          f"(each line: {{\"{PROMPT_KEY}\": \"...\"}})") from None
    except readers.InputError as exc:
        raise PromptError(str(exc)) from None
    if not prompts:
        raise PromptError(f"--prompts {path}: no prompt in the file")
    return prompts


def gather(prompt: str | list[str] | None, prompts_file: str | None) -> list[Prompt]:
    """The prompts of ``--prompts FILE``, else of each ``--prompt`` (none: one empty)."""
    if prompts_file is not None:
        return from_file(prompts_file)
    texts = [prompt] if isinstance(prompt, str) else list(prompt or [""])
    if len(texts) == 1:
        return [Prompt(texts[0], "--prompt")]
    return [Prompt(text, f"--prompt #{i}") for i, text in enumerate(texts, 1)]

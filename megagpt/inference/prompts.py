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
    try:
        chunks = list(readers.iter_chunks([path], input_format="jsonl"))
    except readers.InputError as exc:
        raise PromptError(str(exc)) from None
    prompts = []
    for chunk in chunks:
        for line_no, payload in zip(chunk.line_nos, chunk.payloads):
            texts, reason, detail, _ = readers.parse_record(payload, readers.JSONL, [PROMPT_KEY])
            if reason == readers.BLANK_LINE:
                continue
            if reason is not None:
                raise PromptError(f"--prompts {path}:{line_no}: {reason}: {detail} "
                                  f"(each line: {{\"{PROMPT_KEY}\": \"...\"}})")
            prompts.append(Prompt(texts[0], f"{path}:{line_no}"))
    if not prompts:
        raise PromptError(f"--prompts {path}: no prompt in the file")
    return prompts


def gather(prompt: str | None, prompts_file: str | None) -> list[Prompt]:
    if prompts_file is not None:
        return from_file(prompts_file)
    return [Prompt(prompt or "", "--prompt")]

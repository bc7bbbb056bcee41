"""Warnings that do not apply to this install, and listings that bury the log, kept out of it.

Each entry of ``QUIETED`` names one message of megatron (or of torch, called by megatron),
the module that emits it, a piece of its text as that module's source spells it
(``needle``: ``tests/test_run_log.py`` fails when an upgrade changes or drops the text, so a
filter never silently stops matching, nor hides a new message), and why it does not apply.
Each is a ``warnings`` filter or a ``logging`` filter on the emitting module's logger, and
some hold only where the condition is true (no Transformer Engine, no GPU).

``MEGAGPT_ALL_WARNINGS=1`` in the environment installs none of them.

One message is not a warning but a print, and is avoided rather than filtered:
megatron's one_logger (NVIDIA's internal metrics package) is on by default, and without the
package megatron prints a link to an internal wiki; ``argument_changes`` turns it off where
the package is not installed.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import warnings
from dataclasses import dataclass
from typing import Callable

ALL_WARNINGS = "MEGAGPT_ALL_WARNINGS"


def _always() -> bool:
    return True


def _without_te() -> bool:
    try:
        return importlib.util.find_spec("transformer_engine") is None
    except (ImportError, ValueError):
        return True


def _without_gpu() -> bool:
    import torch

    return not torch.cuda.is_available()


@dataclass(frozen=True)
class Quieted:
    """One message kept out of the log (see the module docstring)."""

    kind: str  # "warning" (warnings.warn) or "log" (a logging call on the module's logger)
    module: str  # the module whose source emits it (its logger, for "log")
    pattern: str  # matched from the start of the message
    needle: str  # a piece of the message as the module's source spells it
    why: str
    when: Callable[[], bool] = _always
    first_line_stays: bool = False  # a "log" message cut to its first line, not dropped


QUIETED: tuple[Quieted, ...] = (
    Quieted("warning", "megatron.core.extensions.transformer_engine_spec_provider",
            r"Only transformer-engine>=1\.7\.0 supports MoE experts, but your version is 0\.0\.0",
            "Only transformer-engine>=1.7.0 supports MoE experts, ",
            "printed at import where Transformer Engine is not installed at all (version "
            "0.0.0): megatron then builds its local MoE experts anyway", _without_te),
    Quieted("log", "megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED",
            "GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes",
            "this entry trains megatron's GPTModel on purpose, and the migration guide the "
            "message points to is not part of the wheel"),
    Quieted("warning", "megatron.core.models.mimo.config.base_configs",
            r"MimoModelConfig is experimental",
            "MimoModelConfig is experimental and still under active development. ",
            "printed when megatron imports its multimodal models, which a GPT run never uses"),
    Quieted("log", "megatron.core.rerun_state_machine",
            r"(RerunStateMachine initialized in mode|Setting RerunStateMachine mode) "
            r"RerunMode\.DISABLED",
            "Setting RerunStateMachine mode",
            "the entry turns reruns off itself and says so once (resilience.divergence); "
            "megatron repeats it around every evaluation"),
    Quieted("log", "megatron.core.distributed.param_and_grad_buffer",
            r"Number of buckets for gradient all-reduce / reduce-scatter: \d+\nParams for bucket",
            "Params for bucket {index + 1} (",
            "megatron lists every parameter's name and gradient type per gradient bucket at "
            "start-up, about 300 lines at 345M; the message's first line, the bucket count, "
            "stays", first_line_stays=True),
    Quieted("warning", "torch.distributed.distributed_c10d",
            r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
            "`torch.distributed.all_gather_into_tensor` is deprecated. ",
            "torch's, about the call megatron's code makes; nothing a user can change"),
    Quieted("log", "torch.utils.cpp_extension", r"No CUDA runtime is found",
            "No CUDA runtime is found, using CUDA_HOME=",
            "torch's extension builder, imported by megatron, where there is no GPU; nothing "
            "is compiled", _without_gpu),
    Quieted("warning", "torch.utils.data.dataloader",
            r"'pin_memory' argument is set as true but no accelerator is found",
            "'pin_memory' argument is set as true but no accelerator is found, ",
            "megatron's data loader always asks for pinned memory; on the CPU there is "
            "nothing to pin for", _without_gpu),
)


class _Dropping(logging.Filter):
    def __init__(self, pattern: str, first_line_stays: bool):
        super().__init__()
        self.pattern = re.compile(pattern)
        self.first_line_stays = first_line_stays

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not self.pattern.match(message):
            return True
        if self.first_line_stays:
            record.msg, record.args = message.split("\n", 1)[0], ()
            return True
        return False


_INSTALLED = False


def install() -> None:
    """Install the filters whose condition holds (once per process)."""
    global _INSTALLED
    if _INSTALLED or os.environ.get(ALL_WARNINGS) == "1":
        return
    _INSTALLED = True
    for quieted in QUIETED:
        if not quieted.when():
            continue
        if quieted.kind == "warning":
            warnings.filterwarnings("ignore", message=quieted.pattern)
        else:
            logging.getLogger(quieted.module).addFilter(
                _Dropping(quieted.pattern, quieted.first_line_stays))


def argument_changes(args) -> dict[str, object]:
    """Settings that keep megatron from printing what does not apply (see the docstring)."""
    changes = {}
    if os.environ.get(ALL_WARNINGS) == "1":
        return changes
    if getattr(args, "enable_one_logger", False) and importlib.util.find_spec("one_logger") is None:
        changes["enable_one_logger"] = False
    return changes



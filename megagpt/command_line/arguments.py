"""The command line: megatron's parser with this entry's options, and megatron's validation.

``parse_command_line(argv)``: ``--config FILE.yaml`` expanded into argv (the command line after
it wins), then megatron's own parser with this entry's options (``add_entry_arguments``).
What the arguments come to on this machine is the launch's resolution (``megagpt.launch``);
``validate_arguments`` is megatron's ``validate_args`` (without touching CUDA when none is
present), and ``set_megatron_globals`` sets megatron's global state and the tokenizer.

Upstream Megatron-LM command lines work unchanged: every flag is megatron's.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Callable

from megagpt import compat, megatron_wrappers
from megagpt.command_line.config_file import (ConfigFileError, expand_config_file, flag_name,
                                 load_config_mapping, split_config_option)
from megagpt.errors import UserError
from megagpt.megatron_change import REPLACES, Change
from megagpt.gpus import DEFAULT_GPU, gpu_type_names

class ArgumentError(UserError, ValueError):
    """The arguments cannot describe a run; the message says which and why."""


def add_entry_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This entry's options, added to megatron's parser."""
    group = parser.add_argument_group("megagpt entry")
    group.add_argument("--config", type=str, default=None,
                       help="YAML file of megatron flags (num-layers: 24, ...); "
                            "flags on the command line override it.")
    group.add_argument("--cpu", action="store_true",
                       help="CPU development mode: gloo, fp32, no GPU needed. For tests, CI "
                            "and laptops, not for speed.")
    _add_dry_run_arguments(group)
    # read by megagpt.launch.apex_kernels
    group.add_argument("--persist-layer-norm", dest="persist_layer_norm_kernel",
                       action="store_true",
                       help="Let megatron's local modules take NVIDIA apex's persistent layer norm "
                            "kernel (megatron's default; the entry leaves it where apex has it: "
                            "measured slower than apex's fused_layer_norm_cuda kernel).")
    # read by megagpt.preflight.data_check
    group.add_argument("--allow-data-tokenizer-mismatch", action="store_true",
                       help="Train on data whose tokenizer record names another tokenizer "
                            "than this run's (ids must still fit the vocabulary).")
    from megagpt.command_line.fast_path_options import add_fast_path_arguments
    from megagpt.diagnostics import settings as diagnostics_settings
    from megagpt.resilience import checkpoint_integrity
    from megagpt.run_log import run_folder

    add_fast_path_arguments(group)
    checkpoint_integrity.add_arguments(group)
    run_folder.add_arguments(group)
    diagnostics_settings.add_arguments(group)
    return parser


def _add_dry_run_arguments(group) -> None:
    """``--dry-run`` and what it plans for (``megagpt.preflight`` reads them)."""
    group.add_argument("--dry-run", action="store_true",
                       help="Check the launch and print the plan (layout, batch, parameters, "
                            "memory, FLOPs); start nothing.")
    group.add_argument("--dry-run-world-size", type=int, default=None, metavar="N",
                       help="GPUs the dry run plans for (default: WORLD_SIZE as torchrun "
                            "sets it, else 1).")
    group.add_argument("--gpu-type", type=str, default=None, metavar="NAME",
                       help="GPU the dry run plans for: memory, arch and the speed figures of "
                            f"the time estimate ({', '.join(gpu_type_names())}; default: this "
                            f"machine's GPU, else {DEFAULT_GPU}).")
    group.add_argument("--gpu-hour-price", type=float, default=None, metavar="PRICE",
                       help="Price of one GPU for one hour: the dry run's estimate then gives "
                            "the run's cost.")
    group.add_argument("--search-layouts", action="store_true",
                       help="With --dry-run: rank every layout (TP × PP × DP, micro-batch, "
                            "virtual stages, recompute) that fits this GPU count by estimated "
                            "step time and print the best five.")
    group.add_argument("--gpu-memory-gb", type=float, default=None, metavar="GIB",
                       help="GPU memory in GiB for the dry run's memory check (overrides "
                            "--gpu-type's).")
    group.add_argument("--dry-run-yaml", type=str, default=None, metavar="FILE",
                       help="Also write the resolved configuration (every megatron argument "
                            "after validation) to FILE as YAML; '-' prints it after the plan.")


def _escape_stray_percent_signs(parser: argparse.ArgumentParser) -> None:
    """argparse formats help with ``%``; some of megatron 0.19's help texts contain a bare
    ``%`` (``... 10%)``) and ``--help`` crashes on them. Escape every ``%`` that does not
    start an argparse placeholder such as ``%(default)s``."""
    import re

    for action in parser._actions:
        if action.help and "%" in action.help:
            action.help = re.sub(r"%(?!\()", "%%", action.help)


@contextlib.contextmanager
def _argv(tokens: list[str]):
    saved = sys.argv
    sys.argv = [saved[0] if saved else "pretrain_gpt.py", *tokens]
    try:
        yield
    finally:
        sys.argv = saved


def _known_flags(extra_args_provider) -> set[str]:
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_megatron_arguments(parser)
    add_entry_arguments(parser)
    if extra_args_provider is not None:
        extra_args_provider(parser)
    return set(parser._option_string_actions)


def _check_config_keys(path: str, extra_args_provider) -> None:
    from megagpt.command_line.option_errors import config_entries, unknown_option_message

    known = _known_flags(extra_args_provider)
    entries = config_entries(path)
    unknown = [flag_name(k) for k in load_config_mapping(path) if flag_name(k) not in known]
    if unknown:  # each with its line and the closest options
        raise ConfigFileError("; ".join(
            unknown_option_message(flag, known, entries, given_on_command_line=False)
            if flag in entries else f"--config {path}: {flag}: unknown option"
            for flag in unknown))


def parse_command_line(argv: list[str] | None = None,
                       extra_args_provider: Callable | None = None) -> argparse.Namespace:
    """megatron's and this entry's arguments as the command line gives them (``--config``
    expanded; ``args.entry_argv`` holds the expanded command line): parsed, neither adapted
    nor validated. The launch's resolution (``megagpt.launch``) decides the rest."""
    from megatron.training.arguments import parse_args

    compat.quiet_fallback_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    command_line = split_config_option(argv)[1]
    argv, config_path = expand_config_file(argv)
    file_argv = argv[:len(argv) - len(command_line)]  # the --config file's, first
    from megagpt.command_line.fast_path_options import check_replaced_flags

    check_replaced_flags(argv)
    if config_path is not None:
        _check_config_keys(config_path, extra_args_provider)

    from megagpt.command_line import option_errors

    def provider(parser):
        add_entry_arguments(parser)
        parser = extra_args_provider(parser) if extra_args_provider else parser
        _escape_stray_percent_signs(parser)
        # one line, not the usage, for a bad option; and the option list for the next launch
        option_errors.raise_one_line(parser, argv, config_path, file_argv)
        option_errors.OptionCache().write(option_errors.describe_options(parser))
        return parser

    from megagpt.megatron_errors import INPUT_ERRORS

    try:
        with _argv(argv):
            args = parse_args(extra_args_provider=provider)
    except INPUT_ERRORS as exc:  # megatron reads --yaml-cfg and checks a few flags here
        raise argument_error(exc) from None
    args.config = config_path
    args.entry_argv = argv
    return args


def check_entry_limits(args) -> None:
    """Settings megatron accepts that this entry cannot honour, or that megatron itself
    fails on only once training has started; ArgumentError naming the flag."""
    spec = getattr(args, "spec", None)
    if spec is not None:
        _check_user_spec(spec)
    for attr in ("hybrid_layer_pattern", "hybrid_override_pattern"):
        if getattr(args, attr, None):
            # megatron's validate_args would take the pattern's length as --num-layers
            flag = "--" + attr.replace("_", "-")
            raise ArgumentError(
                f"{flag} {getattr(args, attr)}: the pattern describes a hybrid Mamba and "
                "attention stack (megatron's HybridModel); pretrain_gpt.py trains GPT models, "
                "whose layers are all transformer layers (--num-layers)")
    if getattr(args, "search_layouts", False) and not args.dry_run:
        raise ArgumentError("--search-layouts ranks layouts in the dry run and starts nothing: "
                            "add --dry-run (or drop it to train)")
    if getattr(args, "dataloader_type", None) == "external":
        raise ArgumentError(
            "--dataloader-type external: megatron then takes what the datasets provider "
            "returns as iterators, and pretrain_gpt.py's provider returns datasets; use single "
            "(the default) or cyclic")
    if getattr(args, "multiple_validation_sets", False) and not getattr(
            args, "full_validation", False) and not getattr(args, "skip_train", False):
        raise ArgumentError("--multiple-validation-sets needs --full-validation (megatron "
                            "0.19 stops with NotImplementedError at its first evaluation)")


def _check_user_spec(spec: list[str]) -> None:
    """``--spec MODULE NAME``: megatron imports it while building the model, and on a failed
    import logs the error and trains with its default spec. ``--spec local`` is megatron's
    local spec."""
    import importlib

    from megagpt.flags import LOCAL_SPEC_ARGUMENT

    if list(spec) == LOCAL_SPEC_ARGUMENT:
        return  # megatron's local spec, built by gpt_builders
    if len(spec) != 2:
        raise ArgumentError(
            f"--spec {' '.join(spec)}: wants a module and the name of a layer spec (or of a "
            "function returning one) in it, e.g. --spec "
            "megatron.core.models.gpt.gpt_layer_specs get_gpt_layer_local_spec, or local "
            "for megatron's local spec")
    module, name = spec
    try:
        found = importlib.import_module(module)
    except ImportError as exc:
        raise ArgumentError(f"--spec {module} {name}: cannot import {module}: {exc}") from None
    if not hasattr(found, name):
        raise ArgumentError(f"--spec {module} {name}: {module} has no {name}")


# What this module changes in megatron, each around one call (not at the launch's entry).
DEVICE_ARCH_VERSION = Change(
    "megatron.training.arguments.get_device_arch_version", REPLACES, __name__,
    does="answers with the planned GPU's architecture (or 0)",
    why="validate_args asks the GPU for its architecture when TP or CP > 1, and a dry run or a "
        "CPU run has none to ask",
    when="around megatron's validate_args where no GPU answers (validate_arguments), undone "
         "after",
    fingerprint="076b134d5b1f")
GLOBAL_TOKENIZER = Change(
    "megatron.training.global_vars._GLOBAL_TOKENIZER", REPLACES, __name__,
    does="the project's tokenizer, which loads local files offline",
    why="megatron's GPT2BPETokenizer asks the HuggingFace hub for 'gpt2' even with local files",
    when="at launch, after megatron's globals are set (set_megatron_globals), until megatron "
         "clears its globals",
    fingerprint="eb0327eb5368")
MEGATRON_CHANGES = (DEVICE_ARCH_VERSION, GLOBAL_TOKENIZER)


@contextlib.contextmanager
def _device_arch_for_validation(arch: int | None):
    """validate_args asks the GPU for its architecture when TP or CP > 1.

    With no GPU (CPU mode, or a dry run of a 128-GPU layout on a laptop) the answer comes
    from ``arch`` instead: e.g. 8 for A100, 9 for H100/H200.
    """
    import torch
    import megatron.training.arguments as margs

    if torch.cuda.is_available() and arch is None:
        yield
        return
    answer = [("get_device_arch_version", __name__, lambda _: lambda: arch or 0)]
    with megatron_wrappers.wrapped(margs, answer):
        yield


def validate_arguments(args, device_arch: int | None = None) -> None:
    """megatron's validate_args, with its assertions turned into ArgumentError."""
    from megatron.training.arguments import validate_args

    if args.lr is None and not getattr(args, "skip_train", False):
        # megatron has no default learning rate and fails deep inside the optimizer.
        raise ArgumentError("--lr is required (the peak learning rate, e.g. --lr 3e-4)")
    from megagpt.megatron_errors import INPUT_ERRORS

    try:
        with _device_arch_for_validation(device_arch):
            validate_args(args, {})
    except INPUT_ERRORS as exc:
        raise argument_error(exc, args) from None


def argument_error(exc: BaseException, args=None, within: bool = True) -> BaseException:
    """An exception megatron raised on the launch's input as one ArgumentError line; any
    other (ours, a bug) as it is. ``within``: also what megatron's code called (a file it
    opened, torch asked for a GPU), as in its argument parsing and validation."""
    from megagpt.megatron_errors import explain, raised_by_megatron

    if isinstance(exc, UserError) or not raised_by_megatron(exc, within=within):
        return exc
    return ArgumentError(explain(exc, args))


def set_megatron_globals(args) -> None:
    """Megatron's global args, timers and writers, and our tokenizer (works offline).

    The tokenizer's files are checked first and a failed load is one line
    (``megagpt.data.tokenizer_files``)."""
    from megatron.training import global_vars
    from megatron.training.global_vars import set_global_variables

    from megagpt.data.tokenizer_files import check_tokenizer_files, load_error

    check_tokenizer_files(args)
    set_global_variables(args, build_tokenizer=False)
    try:
        tokenizer = build_tokenizer(args)
    except Exception as exc:  # noqa: BLE001 - any failure to load is about the user's files
        raise load_error(exc, args) from None
    # megatron clears its tokenizer itself (unset_global_variables), which ends this
    megatron_wrappers.replace(global_vars, "_GLOBAL_TOKENIZER", __name__, tokenizer,
                              megatron_sets=True)


def build_tokenizer(args):
    """GPT-2 BPE offline and HF folders via megagpt.data; the rest via megatron."""
    from megagpt.data.tokenizers import build_tokenizer as offline_build_tokenizer

    return offline_build_tokenizer(args)

"""Megatron flags that rebuild a saved model on one device, parsed and checked.

The trainer saves its whole command line beside every checkpoint (``config_snapshot``'s
``argv``, with ``--config`` already expanded). Replayed through the entry's own parser it
gives back exactly the model that was trained: shape, norms, activation, positions, the
tokenizer. Only the flags that describe the launch rather than the model are dropped
(``LAUNCH_FLAGS``: parallel layout, precision, checkpoint paths, logging, graphs, which
layer implementation ran; and an earlier version's fast-path options, which this one
refuses); the device's own flags come next and the caller's overrides last, so they win
(argparse keeps the last value). The layer implementation is this machine's choice: the
same weights load into TE's layers and megatron's local ones, and a checkpoint trained
under TE's layers generates where TE is missing, or on the CPU.

Two settings are then taken from what the run recorded rather than from the replay:

- the embedding's row count (``padded_vocab_size``): megatron pads the vocabulary by its
  divisor x the tensor-parallel size of the run, so a TP=2 run has more rows than a TP=1
  replay would compute;
- megatron's bias-GeLU fusion, which is the tanh approximation of GeLU and therefore part of
  the function the model computes (the replay on another machine may adapt it).
"""

from __future__ import annotations

import argparse
import contextlib
import io

from megagpt import vocab_padding
from megagpt.errors import UserError
from megagpt.command_line.fast_path_options import REPLACED_FLAGS
from megagpt.inference.checkpoint import SavedConfig

# Argument destinations (megatron's names) that describe how a run was launched, not the
# model it trained. Replaying them would ask this one device for the run's layout,
# precision, checkpoints and loggers.
LAUNCH_FLAGS = frozenset({
    # parallel layout
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
    "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
    "hierarchical_context_parallel_sizes", "cp_comm_type", "use_distributed_optimizer",
    "overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "distributed_backend",
    # precision
    "bf16", "fp16", "fp8", "fp8_recipe", "fp8_param", "fp4", "first_last_layers_bf16",
    "grad_reduce_in_bf16", "accumulate_allreduce_grads_in_fp32",
    # checkpoints and stopping
    "load", "save", "pretrained_checkpoint", "ckpt_step", "finetune", "use_checkpoint_args",
    "save_interval", "no_load_optim", "no_load_rng", "async_save", "exit_interval",
    "exit_duration_in_mins", "exit_signal_handler",
    # this entry's launch options, its fast path's among them
    "cpu", "dry_run", "config", "fast_spec", "fast_cuda_graphs", "fast_compile",
    "fast_disable", "fast_cuda_graph_capture_timeout", "fast_multi_gpu_path",
    # which layers ran (the weights load into either)
    "transformer_impl",
    # graphs and recomputation
    "cuda_graph_impl", "cuda_graph_scope", "enable_cuda_graph", "external_cuda_graph",
    "recompute_granularity", "recompute_method", "recompute_num_layers",
    # loggers that open files
    "tensorboard_dir", "wandb_project", "wandb_exp_name", "wandb_save_dir",
})


class ModelFlagsError(UserError, ValueError):
    """The flags, the tokenizer or the saved configuration cannot describe the model."""


def _parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    from megagpt.command_line.arguments import add_entry_arguments

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_megatron_arguments(parser)
    add_entry_arguments(parser)
    return parser


def _value_count(action: argparse.Action, rest: list[str]) -> int:
    """How many of the tokens in ``rest`` are this option's values."""
    nargs = action.nargs
    if nargs == 0:
        return 0
    if nargs is None:
        return 1
    if isinstance(nargs, int):
        return nargs
    count = 0
    while count < len(rest) and not rest[count].startswith("--"):
        count += 1
        if nargs == "?":
            break
    return count


def without_launch_flags(argv: list[str], parser: argparse.ArgumentParser | None = None
                         ) -> list[str]:
    """``argv`` with every option in ``LAUNCH_FLAGS`` (and its values) and every option an
    earlier version had in place of today's fast-path options (none took a value) left
    out."""
    actions = (parser or _parser())._option_string_actions
    kept: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if name in REPLACED_FLAGS:
            i += 1
            continue
        action = actions.get(name) if token.startswith("--") else None
        if action is None:
            kept.append(token)
            i += 1
            continue
        count = 0 if "=" in token else _value_count(action, argv[i + 1:])
        if action.dest not in LAUNCH_FLAGS:
            kept.extend(argv[i:i + 1 + count])
        i += 1 + count
    return kept


def known_flags() -> list[str]:
    """Every option megatron's parser and the entry's take."""
    return list(_parser()._option_string_actions)


def unknown_flags(tokens: list[str]) -> list[str]:
    """The options in ``tokens`` that neither megatron nor the entry knows."""
    actions = _parser()._option_string_actions
    return [t.split("=", 1)[0] for t in tokens
            if t.startswith("--") and t.split("=", 1)[0] not in actions]


def device_flags(cpu: bool, bf16: bool) -> list[str]:
    """One device, one process: the layout, precision and spec a load runs with.

    megatron's local spec rather than the fast spec: the same parameters and checkpoint
    layout, and megatron's own layer forward (inference contexts included)."""
    flags = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
             "--no-fast-spec"]
    if cpu:
        flags.append("--cpu")
    elif bf16:
        flags.append("--bf16")
    return flags


def replay_argv(saved: SavedConfig | None, cpu: bool, bf16: bool,
                overrides: list[str]) -> list[str]:
    """The saved command line without its launch flags, this device's flags, the overrides."""
    parser = _parser()
    saved_argv = without_launch_flags(saved.argv, parser) if saved is not None else []
    return [*saved_argv, *device_flags(cpu, bf16), *overrides]


@contextlib.contextmanager
def chatter_into(buffer: io.StringIO):
    """megatron prints its argument table on stdout and argparse its usage on stderr; a
    tool's output is its results (``--json`` lines) and at most one error line, so both go
    into ``buffer`` (an error's line is taken from it)."""
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        yield


def parse_model_args(argv: list[str], cpu: bool):
    """(megatron's validated arguments, the launch) for ``argv``, resolved as the entry
    resolves a launch (``megagpt.launch``); filled in where a model-only command line leaves
    megatron's training settings unset."""
    from megagpt.command_line import arguments as entry_arguments
    from megagpt.command_line.option_errors import OptionError
    from megagpt.launch import resolve
    from megagpt.launch.writer import written_for_the_block

    chatter = io.StringIO()
    try:
        with chatter_into(chatter):
            launch = resolve(argv)
            # the launch's environment while megatron validates; a tool is not the launch
            with written_for_the_block(launch) as args:
                # megatron validates a training run: these settings must exist, none is used
                if args.micro_batch_size is None:
                    args.micro_batch_size = 1
                if args.lr is None:
                    args.lr = 0.0
                if args.train_iters is None and args.train_samples is None:
                    args.train_iters = 1
                entry_arguments.validate_arguments(args, device_arch=0 if cpu else None)
    except OptionError as exc:  # a flag or value the parser does not take, in one line
        raise ModelFlagsError(str(exc)) from None
    except SystemExit as exc:  # argparse's own error, printed into the chatter
        lines = [ln for ln in chatter.getvalue().splitlines() if "error:" in ln]
        raise ModelFlagsError(lines[-1].split("error:", 1)[1].strip() if lines
                              else f"megatron's parser stopped (status {exc.code})") from None
    args.perform_initialization = False  # the weights come from the checkpoint
    return args, launch


def restore_recorded_settings(args, saved: SavedConfig | None) -> None:
    """Apply what the run recorded over what the replay computed (module docstring)."""
    if saved is None:
        return
    recorded = saved.transformer.get("bias_activation_fusion")
    if isinstance(recorded, bool) and not getattr(args, "swiglu", False):
        args.bias_gelu_fusion = recorded


def check_vocabulary(args, tokenizer, saved: SavedConfig | None, where: str) -> None:
    """The tokenizer must fit the checkpoint's embedding; then its row count is the saved one.

    megatron pads the tokenizer's vocabulary to a multiple of --make-vocab-size-divisible-by
    x TP, so the saved row count pins the tokenizer's size to one window of that multiple.
    """
    if saved is None or not isinstance(saved.model.get("padded_vocab_size"), int):
        return
    rows = saved.model["padded_vocab_size"]
    size = int(tokenizer.vocab_size)
    divisor = int(saved.model.get("make_vocab_size_divisible_by")
                  or args.make_vocab_size_divisible_by or vocab_padding.DEFAULT_DIVISOR)
    expected = vocab_padding.padded_vocab_size(size, divisor, saved.tensor_parallel)
    if size > rows or expected != rows:
        multiple = divisor * saved.tensor_parallel
        raise ModelFlagsError(
            f"the tokenizer ({describe_tokenizer(args)}) has {size} tokens, but the checkpoint "
            f"{where} has {rows} embedding rows, which megatron's padding (multiples of "
            f"{multiple}) gives for {rows - multiple + 1} to {rows} tokens: give the tokenizer "
            "the model was trained with")
    args.padded_vocab_size = rows


# The flags that name a tokenizer's files, by megatron's tokenizer type
_TOKENIZER_FILES = {"GPT2BPETokenizer": (("--vocab-file", "vocab_file"),
                                         ("--merge-file", "merge_file")),
                    "NullTokenizer": (("--vocab-size", "vocab_size"),)}


def describe_tokenizer(args) -> str:
    """The tokenizer flags in effect, as a user would write them."""
    parts = [f"--tokenizer-type {args.tokenizer_type}"]
    files = _TOKENIZER_FILES.get(args.tokenizer_type, (("--tokenizer-model", "tokenizer_model"),))
    parts += [f"{flag} {getattr(args, attr)}" for flag, attr in files if getattr(args, attr, None)]
    return " ".join(parts)


def build_tokenizer(args):
    """The run's tokenizer, offline (GPT-2 BPE files, HF folders), through megagpt.data."""
    from megagpt.data.tokenizers import build_tokenizer as offline_build_tokenizer

    try:
        with chatter_into(io.StringIO()):
            return offline_build_tokenizer(args)
    except (OSError, ValueError) as exc:
        raise ModelFlagsError(f"cannot build the tokenizer ({describe_tokenizer(args)}): "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                              ) from None

"""A checkpoint's GPT model, rebuilt from what was saved beside it and loaded for inference.

``prepare`` does everything that needs no process group and no weights (find the folder,
replay the saved flags, build and check the tokenizer), so bad input fails before any
expensive work; ``build_model`` and ``load_weights`` then run inside ``megatron_world``.
The distributed checkpoint format stores every tensor with its global shape, so a
checkpoint saved under any TP x PP layout loads into this rank's shard of any other layout
whose shapes divide (the vocabulary's padding is the one shape that depends on TP).
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

from megagpt.errors import UserError
from megagpt.inference import model_flags
from megagpt.inference.checkpoint import (
    CheckpointError,
    SavedConfig,
    checkpoint_folder,
    read_saved_config,
)


@dataclass
class Prepared:
    """A checkpoint ready to load: its folder, what was saved beside it, the parsed args and
    the launch they came to on this machine."""

    folder: str
    saved: SavedConfig | None
    args: argparse.Namespace
    launch: object  # megagpt.launch.Launch: the layers the model is built from
    tokenizer: object  # megatron's tokenizer (tokenize / detokenize / eod / vocab_size)

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding that are tokens (the rest is megatron's padding)."""
        return min(int(self.tokenizer.vocab_size), int(self.args.padded_vocab_size))


def prepare(load: str, overrides: list[str], cpu: bool, bf16: bool = True) -> Prepared:
    """Find the checkpoint ``load`` names and rebuild its arguments and tokenizer."""
    folder = checkpoint_folder(load)
    saved = read_saved_config(folder)
    unknown = model_flags.unknown_flags(overrides)
    if unknown:
        raise model_flags.ModelFlagsError(
            f"unknown option(s) {', '.join(unknown)} (neither this tool's nor a megatron flag)")
    if saved is None and not any(t.startswith("--num-layers") for t in overrides):
        raise CheckpointError(
            f"--load {folder}: no configuration saved beside it (megagpt_config.yaml, written "
            "by pretrain_gpt.py and tools/import_hf.py); "
            "give the model's flags (--num-layers ... --tokenizer-type ...)")
    argv = model_flags.replay_argv(saved, cpu, bf16, overrides)
    args, launch = model_flags.parse_model_args(argv, cpu)
    model_flags.restore_recorded_settings(args, saved)
    tokenizer = model_flags.build_tokenizer(args)
    model_flags.check_vocabulary(args, tokenizer, saved, folder)
    return Prepared(folder, saved, args, launch, tokenizer)


def build_model(args, launch):
    """This rank's GPT stage for ``args`` with the layers of ``launch`` (megatron's local spec
    or TE's: ``model_flags.device_flags``; weights uninitialised), on its device in its
    precision."""
    from megatron.core import parallel_state

    from megagpt import compat
    from megagpt.gpt_model import build_stage, gpt_model_config
    from megagpt.launch.installed import MEGATRON_LINEARS_WGRAD

    model_config, _ = gpt_model_config(args, launch)
    with (compat.megatron_linears_without_wgrad_fusion() if launch.made(MEGATRON_LINEARS_WGRAD)
          else contextlib.nullcontext()):
        model = build_stage(model_config, pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage())
    if not args.cpu:
        # as megatron's get_model leaves a model for training: every parameter and buffer
        # on this rank's GPU (torch's own modules, such as the position embedding and the
        # norms, are built on the CPU) and, under --bf16 / --fp16, in that precision (its
        # Float16Module casts the whole model)
        import torch

        model.cuda(torch.cuda.current_device())
        if args.bf16:
            model.bfloat16()
        elif args.fp16:
            model.half()
    return model


def load_weights(model, folder: str) -> None:
    """Load the model's tensors from the distributed checkpoint in ``folder`` (resharded to
    this rank's shard) and put the model in eval mode."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    try:
        # what the checkpoint lacks is dropped from the request and named after the load:
        # only extra state (TE's FP8 metadata, absent from checkpoints saved without TE's
        # layers) may be missing; a missing weight is an error
        # (megatron calls what is asked for but not in the checkpoint "unexpected")
        state, _, absent = dist_checkpointing.load(
            {"model": model.sharded_state_dict()}, folder,
            strict=StrictHandling.RETURN_UNEXPECTED)
        loaded = model.load_state_dict(state["model"], strict=False)
        lacking = sorted(k for k in [*absent, *loaded.missing_keys, *loaded.unexpected_keys]
                         if not k.endswith("_extra_state"))
        if lacking:
            raise CheckpointError(f"it has no {', '.join(lacking[:3])}"
                                  + (f" (and {len(lacking) - 3} more)" if len(lacking) > 3
                                     else ""))
    except (KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - torch.distributed.checkpoint raises anything
        raise CheckpointError(f"cannot load the model from {folder}: {_one_line(exc)}") from exc
    from megagpt.resilience.checkpoint_integrity import describe_nonfinite, nonfinite_tensors

    bad = nonfinite_tensors(model.named_parameters())
    if bad:  # a loss of nan later would not say where it came from
        raise CheckpointError(f"--load {folder} holds weights that are not finite "
                              f"({describe_nonfinite(bad)}): the checkpoint is damaged, or was "
                              "saved by a run that had diverged")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)


@contextlib.contextmanager
def loaded(prepared: Prepared, seed: int = 1234):
    """Yield (model, device): this rank's stage of the prepared checkpoint, weights loaded,
    inside its megatron world (torn down on exit)."""
    from megagpt.inference.world import megatron_world

    with megatron_world(prepared.args, seed=seed) as device:
        model = build_model(prepared.args, prepared.launch)
        load_weights(model, prepared.folder)
        yield model, device


def _one_line(exc: BaseException) -> str:
    """The first line of the error that stopped a load. torch.distributed.checkpoint wraps
    each rank's error in a CheckpointException whose ``failures`` map ranks to it."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) and first else getattr(first, "exception", exc)
    text = (str(exc).strip() or type(exc).__name__).splitlines()[0][:300]
    return f"{type(exc).__name__}: {text}"


def require_device(cpu: bool) -> None:
    """One GPU, or the CPU when asked for: say so before any loading."""
    import torch

    if not cpu and not torch.cuda.is_available():
        raise UserError("no CUDA GPU is visible here; pass --cpu to run on the CPU")

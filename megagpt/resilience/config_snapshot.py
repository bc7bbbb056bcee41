"""The resolved configuration beside every checkpoint: ``iter_XXXXXXX/megagpt_config.yaml``.

Written by rank 0 right after megatron's ``save_checkpoint`` returns, or, with
``--async-save``, when the trainer finalizes the save (the checkpoint is complete by then;
a crash in between leaves a complete checkpoint without the file, which the loader
accepts). Two sections:

``entry``      what ``checkpoint_guard`` compares before loading: the model's shape, the
               tokenizer and vocabulary, the optimizer, the parallel layout, the iteration,
               the command line;
``container``  megatron's ``PretrainConfigContainer`` as its own ``to_dict`` writes it (the
               same content as ``container.to_yaml``); omitted if it does not serialise.
"""

from __future__ import annotations

import functools
import os

import yaml

from megagpt.errors import UserError
from megagpt.megatron_change import TRAINING, WRAPS, Change

FILENAME = "megagpt_config.yaml"

# Arguments that fix the shapes of the saved tensors, or the meaning of the token ids.
# A checkpoint loads only into a run that agrees on all of them.
MODEL_KEYS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
    "num_query_groups", "group_query_attention", "kv_channels",
    "max_position_embeddings", "position_embedding_type", "normalization", "swiglu",
    "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights",
    "num_experts", "padded_vocab_size", "make_vocab_size_divisible_by",
)
TOKENIZER_KEYS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size")
# What the optimizer's saved state is: megatron loads the plain optimizer's state only into
# the plain optimizer, and the distributed optimizer's only into the distributed one; that
# one's default format (not fully reshardable) only under the same TP x PP.
OPTIMIZER_KEYS = ("optimizer", "use_distributed_optimizer", "dist_ckpt_optim_fully_reshardable")
# Free to change between save and load (the distributed format reshards).
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
               "context_parallel_size", "data_parallel_size", "world_size")


def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def entry_section(args, iteration: int) -> dict:
    """What the guard checks, as plain YAML values."""
    pick = lambda keys: {k: _plain(getattr(args, k, None)) for k in keys}  # noqa: E731
    model = pick(MODEL_KEYS)
    if not model["group_query_attention"]:
        # megatron fills this in during model building; without GQA it is the head count.
        model["num_query_groups"] = model["num_attention_heads"]
    return {
        "iteration": int(iteration),
        "consumed_train_samples": int(getattr(args, "consumed_train_samples", 0) or 0),
        "model": model,
        "tokenizer": pick(TOKENIZER_KEYS),
        "optimizer": {**pick(OPTIMIZER_KEYS), "gradient_buffer": gradient_buffer_dtypes(args)},
        "layout": pick(LAYOUT_KEYS),
        "ckpt_format": args.ckpt_format,
        # TE's layers keep delayed-scaling FP8's scales and amax history as a pickle in their
        # extra state, which TE loads back only when told to trust it (checkpoint_guard)
        "te_pickled_fp8_state": te_pickles_fp8_state(args),
        "argv": [str(a) for a in (getattr(args, "entry_argv", None) or [])],
    }


def gradient_buffer_dtypes(args) -> str | None:
    """"parameters/gradients" dtypes of megatron's gradient buffers (``bfloat16/float32``:
    bf16 weights with float32 gradients, megatron's default; ``bfloat16/bfloat16``: the fast
    path's bf16 gradient buffer), which name the distributed optimizer's buckets in its
    default checkpoint format; None before megatron's validation sets ``params_dtype``."""
    params = getattr(args, "params_dtype", None)
    if params is None:
        return None
    params = str(params).removeprefix("torch.")
    grads = "float32" if getattr(args, "accumulate_allreduce_grads_in_fp32", False) else params
    return f"{params}/{grads}"


def te_pickles_fp8_state(args) -> bool:
    """Whether this run's checkpoints hold Transformer Engine's delayed-scaling FP8 state as a
    Python pickle: TE's layers with ``--fp8-format`` and the delayed recipe (TE's current and
    block scaling keep no state; the fast spec's FP8 keeps its own, as tensors)."""
    return bool(getattr(args, "transformer_impl", None) == "transformer_engine"
                and getattr(args, "fp8", None)
                and getattr(args, "fp8_recipe", "delayed") == "delayed")


def _container_section(container):
    if container is None:
        return None
    from megatron.training.config.container import safe_yaml_representers

    try:
        with safe_yaml_representers():
            # Round trip through the dumper so that a value YAML cannot represent shows up here.
            return yaml.safe_load(yaml.safe_dump(container.to_dict(), default_flow_style=False))
    except Exception:  # noqa: BLE001 - the snapshot must never fail a save
        return None


def write(checkpoint_dir: str, args, iteration: int, container=None) -> str:
    """Write the snapshot into ``checkpoint_dir`` atomically; return its path."""
    snapshot = {"entry": entry_section(args, iteration)}
    container_dict = _container_section(container)
    if container_dict is not None:
        snapshot["container"] = container_dict
    path = os.path.join(checkpoint_dir, FILENAME)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        yaml.safe_dump(snapshot, f, default_flow_style=False, sort_keys=False)
    os.replace(tmp, path)
    return path


class SnapshotError(UserError, ValueError):
    """A checkpoint's snapshot is there but cannot be read; the message names the file."""


def read(checkpoint_dir: str) -> dict | None:
    """The snapshot's ``entry`` section, or None when the checkpoint has none; a snapshot
    that is there but does not parse (damaged, edited) is a SnapshotError, not a missing one."""
    path = os.path.join(checkpoint_dir, FILENAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            snapshot = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise SnapshotError(f"{path} is unreadable{where} ({type(exc).__name__}): the "
                            "checkpoint's configuration is damaged") from None
    entry = snapshot.get("entry") if isinstance(snapshot, dict) else None
    if not isinstance(entry, dict):
        raise SnapshotError(f"{path} has no 'entry' mapping: the checkpoint's configuration is "
                            "damaged or was edited")
    return entry


SAVE_CHECKPOINT = Change(
    TRAINING + "save_checkpoint", WRAPS, __name__,
    does="writes the resolved configuration beside each persistent save",
    why="checkpoint_guard compares it with the run's before loading (the model's shape, the "
        "tokenizer and vocabulary, the optimizer, the parallel layout)",
    fingerprint="42e813b3aa30", outside=("megagpt.resilience.checkpoint_guard",))
MEGATRON_CHANGES = (SAVE_CHECKPOINT,)


def writing_snapshot(save_checkpoint, args, container=None):
    """Wrap megatron's ``save_checkpoint`` to add the snapshot to each persistent save."""

    @functools.wraps(save_checkpoint)
    def wrapper(iteration, *a, **kw):
        import torch

        from megatron.training.checkpointing import get_checkpoint_name

        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        persistent = not kw.get("non_persistent_ckpt", False)

        def write_snapshot():
            checkpoint_dir = get_checkpoint_name(args.save, iteration, return_base_dir=True)
            if os.path.isdir(checkpoint_dir):
                write(checkpoint_dir, args, iteration, container)

        if not (rank0 and persistent and args.save):
            return save_checkpoint(iteration, *a, **kw)
        if args.async_save:
            from megagpt.resilience.async_save import finalize_adds

            # written when the trainer finalizes the save, after metadata.json and the tracker
            with finalize_adds(write_snapshot):
                return save_checkpoint(iteration, *a, **kw)
        result = save_checkpoint(iteration, *a, **kw)
        write_snapshot()
        return result

    wrapper._megagpt_original = save_checkpoint
    return wrapper

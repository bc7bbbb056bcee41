"""A Hugging Face GPT-2 or Llama folder as a checkpoint that pretrain_gpt.py continues from.

    python tools/import_hf.py --hf DIR --save CKPT [--tensor-model-parallel-size T]
        [--make-vocab-size-divisible-by D] [--overwrite]

Writes into ``CKPT``:

``release/``                     the weights as megatron's ``torch_dist`` checkpoint, with
                                 ``megagpt_config.yaml`` beside them (what generate and
                                 export read)
``latest_checkpointed_iteration.txt``  ``release``: megatron loads a release checkpoint's
                                 model only, so training starts at iteration 0 with a fresh
                                 optimizer and learning-rate schedule
``tokenizer/``                   the folder's tokenizer (``--tokenizer-type HuggingFaceTokenizer``)
``model.yaml``                   the matching model flags, for ``pretrain_gpt.py --config``

    python pretrain_gpt.py --config CKPT/model.yaml --load CKPT --save CKPT \\
        --data-path ... --micro-batch-size ... --lr ... --train-iters ...

The distributed format stores global shapes, so the checkpoint loads under any TP x PP
layout its shapes divide, except for the vocabulary's padding: megatron pads the tokenizer's
vocabulary to a multiple of --make-vocab-size-divisible-by x TP, and loads only the padding
it was saved with. The divisor is chosen for ``--tensor-model-parallel-size`` (default 1):
the largest power of two up to 128 that pads nothing (the first training loss then equals
transformers' on the same batch), else 128, with padding rows at the mean embedding.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import yaml

from megagpt.errors import UserError
from megagpt.hf.architectures import ConversionError

TRACKER_RELEASE = "release"
YAML_NAME = "model.yaml"
TOKENIZER_DIR = "tokenizer"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/import_hf.py", allow_abbrev=False,
        description="Turn a transformers GPT-2 or Llama folder into a checkpoint that "
                    "pretrain_gpt.py --load continues from.")
    p.add_argument("--hf", required=True, metavar="DIR", help="a transformers model folder")
    p.add_argument("--save", required=True, metavar="CKPT", help="the checkpoint folder to write")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="T",
                   help="the TP size training will use: it decides the vocabulary's padding")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None, metavar="D",
                   help="megatron's vocabulary divisor (default: the largest power of two up "
                        "to 128 that pads nothing under T, else 128)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --save")
    return p


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise ConversionError(f"--hf {folder}: no such folder")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConversionError(f"--hf {folder}: no config.json (not a transformers model "
                              "folder)") from None
    except ValueError as exc:
        raise ConversionError(f"--hf {path}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"--hf {path}: not a JSON object")
    return config


def read_weights(folder: str) -> dict:
    """Every tensor of the folder's safetensors (one file or an index of shards) or
    pytorch_model.bin."""
    import torch
    from safetensors.torch import load_file

    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(folder, s) for s in shards]
    elif os.path.isfile(os.path.join(folder, "pytorch_model.bin")):
        return torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu",
                          weights_only=True)
    else:
        raise ConversionError(f"--hf {folder}: no model.safetensors, safetensors index or "
                              "pytorch_model.bin")
    tensors: dict = {}
    for path in files:
        try:
            tensors.update(load_file(path))
        except Exception as exc:  # noqa: BLE001 - a damaged file raises anything
            raise ConversionError(f"--hf {path}: cannot read ({exc})") from None
    return tensors


def vocabulary_divisor(vocab: int, tensor_parallel: int) -> int:
    """The largest power of two d <= 128 with vocab a multiple of d x TP; else 128."""
    divisor = 128
    while divisor >= 1:
        if vocab % (divisor * tensor_parallel) == 0:
            return divisor
        divisor //= 2
    return 128


def check_layout(flags: dict, tensor_parallel: int, where: str) -> None:
    """The model's shapes must divide by the TP size training will use."""
    heads = flags["num-attention-heads"]
    groups = flags.get("num-query-groups", heads)
    for what, size in (("attention heads", heads), ("query groups", groups),
                       ("MLP width", flags["ffn-hidden-size"])):
        if size % tensor_parallel:
            raise ConversionError(f"--hf {where}: {size} {what} do not divide by "
                                  f"--tensor-model-parallel-size {tensor_parallel}")


def argv_of(flags: dict) -> list[str]:
    from megagpt.command_line.config_file import mapping_to_argv

    return mapping_to_argv(flags, source=YAML_NAME)


def run(opts) -> int:
    from transformers import AutoTokenizer

    from megagpt.hf.architectures import megatron_flags
    from megagpt.hf.folder import check_output, writing
    from megagpt.inference import model_flags

    check_output(opts.save, "--save", opts.overwrite)
    if opts.tensor_model_parallel_size < 1:
        raise ConversionError(f"--tensor-model-parallel-size {opts.tensor_model_parallel_size}: "
                              "must be at least 1")
    config = read_config(opts.hf)
    target, flags = megatron_flags(config, f"--hf {opts.hf}")
    check_layout(flags, opts.tensor_model_parallel_size, opts.hf)
    try:
        tokenizer = AutoTokenizer.from_pretrained(opts.hf)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a bad folder
        raise ConversionError(f"--hf {opts.hf}: no tokenizer transformers can load offline "
                              f"({str(exc).splitlines()[0][:200]})") from None
    hf_weights = read_weights(opts.hf)
    final = os.path.abspath(opts.save)
    with writing(opts.save) as tmp:
        tokenizer.save_pretrained(os.path.join(tmp, TOKENIZER_DIR))
        tokens = dict(flags, **{"tokenizer-type": "HuggingFaceTokenizer",
                                "tokenizer-model": os.path.join(tmp, TOKENIZER_DIR)})
        args, launch = model_flags.parse_model_args(
            [*argv_of(tokens), *model_flags.device_flags(cpu=True, bf16=False)], cpu=True)
        megatron_tokenizer = model_flags.build_tokenizer(args)
        vocab = int(megatron_tokenizer.vocab_size)
        divisor = opts.make_vocab_size_divisible_by or vocabulary_divisor(
            vocab, opts.tensor_model_parallel_size)
        flags["make-vocab-size-divisible-by"] = divisor
        flags["tokenizer-type"] = "HuggingFaceTokenizer"
        flags["tokenizer-model"] = os.path.join(final, TOKENIZER_DIR)
        rows = -(-vocab // (divisor * opts.tensor_model_parallel_size)) \
            * divisor * opts.tensor_model_parallel_size
        args.make_vocab_size_divisible_by = divisor
        args.padded_vocab_size = rows
        args.tokenizer_model = flags["tokenizer-model"]
        args.entry_argv = argv_of(flags)
        _write_checkpoint(args, launch, hf_weights, target, rows, vocab, tmp, opts.hf,
                          opts.tensor_model_parallel_size)
        with open(os.path.join(tmp, YAML_NAME), "w") as f:
            f.write(f"# {target} from {os.path.abspath(opts.hf)} (tools/import_hf.py): the "
                    f"model flags for pretrain_gpt.py --config\n")
            yaml.safe_dump(flags, f, sort_keys=False)
    padding = "no padding rows" if rows == vocab else \
        f"{rows - vocab} padding rows at the mean embedding"
    print(f"[import] {opts.hf} ({target}) -> {opts.save}: vocabulary {vocab}, {rows} rows "
          f"({padding}; loads under --tensor-model-parallel-size "
          f"{opts.tensor_model_parallel_size} with --make-vocab-size-divisible-by {divisor})")
    print(f"[import] continue pretraining: python pretrain_gpt.py --config "
          f"{os.path.join(opts.save, YAML_NAME)} --load {opts.save} --save {opts.save} "
          f"--data-path ... --micro-batch-size ... --global-batch-size ... --lr ... "
          f"--train-iters ...")
    return 0


def _write_checkpoint(args, launch, hf_weights: dict, target: str, rows: int, vocab: int,
                      folder: str, where: str, tensor_parallel: int) -> None:
    """The megatron model built from ``args`` (with the layers of ``launch``) and the
    converted weights, saved as a release checkpoint under ``folder`` with its configuration
    snapshot."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state
    from megatron.training.checkpointing import _build_sharded_state_dict_metadata

    from megagpt.hf import weights
    from megagpt.inference import loading
    from megagpt.inference.architecture import Architecture
    from megagpt.inference.world import megatron_world
    from megagpt.resilience import checksums, config_snapshot
    from megagpt.resilience.checkpoint_guard import TRACKER

    release = os.path.join(folder, TRACKER_RELEASE)
    with megatron_world(args):
        model = loading.build_model(args, launch)
        arch = Architecture.of(model)
        converted = weights.from_transformers(hf_weights, arch, target, rows, vocab,
                                              f"--hf {where}")
        own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        missing = sorted(set(own) - set(converted))
        if missing:
            raise ConversionError(f"--hf {where}: nothing converts to {missing[0]}")
        for name, tensor in own.items():
            source = converted[name]
            if tuple(source.shape) != tuple(tensor.shape):
                raise ConversionError(f"--hf {where}: {name} is {tuple(source.shape)} after "
                                      f"conversion, the model has {tuple(tensor.shape)}")
            with torch.no_grad():
                tensor.copy_(source.to(tensor.dtype))
        metadata = _build_sharded_state_dict_metadata(args)
        sharded = model.sharded_state_dict(metadata={
            **metadata, "dp_cp_group": parallel_state.get_data_parallel_group(
                with_context_parallel=True)})
        os.makedirs(release)
        state = {"model": sharded, "args": args, "checkpoint_version": 3.0, "iteration": 0}
        dist_checkpointing.save(state, release, content_metadata=metadata)
    # the snapshot's layout is the one the vocabulary was padded for (what loads it)
    args.tensor_model_parallel_size = tensor_parallel
    config_snapshot.write(release, args, 0)
    # the loader checks the files against these, as it does a training run's checkpoints
    checksums.write_manifest(release, checksums.digest_files(
        release, checksums.checkpoint_files(release))[0])
    with open(os.path.join(folder, TRACKER), "w") as f:
        f.write(TRACKER_RELEASE)


def main(argv: list[str] | None = None) -> int:
    from megagpt.inference.world import quiet_megatron

    quiet_megatron()
    opts = build_parser().parse_args(argv)
    try:
        return run(opts)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

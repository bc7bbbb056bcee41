"""A trained checkpoint as a Hugging Face transformers model folder.

    python tools/export_hf.py --load CKPT --output DIR [--dtype bf16|fp32] [--overwrite]
        [megatron model flags ...]

Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` and the tokenizer's
files, which ``AutoModelForCausalLM.from_pretrained(DIR)`` and
``AutoTokenizer.from_pretrained(DIR)`` load offline. GPT-2-style models (learned positions,
LayerNorm, GeLU) become ``GPT2LMHeadModel``, Llama-style ones (RoPE, RMSNorm, SwiGLU)
``LlamaForCausalLM`` (``megagpt.hf.architectures``); anything else is refused in one line.
The vocabulary's padding rows are dropped. ``--dtype`` defaults to the precision the model
was trained in (the export is then lossless). The checkpoint loads on the CPU whatever
layout it was saved under; the folder appears whole or not at all.
"""

from __future__ import annotations

import argparse
import os
import sys

from megagpt.hf.architectures import ConversionError

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/export_hf.py", allow_abbrev=False,
        description="Write a checkpoint as a Hugging Face transformers model folder.")
    p.add_argument("--load", required=True, metavar="CKPT")
    p.add_argument("--output", required=True, metavar="DIR")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="weights' precision (default: the precision the model trained in)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    return p


def transformers_tokenizer(prepared):
    """The transformers tokenizer under megatron's, whose files the folder gets."""
    from transformers import PreTrainedTokenizerBase

    from megagpt.inference.model_flags import describe_tokenizer

    hf = getattr(getattr(prepared.tokenizer, "_tokenizer", None), "tokenizer", None)
    if not isinstance(hf, PreTrainedTokenizerBase):
        raise ConversionError(
            f"the tokenizer ({describe_tokenizer(prepared.args)}) has no transformers files to "
            "export; give the tokenizer the model was trained with as --tokenizer-type "
            "GPT2BPETokenizer or HuggingFaceTokenizer")
    return hf


def trained_dtype(prepared) -> str:
    saved = prepared.saved
    return "bf16" if saved is not None and saved.transformer.get("bf16") else "fp32"


def write_folder(folder: str, tensors: dict, config, bos: int, eos: int) -> None:
    """config.json, generation_config.json and model.safetensors into ``folder``."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    config.save_pretrained(folder)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos).save_pretrained(folder)
    # each tensor with its own storage: safetensors refuses views into a larger tensor
    own = {k: v.clone() for k, v in tensors.items()}
    save_file(own, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def run(opts, overrides: list[str]) -> int:
    import torch

    from megagpt.hf import weights
    from megagpt.hf.architectures import transformers_class, transformers_config
    from megagpt.hf.folder import check_output, writing
    from megagpt.inference import loading
    from megagpt.inference.architecture import Architecture
    from megagpt.inference.world import megatron_world

    check_output(opts.output, "--output", opts.overwrite)
    prepared = loading.prepare(opts.load, overrides, cpu=True)
    tokenizer = transformers_tokenizer(prepared)
    dtype = opts.dtype or trained_dtype(prepared)
    with megatron_world(prepared.args):
        model = loading.build_model(prepared.args, prepared.launch)
        arch = Architecture.of(model)
        try:
            target = transformers_class(arch)
        except ConversionError as exc:
            raise ConversionError(f"--load {prepared.folder}: {exc}") from None
        loading.load_weights(model, prepared.folder)
        tensors = weights.to_transformers(model.state_dict(), arch, target, prepared.vocab_size,
                                          getattr(torch, DTYPES[dtype]))
    eod = int(prepared.tokenizer.eod)
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eod
    config = transformers_config(arch, target, prepared.vocab_size, bos, eod, DTYPES[dtype])
    with writing(opts.output) as tmp:
        write_folder(tmp, tensors, config, bos, eod)
        tokenizer.save_pretrained(tmp)
    count = sum(t.numel() for t in tensors.values())
    print(f"[export] {prepared.folder} -> {opts.output}: {target}, {arch.num_layers} layers, "
          f"{count / 1e6:.1f}M parameters, {DTYPES[dtype]}, vocabulary {prepared.vocab_size} "
          f"(of {arch.padded_vocab_size} rows); load with "
          f"AutoModelForCausalLM.from_pretrained({opts.output!r})")
    return 0


def main(argv: list[str] | None = None) -> int:
    from megagpt.inference.world import run_tool

    return run_tool(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())

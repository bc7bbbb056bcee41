"""Loss and perplexity of a checkpoint on held-out text.

    python tools/perplexity.py --load CKPT --input held_out.txt [more files] [--cpu] [--json]
    python tools/perplexity.py --load CKPT --data-path data/corpus_text_document

Text inputs (``.txt``: one document per file; anything else jsonl with ``--json-key``,
default ``text``) are tokenized with the checkpoint's tokenizer and each document followed
by the end-of-document token, as ``tools/preprocess_data.py --append-eod`` writes them; a
preprocessed prefix is read as it is. The documents, one stream in order, are cut into
windows of ``--seq-length`` tokens (default: the model's) that each predict their next
``seq-length`` tokens, so every token after the first is predicted once with up to a
window of context. Loss: mean negative log-likelihood per predicted token over the real
vocabulary (megatron's padding rows are no tokens; the exported model has none either), in
nats; perplexity = exp(loss).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

import numpy as np
import torch

from megagpt.errors import UserError


class PerplexityError(UserError, ValueError):
    """Held-out data that cannot be read or is too short."""


@dataclass(frozen=True)
class Result:
    loss: float
    tokens: int  # predicted tokens
    windows: int
    seq_length: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    def as_json(self) -> dict:
        return {"loss": self.loss, "perplexity": self.perplexity, "tokens": self.tokens,
                "windows": self.windows, "seq_length": self.seq_length}


def text_token_stream(paths: list[str], key: str, tokenizer) -> np.ndarray:
    """Every document of ``paths`` tokenized, each followed by the end-of-document token."""
    from megagpt.data import readers

    pieces = []
    try:
        for text, _, _ in readers.iter_texts(readers.expand_inputs(paths), key):
            pieces.append(np.asarray(tokenizer.tokenize(text), dtype=np.int64))
            pieces.append(np.asarray([tokenizer.eod], dtype=np.int64))
    except readers.InputError as exc:  # a RecordError says "file:line: reason: detail"
        raise PerplexityError(str(exc)) from None
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def prefix_token_stream(prefix: str) -> np.ndarray:
    """The documents of a preprocessed ``.bin/.idx`` prefix, concatenated in order."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if not IndexedDataset.exists(prefix):
        raise PerplexityError(f"--data-path {prefix}: no {prefix}.bin / {prefix}.idx")
    dataset = IndexedDataset(prefix)
    return np.concatenate([np.asarray(dataset[i], dtype=np.int64) for i in range(len(dataset))])


def windows(stream: np.ndarray, seq_length: int) -> list[np.ndarray]:
    """Windows of ``seq_length + 1`` tokens every ``seq_length`` tokens (the last one may be
    shorter): window ``i`` predicts stream positions ``i*seq+1 .. (i+1)*seq``."""
    out = []
    for start in range(0, max(len(stream) - 1, 0), seq_length):
        piece = stream[start:start + seq_length + 1]
        if len(piece) >= 2:
            out.append(piece)
    return out


@torch.no_grad()
def evaluate(model, stream: np.ndarray, seq_length: int, vocab_size: int, device,
             batch_size: int = 8) -> Result:
    """Mean next-token loss of ``model`` over ``stream`` (see the module docstring)."""
    pieces = windows(stream, seq_length)
    if not pieces:
        raise PerplexityError(f"the held-out text has {len(stream)} tokens; at least 2 are "
                              "needed")
    total, count = 0.0, 0
    by_length: dict[int, list[np.ndarray]] = {}
    for piece in pieces:
        by_length.setdefault(len(piece), []).append(piece)
    for length, group in by_length.items():
        for start in range(0, len(group), batch_size):
            batch = torch.as_tensor(np.stack(group[start:start + batch_size]), device=device)
            tokens, labels = batch[:, :-1], batch[:, 1:]
            positions = torch.arange(length - 1, device=device).expand_as(tokens)
            logits = model(tokens, positions, None, runtime_gather_output=True)
            log_probs = torch.log_softmax(logits[..., :vocab_size].float(), dim=-1)
            total -= float(log_probs.gather(-1, labels.unsqueeze(-1)).sum())
            count += labels.numel()
    return Result(total / count, count, len(pieces), seq_length)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/perplexity.py", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, metavar="CKPT")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="FILE",
                     help=".txt files (one document each) or jsonl files, globs allowed")
    src.add_argument("--data-path", dest="data_prefix", metavar="PREFIX",
                     help="a preprocessed dataset (PREFIX.bin / PREFIX.idx)")
    p.add_argument("--json-key", default="text", help="the jsonl key holding the text")
    p.add_argument("--eval-seq-length", type=int, default=None, metavar="S",
                   help="window length (default: the model's --seq-length)")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="evaluate only the first N tokens of the stream")
    p.add_argument("--batch-size", type=int, default=8, metavar="B")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (fp32)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="weights on the GPU (default bf16)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(opts, overrides: list[str]) -> int:
    from megagpt.inference import loading

    loading.require_device(opts.cpu)
    prepared = loading.prepare(opts.load, overrides, cpu=opts.cpu, bf16=opts.dtype == "bf16")
    if opts.input:
        stream, source = text_token_stream(opts.input, opts.json_key, prepared.tokenizer), \
            " ".join(opts.input)
    else:
        stream, source = prefix_token_stream(opts.data_prefix), opts.data_prefix
    if opts.max_tokens:
        stream = stream[:opts.max_tokens]
    seq_length = opts.eval_seq_length or prepared.args.seq_length
    if not 1 <= seq_length <= prepared.args.max_position_embeddings:
        raise PerplexityError(f"--eval-seq-length {seq_length}: must be between 1 and the "
                              f"model's {prepared.args.max_position_embeddings} positions")
    too_big = stream[stream >= prepared.vocab_size]
    if too_big.size:
        raise PerplexityError(f"{source}: token id {int(too_big[0])} is outside the "
                              f"checkpoint's vocabulary of {prepared.vocab_size}")
    with loading.loaded(prepared) as (model, device):
        result = evaluate(model, stream, seq_length, prepared.vocab_size, device,
                          opts.batch_size)
    if opts.json:
        print(json.dumps({**result.as_json(), "load": prepared.folder, "input": source}))
    else:
        print(f"[perplexity] {prepared.folder} on {source}: loss {result.loss:.4f}, "
              f"perplexity {result.perplexity:.2f} over {result.tokens} predicted tokens "
              f"({result.windows} windows of up to {seq_length})")
    return 0


def main(argv: list[str] | None = None) -> int:
    from megagpt.inference.world import run_tool

    return run_tool(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Tokenizers for training and preprocessing, offline.

``build_tokenizer(args)`` is what the training entry calls. It behaves like megatron's
``megatron.core.tokenizers.utils.build_tokenizer.build_tokenizer`` except for
``GPT2BPETokenizer``: megatron routes that through ``AutoTokenizer.from_pretrained("gpt2", ...)``,
which needs the HuggingFace hub even when ``--vocab-file``/``--merge-file`` are given. We write
the two files into a local HuggingFace folder (vocab.json, merges.txt, tokenizer_config.json
naming GPT2Tokenizer) and load that through megatron's own HuggingFace path instead: same class,
same ids, no network.

For preprocessing, ``fast_encoder_for(...)`` returns a batch encoder that gives the same ids as the
megatron tokenizer but faster: tiktoken built from the GPT-2 files, or the HuggingFace Rust
backend's ``encode_batch`` for tokenizer folders. It is checked against the megatron tokenizer on
probe texts before use; on any difference we fall back to the megatron tokenizer itself.
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from megagpt.data.cache import cache_root, publish_dir

logger = logging.getLogger(__name__)

GPT2_TYPE = "GPT2BPETokenizer"
ENDOFTEXT = "<|endoftext|>"
# GPT-2's pre-tokenisation regex (tiktoken's r50k pattern; the same as in OpenAI's encoder.py).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Fields megatron's build_tokenizer (or _set_padded_vocab_size) reads that are not in its
# "tokenizer" argument group; defaults as in megatron.training.arguments.
_EXTRA_DEFAULTS = {
    "make_vocab_size_divisible_by": 128,
    "tensor_model_parallel_size": 1,
    "rank": 0,
    "tokenizer_prompt_format": None,
    "image_tag_type": None,
    "force_system_message": False,
    "sft_tokenizer_prompt_format": None,
}


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add megatron's own tokenizer flags (--tokenizer-type, --vocab-file, --merge-file, ...)."""
    from megatron.training.arguments import _add_tokenizer_args

    return _add_tokenizer_args(parser)


def tokenizer_namespace(**overrides) -> argparse.Namespace:
    """An args namespace with every field megatron's build_tokenizer reads, at megatron's defaults."""
    ns = add_tokenizer_args(argparse.ArgumentParser(add_help=False)).parse_args([])
    for k, v in _EXTRA_DEFAULTS.items():
        setattr(ns, k, v)
    for k, v in overrides.items():
        setattr(ns, k, v)
    return ns


def complete_namespace(args: argparse.Namespace) -> argparse.Namespace:
    """A shallow copy of ``args`` with any missing tokenizer field filled with megatron's default."""
    full = tokenizer_namespace()
    for k, v in vars(args).items():
        setattr(full, k, v)
    return full


# --------------------------------------------------------------------------- GPT-2 as an HF folder


_GPT2_HF_CONFIG = {
    "tokenizer_class": "GPT2Tokenizer",
    "add_prefix_space": False,
    "add_bos_token": False,
    "clean_up_tokenization_spaces": False,
    "bos_token": ENDOFTEXT,
    "eos_token": ENDOFTEXT,
    "unk_token": ENDOFTEXT,
    "model_max_length": int(1e30),  # no limit: HF would warn on every long document
}


def gpt2_hf_folder(vocab_file: str, merge_file: str, cache_dir=None) -> str:
    """A local HuggingFace tokenizer folder for GPT-2 BPE files, cached by content hash.

    ``clean_up_tokenization_spaces`` is off so that decoding gives back the exact text; the
    special tokens are GPT-2's (``<|endoftext|>`` for bos/eos/unk), as the hub's ``gpt2`` has.
    """
    for p in (vocab_file, merge_file):
        if not p or not os.path.isfile(p):
            raise FileNotFoundError(f"GPT-2 BPE file not found: {p}")
    config = json.dumps(_GPT2_HF_CONFIG, indent=1).encode()
    vocab, merges = Path(vocab_file).read_bytes(), Path(merge_file).read_bytes()
    digest = hashlib.sha256(b"\0".join([vocab, merges, config])).hexdigest()[:16]
    root = cache_root(cache_dir) / "tokenizers"
    final = root / f"gpt2-{digest}"
    if (final / "tokenizer_config.json").is_file():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "vocab.json").write_bytes(vocab)
    (tmp / "merges.txt").write_bytes(merges)
    (tmp / "special_tokens_map.json").write_text(
        json.dumps({k: ENDOFTEXT for k in ("bos_token", "eos_token", "unk_token")}))
    (tmp / "tokenizer_config.json").write_bytes(config)  # last: its presence marks a whole folder
    return str(publish_dir(tmp, final))


def _resolve_gpt2_files(args, say=None) -> tuple[str, str]:
    if args.vocab_file and args.merge_file:
        return args.vocab_file, args.merge_file
    if args.vocab_file or args.merge_file:
        raise ValueError("GPT2BPETokenizer needs both --vocab-file and --merge-file (or neither, "
                         "to use the cached GPT-2 files)")
    from megagpt.data.gpt2_files import ensure_gpt2_files
    from megagpt.log import log

    files = ensure_gpt2_files()
    (say or log)(f"tokenizer: GPT2BPETokenizer without --vocab-file/--merge-file: the cached "
                 f"GPT-2 files {files.vocab_file} and {files.merge_file} (OpenAI's encoder.json "
                 "and vocab.bpe)")
    return files.vocab_file, files.merge_file


def build_tokenizer(args, say=None, **kwargs):
    """Build the global tokenizer from megatron's parsed args; GPT2BPETokenizer works offline.

    Every type other than GPT2BPETokenizer goes to megatron's ``build_tokenizer`` unchanged,
    a HuggingFace hub name in the local cache while the hub cannot be asked with
    huggingface_hub offline for the load (``tokenizer_files.hub_tokenizer_load``; ``say``
    is given the line saying so, megagpt.log.log by default).
    For GPT2BPETokenizer the vocab/merge files (``--vocab-file``/``--merge-file``, or the cached
    GPT-2 files when both are absent) become a local HF folder loaded through megatron's
    ``HuggingFaceTokenizer`` path. ``args.padded_vocab_size`` is set exactly as megatron does:
    only when ``args.pad_vocab_size`` is true and it is still None.
    """
    from megatron.core.tokenizers.utils.build_tokenizer import _set_padded_vocab_size
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as mcore_build

    from megagpt.data.tokenizer_files import hub_tokenizer_load

    if args.tokenizer_type != GPT2_TYPE:
        with hub_tokenizer_load(args, say):
            return mcore_build(args, **kwargs)
    vocab_file, merge_file = _resolve_gpt2_files(args, say)
    local = copy.copy(args)
    local.tokenizer_type = "HuggingFaceTokenizer"
    local.tokenizer_model = gpt2_hf_folder(vocab_file, merge_file)
    local.vocab_file = None  # the folder holds them; AutoTokenizer must not get them twice
    local.merge_file = None
    local.pad_vocab_size = False
    tokenizer = mcore_build(local, **kwargs)
    if getattr(args, "pad_vocab_size", True):
        _set_padded_vocab_size(args, tokenizer)
    return tokenizer


# --------------------------------------------------------------------------- fast batch encoders


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map (from OpenAI's encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def gpt2_tiktoken_encoding(vocab_file: str, merge_file: str):
    """Cached by the files' paths, sizes and modification times (building takes ~0.3 s)."""
    st = [os.stat(p) for p in (vocab_file, merge_file)]
    key = (os.path.abspath(vocab_file), os.path.abspath(merge_file),
           *[(s.st_size, s.st_mtime_ns) for s in st])
    return _gpt2_tiktoken_encoding(key)


@functools.lru_cache(maxsize=4)
def _gpt2_tiktoken_encoding(key):
    return _build_gpt2_tiktoken_encoding(key[0], key[1])


def _build_gpt2_tiktoken_encoding(vocab_file: str, merge_file: str):
    """A tiktoken Encoding from GPT-2 style files, or None if the files don't fit tiktoken's model.

    tiktoken needs each token's rank to equal its merge priority; we derive ranks from the merge
    order and require them to equal the ids in vocab.json (true for OpenAI's GPT-2 files).
    """
    import tiktoken

    byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}

    def to_bytes(token: str) -> bytes:
        return bytes(byte_decoder[ch] for ch in token)

    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(merge_file, encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = [ln.split() for ln in lines if ln and not ln.startswith("#version")]
    try:
        ids = {to_bytes(tok): i for tok, i in vocab.items() if tok != ENDOFTEXT}
        ranks = {bytes([b]): ids[bytes([b])] for b in range(256)}
        for a, b in merges:
            ranks[to_bytes(a) + to_bytes(b)] = ids[to_bytes(a) + to_bytes(b)]
    except (KeyError, ValueError):
        return None
    if ranks != ids or sorted(ranks.values()) != list(range(len(ranks))):
        return None
    # merge priority must follow the file order, i.e. ids ascending along the merges
    merge_ids = [ranks[to_bytes(a) + to_bytes(b)] for a, b in merges]
    if merge_ids != sorted(merge_ids):
        return None
    special = {ENDOFTEXT: vocab[ENDOFTEXT]} if ENDOFTEXT in vocab else {}
    return tiktoken.Encoding(
        name="gpt2-local", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=special,
        explicit_n_vocab=len(ranks) + len(special))


class MegatronEncoder:
    """One document at a time through the megatron tokenizer (the reference; slowest)."""

    name = "megatron tokenizer.tokenize"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(self.tokenizer.tokenize(t), dtype=np.int64) for t in texts]


class TiktokenEncoder:
    """GPT-2 BPE through tiktoken; special tokens in the text are encoded as specials, as HF does."""

    name = "tiktoken (GPT-2 files)"

    def __init__(self, encoding):
        self.encoding = encoding

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        enc = self.encoding.encode_to_numpy
        return [enc(t, allowed_special="all") for t in texts]


class HFBackendEncoder:
    """The HuggingFace tokenizer's Rust backend, ``encode_batch``."""

    name = "HuggingFace tokenizers encode_batch"

    def __init__(self, backend, add_special_tokens: bool):
        self.backend = backend
        self.add_special_tokens = add_special_tokens

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        out = self.backend.encode_batch(texts, add_special_tokens=self.add_special_tokens)
        return [np.asarray(e.ids, dtype=np.int64) for e in out]


PROBE_TEXTS = [
    "Hello world",
    " leading space, trailing space ",
    "It's we'll they're I'd you've DON'T",
    "Numbers 12345 67,890.12 and 3.14159",
    "tabs\tand\nnewlines\n\n\nand   runs   of spaces   ",
    "Unicode: café naïve – “quotes” 日本語 😀 Ωμέγα",
    f"special{ENDOFTEXT}inside and at the end {ENDOFTEXT}",
    "<|endoftext",
    "x",
    "  \n ",
    "To be, or not to be: that is the question:\nWhether 'tis nobler in the mind to suffer",
]


def _agrees(encoder, tokenizer, texts) -> bool:
    try:
        got = encoder.encode_batch(texts)
        return all(list(map(int, g)) == list(map(int, tokenizer.tokenize(t)))
                   for g, t in zip(got, texts))
    except Exception:  # a fast path that cannot even run is simply not used
        return False


def fast_encoder_for(tokenizer, args, probe_texts=None):
    """The fastest encoder whose ids equal ``tokenizer.tokenize`` on the probe texts."""
    texts = list(PROBE_TEXTS) + list(probe_texts or [])
    candidates = []
    hf = getattr(getattr(tokenizer, "_tokenizer", None), "tokenizer", None)
    if args.tokenizer_type in (GPT2_TYPE, "HuggingFaceTokenizer") and not args.special_tokens:
        folder = args.tokenizer_model if args.tokenizer_type == "HuggingFaceTokenizer" else None
        vocab, merges = getattr(args, "vocab_file", None), getattr(args, "merge_file", None)
        if folder and os.path.isdir(folder):
            vocab, merges = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
        if args.tokenizer_type == GPT2_TYPE and not (vocab and merges):
            from megagpt.data.gpt2_files import ensure_gpt2_files

            f = ensure_gpt2_files()
            vocab, merges = f.vocab_file, f.merge_file
        if vocab and merges and os.path.isfile(vocab) and os.path.isfile(merges):
            enc = gpt2_tiktoken_encoding(vocab, merges)
            if enc is not None:
                candidates.append(TiktokenEncoder(enc))
    backend = getattr(hf, "backend_tokenizer", None) if hf is not None else None
    if backend is not None:
        include = getattr(tokenizer._tokenizer, "include_special_tokens", True)
        candidates.append(HFBackendEncoder(backend, add_special_tokens=include))
    for enc in candidates:
        if _agrees(enc, tokenizer, texts):
            return enc
        logger.warning("fast encoder %s disagrees with the megatron tokenizer; not used", enc.name)
    return MegatronEncoder(tokenizer)

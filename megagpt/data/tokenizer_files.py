"""The tokenizer's files, checked before it is loaded, and a failed load as one line.

``--vocab-file /missing`` otherwise ends in a ``FileNotFoundError`` traceback from the
tokenizer code, and a damaged file in whatever its parser raises (``JSONDecodeError``,
a sentencepiece ``RuntimeError``, ``OSError`` from transformers).
"""

from __future__ import annotations

import os
import re

from megagpt.errors import UserError

# Tokenizer types whose --tokenizer-model is a file or a folder on disk (HuggingFace's may
# also be a hub name, which megatron looks up online).
MODEL_FILE_TYPES = {"SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                    "TikTokenizer", "MultimodalTokenizer", "SFTTokenizer"}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class TokenizerError(UserError, ValueError):
    """The tokenizer's files are missing or do not load; the message names the flag."""


def _looks_like_hub_name(value: str) -> bool:
    return bool(_HUB_NAME.match(value)) and not value.startswith((".", "/", "~"))


def check_tokenizer_files(args) -> None:
    """TokenizerError naming the first tokenizer file flag whose file is not there (and
    the vocabulary size a NullTokenizer is made with: it has no files)."""
    if args.tokenizer_type == "NullTokenizer" and not (getattr(args, "vocab_size", None) or 0) > 0:
        raise TokenizerError(
            f"--tokenizer-type NullTokenizer needs --vocab-size N > 0 (the number of token "
            f"ids; given: {getattr(args, 'vocab_size', None)}): the data's ids are used as "
            "they are")
    for attr, flag in (("vocab_file", "--vocab-file"), ("merge_file", "--merge-file")):
        path = getattr(args, attr, None)
        if path and not os.path.isfile(path):
            what = "a folder, not a file" if os.path.isdir(path) else "no such file"
            raise TokenizerError(f"{flag} {path}: {what} (tokenizer {args.tokenizer_type})")
    model = getattr(args, "tokenizer_model", None)
    if not model or os.path.exists(model):
        return
    if args.tokenizer_type == "HuggingFaceTokenizer" and _looks_like_hub_name(model):
        return  # a hub name: megatron asks the hub (an error offline, caught at load time)
    if args.tokenizer_type in MODEL_FILE_TYPES or args.tokenizer_type == "HuggingFaceTokenizer":
        raise TokenizerError(f"--tokenizer-model {model}: no such file or folder "
                             f"(tokenizer {args.tokenizer_type})")


def load_error(exc: BaseException, args) -> TokenizerError:
    """A failed tokenizer load, in one line naming the tokenizer flags."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    named = [f"--tokenizer-type {args.tokenizer_type}"]
    for attr in ("tokenizer_model", "vocab_file", "merge_file"):
        if getattr(args, attr, None):
            named.append(f"--{attr.replace('_', '-')} {getattr(args, attr)}")
    return TokenizerError(f"cannot load the tokenizer ({' '.join(named)}): "
                          f"{type(exc).__name__}: {text[:300]}")

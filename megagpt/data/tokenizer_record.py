"""Which tokenizer made a dataset: ``{prefix}.tokenizer.json`` beside ``{prefix}.bin/.idx``.

Token ids mean nothing without the tokenizer that produced them: GPT-2 BPE data trained
with another vocabulary stops inside the embedding (``IndexError`` on a CPU, a device-side
assert on a GPU) or, worse, trains on the wrong words. Preprocessing writes this record with
the dataset; the training entry compares it with its own tokenizer before building the model
(``megagpt.preflight.data_check``).

The record holds the tokenizer's type, its vocabulary size (unpadded, as the tokenizer
reports it), the sha256 of each file it was loaded from (by content, so the same files at
another path compare equal), and facts about the data the check uses without reading the
``.bin``: the largest token id, the dtype, the document and token counts.

Kept free of torch and megatron imports: preprocessing imports it before its first document.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field

SUFFIX = ".tokenizer.json"
FORMAT = 1

# Tokenizer arguments that name files the tokenizer is loaded from.
FILE_ARGS = ("vocab_file", "merge_file", "tokenizer_model")
# The files of a HuggingFace tokenizer folder that decide its ids (weights are not hashed).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
                      "merges.txt", "special_tokens_map.json", "added_tokens.json",
                      "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


def record_path(prefix: str) -> str:
    return prefix + SUFFIX


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_hashes(args) -> dict[str, str]:
    """``{role: sha256}`` of the files the tokenizer named by ``args`` is loaded from.

    Files that do not exist here (a hub name, a path on another machine) are left out.
    """
    hashes = {}
    for name in FILE_ARGS:
        path = getattr(args, name, None)
        if not path:
            continue
        if os.path.isfile(path):
            hashes[name] = _sha256(path)
        elif os.path.isdir(path):
            for member in HF_TOKENIZER_FILES:
                full = os.path.join(path, member)
                if os.path.isfile(full):
                    hashes[f"{name}/{member}"] = _sha256(full)
    return hashes


@dataclass(frozen=True)
class TokenizerIdentity:
    """What decides a tokenizer's ids."""

    tokenizer_type: str
    vocab_size: int | None
    files: dict = field(default_factory=dict)  # role -> sha256

    @classmethod
    def of(cls, args, vocab_size: int | None) -> "TokenizerIdentity":
        return cls(args.tokenizer_type, int(vocab_size) if vocab_size else None, file_hashes(args))

    def describe(self) -> str:
        files = ", ".join(f"{role} {digest[:12]}" for role, digest in sorted(self.files.items()))
        return (f"{self.tokenizer_type} (vocab {self.vocab_size}"
                + (f"; {files}" if files else "") + ")")


def differences(recorded: TokenizerIdentity, current: TokenizerIdentity) -> list[str]:
    """How ``current`` differs from the tokenizer that made the data (empty: the same)."""
    found = []
    if recorded.tokenizer_type != current.tokenizer_type:
        found.append(f"type {recorded.tokenizer_type} there, {current.tokenizer_type} here")
    if recorded.vocab_size and current.vocab_size and recorded.vocab_size != current.vocab_size:
        found.append(f"vocabulary size {recorded.vocab_size} there, {current.vocab_size} here")
    # Files are compared by content; a role only one side has (a file not present on this
    # machine) cannot be compared and is not counted as a difference.
    for role in sorted(set(recorded.files) & set(current.files)):
        if recorded.files[role] != current.files[role]:
            found.append(f"{role} sha256 {recorded.files[role][:12]} there, "
                         f"{current.files[role][:12]} here")
    if not found and recorded.files and current.files and \
            not set(recorded.files) & set(current.files):
        found.append("none of the tokenizer's files can be compared (different file kinds)")
    return found


@dataclass(frozen=True)
class DataRecord:
    """A dataset's record: its tokenizer and what the data check needs from the .bin."""

    tokenizer: TokenizerIdentity
    max_token_id: int | None
    dtype: str
    documents: int
    tokens: int
    append_eod: bool = False
    format: int = FORMAT

    def to_json(self) -> str:
        data = asdict(self)
        data["tool"] = "megagpt preprocess"
        return json.dumps(data, indent=1, sort_keys=True) + "\n"


def write(prefix: str, record: DataRecord, suffix_of_tmp: str = "") -> str:
    """Write the record for ``prefix`` (at ``{prefix}.tokenizer.json{suffix_of_tmp}``)."""
    path = record_path(prefix) + suffix_of_tmp
    with open(path, "w", encoding="utf-8") as f:
        f.write(record.to_json())
    return path


class RecordError(ValueError):
    """A record exists but cannot be read (damaged, or written by a newer version)."""


def read(prefix: str) -> DataRecord | None:
    """The record beside ``prefix``, None when there is none; RecordError when unreadable."""
    path = record_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        tokenizer = TokenizerIdentity(**data["tokenizer"])
        if int(data.get("format", 0)) > FORMAT:
            raise RecordError(f"{path}: format {data['format']} is newer than this megagpt's "
                              f"({FORMAT})")
        return DataRecord(tokenizer=tokenizer, max_token_id=data.get("max_token_id"),
                          dtype=data["dtype"], documents=int(data["documents"]),
                          tokens=int(data["tokens"]), append_eod=bool(data.get("append_eod")),
                          format=int(data.get("format", FORMAT)))
    except RecordError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RecordError(f"{path}: unreadable tokenizer record ({exc})") from None

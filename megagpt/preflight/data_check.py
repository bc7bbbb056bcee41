"""The training data, checked before the model is built (and in ``--dry-run``).

Megatron opens the datasets after the whole start-up (process groups, model, optimizer) and
reports a bad one with an assertion deep in its dataset builder, followed by an
``AttributeError`` from the half-built ``IndexedDataset``'s ``__del__``; data tokenized
with another vocabulary is not noticed at all until the embedding indexes past its table.
Here, for every prefix of ``--data-path`` and of the per-split paths
(``--train-data-path`` ..., ``--data-args-path``, ``--per-split-data-args-path``):

1. the blend parses: ``PREFIX`` ..., or ``WEIGHT PREFIX`` pairs with weights >= 0, not all 0
   (megatron reads an odd-length list with numbers in it as prefixes named ``0.5``);
2. ``PREFIX.bin`` and ``PREFIX.idx`` exist, the index is megatron's format, and the ``.bin``
   is as long as the index says;
3. the tokenizer that made the data (``PREFIX.tokenizer.json``, written by preprocessing)
   is this run's: type, vocabulary size and files; ``--allow-data-tokenizer-mismatch`` lets
   a deliberate mismatch through, and data without a record gets a warning;
4. the data's token ids fit this run's vocabulary: the record's largest id, else the
   ``.bin`` itself (read in full up to ``SCAN_LIMIT_BYTES``, else sampled);
5. every split of ``--split`` that megatron asks samples of holds at least one document
   of each prefix: megatron repeats a split's documents until it has the samples asked
   for, and with none it loops forever while building its index (a 1/1000 test share of
   a few hundred documents, with ``--eval-iters`` > 0).

Each problem is one ``DataError`` naming the flag, the prefix and the file.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from megagpt.data import indexed_format, tokenizer_record
from megagpt.data.indexed_format import IndexFacts
from megagpt.errors import UserError

# A .bin up to this size is read whole for its largest id (~1 s per GB here); a larger one
# without a record is sampled in SAMPLE_BLOCKS blocks spread over the file.
SCAN_LIMIT_BYTES = 2 << 30
SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES = 64, 1 << 20


class DataError(UserError, ValueError):
    """The training data cannot be used as given; the message names the flag and the file."""


@dataclass(frozen=True)
class DataSource:
    """One blend as megatron will read it: prefixes and optional weights, and its flag."""

    flag: str
    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None = None


# ---------------------------------------------------------------------------
# 1. Blends
# ---------------------------------------------------------------------------

def _is_weight(item: str) -> bool:
    try:
        float(item)
    except ValueError:
        return False
    # a dataset may be named like a number; its files decide
    return not (os.path.exists(item + ".bin") or os.path.exists(item + ".idx"))


def parse_blend(flag: str, items: list[str]) -> DataSource:
    """``items`` of ``flag`` as megatron reads them, or DataError when they are not a blend."""
    items = [str(i) for i in items]
    shown = f"{flag} {' '.join(items)}"
    if not items:
        raise DataError(f"{flag} is given without a dataset prefix")
    weights_at = [i for i, item in enumerate(items) if _is_weight(item)]
    if not weights_at:
        return DataSource(flag, tuple(items))
    if len(items) % 2 or weights_at != list(range(0, len(items), 2)):
        raise DataError(
            f"{shown}: a blend is WEIGHT PREFIX pairs (e.g. 0.7 a_text_document 0.3 "
            f"b_text_document), or prefixes alone; here {len(items)} items have numbers at "
            f"positions {', '.join(str(i + 1) for i in weights_at)}")
    weights = tuple(float(items[i]) for i in weights_at)
    bad = [w for w in weights if not math.isfinite(w) or w < 0]
    if bad:
        raise DataError(f"{shown}: blend weights must be finite and >= 0, got {bad[0]:g}")
    if sum(weights) <= 0:
        raise DataError(f"{shown}: the blend weights sum to 0; no dataset would be read")
    return DataSource(flag, tuple(items[i + 1] for i in weights_at), weights)


def _read_list_file(flag: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise DataError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None


def data_sources(args) -> list[DataSource]:
    """Every blend this run reads, as megatron's ``get_blend_and_blend_per_split`` will."""
    if getattr(args, "mock_data", False):
        return []
    sources = []
    if args.data_args_path:
        items = _read_list_file("--data-args-path", args.data_args_path).split()
        sources.append(parse_blend(f"--data-args-path {args.data_args_path}", items))
    elif args.data_path:
        sources.append(parse_blend("--data-path", args.data_path))
    if args.per_split_data_args_path:
        path = args.per_split_data_args_path
        flag = f"--per-split-data-args-path {path}"
        try:
            per_split = json.loads(_read_list_file(flag, path))
            splits = {split: per_split[split] for split in ("train", "valid", "test")}
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{flag}: not a JSON object with train, valid and test lists "
                            f"({type(exc).__name__}: {exc})") from None
        for split, items in splits.items():
            if items:
                items = items.split() if isinstance(items, str) else items
                sources.append(parse_blend(f"{flag} ({split})", items))
    else:
        for flag, items in (("--train-data-path", args.train_data_path),
                            ("--valid-data-path", args.valid_data_path),
                            ("--test-data-path", args.test_data_path)):
            if items:
                sources.append(parse_blend(flag, items))
    return sources


# ---------------------------------------------------------------------------
# 2. Files
# ---------------------------------------------------------------------------

def _did_you_mean(prefix: str) -> str:
    for candidate in (prefix[:-4] if prefix.endswith((".bin", ".idx")) else None,
                      f"{prefix}_text_document"):
        if candidate and os.path.isfile(candidate + ".bin") and os.path.isfile(candidate + ".idx"):
            return f"; did you mean {candidate}?"
    return ""


def read_index(flag: str, prefix: str) -> IndexFacts:
    """The .idx header of ``prefix``, after checking both files are there and agree."""
    missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if missing:
        which = " and ".join(missing) if len(missing) == 2 else missing[0]
        raise DataError(f"{flag}: {which} not found (a prefix names PREFIX.bin and "
                        f"PREFIX.idx, as preprocessing writes them){_did_you_mean(prefix)}")
    idx = prefix + ".idx"
    try:
        facts = indexed_format.read_index(idx)
    except (OSError, ValueError) as exc:
        raise DataError(f"{flag}: {idx} is not a readable megatron index ({exc})") from None
    size = os.path.getsize(prefix + ".bin")
    if size < facts.bin_bytes:
        raise DataError(f"{flag}: {prefix}.bin is {size:,} bytes but {idx} describes "
                        f"{facts.bin_bytes:,} (truncated, or the two files come from different "
                        f"runs)")
    return facts


# ---------------------------------------------------------------------------
# 3, 4. Tokenizer and ids
# ---------------------------------------------------------------------------

def largest_id(prefix: str, facts: IndexFacts) -> tuple[int, str]:
    """(the largest token id found, how it was found) by reading the .bin."""
    nbytes = facts.bin_bytes
    if nbytes == 0:
        return -1, "empty"
    data = np.memmap(prefix + ".bin", dtype=facts.dtype, mode="r",
                     shape=(nbytes // facts.dtype.itemsize,))
    if nbytes <= SCAN_LIMIT_BYTES:
        block = (64 << 20) // facts.dtype.itemsize
        top = max(int(data[i:i + block].max()) for i in range(0, len(data), block))
        return top, "read in full"
    block = SAMPLE_BLOCK_BYTES // facts.dtype.itemsize
    starts = np.linspace(0, len(data) - block, SAMPLE_BLOCKS).astype(np.int64)
    top = max(int(data[s:s + block].max()) for s in starts)
    return top, f"sampled: {SAMPLE_BLOCKS} blocks of {SAMPLE_BLOCK_BYTES >> 20} MiB"


def _dtype_holds_only_ids_below(dtype: np.dtype, vocab_size: int) -> bool:
    """True when no value of ``dtype`` can be outside the vocabulary (uint16 and GPT-2's
    50,257 ids is not such a case; uint8 data and a 50,257 vocabulary is)."""
    return dtype.kind == "u" and int(np.iinfo(dtype).max) < vocab_size


def run_tokenizer_identity(args, vocab_size: int | None) -> tokenizer_record.TokenizerIdentity:
    """This run's tokenizer as a record would describe it (GPT-2's default files resolved)."""
    if args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file or args.merge_file):
        import copy

        from megagpt.data.gpt2_files import cached_gpt2_files

        cached = cached_gpt2_files()
        if cached is not None:
            args = copy.copy(args)
            args.vocab_file, args.merge_file = cached.vocab_file, cached.merge_file
    return tokenizer_record.TokenizerIdentity.of(args, vocab_size)


def _tokenizer_flags(args) -> str:
    parts = [f"--tokenizer-type {args.tokenizer_type}"]
    for name in ("vocab_size", "vocab_file", "merge_file", "tokenizer_model"):
        value = getattr(args, name, None)
        if value and not (name == "vocab_size" and args.tokenizer_type != "NullTokenizer"):
            parts.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(parts)


@dataclass
class DataReport:
    """What the check found: prefixes checked, those without a record, .bin files read."""

    prefixes: int = 0
    without_record: list = field(default_factory=list)
    scanned: list = field(default_factory=list)


def _read_record(flag: str, prefix: str):
    try:
        return tokenizer_record.read(prefix)
    except tokenizer_record.RecordError as exc:
        raise DataError(f"{flag}: {exc}") from None


def check_prefix(flag: str, prefix: str, facts: IndexFacts, record, args, identity,
                 vocab_size: int | None, report: DataReport) -> None:
    """The tokenizer record and the ids of one prefix whose files are there."""
    if record is not None:
        differences = tokenizer_record.differences(record.tokenizer, identity)
        if differences and not getattr(args, "allow_data_tokenizer_mismatch", False):
            raise DataError(
                f"{flag} {prefix} was tokenized with {record.tokenizer.describe()}, this run "
                f"uses {_tokenizer_flags(args)}: {'; '.join(differences)}. Use the data's "
                f"tokenizer, preprocess the text again with this one, or pass "
                f"--allow-data-tokenizer-mismatch")
    if not vocab_size:
        return
    if record is not None and record.max_token_id is not None:
        top, how = record.max_token_id, f"its tokenizer record {tokenizer_record.record_path(prefix)}"
    elif _dtype_holds_only_ids_below(facts.dtype, vocab_size):
        return
    else:
        top, how = largest_id(prefix, facts)
        report.scanned.append(f"{prefix}.bin ({how})")
        how = f"{prefix}.bin, {how}"
    if top >= vocab_size:
        made_with = f"; the data was made with {record.tokenizer.describe()}" if record else ""
        raise DataError(
            f"{flag} {prefix}: token ids up to {top} ({how}), but this run's tokenizer "
            f"({_tokenizer_flags(args)}) has {vocab_size} ids (0..{vocab_size - 1}); the "
            f"embedding would be indexed past its end{made_with}")


SPLIT_NAMES = ("train", "validation", "test")


def requested_samples(args) -> tuple[int, int, int]:
    """The samples megatron asks of each split (its get_train_valid_test_num_samples)."""
    from megatron.training.training import get_train_valid_test_num_samples

    from megagpt.preflight.schedule_check import global_args

    with global_args(args):
        counts = get_train_valid_test_num_samples()
    return tuple(int(c or 0) for c in counts)


def checked_split(split: str) -> str:
    """``--split`` as megatron reads it (the numbers in it, up to three), or a DataError when
    it names no share above 0 (megatron would divide by their sum)."""
    try:
        shares = [float(number) for number in re.findall(r"[.0-9]+", split)]
    except ValueError:
        shares = None
    if shares is None or not 0 < len(shares) <= 3 or not sum(shares) > 0:
        raise DataError(f"--split {split}: wants up to three shares, not all 0, for train, "
                        "validation and test (e.g. --split 98,1,1)")
    return split


def check_split_shares(flag: str, prefix: str, facts: IndexFacts, args,
                       requested: tuple[int, int, int]) -> None:
    """DataError when a split asked for samples gets none of ``prefix``'s documents."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(
        checked_split(args.split)))
    n = facts.sequences
    for name, bookends, wanted in zip(SPLIT_NAMES, matrix, requested):
        if not wanted:
            continue
        if bookends is None:
            raise DataError(
                f"--split {args.split} gives the {name} split no share of {flag} {prefix}, but "
                f"megatron asks that split for {wanted} samples"
                + (f" (--eval-iters {args.eval_iters})" if name != "train" else "")
                + "; give it a share (e.g. --split 98,1,1)"
                + (" or ask it for none (--eval-iters 0)" if name != "train" else ""))
        # megatron's _build_megatron_dataset_splits: round(share * documents) at both ends
        documents = int(round(bookends[1] * n)) - int(round(bookends[0] * n))
        if documents <= 0:
            raise DataError(
                f"{flag} {prefix}: --split {args.split} gives the {name} split none of its {n} "
                f"documents, but megatron asks that split for {wanted} samples and would loop "
                f"forever building its index; give the {name} split a larger share, more "
                f"data, or ask it for none" + (" (--eval-iters 0)" if name != "train" else ""))


def check_data(args, vocab_size: int | None, log: Callable[[str], None]) -> DataReport:
    """Check every dataset this run reads (see the module docstring); DataError on a problem.

    ``vocab_size``: the run's tokenizer's size, unpadded (None: the ids are not checked).
    """
    report = DataReport()
    sources = data_sources(args)
    if not sources:
        return report
    # first every prefix's files and record, so that a missing file is named before any
    # deeper problem of another prefix, and the warning comes before any error
    found = {}
    for source in sources:
        for prefix in source.prefixes:
            if prefix not in found:
                facts = read_index(source.flag, prefix)
                found[prefix] = (source.flag, facts, _read_record(source.flag, prefix))
    report.prefixes = len(found)
    report.without_record = [p for p, (_, _, record) in found.items() if record is None]
    if report.without_record:
        shown = ", ".join(report.without_record[:3])
        more = f" and {len(report.without_record) - 3} more" if len(report.without_record) > 3 else ""
        log(f"warning: data: no tokenizer record ({tokenizer_record.SUFFIX}) beside "
            f"{shown}{more} (made before megagpt wrote one, or by another tool): the "
            f"tokenizer it was made with is not checked; its ids are")
    identity = run_tokenizer_identity(args, vocab_size)
    # --split divides the --data-path (or --data-args-path) datasets, not per-split ones
    split_flags = {s.flag for s in sources if s.flag == "--data-path"
                   or s.flag.startswith("--data-args-path")}
    requested = (requested_samples(args)
                 if split_flags and getattr(args, "split", None) is not None else None)
    for prefix, (flag, facts, record) in found.items():
        check_prefix(flag, prefix, facts, record, args, identity, vocab_size, report)
        if requested is not None and flag in split_flags:
            check_split_shares(flag, prefix, facts, args, requested)
    log(f"data: {report.prefixes} dataset prefix{'es' if report.prefixes != 1 else ''} "
        f"checked (files, tokenizer, ids < {vocab_size})")
    return report

"""Join several indexed datasets (``prefix.bin/.idx`` pairs) into one, in the given order.

Like upstream's ``tools/merge_datasets.py``, the output is ``{output-prefix}.bin/.idx`` (no
``_text_document`` suffix is added). Inputs are explicit prefixes or folders (every pair in a
folder, sorted by name). All inputs must have the same token dtype; each is checked (both files
present, .bin size matching its index) before anything is written, and the output is written
under temporary names and renamed at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from megagpt.data import tokenizer_record


class MergeError(Exception):
    """Bad merge input or output (one line)."""


@dataclass
class MergeResult:
    prefix: str
    inputs: list
    documents: int
    tokens: int
    dtype: str
    tokenizer_record: bool = False  # whether the output has one (the inputs agree on it)


def _strip(path: str) -> str:
    for ext in (".bin", ".idx"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


def expand_prefixes(inputs: list[str]) -> list[str]:
    """Prefixes and folders -> prefixes (a path ending in .bin/.idx counts as its prefix)."""
    out: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted({_strip(str(p)) for p in Path(item).iterdir()
                            if p.suffix in (".bin", ".idx")})
            if not found:
                raise MergeError(f"{item}: folder holds no .bin/.idx pairs")
            out.extend(found)
        else:
            out.append(_strip(item))
    return out


def _describe(prefix: str):
    """(dtype, documents, tokens) of one dataset, after checking it is whole."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise MergeError(f"{prefix}{ext}: not found")
    try:
        ds = IndexedDataset(prefix)
    except Exception as e:  # a truncated or foreign .idx
        raise MergeError(f"{prefix}.idx: not a Megatron index ({type(e).__name__}: {e})") from None
    idx = ds.index
    tokens = int(idx.sequence_lengths.sum())
    expected = tokens * idx.dtype_size
    actual = os.path.getsize(prefix + ".bin")
    if actual != expected:
        raise MergeError(f"{prefix}.bin: {actual} bytes, but its index describes {expected}")
    return idx.dtype, len(idx.document_indices) - 1, tokens


def merged_record(prefixes: list[str], dtype_name: str, documents: int, tokens: int):
    """The tokenizer record of the merged dataset: the inputs' tokenizer when every input has
    a record naming the same one, else None (the training entry then warns about the data)."""
    from megagpt.data import tokenizer_record

    try:
        records = [tokenizer_record.read(p) for p in prefixes]
    except tokenizer_record.RecordError as e:
        raise MergeError(str(e)) from None
    if any(r is None for r in records) or any(r.tokenizer != records[0].tokenizer
                                              for r in records):
        return None
    tops = [r.max_token_id for r in records]
    return tokenizer_record.DataRecord(
        records[0].tokenizer, None if None in tops else max(tops), dtype_name, documents,
        tokens, all(r.append_eod for r in records))


def merge_datasets(prefixes: list[str], output_prefix: str) -> MergeResult:
    """Merge ``prefixes`` (in order) into ``output_prefix.bin/.idx``; returns counts."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    if not prefixes:
        raise MergeError("nothing to merge")
    out_abs = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == out_abs for p in prefixes):
        raise MergeError(f"{output_prefix}: the output is also an input")
    quiet = logging.getLogger("megatron.core.datasets.indexed_dataset")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        described = [(p, *_describe(p)) for p in prefixes]
        dtypes = {d for _, d, _, _ in described}
        if len(dtypes) != 1:
            listing = ", ".join(f"{p} ({d.__name__})" for p, d, _, _ in described)
            raise MergeError(f"inputs have different token dtypes: {listing}")
        dtype = dtypes.pop()
        docs = sum(n for _, _, n, _ in described)
        tokens = sum(t for _, _, _, t in described)
        record = merged_record(prefixes, dtype.__name__, docs, tokens)
        tmp = f"{output_prefix}.tmp-{os.getpid()}"
        record_path = tokenizer_record.record_path
        try:
            os.makedirs(os.path.dirname(out_abs), exist_ok=True)
            builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
            for p, *_ in described:
                builder.add_index(p)
            builder.finalize(tmp + ".idx")
            if record is not None:
                tokenizer_record.write(tmp, record)
            os.replace(tmp + ".bin", output_prefix + ".bin")
            os.replace(tmp + ".idx", output_prefix + ".idx")
            if record is not None:  # last: a dataset with a record is whole
                os.replace(record_path(tmp), record_path(output_prefix))
            else:  # an earlier output's record would describe other data
                Path(record_path(output_prefix)).unlink(missing_ok=True)
        except OSError as e:
            raise MergeError(f"{output_prefix}: cannot write: {e.strerror or e}") from None
        finally:
            for ext in (".bin", ".idx", tokenizer_record.SUFFIX):
                Path(tmp + ext).unlink(missing_ok=True)
        merged = IndexedDataset(output_prefix)
        if len(merged.document_indices) - 1 != docs:  # pragma: no cover
            raise RuntimeError("merged document count differs from the inputs' sum")
    finally:
        quiet.setLevel(level)
    return MergeResult(output_prefix, list(prefixes), docs, tokens, dtype.__name__,
                       record is not None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megagpt-merge-datasets",
                                description="Merge Megatron indexed datasets into one.")
    p.add_argument("--input", nargs="+", required=True, metavar="PREFIX_OR_DIR",
                   help="dataset prefixes (path without .bin/.idx) or folders of them, in order")
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin and .idx")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megagpt.data.preprocess import quiet_imports

    quiet_imports()
    try:
        prefixes = expand_prefixes(args.input)
        r = merge_datasets(prefixes, args.output_prefix)
    except MergeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[merge] {len(r.inputs)} datasets -> {r.prefix}.bin/.idx: {r.documents:,} documents, "
          f"{r.tokens:,} tokens ({r.dtype})", file=sys.stderr)
    if not r.tokenizer_record:
        print("[merge] no tokenizer record written: an input has none, or they name different "
              "tokenizers", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Input files -> chunks of raw records, and one record -> its texts (with validation).

Reading happens in the main process and only splits bytes into records (a jsonl line, a text
file, or a blank-line separated block of a text file), keeping each record's source file and
1-based line number. Decoding, JSON parsing and checking happen in ``parse_record``, which the
workers run, so every problem can be reported as ``file:line: reason``.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import zlib
from dataclasses import dataclass, field
from typing import Iterator

# Why a record is not written. Each is counted in the summary; by default the first one is fatal.
BLANK_LINE = "blank line"  # a jsonl line with only whitespace: counted, never fatal
MALFORMED_JSON = "malformed JSON"
MISSING_KEY = "missing key"
NON_STRING = "non-string value"
INVALID_UTF8 = "invalid UTF-8"
EMPTY_DOCUMENT = "empty document"
REASONS = (MALFORMED_JSON, MISSING_KEY, NON_STRING, INVALID_UTF8, EMPTY_DOCUMENT, BLANK_LINE)

JSONL, TXT = "jsonl", "txt"
TXT_SPLITS = ("file", "paragraphs")


class InputError(Exception):
    """Bad input that stops the run; the message is one line naming the file (and line)."""


class RecordError(InputError):
    """A record that does not give the text asked for (``iter_texts``): where and why."""

    def __init__(self, source: str, line: int, reason: str, detail: str):
        super().__init__(f"{source}:{line}: {reason}: {detail}")
        self.source, self.line, self.reason, self.detail = source, line, reason, detail


@dataclass
class Chunk:
    """Consecutive records of one file."""

    source: str
    kind: str  # JSONL or TXT
    line_nos: list[int] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    empty_file: bool = False  # the file had no record at all

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.payloads))


def expand_inputs(patterns: list[str] | str) -> list[str]:
    """Paths and globs -> the sorted list of files, or InputError naming what matched nothing."""
    if isinstance(patterns, str):
        patterns = [patterns]
    files: list[str] = []
    for pat in patterns:
        if glob.has_magic(pat):
            matched = sorted(p for p in glob.glob(pat, recursive=True) if os.path.isfile(p))
            if not matched:
                raise InputError(f"{pat}: no input file matches this pattern")
            files.extend(matched)
        elif os.path.isdir(pat):
            raise InputError(f"{pat}: is a folder; give files or a glob such as '{pat}/*.jsonl'")
        elif not os.path.exists(pat):
            raise InputError(f"{pat}: input file not found")
        else:
            files.append(pat)
    seen, unique = set(), []
    for f in files:
        key = os.path.realpath(f)
        if key not in seen:  # the same file twice would be written twice
            seen.add(key)
            unique.append(f)
    return unique


def detect_kind(path: str, input_format: str = "auto") -> str:
    """jsonl or txt: from --input-format, else from the name (.txt / .txt.gz are text)."""
    if input_format != "auto":
        return input_format
    name = path[:-3] if path.endswith(".gz") else path
    return TXT if name.endswith((".txt", ".text", ".md")) else JSONL


def _open(path: str):
    try:
        if path.endswith(".gz"):
            return gzip.open(path, "rb")
        return open(path, "rb")
    except OSError as e:
        raise InputError(f"{path}: cannot open: {e.strerror or e}") from None


def _lines(path: str) -> Iterator[bytes]:
    f = _open(path)
    try:
        with f:
            yield from f
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise InputError(f"{path}: cannot read: {e}") from None


def _records(path: str, kind: str, txt_split: str) -> Iterator[tuple[int, bytes]]:
    """(line number, raw bytes) for each record of one file."""
    if kind == JSONL:
        for no, line in enumerate(_lines(path), 1):
            yield no, line
    elif txt_split == "file":
        data = b"".join(_lines(path))
        if data:
            yield 1, data
    else:  # paragraphs: maximal runs of non-blank lines, without their final newline
        block: list[bytes] = []
        start = 0
        for no, line in enumerate(_lines(path), 1):
            if line.strip():
                if not block:
                    start = no
                block.append(line)
            elif block:
                yield start, _join_block(block)
                block = []
        if block:
            yield start, _join_block(block)


def _join_block(block: list[bytes]) -> bytes:
    data = b"".join(block)
    if data.endswith(b"\r\n"):
        return data[:-2]
    return data[:-1] if data.endswith(b"\n") else data


def iter_chunks(paths: list[str], input_format: str = "auto", txt_split: str = "file",
                chunk_bytes: int = 1 << 18, chunk_records: int = 2048) -> Iterator[Chunk]:
    """Chunks of about ``chunk_bytes`` (at most ``chunk_records`` records), file by file, in order."""
    if txt_split not in TXT_SPLITS:
        raise ValueError(f"txt_split must be one of {TXT_SPLITS}")
    for path in paths:
        kind = detect_kind(path, input_format)
        chunk = Chunk(path, kind)
        size = 0
        any_record = False
        for no, payload in _records(path, kind, txt_split):
            any_record = True
            chunk.line_nos.append(no)
            chunk.payloads.append(payload)
            size += len(payload)
            if size >= chunk_bytes or len(chunk.payloads) >= chunk_records:
                yield chunk
                chunk, size = Chunk(path, kind), 0
        if chunk.payloads:
            yield chunk
        if not any_record:
            yield Chunk(path, kind, empty_file=True)


def _utf8_error(payload: bytes, err: UnicodeDecodeError, kind: str) -> tuple[int, str]:
    """(extra lines past the record's first line, detail) for a decode error."""
    extra = payload.count(b"\n", 0, err.start) if kind == TXT else 0
    column = err.start - payload.rfind(b"\n", 0, err.start)  # 1-based, in bytes
    bad = payload[err.start:err.start + 1]
    return extra, f"byte {bad!r} at column {column} ({err.reason})"


def parse_record(payload: bytes, kind: str, keys: list[str]):
    """Return (texts, None, None, 0) or (None, reason, detail, extra_lines) for one record.

    ``texts`` has one string per key in ``keys`` (for text input, the single key gets the whole
    record). ``extra_lines`` is how far into a multi-line text record the problem lies.
    """
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as e:
        extra, detail = _utf8_error(payload, e, kind)
        return None, INVALID_UTF8, detail, extra
    if kind == TXT:
        return [text] * len(keys), None, None, 0
    if not text.strip():
        return None, BLANK_LINE, "", 0
    try:
        obj = json.loads(text)
    except ValueError as e:
        msg = getattr(e, "msg", str(e))
        col = getattr(e, "colno", None)
        return None, MALFORMED_JSON, f"{msg}" + (f" (column {col})" if col else ""), 0
    if not isinstance(obj, dict):
        return None, MALFORMED_JSON, f"expected a JSON object, got {type(obj).__name__}", 0
    texts = []
    for key in keys:
        if key not in obj:
            return None, MISSING_KEY, f"no key {key!r} (keys: {', '.join(list(obj)[:5]) or 'none'})", 0
        value = obj[key]
        if not isinstance(value, str):
            return None, NON_STRING, f"key {key!r} holds {type(value).__name__}, not a string", 0
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                return None, INVALID_UTF8, f"key {key!r}: lone surrogate {value[e.start]!r} " \
                                           f"(a \\u escape that is not text)", 0
        texts.append(value)
    return texts, None, None, 0


def iter_texts(paths: list[str], key: str, input_format: str = "auto"
               ) -> Iterator[tuple[str, str, int]]:
    """(text, source, line) for ``key`` of every record of ``paths`` (text files: the whole
    record), in order; blank lines are skipped. The files are read before the first record is
    parsed (``InputError``); the first record that does not parse raises ``RecordError``."""
    chunks = list(iter_chunks(paths, input_format=input_format))
    for chunk in chunks:
        for line_no, payload in zip(chunk.line_nos, chunk.payloads):
            texts, reason, detail, extra = parse_record(payload, chunk.kind, [key])
            if reason == BLANK_LINE:
                continue
            if reason is not None:
                raise RecordError(chunk.source, line_no + extra, reason, detail)
            yield texts[0], chunk.source, line_no

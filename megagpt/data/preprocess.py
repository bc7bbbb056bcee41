"""Text -> token ids -> Megatron indexed datasets (``{prefix}_{key}_document.bin/.idx``).

Flags follow upstream Megatron-LM's ``tools/preprocess_data.py``; the tokenizer flags are
megatron's own. What differs:

* Nothing is lost silently. Every input record (a jsonl line, a text file or paragraph) is either
  written as a document or skipped with a reason, and the summary shows
  ``read = written + skipped``. By default the first bad record stops the run with
  ``file:line: reason`` and exit code 2, leaving no output (outputs are written under temporary
  names and renamed at the end). ``--skip-bad-lines`` skips and counts bad records instead.
  Empty documents (no tokens) are bad records: upstream drops them silently; we count them.
  Blank jsonl lines carry no data: they are always skipped and counted, never fatal.
* Speed: workers parse and encode chunks of records with a batch encoder that gives the megatron
  tokenizer's ids (tiktoken for GPT-2 files, the HF Rust backend for tokenizer folders), checked
  against the megatron tokenizer before use.
* Plain text input (``.txt``): one document per file, or per blank-line separated paragraph.
* The tokenizer's files are checked before any input is read or output written, as the
  training entry checks them (``megagpt.data.tokenizer_files``): a missing file, or a
  Hugging Face hub name neither in the local cache nor on a hub that answers, is one line
  (exit 2); a cached hub name with no hub to ask is loaded from the cache at once.

Exit codes: 0 done, 2 bad input or options, 1 output / tokenizer / fetch failure, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import sys
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megagpt.data import indexed_format, readers, tokenizer_record
from megagpt.data.progress import Progress, Stats, summary_lines
from megagpt.data.readers import EMPTY_DOCUMENT, BLANK_LINE, InputError


class OutputError(Exception):
    """The output cannot be written, or the tokenizer cannot be set up (exit code 1)."""


# The tokenizer flags the light parser knows; any other (megatron's whole tokenizer group)
# makes the command line be parsed by megatron's own parser, which imports megatron.
LIGHT_TOKENIZER_FLAGS = ("--tokenizer-type", "--vocab-file", "--merge-file")
GPT2_TYPE = "GPT2BPETokenizer"


def build_parser(light: bool = False) -> argparse.ArgumentParser:
    """The command line: with megatron's tokenizer flags, or (``light``) only the three a
    GPT-2 BPE run needs, so that parsing imports no megatron (seconds of start-up)."""
    p = argparse.ArgumentParser(
        prog="megagpt-preprocess", allow_abbrev=not light,
        description="Tokenize jsonl / text files into Megatron indexed datasets "
                    "({output-prefix}_{key}_document.bin/.idx).")
    g = p.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="jsonl or text files (.gz works), or globs such as 'data/*.jsonl.gz'")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract from each jsonl object; one output per key (default: text)")
    g.add_argument("--input-format", choices=["auto", "jsonl", "txt"], default="auto",
                   help="auto: .txt/.txt.gz are text, everything else jsonl (default: auto)")
    g.add_argument("--txt-split", choices=list(readers.TXT_SPLITS), default="file",
                   help="text input: one document per file, or per blank-line separated paragraph")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip bad records (malformed JSON, missing key, non-string value, invalid "
                        "UTF-8, empty document) and count them per reason, instead of failing")
    if light:
        g = p.add_argument_group("tokenizer")
        for flag in LIGHT_TOKENIZER_FLAGS:
            g.add_argument(flag, type=str, default=None)
    else:
        from megagpt.data.tokenizers import add_tokenizer_args

        add_tokenizer_args(p)
    p.set_defaults(tokenizer_type=GPT2_TYPE)
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="path prefix; writes {prefix}_{key}_document.bin and .idx")
    g.add_argument("--append-eod", action="store_true",
                   help="append the tokenizer's end-of-document token to every document")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="worker processes encoding in parallel (default: number of CPUs)")
    g.add_argument("--partitions", type=int, default=1,
                   help="accepted for compatibility with upstream; workers already stream the "
                        "input in chunks, so it has no effect")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="print a progress line every this many documents (0: never)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, parsed without megatron when only GPT-2 BPE flags are given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not {"-h", "--help"} & set(argv):
        args, rest = build_parser(light=True).parse_known_args(argv)
        if not rest and args.tokenizer_type == GPT2_TYPE:
            return args
    return build_parser().parse_args(argv)


# --------------------------------------------------------------------------- worker side

_W: dict = {}


def _init_worker(state: dict) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _W.clear()
    _W.update(state)


@dataclass
class ChunkResult:
    source: str
    n_records: int
    n_bytes: int
    bad: list  # (line number, reason, detail), sorted by line
    ids: list  # per key: all documents' ids, concatenated, in the output dtype
    lengths: list  # per key: each document's length (EOD included)
    empty_file: bool = False
    max_ids: list = field(default_factory=list)  # per key: the largest id, -1 if none


def _encode_chunk(chunk: readers.Chunk) -> ChunkResult:
    keys, encoder, dtype = _W["keys"], _W["encoder"], _W["dtype"]
    if chunk.empty_file:
        return ChunkResult(chunk.source, 0, 0, [], [], [], empty_file=True)
    per_key: list[list[str]] = [[] for _ in keys]
    lines, bad = [], []
    for no, payload in zip(chunk.line_nos, chunk.payloads):
        texts, reason, detail, extra = readers.parse_record(payload, chunk.kind, keys)
        if texts is None:
            bad.append((no + extra, reason, detail))
            continue
        lines.append(no)
        for i, t in enumerate(texts):
            per_key[i].append(t)
    encoded = [encoder.encode_batch(texts) if texts else [] for texts in per_key]
    empty = {j for docs in encoded for j, a in enumerate(docs) if len(a) == 0}
    bad.extend((lines[j], EMPTY_DOCUMENT, "the text has no tokens") for j in sorted(empty))
    bad.sort(key=lambda b: b[0])
    ids, lengths, max_ids = [], [], []
    eod = np.array([_W["eod"]], dtype=np.int64) if _W["append_eod"] else None
    info = np.iinfo(dtype)
    for docs in encoded:
        docs = [np.asarray(a) for j, a in enumerate(docs) if j not in empty]
        lens = np.fromiter((len(a) for a in docs), dtype=np.int64, count=len(docs))
        if eod is not None:
            docs = [x for a in docs for x in (a, eod)]
            lens += 1
        flat = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
        if flat.size and (int(flat.max()) > info.max or int(flat.min()) < info.min):
            raise ValueError(f"token id out of range for {np.dtype(dtype).name} "
                             f"(min {flat.min()}, max {flat.max()})")
        ids.append(flat.astype(dtype, copy=False))
        lengths.append(lens)
        max_ids.append(int(flat.max()) if flat.size else -1)
    return ChunkResult(chunk.source, len(chunk.payloads), chunk.nbytes, bad, ids, lengths,
                       max_ids=max_ids)


# --------------------------------------------------------------------------- main side


@dataclass
class PreprocessResult:
    prefixes: dict  # json key -> output prefix ({prefix}_{key}_document)
    stats: Stats
    dtype: str
    seconds: float
    encoder: str
    summary: list = field(default_factory=list)


def _output_paths(prefix: str, keys: list[str]) -> dict[str, str]:
    return {k: f"{prefix}_{k}_document" for k in keys}


def _check_output_dir(prefix: str) -> None:
    d = os.path.dirname(os.path.abspath(prefix))
    try:
        os.makedirs(d, exist_ok=True)
        probe = os.path.join(d, f".megagpt-write-test-{os.getpid()}")
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise OutputError(f"{d}: cannot write output there: {e.strerror or e}") from None


def _validate(args) -> None:
    if args.workers < 1:
        raise InputError(f"--workers must be at least 1, got {args.workers}")
    if args.log_interval < 0:
        raise InputError(f"--log-interval must be 0 or more, got {args.log_interval}")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise InputError(f"--json-keys has duplicates: {args.json_keys}")


@dataclass
class TokenizerSetup:
    """What the pipeline needs of the tokenizer."""

    vocab_size: int
    eod: int | None
    encoder: object  # .encode_batch(texts) -> arrays of ids; .name
    targs: argparse.Namespace  # the tokenizer's arguments, files resolved (for the record)


def _pinned_gpt2(args) -> TokenizerSetup | None:
    """GPT-2 BPE from OpenAI's files (sha256-pinned) through tiktoken, without loading the
    megatron tokenizer: for these files the two give the same ids, which the test suite
    checks (tests/test_data_tokenizers.py), so megatron and transformers need not be
    imported. None for any other tokenizer, files or option."""
    from megagpt.data import gpt2_files
    from megagpt.data.cache import sha256_file

    if args.tokenizer_type != GPT2_TYPE or getattr(args, "special_tokens", None) \
            or getattr(args, "vocab_extra_ids", 0):
        return None
    vocab, merges = args.vocab_file, args.merge_file
    if not (vocab or merges):
        try:
            files = gpt2_files.ensure_gpt2_files()
        except Exception as e:
            raise OutputError(f"cannot fetch the GPT-2 files: {e}") from None
        vocab, merges = files.vocab_file, files.merge_file
    if not (vocab and merges and os.path.isfile(vocab) and os.path.isfile(merges)):
        return None  # the full path says what is wrong with them
    if (sha256_file(vocab), sha256_file(merges)) != (gpt2_files.VOCAB_SHA256,
                                                     gpt2_files.MERGES_SHA256):
        return None
    from megagpt.data.tokenizers import TiktokenEncoder, gpt2_tiktoken_encoding

    encoding = gpt2_tiktoken_encoding(vocab, merges)
    if encoding is None:  # pragma: no cover - the pinned files always fit tiktoken
        return None
    targs = argparse.Namespace(**vars(args))
    targs.vocab_file, targs.merge_file = vocab, merges
    encoder = TiktokenEncoder(encoding)
    encoder.name = "tiktoken (OpenAI's GPT-2 files, pinned)"
    return TokenizerSetup(gpt2_files.GPT2_VOCAB_SIZE, gpt2_files.GPT2_EOD, encoder, targs)


def _tokenizer_setup(args, stream=None) -> TokenizerSetup:
    setup = _pinned_gpt2(args)
    if setup is None:
        from megagpt.data.tokenizers import fast_encoder_for

        tokenizer, targs = _load_tokenizer(args, stream)
        setup = TokenizerSetup(tokenizer.vocab_size, getattr(tokenizer, "eod", None),
                               fast_encoder_for(tokenizer, targs), targs)
    if args.append_eod and setup.eod is None:
        raise InputError(f"--append-eod: tokenizer {args.tokenizer_type} has no end-of-document token")
    return setup


def _check_tokenizer(args) -> None:
    """The training entry's check of the tokenizer flags' files (and of a hub name), as an
    InputError; it imports no torch, megatron or transformers."""
    from megagpt.data.tokenizer_files import TokenizerError, check_tokenizer_files

    try:
        check_tokenizer_files(args)
    except TokenizerError as e:
        raise InputError(str(e)) from None


def _load_tokenizer(args, stream=None):
    from megagpt.data.tokenizers import build_tokenizer, complete_namespace

    targs = complete_namespace(args)
    if targs.tokenizer_type == "GPT2BPETokenizer" and not (targs.vocab_file or targs.merge_file):
        from megagpt.data.gpt2_files import ensure_gpt2_files

        try:  # resolve once here, so that the tokenizer and the fast encoder use the same files
            files = ensure_gpt2_files()
        except Exception as e:
            raise OutputError(f"cannot fetch the GPT-2 files: {e}") from None
        targs.vocab_file, targs.merge_file = files.vocab_file, files.merge_file
    targs.padded_vocab_size = None
    targs.pad_vocab_size = False  # padding is the model's business, not the data's
    try:
        tokenizer = build_tokenizer(
            targs, say=lambda line: print(f"[preprocess] {line}", file=stream or sys.stderr))
    except Exception as e:  # megatron raises many kinds; the user needs the one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OutputError(f"cannot load tokenizer {args.tokenizer_type}: {first}") from None
    return tokenizer, targs


def run(args: argparse.Namespace, stream=None) -> PreprocessResult:
    """The whole pipeline for parsed ``args`` (see ``build_parser``). Raises InputError/OutputError."""
    stream = stream or sys.stderr
    _validate(args)
    paths = readers.expand_inputs(args.input)  # names only: nothing is read yet
    _check_tokenizer(args)
    _check_output_dir(args.output_prefix)
    if args.workers > 1:  # HF's Rust thread pool and fork() do not mix; workers give parallelism
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    setup = _tokenizer_setup(args, stream)
    targs, encoder = setup.targs, setup.encoder
    dtype = indexed_format.optimal_dtype(setup.vocab_size)
    keys = list(args.json_keys)
    kinds = {readers.detect_kind(p, args.input_format) for p in paths}
    if readers.TXT in kinds and len(keys) != 1:
        raise InputError("text input has one text per document: give a single --json-keys name")
    unit = "lines" if kinds == {readers.JSONL} else "records"
    if args.partitions != 1:
        print(f"[preprocess] note: --partitions {args.partitions} has no effect "
              f"(input is streamed to {args.workers} workers)", file=stream)
    if targs.vocab_file and not args.vocab_file:
        print(f"[preprocess] GPT-2 files: {targs.vocab_file}, {targs.merge_file}", file=stream)
    print(f"[preprocess] {len(paths)} input file(s) -> {args.output_prefix}_{{{','.join(keys)}}}"
          f"_document; tokenizer {args.tokenizer_type} (vocab {setup.vocab_size}, "
          f"{np.dtype(dtype).name}), encoder: {encoder.name}, workers {args.workers}", file=stream)

    finals = _output_paths(args.output_prefix, keys)
    tmp = {k: f"{p}.tmp-{os.getpid()}" for k, p in finals.items()}
    state = {"keys": keys, "encoder": encoder, "dtype": dtype, "append_eod": args.append_eod,
             "eod": setup.eod if args.append_eod else None}
    stats = Stats()
    max_ids = dict.fromkeys(keys, -1)  # per key, for the tokenizer record
    key_tokens = dict.fromkeys(keys, 0)
    progress = Progress(stats, args.log_interval, stream)
    pool = None
    builders = {}
    done = False
    try:
        try:
            builders = {k: indexed_format.IndexedWriter(tmp[k] + ".bin", dtype) for k in keys}
        except OSError as e:
            raise OutputError(f"{tmp[keys[0]]}.bin: cannot create: {e.strerror or e}") from None

        def consume(res: ChunkResult) -> None:
            if res.empty_file:
                if not args.skip_bad_lines:
                    raise InputError(f"{res.source}: input file is empty "
                                     f"(use --skip-bad-lines to skip empty files)")
                stats.empty_files.append(res.source)
                return
            for line, reason, detail in res.bad:
                if reason != BLANK_LINE and not args.skip_bad_lines:
                    raise InputError(f"{res.source}:{line}: {reason}: {detail} "
                                     f"(use --skip-bad-lines to skip and count such lines)")
                stats.skipped[reason] += 1
            stats.records += res.n_records
            stats.bytes_in += res.n_bytes
            for k, top in zip(keys, res.max_ids):
                max_ids[k] = max(max_ids[k], top)
            for k, ids, lens in zip(keys, res.ids, res.lengths):
                builders[k].add_documents(ids, lens)
                stats.tokens += len(ids)
                key_tokens[k] += len(ids)
            stats.documents += len(res.lengths[0]) if res.lengths else 0
            progress.update()

        chunks = readers.iter_chunks(paths, args.input_format, args.txt_split)
        if args.workers == 1:
            _init_worker(state)
            for chunk in chunks:
                consume(_encode_chunk(chunk))
        else:
            pool = mp.get_context("fork").Pool(args.workers, _init_worker, (state,))
            pending: deque = deque()  # in input order; bounded so reading never runs far ahead
            for chunk in chunks:
                pending.append(pool.apply_async(_encode_chunk, (chunk,)))
                while len(pending) > 2 * args.workers + 2:
                    consume(pending.popleft().get())
            while pending:
                consume(pending.popleft().get())
            pool.close()
            pool.join()
            pool = None
        progress.close()
        if not stats.balanced():  # pragma: no cover - a bug, not bad input
            raise RuntimeError(f"invariant broken: {stats}")
        identity = tokenizer_record.TokenizerIdentity.of(targs, setup.vocab_size)
        try:
            for k in keys:
                builders[k].finalize(tmp[k] + ".idx")
                record = tokenizer_record.DataRecord(
                    identity, max_ids[k] if max_ids[k] >= 0 else None, np.dtype(dtype).name,
                    stats.documents, key_tokens[k], bool(args.append_eod))
                tokenizer_record.write(tmp[k], record)
            for k in keys:  # the record last: a dataset with a record is whole
                os.replace(tmp[k] + ".bin", finals[k] + ".bin")
                os.replace(tmp[k] + ".idx", finals[k] + ".idx")
                os.replace(tokenizer_record.record_path(tmp[k]),
                           tokenizer_record.record_path(finals[k]))
        except OSError as e:
            raise OutputError(f"{args.output_prefix}: cannot finish output: {e.strerror or e}") from None
        done = True
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if not done:
            for b in builders.values():
                b.data_file.close()
            for k in keys:
                for ext in (".bin", ".idx", tokenizer_record.SUFFIX):
                    Path(tmp[k] + ext).unlink(missing_ok=True)

    for k in keys:  # the outputs must read back, with every document
        facts = indexed_format.read_index(finals[k] + ".idx")
        if facts.document_count != stats.documents or \
                os.path.getsize(finals[k] + ".bin") != facts.bin_bytes:  # pragma: no cover
            raise RuntimeError(f"{finals[k]}: {facts.document_count} documents on disk, "
                               f"{stats.documents} written")
    seconds = progress.elapsed()
    sizes = {finals[k] + ext: os.path.getsize(finals[k] + ext) for k in keys for ext in (".bin", ".idx")}
    lines = summary_lines(stats, unit, sizes, seconds, np.dtype(dtype).name)
    for ln in lines:
        print(f"[preprocess] {ln}", file=stream)
    return PreprocessResult(finals, stats, np.dtype(dtype).name, seconds, encoder.name, lines)


def preprocess(input, output_prefix: str, **options) -> PreprocessResult:
    """Python entry: ``preprocess("a.jsonl", "out/a", append_eod=True, workers=2)``.

    ``options`` are the CLI flags with underscores (``json_keys=["text"]``, ``vocab_file=...``,
    ``tokenizer_type=...``, ``skip_bad_lines=True``, ``log_interval=0``, ...).
    """
    stream = options.pop("stream", None)
    light = build_parser(light=True).parse_args(["--input", "x", "--output-prefix", "x"])
    known = set(vars(light))
    parser = build_parser(light=all(k in known for k in options))
    args = parser.parse_args(["--input", "x", "--output-prefix", "x"])
    args.input = [input] if isinstance(input, (str, os.PathLike)) else list(input)
    args.input = [str(p) for p in args.input]
    args.output_prefix = str(output_prefix)
    for k, v in options.items():
        if not hasattr(args, k):
            raise TypeError(f"preprocess() got an unknown option {k!r}")
        setattr(args, k, v)
    return run(args, stream=stream)


@contextlib.contextmanager
def quiet_megatron_logs():
    """Hide the indexed dataset's INFO lines (six per file opened)."""
    log = logging.getLogger("megatron.core.datasets.indexed_dataset")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def quiet_imports() -> None:
    """For the CLIs: drop the import-time noise about missing CUDA / TE / apex (irrelevant here)."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def main(argv=None) -> int:
    quiet_imports()
    args = parse_args(argv)
    try:
        run(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; no output written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

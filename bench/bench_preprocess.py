"""Preprocessing throughput: megagpt's pipeline vs. a baseline doing what upstream's tool does.

The baseline (``baseline_preprocess`` below, written here, not copied) follows upstream
Megatron-LM's ``tools/preprocess_data.py``: a ``multiprocessing.Pool`` whose initializer builds
the megatron tokenizer in each worker, ``imap(encode, lines, chunksize=32)`` over the open file,
``json.loads`` + ``tokenizer.tokenize(text)`` one document at a time, and the main process adding
each document to megatron's ``IndexedDatasetBuilder``.

The corpus is the embedded Shakespeare jsonl repeated up to ``--mb`` megabytes. Both runs write
GPT-2 ids with ``--append-eod``; their .bin/.idx files must be byte-identical. Timings cover
everything after the Python imports (tokenizer set-up included); the two run in turn
``--repeat`` times and the best wall time of each is reported, with its CPU time (all processes).

``--end-to-end`` times whole commands instead, as a user waits for them: a fresh Python process
each, start-up and imports included. Ours is ``tools/preprocess_data.py``; the baseline is this
file's ``--baseline-process`` mode, which first imports what upstream's tool imports at its top
(torch, megatron's tokenizer arguments and ``indexed_dataset``), then runs the baseline.

    python bench/bench_preprocess.py --workers 2 --mb 20
    python bench/bench_preprocess.py --workers 2 --mb 11 --end-to-end
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megagpt.data.preprocess import preprocess, quiet_imports  # noqa: E402

quiet_imports()


# --------------------------------------------------------------------------- the baseline


class UpstreamStyleEncoder:
    """One document per call through the megatron tokenizer wrapper, as upstream's Encoder."""

    def __init__(self, tokenizer_args, keys, append_eod):
        self.tokenizer_args = tokenizer_args
        self.keys = keys
        self.append_eod = append_eod

    def initializer(self):
        from megagpt.data.tokenizers import build_tokenizer

        UpstreamStyleEncoder.tokenizer = build_tokenizer(self.tokenizer_args)

    def encode(self, json_line):
        data = json.loads(json_line)
        ids, lens = {}, {}
        for key in self.keys:
            doc_ids = UpstreamStyleEncoder.tokenizer.tokenize(data[key])
            sentence_lens = [len(doc_ids)] if doc_ids else []
            if doc_ids and self.append_eod:
                doc_ids.append(UpstreamStyleEncoder.tokenizer.eod)
                sentence_lens[-1] += 1
            ids[key], lens[key] = doc_ids, sentence_lens
        return ids, lens, len(json_line)


def baseline_preprocess(input_path, output_prefix, tokenizer_args, workers, append_eod=True):
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from megagpt.data.tokenizers import build_tokenizer

    keys = ["text"]
    encoder = UpstreamStyleEncoder(tokenizer_args, keys, append_eod)
    tokenizer = build_tokenizer(tokenizer_args)  # upstream builds one in the main process too
    docs = tokens = 0
    with open(input_path, "r", encoding="utf-8") as fin:
        pool = mp.get_context("fork").Pool(workers, initializer=encoder.initializer)
        encoded = pool.imap(encoder.encode, fin, 32)
        builders = {k: IndexedDatasetBuilder(f"{output_prefix}_{k}_document.bin",
                                             dtype=DType.optimal_dtype(tokenizer.vocab_size))
                    for k in keys}
        for doc, sentence_lens, _ in encoded:
            for key in doc:
                builders[key].add_document(doc[key], sentence_lens[key])
                tokens += len(doc[key])
            docs += 1
        pool.close()
        pool.join()
    for k in keys:
        builders[k].finalize(f"{output_prefix}_{k}_document.idx")
    return docs, tokens


# --------------------------------------------------------------------------- the harness


def make_corpus(path: Path, megabytes: float) -> tuple[int, int]:
    from megagpt.data.corpus import ensure_embedded_dataset

    lines = Path(ensure_embedded_dataset().jsonl).read_bytes().splitlines(keepends=True)
    target, size, n = megabytes * 1e6, 0, 0
    with open(path, "wb") as f:
        while size < target:
            for line in lines:
                f.write(line)
                size += len(line)
                n += 1
                if size >= target:
                    break
    return n, size


def cpu_seconds() -> float:
    """User + system time of this process and its reaped children (the pool workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn):
    """(wall seconds, CPU seconds, result) of one call."""
    t, c = time.perf_counter(), cpu_seconds()
    out = fn()
    return time.perf_counter() - t, cpu_seconds() - c, out


def interleaved_best(repeat, *fns):
    """Run the functions in turn ``repeat`` times (so that load from other processes hits both
    alike); for each, the run with the best wall time: (wall, cpu, result)."""
    best = [None] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            r = timed(fn)
            if best[i] is None or r[0] < best[i][0]:
                best[i] = r
    return best


def run_baseline_process(input_path: str, output_prefix: str, workers: int) -> int:
    """The baseline as its own command: upstream's module-level imports, then the work."""
    import torch  # noqa: F401 - upstream's tool imports these at its top
    from megatron.core.datasets import indexed_dataset  # noqa: F401
    from megatron.training.arguments import _add_tokenizer_args  # noqa: F401

    from megagpt.data.gpt2_files import ensure_gpt2_files
    from megagpt.data.tokenizers import tokenizer_namespace

    gpt2 = ensure_gpt2_files()
    targs = tokenizer_namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2.vocab_file,
                                merge_file=gpt2.merge_file, pad_vocab_size=False)
    baseline_preprocess(input_path, output_prefix, targs, workers)
    return 0


def end_to_end(a) -> int:
    """Whole commands, interleaved, best of --repeat; outputs compared byte for byte."""
    import subprocess

    from megagpt.data.gpt2_files import ensure_gpt2_files

    gpt2 = ensure_gpt2_files()
    root = Path(__file__).resolve().parents[1]
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        n_docs, n_bytes = make_corpus(corpus, a.mb)
        print(f"corpus: {n_docs:,} documents, {n_bytes / 1e6:.1f} MB jsonl (embedded Shakespeare, "
              f"repeated)")
        ours = [sys.executable, str(root / "tools" / "preprocess_data.py"), "--input", str(corpus),
                "--output-prefix", str(tmp / "ours"), "--tokenizer-type", "GPT2BPETokenizer",
                "--vocab-file", gpt2.vocab_file, "--merge-file", gpt2.merge_file,
                "--append-eod", "--workers", str(a.workers), "--log-interval", "0"]
        base = [sys.executable, str(Path(__file__).resolve()), "--baseline-process", str(corpus),
                str(tmp / "base"), "--workers", str(a.workers)]

        def command(cmd):
            return lambda: subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)

        (t_base, c_base, _), (t_ours, c_ours, _) = interleaved_best(
            a.repeat, command(base), command(ours))
        same = all((tmp / f"base_text_document{e}").read_bytes()
                   == (tmp / f"ours_text_document{e}").read_bytes() for e in (".bin", ".idx"))
    print("\n| command (a fresh process; start-up and imports included) | wall s | CPU s |\n"
          "| --- | ---: | ---: |")
    print(f"| baseline: upstream-style tool (torch + megatron imports, Pool.imap) | {t_base:.2f} | "
          f"{c_base:.2f} |")
    print(f"| megagpt: tools/preprocess_data.py | {t_ours:.2f} | {c_ours:.2f} |")
    print(f"\nspeed-up: {t_base / t_ours:.2f}x wall, {c_base / c_ours:.2f}x CPU time; outputs "
          f"byte-identical: {same}; {n_docs:,} documents, {n_bytes / 1e6:.1f} MB, workers "
          f"{a.workers}, best of {a.repeat}; load average before: {load_before}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"Python {platform.python_version()}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    return 0 if same else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mb", type=float, default=20.0, help="corpus size in MB (>= 10 for the report)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workdir", default=None, help="where to put the corpus and outputs (default: temp)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the figures with the run's date, commit, machine, versions "
                        "and command (bench/records.py add FILE makes table rows of them)")
    p.add_argument("--end-to-end", action="store_true",
                   help="time whole commands (fresh processes, imports included)")
    p.add_argument("--baseline-process", nargs=2, metavar=("INPUT", "PREFIX"),
                   help="run only the baseline, as its own command (what --end-to-end times)")
    a = p.parse_args(argv)
    if a.baseline_process:
        return run_baseline_process(*a.baseline_process, a.workers)
    if a.end_to_end:
        return end_to_end(a)

    import megatron.core
    import tiktoken
    import tokenizers
    import torch
    import transformers

    from megagpt.data.gpt2_files import ensure_gpt2_files
    from megagpt.data.tokenizers import tokenizer_namespace

    gpt2 = ensure_gpt2_files()
    targs = tokenizer_namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2.vocab_file,
                                merge_file=gpt2.merge_file, pad_vocab_size=False)
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        n_docs, n_bytes = make_corpus(corpus, a.mb)
        print(f"corpus: {n_docs:,} documents, {n_bytes / 1e6:.1f} MB jsonl (embedded Shakespeare, repeated)")

        (t_base, c_base, (docs_b, tokens_b)), (t_ours, c_ours, res) = interleaved_best(
            a.repeat,
            lambda: baseline_preprocess(corpus, str(tmp / "base"), targs, a.workers),
            lambda: preprocess(corpus, tmp / "ours", tokenizer_type="GPT2BPETokenizer",
                               vocab_file=gpt2.vocab_file, merge_file=gpt2.merge_file, append_eod=True,
                               workers=a.workers, log_interval=0, stream=io.StringIO()))
        same = all((tmp / f"base_text_document{e}").read_bytes() == (tmp / f"ours_text_document{e}").read_bytes()
                   for e in (".bin", ".idx"))
    assert docs_b == res.stats.documents == n_docs and tokens_b == res.stats.tokens

    rows = [("baseline (upstream-style Pool.imap, chunksize 32, megatron tokenizer)", t_base, c_base),
            (f"megagpt ({res.encoder}, chunked workers)", t_ours, c_ours)]
    print("\n| tool | wall s | documents/s | tokens/s | MB/s | CPU s (all processes) |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, t, c in rows:
        print(f"| {name} | {t:.2f} | {n_docs / t:,.0f} | {tokens_b / t / 1e6:.2f}M | "
              f"{n_bytes / 1e6 / t:.2f} | {c:.2f} |")
    print(f"\nspeed-up: {t_base / t_ours:.2f}x wall, {c_base / c_ours:.2f}x CPU time; outputs "
          f"byte-identical: {same}; {n_docs:,} documents, {tokens_b:,} tokens, workers {a.workers}, "
          f"best of {a.repeat}; load average before: {load_before}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"Python {platform.python_version()}, torch {torch.__version__}, megatron-core "
          f"{megatron.core.__version__}, transformers {transformers.__version__}, tokenizers "
          f"{tokenizers.__version__}, tiktoken {tiktoken.__version__}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if a.json:
        from run_info import run_info

        Path(a.json).write_text(json.dumps(dict(
            info=run_info("transformers", "tokenizers", "tiktoken"), workers=a.workers,
            repeat=a.repeat, identical_outputs=same, load_average_before=load_before,
            corpus=dict(documents=n_docs, tokens=tokens_b, bytes=n_bytes),
            rows=[dict(tool=tool, wall_s=t, cpu_s=c)
                  for tool, (_, t, c) in zip(("baseline", "megagpt"), rows)]), indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

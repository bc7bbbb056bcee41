"""Bad launch input: one ``error:`` line naming what and where, exit status 2, no traceback,
before any model is built; the dry run rejects the same inputs.

Each case is a launch a new user wrote; the entry runs as a real CPU process."""

from __future__ import annotations

import os
import shutil

import pytest

from helpers import run_entry
from megagpt.data.preprocess import preprocess

pytestmark = pytest.mark.slow

TINY = ["--cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "3", "--eval-iters", "0"]
MOCK = TINY + ["--mock-data", "--vocab-size", "512"]
NULL_512 = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]
MODEL_BUILT = "number of parameters on (tensor"


def one_error_line(proc) -> str:
    """The single ``error:`` line of a launch refused before any model was built."""
    out = proc.stdout
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert MODEL_BUILT not in out, "refused only after the model was built:\n" + out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def gpt2_data(gpt2, tmp_path_factory):
    """GPT-2 BPE data with its tokenizer record, and a copy without one (older data)."""
    work = tmp_path_factory.mktemp("gpt2_data")
    src = work / "text.jsonl"
    src.write_text("".join(f'{{"text": "line {i}: to be, or not to be, that is the question"}}\n'
                           for i in range(200)))
    prefix = preprocess(src, work / "gpt2", tokenizer_type="GPT2BPETokenizer",
                        vocab_file=gpt2.vocab_file, merge_file=gpt2.merge_file, append_eod=True,
                        workers=1, log_interval=0, stream=open(os.devnull, "w")).prefixes["text"]
    old = str(work / "old_text_document")
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, old + ext)
    return prefix, old


# 3. data paths and blends ----------------------------------------------------------------

def test_missing_data_prefix_names_both_files(tmp_path):
    for extra in ([], ["--dry-run"]):
        line = one_error_line(run_entry(TINY + NULL_512 + ["--data-path", "/no/such/prefix",
                                                           *extra], cwd=tmp_path))
        assert line == ("error: --data-path: /no/such/prefix.bin and /no/such/prefix.idx not "
                        "found (a prefix names PREFIX.bin and PREFIX.idx, as preprocessing "
                        "writes them)")


def test_blend_with_an_odd_count_is_not_read_as_prefixes(tmp_path, gpt2_data):
    prefix, _ = gpt2_data
    line = one_error_line(run_entry(TINY + NULL_512 + ["--data-path", "0.5", prefix, "0.5"],
                                    cwd=tmp_path))
    assert "--data-path 0.5" in line and "a blend is WEIGHT PREFIX pairs" in line
    assert "numbers at positions 1, 3" in line


def test_missing_per_split_path_names_its_flag(tmp_path, gpt2_data):
    prefix, _ = gpt2_data
    line = one_error_line(run_entry(TINY + NULL_512 + [
        "--train-data-path", prefix, "--valid-data-path", str(tmp_path / "valid"),
        "--test-data-path", prefix, "--dry-run"], cwd=tmp_path))
    assert line.startswith(f"error: --valid-data-path: {tmp_path / 'valid'}.bin and")


# 4. the data's tokenizer and ids -------------------------------------------------------

def test_data_of_another_tokenizer_is_refused_by_its_record(tmp_path, gpt2_data):
    prefix, _ = gpt2_data
    line = one_error_line(run_entry(TINY + NULL_512 + ["--data-path", prefix], cwd=tmp_path))
    assert f"--data-path {prefix} was tokenized with GPT2BPETokenizer (vocab 50257" in line
    assert "type GPT2BPETokenizer there, NullTokenizer here" in line
    assert "vocabulary size 50257 there, 512 here" in line
    assert "--allow-data-tokenizer-mismatch" in line
    # the override lets the tokenizer through, not ids the embedding does not have
    line = one_error_line(run_entry(TINY + NULL_512 + ["--data-path", prefix,
                                                       "--allow-data-tokenizer-mismatch"],
                                    cwd=tmp_path))
    assert "token ids up to 50256 (its tokenizer record" in line
    assert "has 512 ids (0..511)" in line


def test_data_without_a_record_warns_and_its_ids_are_still_checked(tmp_path, gpt2_data):
    _, old = gpt2_data
    proc = run_entry(TINY + NULL_512 + ["--data-path", old], cwd=tmp_path)
    line = one_error_line(proc)
    assert f"no tokenizer record (.tokenizer.json) beside {old}" in proc.stdout
    assert f"token ids up to 50256 ({old}.bin, read in full)" in line


# 5. tokenizer files ----------------------------------------------------------------------

def test_missing_vocab_file(tmp_path, gpt2):
    for extra in ([], ["--dry-run"]):
        line = one_error_line(run_entry(MOCK + ["--tokenizer-type", "GPT2BPETokenizer",
                                                "--vocab-file", "/missing", "--merge-file",
                                                gpt2.merge_file, *extra], cwd=tmp_path))
        assert line == "error: --vocab-file /missing: no such file (tokenizer GPT2BPETokenizer)"


def test_unreadable_tokenizer_file_is_one_line(tmp_path, gpt2):
    broken = tmp_path / "vocab.json"
    broken.write_text("{not json")
    line = one_error_line(run_entry(MOCK + ["--tokenizer-type", "GPT2BPETokenizer",
                                            "--vocab-file", str(broken), "--merge-file",
                                            gpt2.merge_file], cwd=tmp_path))
    assert line.startswith("error: cannot load the tokenizer (--tokenizer-type GPT2BPETokenizer")
    assert str(broken) in line


# 6. checkpoints ------------------------------------------------------------------------

def test_save_without_save_interval(tmp_path):
    line = one_error_line(run_entry(MOCK + ["--save", "ckpt"], cwd=tmp_path))
    assert line.startswith("error: --save ckpt needs --save-interval N")


def test_unwritable_save(tmp_path):
    (tmp_path / "a_file").write_text("")
    for save, why in ((tmp_path / "a_file" / "ckpt", f"{tmp_path / 'a_file'} is not a folder"),
                      ("/proc/ckpt", "cannot write there (in /proc)")):
        for extra in ([], ["--dry-run"]):
            line = one_error_line(run_entry(MOCK + ["--save", str(save), "--save-interval", "2",
                                                    *extra], cwd=tmp_path))
            assert line.startswith(f"error: --save {save}: {why}"), line
    assert not (tmp_path / "ckpt").exists()


# 7. the learning-rate schedule -------------------------------------------------------------

def test_warmup_longer_than_decay(tmp_path):
    line = one_error_line(run_entry(MOCK + ["--lr-warmup-iters", "5", "--lr-decay-iters", "1"],
                                    cwd=tmp_path))
    assert line == ("error: learning-rate schedule: megatron requires lr_warmup_steps < "
                    "lr_decay_steps, but the warm-up is 5 iterations (--lr-warmup-iters / "
                    "--lr-warmup-samples / --lr-warmup-fraction) and the decay is 1 iterations "
                    "(--lr-decay-iters / --lr-decay-samples, else --train-iters)")


# megatron's own validation --------------------------------------------------------------

def test_megatron_assertion_names_its_flags(tmp_path):
    line = one_error_line(run_entry(MOCK + ["--num-layers-per-virtual-pipeline-stage", "1"],
                                    cwd=tmp_path))
    assert line.startswith("error: invalid arguments: When interleaved schedule is used, "
                           "pipeline-model-parallel size should be greater than 1")
    assert "given: --pipeline-model-parallel-size 1" in line
    assert "[megatron/training/arguments.py:" in line


def test_megatron_config_value_error_names_its_flags(tmp_path):
    """TransformerConfig checks its fields with ValueErrors, after validate_args passed."""
    line = one_error_line(run_entry(MOCK + ["--recompute-granularity", "full",
                                            "--recompute-method", "block"], cwd=tmp_path))
    assert line.startswith("error: invalid arguments: When using recompute_granularity: full "
                           "recompute_num_layers must be between 1 and")
    assert "--recompute-granularity full" in line and "--recompute-num-layers None" in line

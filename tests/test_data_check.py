"""The data check and the tokenizer record, in-process on real preprocessed datasets; the
other pre-model checks (outputs, schedule) and megatron's assertions as one line."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil

import pytest

from megagpt.data import tokenizer_record
from megagpt.data.preprocess import preprocess
from megagpt.preflight import data_check
from megagpt.preflight.data_check import DataError, check_data, parse_blend


def _quiet():
    return open(os.devnull, "w")


@pytest.fixture(scope="module")
def null_data(tmp_path_factory):
    """A NullTokenizer dataset (ids < 300, EOD 511) with its record."""
    work = tmp_path_factory.mktemp("null")
    src = work / "ids.jsonl"
    src.write_text("".join(f'{{"text": "{i} {i + 1} {299 - i}"}}\n' for i in range(100)))
    return preprocess(src, work / "ids", tokenizer_type="NullTokenizer", vocab_size=512,
                      append_eod=True, workers=1, log_interval=0,
                      stream=_quiet()).prefixes["text"]


def run_args(**changes) -> argparse.Namespace:
    values = dict(mock_data=False, data_path=None, data_args_path=None, train_data_path=None,
                  valid_data_path=None, test_data_path=None, per_split_data_args_path=None,
                  tokenizer_type="NullTokenizer", vocab_size=512, vocab_file=None,
                  merge_file=None, tokenizer_model=None, allow_data_tokenizer_mismatch=False)
    values.update(changes)
    return argparse.Namespace(**values)


# ---------------------------------------------------------------------------
# The record
# ---------------------------------------------------------------------------

def test_preprocessing_records_the_tokenizer_beside_the_data(null_data, gpt2, tmp_path):
    record = tokenizer_record.read(null_data)
    assert record.tokenizer == tokenizer_record.TokenizerIdentity("NullTokenizer", 512, {})
    assert record.max_token_id == 511 and record.append_eod  # EOD is vocab_size - 1
    assert record.documents == 100 and record.tokens == 400 and record.dtype == "uint16"

    src = tmp_path / "t.jsonl"
    src.write_text('{"text": "Hello world"}\n')
    prefix = preprocess(src, tmp_path / "g", tokenizer_type="GPT2BPETokenizer",
                        vocab_file=gpt2.vocab_file, merge_file=gpt2.merge_file,
                        workers=1, log_interval=0, stream=_quiet()).prefixes["text"]
    gpt2_record = tokenizer_record.read(prefix)
    digest = hashlib.sha256(open(gpt2.vocab_file, "rb").read()).hexdigest()
    assert gpt2_record.tokenizer.tokenizer_type == "GPT2BPETokenizer"
    assert gpt2_record.tokenizer.vocab_size == 50257
    assert gpt2_record.tokenizer.files == {
        "vocab_file": digest, "merge_file": hashlib.sha256(
            open(gpt2.merge_file, "rb").read()).hexdigest()}
    assert gpt2_record.max_token_id == max([15496, 995])  # "hello", " world"
    assert sorted(os.listdir(tmp_path)) == ["g_text_document.bin", "g_text_document.idx",
                                            "g_text_document.tokenizer.json", "t.jsonl"]


def test_the_same_files_elsewhere_are_the_same_tokenizer(gpt2, tmp_path):
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    vocab = shutil.copy(gpt2.vocab_file, copy_dir / "gpt2-vocab.json")
    merges = shutil.copy(gpt2.merge_file, copy_dir / "gpt2-merges.txt")
    here = tokenizer_record.TokenizerIdentity.of(
        run_args(tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2.vocab_file,
                 merge_file=gpt2.merge_file), 50257)
    there = tokenizer_record.TokenizerIdentity.of(
        run_args(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab),
                 merge_file=str(merges)), 50257)
    assert tokenizer_record.differences(here, there) == []
    with open(merges, "a") as f:
        f.write("x y\n")
    changed = tokenizer_record.TokenizerIdentity.of(
        run_args(tokenizer_type="GPT2BPETokenizer", vocab_file=str(vocab),
                 merge_file=str(merges)), 50257)
    assert [d.split(" sha256")[0] for d in tokenizer_record.differences(here, changed)] == [
        "merge_file"]


def test_a_damaged_record_is_an_error_not_a_silent_pass(null_data, tmp_path):
    prefix = str(tmp_path / "d")
    for ext in (".bin", ".idx"):
        shutil.copy(null_data + ext, prefix + ext)
    with open(tokenizer_record.record_path(prefix), "w") as f:
        f.write("{")
    with pytest.raises(DataError, match=r"unreadable tokenizer record"):
        check_data(run_args(data_path=[prefix]), 512, lambda line: None)


# ---------------------------------------------------------------------------
# Blends and files
# ---------------------------------------------------------------------------

def test_blends_parse_as_megatron_reads_them_or_are_refused():
    assert parse_blend("--data-path", ["a", "b"]).weights is None
    source = parse_blend("--data-path", ["0.7", "a", "0.3", "b"])
    assert source.prefixes == ("a", "b") and source.weights == (0.7, 0.3)
    for items, message in ((["0.5", "a", "0.5"], "numbers at positions 1, 3"),
                           (["a", "0.5", "b", "0.5"], "numbers at positions 2, 4"),
                           (["0.5", "a", "b"], "numbers at positions 1"),
                           (["-1", "a", "1", "b"], "finite and >= 0"),
                           (["nan", "a", "1", "b"], "finite and >= 0"),
                           (["0", "a", "0", "b"], "sum to 0")):
        with pytest.raises(DataError, match=message):
            parse_blend("--data-path", items)


def test_a_prefix_named_like_a_number_is_a_prefix(null_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for ext in (".bin", ".idx"):
        shutil.copy(null_data + ext, tmp_path / f"0.5{ext}")
    assert parse_blend("--data-path", ["0.5"]).prefixes == ("0.5",)


def test_files_checked_with_the_prefix_a_user_meant(null_data, tmp_path):
    with pytest.raises(DataError, match=rf"did you mean {null_data}\?"):
        check_data(run_args(data_path=[null_data + ".bin"]), 512, lambda line: None)
    base = null_data[: -len("_text_document")]
    with pytest.raises(DataError, match=rf"did you mean {null_data}\?"):
        check_data(run_args(data_path=[base]), 512, lambda line: None)
    truncated = str(tmp_path / "t")
    shutil.copy(null_data + ".idx", truncated + ".idx")
    data = open(null_data + ".bin", "rb").read()
    open(truncated + ".bin", "wb").write(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"t.bin is \d+ bytes but .*t.idx describes"):
        check_data(run_args(data_path=[truncated]), 512, lambda line: None)
    open(truncated + ".idx", "wb").write(b"not an index at all, but long enough to unpack")
    with pytest.raises(DataError, match="not a readable megatron index"):
        check_data(run_args(data_path=[truncated]), 512, lambda line: None)


def test_per_split_and_list_files(null_data, tmp_path):
    listing = tmp_path / "blend.txt"
    listing.write_text(f"0.5 {null_data}\n0.5 {null_data}\n")
    lines = []
    report = check_data(run_args(data_args_path=str(listing)), 512, lines.append)
    assert report.prefixes == 1 and lines[-1].startswith("data: 1 dataset prefix checked")
    per_split = tmp_path / "splits.json"
    per_split.write_text(json.dumps({"train": [null_data], "valid": f"1 {null_data}",
                                     "test": [str(tmp_path / "gone")]}))
    with pytest.raises(DataError, match=r"\(test\): .*gone.bin and .*gone.idx not found"):
        check_data(run_args(per_split_data_args_path=str(per_split)), 512, lambda line: None)
    per_split.write_text("[]")
    with pytest.raises(DataError, match="not a JSON object with train, valid and test"):
        check_data(run_args(per_split_data_args_path=str(per_split)), 512, lambda line: None)


# ---------------------------------------------------------------------------
# Tokenizer and ids
# ---------------------------------------------------------------------------

def test_matching_tokenizer_passes_and_a_mismatch_needs_the_flag(null_data):
    lines = []
    check_data(run_args(data_path=[null_data]), 512, lines.append)
    assert not any(line.startswith("warning") for line in lines)
    other = run_args(data_path=[null_data], vocab_size=600)
    with pytest.raises(DataError, match="vocabulary size 512 there, 600 here"):
        check_data(other, 600, lambda line: None)
    other.allow_data_tokenizer_mismatch = True
    check_data(other, 600, lambda line: None)  # ids < 512 fit 600


def test_ids_are_read_from_the_bin_without_a_record(null_data, tmp_path, monkeypatch):
    prefix = str(tmp_path / "old")
    for ext in (".bin", ".idx"):
        shutil.copy(null_data + ext, prefix + ext)
    lines = []
    with pytest.raises(DataError, match=r"ids up to 511 \(.*old.bin, read in full\).* has 300"):
        check_data(run_args(data_path=[prefix], vocab_size=300), 300, lines.append)
    # a .bin above the limit is sampled; the sample here covers the whole small file
    monkeypatch.setattr(data_check, "SCAN_LIMIT_BYTES", 16)
    monkeypatch.setattr(data_check, "SAMPLE_BLOCK_BYTES", 64)
    with pytest.raises(DataError, match=r"ids up to 511 \(.*sampled: 64 blocks"):
        check_data(run_args(data_path=[prefix], vocab_size=300), 300, lambda line: None)
    lines = []
    check_data(run_args(data_path=[prefix]), 512, lines.append)
    assert any(line.startswith("warning: data: no tokenizer record") for line in lines)


def test_a_split_asked_for_samples_needs_documents(null_data):
    """megatron loops forever building the index of a split with no document that is asked
    for samples; 1/1000 of 100 documents rounds to none."""
    args = run_args(data_path=[null_data], split="949,50,1", train_iters=3, train_samples=None,
                    global_batch_size=4, full_validation=False, skip_train=False,
                    eval_interval=2, start_eval_at_iter=None, eval_iters=1,
                    phase_transition_iterations=None)
    with pytest.raises(DataError, match=r"--split 949,50,1 gives the test split none of its "
                                        r"100 documents, but megatron asks that split for 4 "
                                        r"samples.*\(--eval-iters 0\)"):
        check_data(args, 512, lambda line: None)
    args.eval_iters = 0  # nothing asked of validation and test
    check_data(args, 512, lambda line: None)
    args.eval_iters, args.split = 1, "90,5,5"
    check_data(args, 512, lambda line: None)


# ---------------------------------------------------------------------------
# The other checks before the model
# ---------------------------------------------------------------------------

MODEL = ["--cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
         "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "10"]


def validated(*extra):
    from megagpt import launch
    from megagpt.command_line import arguments

    args = launch.parse_arguments([*MODEL, *extra])
    arguments.validate_arguments(args, device_arch=0)
    return args


def test_schedule_checked_by_megatrons_scheduler():
    from megagpt.preflight import ScheduleError, check_schedule

    check_schedule(validated("--lr-warmup-iters", "2"))
    with pytest.raises(ScheduleError, match="warm-up is 10 iterations .* decay is 10"):
        check_schedule(validated("--lr-warmup-iters", "10"))
    with pytest.raises(ScheduleError, match=r"requires init_lr <= max_lr, but the peak learning "
                                            r"rate is 0.001 \(--lr\) and the initial learning "
                                            r"rate is 0.01 \(--lr-warmup-init\)"):
        check_schedule(validated("--lr-warmup-init", "0.01"))
    with pytest.raises(ScheduleError, match="requires start_wd >= 0.0"):
        check_schedule(validated("--start-weight-decay", "-1", "--end-weight-decay", "0.1",
                                 "--weight-decay-incr-style", "linear"))


def test_megatron_assertion_without_a_message_says_which_condition_failed():
    from megagpt import launch
    from megagpt.command_line import arguments

    args = launch.parse_arguments([*MODEL, "--save", "ckpt"])
    with pytest.raises(arguments.ArgumentError) as err:
        arguments.validate_arguments(args, device_arch=0)  # megatron's bare assertion
    assert str(err.value).startswith(
        "invalid arguments: megatron requires `args.save_interval is not None`, which is false "
        "for this launch; given: --save-interval None [megatron/training/arguments.py:")


def test_outputs_checked_without_creating_anything(tmp_path):
    from megagpt.preflight import OutputError, check_outputs

    args = argparse.Namespace(save=str(tmp_path / "new" / "ckpt"), save_interval=5,
                              tensorboard_dir=None, data_cache_path=None, wandb_save_dir=None)
    check_outputs(args)
    assert os.listdir(tmp_path) == []
    args.save_interval = 0
    with pytest.raises(OutputError, match="--save-interval 0: must be a positive"):
        check_outputs(args)
    (tmp_path / "f").write_text("")
    args.save_interval, args.save, args.tensorboard_dir = 5, None, str(tmp_path / "f")
    with pytest.raises(OutputError, match=r"--tensorboard-dir .*f: it exists and is not a folder"):
        check_outputs(args)

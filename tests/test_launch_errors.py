"""Bad launch input: one ``error:`` line naming what and where, exit status 2, no traceback,
before any model is built; the dry run rejects the same inputs.

Each case is a launch a new user wrote; the entry runs as a real CPU process."""

from __future__ import annotations

import os
import shutil
import socket

import pytest

from helpers import run_entry
from megagpt.data.preprocess import preprocess
from megagpt.data.tokenizer_files import GPT2_FILES_HINT

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
        assert line == ("error: --vocab-file /missing: no such file (tokenizer "
                        "GPT2BPETokenizer)" + GPT2_FILES_HINT)


def test_unreadable_tokenizer_file_is_one_line(tmp_path, gpt2):
    broken = tmp_path / "vocab.json"
    broken.write_text("{not json")
    line = one_error_line(run_entry(MOCK + ["--tokenizer-type", "GPT2BPETokenizer",
                                            "--vocab-file", str(broken), "--merge-file",
                                            gpt2.merge_file], cwd=tmp_path))
    assert line.startswith("error: cannot load the tokenizer (--tokenizer-type GPT2BPETokenizer")
    assert str(broken) in line


def test_hub_name_not_cached_with_the_hub_unreachable(tmp_path, monkeypatch):
    """Refused at the check, not after huggingface_hub's retries (about a minute)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                "http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)  # the probe goes to the closed port itself
    with socket.socket() as closed:  # bound, not listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
        env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": endpoint}
        for extra in ([], ["--dry-run"]):
            proc = run_entry(MOCK + ["--tokenizer-type", "HuggingFaceTokenizer",
                                     "--tokenizer-model", "gpt2", *extra], cwd=tmp_path, env=env)
            line = one_error_line(proc)
            assert line.startswith(f"error: --tokenizer-model gpt2: not in the local Hugging "
                                   f"Face cache ({tmp_path / 'hf' / 'hub'}) and the hub cannot "
                                   f"be reached ({endpoint}: "), line
            assert "Retrying" not in proc.stdout


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


# 8. flags megatron accepts but fails on later, counts below 1 ---------------------------

REFUSED = [
    # counts and sizes: megatron divides by most of them
    (["--micro-batch-size", "0"], "error: --micro-batch-size 0: must be at least 1"),
    (["--num-attention-heads", "0"], "error: --num-attention-heads 0: must be at least 1"),
    (["--num-layers", "0"], "error: --num-layers 0: must be at least 1"),
    (["--train-iters", "0"], "error: --train-iters 0: must be at least 1"),
    (["--seed", "-1"], "error: --seed -1: must be 0 or more"),
    (["--eval-iters", "2", "--eval-interval", "0"],
     "error: --eval-interval 0: must be at least 1 with --eval-iters 2"),
    # raised by megatron's validate_args or parse_args other than as an assertion
    (["--no-position-embedding"], "error: invalid arguments: RuntimeError: "
                                  "--no-position-embedding is deprecated"),
    (["--attention-backend", "local", "--no-fast-spec"],
     "error: invalid arguments: --attention-backend local is only supported with --spec local"),
    (["--heterogeneous-layers-config-path", "/no/such.json"],
     "error: invalid arguments: FileNotFoundError: [Errno 2] No such file or directory: "
     "'/no/such.json'"),
    (["--yaml-cfg", "/no/such.yaml"],
     "error: invalid arguments: FileNotFoundError: [Errno 2] No such file or directory: "
     "'/no/such.yaml'"),
    # what this entry or a plain install cannot honour
    (["--dataloader-type", "external"], "error: --dataloader-type external: megatron then "
                                        "takes what the datasets provider returns as iterators"),
    (["--multiple-validation-sets"], "error: --multiple-validation-sets needs --full-validation"),
    (["--spec", "no.such.module", "layer_spec"],
     "error: --spec no.such.module layer_spec: cannot import no.such.module"),
    (["--spec", "megatron.core"],
     "error: --spec megatron.core: wants a module and the name of a layer spec"),
    (["--multi-latent-attention"],
     "error: --multi-latent-attention needs Transformer Engine"),
    (["--num-experts", "2", "--disable-bias-linear", "--moe-token-dispatcher-type", "flex"],
     "error: --moe-token-dispatcher-type flex needs the deep_ep package"),
    (["--persist-layer-norm"], "error: --persist-layer-norm needs NVIDIA apex built with its "
                               "persistent layer norm"),
    (["--persist-layer-norm", "--no-persist-layer-norm"],
     "error: --persist-layer-norm and --no-persist-layer-norm ask for opposite kernels"),
    (["--init-model-with-meta-device"],
     "error: --init-model-with-meta-device needs Transformer Engine"),
    (["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"],
     "error: CPU mode (--cpu) cannot run with: --use-torch-fsdp2"),
]


@pytest.mark.parametrize("flags,start", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_flags_megatron_would_fail_on_later_are_refused_first(tmp_path, flags, start):
    line = one_error_line(run_entry(MOCK + flags, cwd=tmp_path))
    assert line.startswith(start), line


def test_split_without_any_share_or_without_a_share_asked_for(tmp_path, gpt2, gpt2_data):
    prefix, _ = gpt2_data
    data = ["--data-path", prefix, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
            gpt2.vocab_file, "--merge-file", gpt2.merge_file]
    line = one_error_line(run_entry(TINY + data + ["--split", "0,0,0"], cwd=tmp_path))
    assert line.startswith("error: --split 0,0,0: wants up to three shares, not all 0")
    line = one_error_line(run_entry(TINY + data + ["--split", "100,0,0", "--eval-iters", "2",
                                                   "--eval-interval", "2"], cwd=tmp_path))
    assert line.startswith(f"error: --split 100,0,0 gives the validation split no share of "
                           f"--data-path {prefix}, but megatron asks that split for ")
    assert "(--eval-iters 2)" in line


def test_null_tokenizer_without_a_vocabulary_size(tmp_path, gpt2_data):
    prefix, _ = gpt2_data
    line = one_error_line(run_entry(TINY + ["--data-path", prefix, "--tokenizer-type",
                                            "NullTokenizer"], cwd=tmp_path))
    assert line.startswith("error: --tokenizer-type NullTokenizer needs --vocab-size N > 0")


def test_a_split_share_without_documents_and_asked_for_none_is_not_built(tmp_path, gpt2,
                                                                          gpt2_data):
    """200 documents and megatron's default split 969,30,1: the test share rounds to no
    document. Asked for no samples (--eval-iters 0), megatron would still build its index
    and loop forever; the entry does not build it, and trains."""
    prefix, _ = gpt2_data
    proc = run_entry(TINY + ["--data-path", prefix, "--tokenizer-type", "GPT2BPETokenizer",
                             "--vocab-file", gpt2.vocab_file, "--merge-file", gpt2.merge_file],
                     cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "data: no samples asked of the validation and test splits: not built" in proc.stdout
    assert "[after training is done]" in proc.stdout


def test_skip_train_builds_and_exits(tmp_path):
    proc = run_entry(MOCK + ["--skip-train"], cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    assert "skipping training (--skip-train is on)" in proc.stdout


def test_resume_under_another_schedule_names_the_flags_that_allow_it(tmp_path):
    saved = run_entry(MOCK + ["--save", "ckpt", "--save-interval", "3"], cwd=tmp_path)
    assert saved.returncode == 0, saved.stdout[-3000:]
    longer = [f if f != "3" or MOCK[i - 1] != "--train-iters" else "5"
              for i, f in enumerate(MOCK)]
    refused = run_entry(longer + ["--load", "ckpt"], cwd=tmp_path)
    # a checkpoint is read into a built model: refused then, in one line
    assert refused.returncode == 2 and "Traceback" not in refused.stdout, refused.stdout[-3000:]
    errors = [line for line in refused.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, refused.stdout[-3000:]
    line = errors[0]
    assert line.startswith("error: cannot load checkpoint ")
    assert "add --override-opt_param-scheduler to take this launch's" in line
    resumed = run_entry(longer + ["--load", "ckpt", "--override-opt_param-scheduler"],
                        cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:]


def test_a_refused_launch_leaves_no_empty_tensorboard_file(tmp_path):
    """megatron opens its TensorBoard writer (an event file) with its globals, before the data
    and the checkpoint are checked: a launch refused then leaves nothing behind, and a folder
    that was there keeps what it held."""
    tensorboard = tmp_path / "tb"
    one_error_line(run_entry(TINY + NULL_512 + ["--data-path", str(tmp_path / "none"),
                                                "--tensorboard-dir", str(tensorboard)],
                             cwd=tmp_path))
    assert not tensorboard.exists()
    tensorboard.mkdir()
    (tensorboard / "notes.txt").write_text("mine")
    one_error_line(run_entry(MOCK + ["--load", str(tmp_path / "nothing"), "--tensorboard-dir",
                                     str(tensorboard)], cwd=tmp_path))
    assert [p.name for p in tensorboard.iterdir()] == ["notes.txt"]

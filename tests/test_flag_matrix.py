"""The flag matrix (tests/flag_matrix.py): every row trains, or is refused in one line by design.

``make test`` runs the rows marked ``ci``; ``MEGAGPT_FLAG_MATRIX=all`` runs every row (also
``MEGAGPT_FLAG_MATRIX=row,row`` for some). The selected rows run as real entry processes,
two at a time (the start-up, mostly imports, leaves a core idle), while pytest reports each
row as its own test. On a GPU machine ``MEGAGPT_FLAG_MATRIX_DEVICE=gpu`` runs them there,
with their precision flags (rows needing more GPUs than there are are skipped).
"""

from __future__ import annotations

import math
import os
import random
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import flag_matrix
from helpers import fetched_or_skip, parse_losses, run_entry

DEVICE = os.environ.get("MEGAGPT_FLAG_MATRIX_DEVICE", "cpu")
SELECTION = os.environ.get("MEGAGPT_FLAG_MATRIX", "ci")
# two at a time on a 2-core machine; a GPU machine with more cores can take more
# (MEGAGPT_FLAG_MATRIX_PARALLEL)
PARALLEL_RUNS = int(os.environ.get("MEGAGPT_FLAG_MATRIX_PARALLEL", "2"))
ROW_TIMEOUT_S = 420


def selected_rows() -> list[flag_matrix.Row]:
    if SELECTION == "all":
        return list(flag_matrix.ROWS)
    if SELECTION == "ci":
        return [row for row in flag_matrix.ROWS if row.ci]
    names = [n for n in SELECTION.split(",") if n]
    unknown = [n for n in names if n not in flag_matrix.BY_NAME]
    assert not unknown, f"MEGAGPT_FLAG_MATRIX names unknown rows: {unknown}"
    return [flag_matrix.BY_NAME[n] for n in names]


def make_null_tokenizer_dataset(directory) -> str:
    """A small real dataset: 300 documents of NullTokenizer ids (< 511), with EOD."""
    from megagpt.data.preprocess import preprocess

    rng = random.Random(0)
    jsonl = directory / "ids.jsonl"
    with open(jsonl, "w") as f:
        for _ in range(300):
            ids = " ".join(str(rng.randrange(511)) for _ in range(rng.randrange(20, 120)))
            f.write(f'{{"text": "{ids}"}}\n')
    result = preprocess(jsonl, directory / "ids", tokenizer_type="NullTokenizer", vocab_size=512,
                        append_eod=True, workers=1, log_interval=0,
                        stream=open(os.devnull, "w"))
    return result.prefixes["text"]


def _data_for(rows, directory) -> dict[str, str]:
    data = {}
    if any(flag_matrix.uses(r, "DATA") for r in rows):
        data["DATA"] = make_null_tokenizer_dataset(directory)
    if any(flag_matrix.uses(r, "GPT2_DATA") for r in rows):
        from megagpt.data.corpus import ensure_embedded_dataset

        corpus = fetched_or_skip(ensure_embedded_dataset, "the embedded corpus")
        data.update(GPT2_DATA=corpus.prefix, GPT2_VOCAB=corpus.vocab_file,
                    GPT2_MERGES=corpus.merge_file)
    return data


def _te_installed() -> bool:
    from megagpt.compat import Installed

    return Installed.detect().transformer_engine


def _apex_installed() -> bool:
    from megagpt.compat import Installed

    return Installed.detect().apex


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_row(row: flag_matrix.Row, workdir, data: dict) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    argv = flag_matrix.launch_flags(row, DEVICE, data)
    started = time.monotonic()
    try:
        proc = run_entry(argv, cwd=workdir, nproc=row.nproc, timeout=ROW_TIMEOUT_S)
        rc, out = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:  # a hang is this row's failure, not the session's
        output = exc.output or b""
        rc = f"no exit within {ROW_TIMEOUT_S} s"
        out = output.decode(errors="replace") if isinstance(output, bytes) else output
    (workdir / "entry.log").write_text(out)
    return {"rc": rc, "out": out, "argv": argv, "seconds": time.monotonic() - started}


@pytest.fixture(scope="session")
def matrix_results(request, tmp_path_factory):
    """Every selected row of this session, run two at a time on first use."""
    names = {item.callspec.params["row"].name for item in request.session.items
             if getattr(item, "callspec", None) and "row" in item.callspec.params
             and isinstance(item.callspec.params["row"], flag_matrix.Row)}
    rows = [row for row in selected_rows() if row.name in names]
    if DEVICE == "gpu":
        rows = [row for row in rows if row.nproc <= _gpus()]
    root = tmp_path_factory.mktemp("flag_matrix")
    data = _data_for(rows, root)
    with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
        futures = {row.name: pool.submit(run_row, row, root / row.name, data) for row in rows}
        return {name: future.result() for name, future in futures.items()}


def _context(result) -> str:
    return f"flags: {' '.join(result['argv'])}\n{result['out'][-4000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("row", selected_rows(), ids=lambda row: row.name)
def test_row_trains_or_is_refused_in_one_line(row, matrix_results):
    if row.name not in matrix_results:
        pytest.skip(f"needs {row.nproc} GPUs")
    result = matrix_results[row.name]
    out = result["out"]
    assert "Traceback" not in out, _context(result)
    refusal = row.expected_refusal(_te_installed(), _apex_installed(), DEVICE)
    if refusal is None:
        assert result["rc"] == 0, _context(result)
        if _apex_installed():  # what the launch takes from apex, said once
            assert out.count("apex: what this launch takes from it:") == 1, _context(result)
        losses = parse_losses(out)
        assert sorted(losses) == [1, 2, 3], _context(result)
        assert all(math.isfinite(loss) for loss in losses.values()), _context(result)
        return
    assert result["rc"] == 2, _context(result)
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(set(errors)) == 1 and refusal in errors[0], _context(result)
    assert not re.search(r"number of parameters on \(tensor", out), "refused after the model"


def test_table_covers_the_features_named_for_it():
    """The table keeps a row for each feature the matrix exists for."""
    flags = {f for row in flag_matrix.ROWS for f in row.flags}
    for needed in ("--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
                   "--tensor-model-parallel-size", "--sequence-parallel", "--swiglu",
                   "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                   "--calculate-per-token-loss", "--recompute-activations",
                   "--recompute-granularity", "--use-distributed-optimizer",
                   "--overlap-grad-reduce", "--overlap-param-gather", "--async-save",
                   "--tensorboard-dir", "--deterministic-mode", "--rerun-mode", "--bf16",
                   "--fp16"):
        assert needed in flags, needed
    assert {"rope"} <= {row.flags[i + 1] for row in flag_matrix.ROWS
                        for i, f in enumerate(row.flags) if f == "--position-embedding-type"}
    ci = [row for row in flag_matrix.ROWS if row.ci]
    assert 0 < len(ci) < len(flag_matrix.ROWS)

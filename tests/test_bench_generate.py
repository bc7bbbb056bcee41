"""bench/bench_generate.py's logic on the CPU (no CUDA graphs): every engine runs on one
exported model and, in fp32, gives transformers' greedy tokens."""

import json
import subprocess

import pytest

from helpers import PYTHON, REPO, entry_env

pytestmark = pytest.mark.slow


def test_the_bench_times_every_engine_on_one_model_and_they_agree(tmp_path):
    out = subprocess.run([PYTHON, str(REPO / "bench" / "bench_generate.py"), "--cpu",
                          "--shape", "tiny", "--batch-sizes", "1", "3", "--prompt-tokens", "8",
                          "--new-tokens", "12", "--repeats", "1", "--out", str(tmp_path)],
                         cwd=tmp_path, env=entry_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    record = json.loads((tmp_path / "bench_generate.json").read_text())
    rows = {(r["engine"], r["batch"]): r for r in record["rows"]}
    assert sorted(rows) == sorted((e, b) for e in ("transformers", "megatron", "kv")
                                  for b in (1, 3))
    for (engine, batch), row in rows.items():
        assert row["tokens_per_second"] == pytest.approx(batch * 12 / row["seconds"])
        if engine != "transformers":
            assert row["agreement_with_transformers"] == {"fewest": 12, "mean": 12.0}
            assert row["x_transformers"] == pytest.approx(
                row["tokens_per_second"] / rows[("transformers", batch)]["tokens_per_second"])
    assert "kv against megatron at batch 3: agree for 12 / 12.0 tokens" in out.stdout
    assert record["versions"]["megatron-core"].startswith("0.19")

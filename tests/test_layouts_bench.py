"""bench/layouts.py, the multi-GPU layout benchmark, run on two CPU processes: it must launch
the layouts, compare their losses with one process's, resume a checkpoint saved under tensor
parallelism under pipeline parallelism, and write what bench/records.py makes table rows of."""

import json
import subprocess
import sys

import pytest

from helpers import REPO, entry_env

pytestmark = pytest.mark.slow


def test_layouts_bench_runs_compares_and_resumes_across_layouts(tmp_path):
    out = tmp_path / "layouts"
    cmd = [sys.executable, str(REPO / "bench" / "layouts.py"), "--cpu", "--shape", "tiny",
           "--gpus", "2", "--iters", "4", "--skip", "1", "--layouts", "tp2,dp2,cp2,tp2pp2dp2",
           "--resume-check", "tp2,pp2", "--out", str(out), "--", "--mock-data",
           "--vocab-size", "512"]
    p = subprocess.run(cmd, cwd=REPO, env=entry_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:]
    report = json.loads((out / "layouts.json").read_text())
    layouts = report["layouts"]
    assert sorted(layouts["one"]["losses"]) == ["1", "2", "3", "4"]
    for name in ("tp2", "dp2"):  # fp32 on the CPU: the same numbers as one process
        assert layouts[name]["rc"] == 0
        assert layouts[name]["against_one"]["iterations"] == 4
        assert layouts[name]["against_one"]["max_rel_diff"] < 1e-3
    assert "Transformer Engine" in layouts["cp2"]["refused"]
    assert "needs 8 processes" in layouts["tp2pp2dp2"]["skipped"]
    resume = report["resume"]
    assert resume["runs_ok"] and resume["resumed_iterations"] == [3, 4]
    assert resume["against_uninterrupted"]["max_rel_diff"] < 1e-3
    assert not list(out.glob("ckpt_*")), "checkpoints are removed after the check"
    assert "resumed under pp2" in p.stdout

    # the report becomes rows of docs/benchmarks.md (bench/records.py)
    sys.path.insert(0, str(REPO / "bench"))
    import records

    made = records.from_output(report)
    assert all(not records.problems(r) for r in made)
    rows = {r["row"]["layout"]: r for r in made if r["table"] == "layouts"}
    assert set(rows) == {"one", "tp2", "dp2", "cp2"}  # tp2pp2dp2 was skipped: no row
    tp2 = rows["tp2"]["figures"]
    assert tp2["max_rel_loss_diff"] < 1e-3 and tp2["ms_per_iter"] > 0
    assert "Transformer Engine" in rows["cp2"]["figures"]["not_run"]
    assert rows["one"]["command"].startswith("python bench/layouts.py --cpu --shape tiny")
    (resume,) = [r for r in made if r["table"] == "resume"]
    assert (resume["row"]["saved_under"], resume["row"]["resumed_under"]) == ("tp2", "pp2")
    assert resume["figures"]["iterations"] == 2

    # a later invocation compares with that one-process log instead of running it again
    again = tmp_path / "again"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "layouts.py"), "--cpu",
                        "--shape", "tiny", "--gpus", "2", "--iters", "4", "--skip", "1",
                        "--layouts", "", "--one-log", str(out / "one.log"), "--out", str(again)],
                       cwd=REPO, env=entry_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=60)
    assert p.returncode == 0, p.stdout[-4000:]
    reused = json.loads((again / "layouts.json").read_text())["layouts"]["one"]
    assert reused["losses"] == layouts["one"]["losses"]
    assert not (again / "one.log").exists()  # not run

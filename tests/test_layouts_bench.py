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
           "--gpus", "2", "--iters", "4", "--skip", "1", "--layouts", "dp2,cp2,tp2pp2dp2",
           "--resume-check", "tp2,dp2", "--out", str(out), "--",
           "--mock-data",
           "--vocab-size", "512"]
    p = subprocess.run(cmd, cwd=REPO, env=entry_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:]
    report = json.loads((out / "layouts.json").read_text())
    layouts = report["layouts"]
    assert sorted(layouts["one"]["losses"]) == ["1", "2", "3", "4"]
    # fp32 on the CPU: the same numbers as one process (TP=2 against one process is
    # test_parallel_layouts'; here the resume check below saves under it)
    assert layouts["dp2"]["rc"] == 0
    assert layouts["dp2"]["against_one"]["iterations"] == 4
    assert layouts["dp2"]["against_one"]["max_rel_diff"] < 1e-3
    assert "tp2" not in layouts
    assert "Transformer Engine" in layouts["cp2"]["refused"]
    assert "needs 8 processes" in layouts["tp2pp2dp2"]["skipped"]
    # under DP=2 with the distributed optimizer (its optimizer state resharded); TP=2 -> PP=2
    # is test_checkpoint_faults' (the entry alone, without this tool)
    assert [(r["saved_under"], r["resumed_under"]) for r in report["resumes"]] == [
        ("tp2", "dp2")]
    for resume in report["resumes"]:
        assert resume["runs_ok"] and resume["resumed_iterations"] == [3, 4]
        # The resumed layout sums in another order than the uninterrupted one (DP=2 adds two
        # ranks' gradients and losses, TP=2 splits each GEMM's inner sum and clips by a norm
        # summed over other shards): equal to float32 rounding, not bit for bit; whether the
        # logged 7 digits agree too depends on the CPU's GEMM kernels. The distributed
        # optimizer's moments and step must come back as saved: a step advanced once per
        # parameter moved a tiny CPU run's loss (about 6) by 4e-3 two iterations after its
        # resume (bench/notes/resume.md), 60 times this bound.
        assert resume["against_uninterrupted"]["max_rel_diff"] < 1e-5, resume
    assert not list(out.glob("ckpt_*")), "checkpoints are removed after the check"
    assert "resumed under dp2" in p.stdout

    # the report becomes rows of bench/benchmarks.md (bench/records.py)
    sys.path.insert(0, str(REPO / "bench"))
    import records

    made = records.from_output(report)
    assert all(not records.problems(r) for r in made)
    rows = {r["row"]["layout"]: r for r in made if r["table"] == "layouts"}
    assert set(rows) == {"one", "dp2", "cp2"}  # tp2pp2dp2 was skipped: no row
    dp2 = rows["dp2"]["figures"]
    assert dp2["max_rel_loss_diff"] < 1e-3 and dp2["ms_per_iter"] > 0
    assert "Transformer Engine" in rows["cp2"]["figures"]["not_run"]
    assert rows["one"]["command"].startswith("python bench/layouts.py --cpu --shape tiny")
    resumes = [r for r in made if r["table"] == "resume"]
    assert [(r["row"]["saved_under"], r["row"]["resumed_under"]) for r in resumes] == [
        ("tp2", "dp2")]
    assert all(r["figures"]["iterations"] == 2 for r in resumes)

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


def test_a_global_batch_each_layout_can_split():
    """Every data-parallel rank takes whole micro-batches, and the interleaved schedule a
    multiple of its stages per rank; layouts that cannot are skipped with the reason."""
    sys.path.insert(0, str(REPO / "bench"))
    import layouts

    assert [layouts.data_parallel_size(n) for n in ("one", "tp2", "pp2", "dp2", "dp8",
                                                    "tp2pp2dp2", "cp2")] == [1, 1, 1, 2, 8, 2, 1]
    assert layouts.batch_unsplittable_reason("dp4", 8) is None
    assert layouts.batch_unsplittable_reason("dp8", 4) == \
        "4 micro-batches per step do not split over DP=8"
    assert layouts.batch_unsplittable_reason("vpp2", 4) is None
    assert "multiple of 2 micro-batches per data-parallel rank, not 3" in \
        layouts.batch_unsplittable_reason("vpp2", 3)
    assert "--global-batch-size" in (flags := layouts.model_flags("1.3B", 1, 10, False,
                                                                 micro_batch=8, micro_batches=16))
    assert flags[flags.index("--global-batch-size") + 1] == "128"
    assert flags[flags.index("--hidden-size") + 1] == "2048"
    # a resume across optimizers or TP x PP saves what the other layout loads
    assert layouts.same_optimizer("tp2", "pp2") == []
    assert layouts.same_optimizer("dp2", "dp2eager") == []
    assert layouts.same_optimizer("tp2", "dp2") == ["--use-distributed-optimizer",
                                                    "--dist-ckpt-optim-fully-reshardable"]


def test_any_tp_pp_dp_layout_by_name():
    sys.path.insert(0, str(REPO / "bench"))
    import layouts

    assert layouts.layout_spec("tp2pp4") == (8, ["--tensor-model-parallel-size", "2",
                                                 "--pipeline-model-parallel-size", "4"])
    assert layouts.layout_spec("pp8") == (8, ["--pipeline-model-parallel-size", "8"])
    assert layouts.layout_spec("tp2dp4") == (8, ["--tensor-model-parallel-size", "2",
                                                 *layouts.DP_FLAGS])
    assert layouts.layout_spec("tp2") == layouts.LAYOUTS["tp2"]  # the named ones as named
    assert layouts.layout_spec("dp2pp2") is None  # out of order: not guessed at
    assert layouts.layout_spec("tp0") is None and layouts.layout_spec("x") is None
    assert layouts.data_parallel_size("tp2dp4") == 4


def test_measured_layouts_are_set_beside_the_dry_runs_estimate(tmp_path):
    """--no-one --estimate: each layout's measured step and the dry run's estimate of the
    same launch (on the CPU the two are not comparable; what is checked is that every timed
    layout gets its estimate, and the report's rows carry both)."""
    out = tmp_path / "ranking"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "layouts.py"), "--cpu",
                        "--shape", "tiny", "--gpus", "2", "--iters", "3", "--skip", "1",
                        "--no-one", "--layouts", "tp2,tp1dp2", "--estimate", "H200",
                        "--out", str(out), "--", "--mock-data", "--vocab-size", "512"],
                       cwd=REPO, env=entry_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:]
    report = json.loads((out / "layouts.json").read_text())
    assert set(report["layouts"]) == {"tp2", "tp1dp2"} and not (out / "one.log").exists()
    for r in report["layouts"].values():
        assert r["ms_per_iter"] > 0 and r["estimated_ms"] > 0
    assert "measured against the dry run's estimate on H200" in p.stdout

    sys.path.insert(0, str(REPO / "bench"))
    import records

    made = records.from_output(report)
    assert all(not records.problems(r) for r in made)
    assert {r["row"]["layout"]: r["figures"]["estimated_on"] for r in made} == {
        "tp2": "H200", "tp1dp2": "H200"}


def test_an_estimate_for_a_gpu_the_dry_run_does_not_know_is_refused_first(tmp_path):
    p = subprocess.run([sys.executable, str(REPO / "bench" / "layouts.py"), "--cpu",
                        "--shape", "tiny", "--layouts", "tp2", "--estimate", "V100",
                        "--out", str(tmp_path)], cwd=REPO, env=entry_env(),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert p.returncode == 2 and "--estimate V100: not a GPU type the dry run knows" in p.stdout
    assert not list(tmp_path.iterdir())

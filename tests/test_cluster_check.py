"""``megagpt-check``: a GPU, node or rail more than the margin below the others or the dry
run's figure is named in one line. The report from given measurements (two nodes, one slow
GPU, one slow rail); gloo processes on the CPU, one slowed on purpose; one GPU against the
dry run's figure for it."""

import json
import re
import subprocess
import sys

import pytest

from helpers import REPO, _free_port, entry_env
from megagpt.preflight.cluster_check import Place, Reference, reference_for, report_lines
from process_faults import DutyCycle, rank_process

H200 = reference_for("H200", cpu=False)
EXAMPLES = REPO / "examples"


def test_the_dry_runs_figures_are_the_step_time_models():
    from megagpt.gpus import KNOWN_GPUS
    from megagpt.preflight.step_time import bus_bandwidth

    spec = KNOWN_GPUS["H200"].spec
    assert H200.gemm_tflops == pytest.approx(spec.dense_16bit_tflops * spec.gemm_efficiency)
    assert H200.inside_node_gb_s == pytest.approx(bus_bandwidth(spec, True) / 1e9)
    assert H200.across_nodes_gb_s == pytest.approx(bus_bandwidth(spec, False) / 1e9)
    assert reference_for(None, cpu=True) == Reference("CPU", None, None, None)


def test_a_slow_gpu_and_a_slow_rail_are_named_in_one_line():
    places = [Place(r, r // 4, r % 4, f"node{r // 4}") for r in range(8)]
    gemm = [700.0] * 8
    gemm[5] = 500.0  # 29 % below the median, and below the dry run's 643
    inside = [360.0] * 4 + [350.0] * 4
    across = [46.0, 46.0, 30.0, 46.0] * 2  # rail 2 (local rank 2 of each node)
    lines, error = report_lines(places, gemm, inside, across, H200, margin=0.15)
    assert lines[0] == "check: 8 ranks on 2 nodes"
    assert lines[1] == "  GEMM            500-700 TFLOP/s per GPU; the dry run's H200 figure: 643"
    assert error == ("2 slow: rank 5 (node1, node 1, local rank 1) 500 TFLOP/s (29 % below the "
                     "median 700, 22 % below the dry run's 643); rail 2 (local rank 2 of every "
                     "node) 30 GB/s across nodes (35 % below the median 46, 36 % below the dry "
                     "run's 47) (margin 15 %)")
    even, none = report_lines(places, [700.0] * 8, inside, [46.0] * 8, H200, margin=0.15)
    assert none is None and even[-1].startswith("check OK")


# Two single-threaded gloo processes on a shared 2-core host differ by up to ~25 % in their
# best burst (measured here, 2026-12-04), and one was 31 % below the median of two while the
# suite's other worker ran beside them (2026-12-06, 58a03bb): a margin of 50 % is above that
# (the even check fails only where one rank is a third of the other), and below the ~78 % by
# which a rank stopped seven eighths of the time falls behind the median.
CPU_MARGIN = "50"
STOPPED_S = 0.04375  # of every 50 ms (DutyCycle)


def _check(tmp_path, *flags):
    """megagpt-check --cpu on 2 gloo processes (it starts torchrun itself)."""
    return subprocess.Popen([sys.executable, "-m", "megagpt.preflight.cluster_check", "--cpu",
                             "--nproc-per-node", "2", "--margin", CPU_MARGIN,
                             "--json", str(tmp_path / "check.json"), *flags], cwd=REPO,
                            env=entry_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.slow
def test_a_slowed_cpu_rank_is_named_and_an_even_run_passes(tmp_path):
    even = _check(tmp_path)
    out, err = even.communicate(timeout=180)
    assert even.returncode == 0, out + err
    assert "check OK" in out and "error:" not in err

    slowed = _check(tmp_path)
    with DutyCycle(rank_process(slowed, 1), stopped_s=STOPPED_S):
        out, err = slowed.communicate(timeout=180)
    assert slowed.returncode == 1, out + err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert re.match(r"error: 1 slow: rank 1 \(\S+, node 0, local rank 1\) [0-9.]+ TFLOP/s "
                    r"\(\d+ % below the median [0-9.]+\) \(margin 50 %\)$", line), line
    measured = json.loads((tmp_path / "check.json").read_text())
    assert [r["rank"] for r in measured["ranks"]] == [0, 1]
    assert measured["ranks"][1]["gemm_tflops"] < 0.5 * measured["ranks"][0]["gemm_tflops"]


@pytest.mark.slow
def test_the_sbatch_examples_check_runs_on_every_node_and_stops_a_slow_job(tmp_path):
    """examples/cluster_check.sh as the sbatch runs it (one node, gloo processes here)."""
    env = entry_env({"PYTHON": sys.executable, "GPUS_PER_NODE": "2",
                     "MASTER_PORT": str(_free_port()),
                     "CHECK_ARGS": "--cpu", "MARGIN": CPU_MARGIN})
    for name in ("SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST"):
        env.pop(name, None)
    ok = subprocess.run(["bash", str(EXAMPLES / "cluster_check.sh")], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=180)
    assert ok.returncode == 0 and "check OK" in ok.stdout, ok.stdout + ok.stderr

    # the same with rank 1 running an eighth of the time: named, and the job not started
    env["MASTER_PORT"] = str(_free_port())
    slow = subprocess.Popen(["bash", str(EXAMPLES / "cluster_check.sh")], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with DutyCycle(rank_process(slow, 1), stopped_s=STOPPED_S):
        out, err = slow.communicate(timeout=180)
    assert slow.returncode == 1, out + err
    assert re.search(r"^error: 1 slow: rank 1 ", err, re.M), err
    assert err.rstrip().endswith("cluster check failed: not starting the run "
                                 "(CLUSTER_CHECK=0 skips the check)"), err


@pytest.mark.gpu
def test_one_gpu_meets_the_dry_runs_gemm_figure(tmp_path):
    import torch

    name = torch.cuda.get_device_name(0)
    check = subprocess.run([sys.executable, "-m", "megagpt.preflight.cluster_check",
                            "--nproc-per-node",
                            "1", "--json", str(tmp_path / "check.json")], cwd=REPO,
                           env=entry_env(), capture_output=True, text=True, timeout=300)
    measured = json.loads((tmp_path / "check.json").read_text())
    rate = measured["ranks"][0]["gemm_tflops"]
    reference = measured["reference"]
    assert reference["gemm_tflops"] is not None, f"no dry-run figure for {name}"
    assert check.returncode == 0, check.stdout + check.stderr
    assert rate >= 0.85 * reference["gemm_tflops"], (rate, reference)
    print(f"{name}: GEMM {rate:.0f} TFLOP/s, the dry run's {reference['gemm_tflops']:.0f}")

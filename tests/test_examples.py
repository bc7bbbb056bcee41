"""The examples run as shipped: the launch scripts' dry runs (no torchrun, no GPU), the SLURM
path with stand-ins for srun/scontrol, the minimal loop and the resume script on the CPU."""

import json
import os
import re
import subprocess
import sys

import pytest

from helpers import REPO, entry_env, parse_losses

EXAMPLES = REPO / "examples"


# A guard against a hang only: resume.sh runs three processes, 60 s on two idle cores, and
# took over 240 s while the cores were shared by other runs.
def run_script(script, *args, env=None, timeout=600) -> subprocess.CompletedProcess:
    merged = entry_env({"PYTHON": sys.executable, **(env or {})})
    for name in ("SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST", "WORLD_SIZE", "RANK",
                 "NNODES", "NODE_RANK", "GPUS_PER_NODE", "MASTER_ADDR", "MASTER_PORT"):
        if name not in (env or {}):
            merged.pop(name, None)
    return subprocess.run(["bash", str(EXAMPLES / script), *map(str, args)], cwd=REPO,
                          env=merged, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)


def test_scripts_are_valid_bash():
    for script in [*EXAMPLES.glob("*.sh"), *EXAMPLES.glob("*.sbatch")]:
        subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.slow
def test_175b_dry_run_passes_on_16_nodes(tmp_path):
    out = run_script("train_gpt3_175b_distributed.sh", 16, env={"DRY_RUN": "1"}).stdout
    assert "launch: 16 nodes × 8 GPUs = 128 GPUs; node rank 0; master localhost:6000" in out
    assert "GPUs            128 = TP 8 × PP 16 × CP 1 × DP 1" in out
    assert "micro-batches   1536 per step" in out
    assert "dry run OK: 128 GPUs, 174.62B parameters" in out, out[-3000:]


@pytest.mark.slow
def test_175b_on_one_node_stops_before_torchrun_with_the_arithmetic():
    # The real launch path (no DRY_RUN): the preflight fails, torchrun never starts.
    result = run_script("train_gpt3_175b_distributed.sh", 1)
    assert result.returncode == 2, result.stdout[-3000:]
    assert "world size 8 is not divisible by TP 8 × PP 16 × CP 1 = 128 GPUs per model " \
           "replica" in result.stdout
    assert "preflight failed: not starting torchrun" in result.stdout


@pytest.mark.slow
def test_175b_sbatch_takes_nodes_rank_and_master_from_slurm(tmp_path):
    # Stand-ins for SLURM's tools: srun runs its command once (as node 0), scontrol lists hosts.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] || exit 1\n'
        'for i in $(seq -w 1 192); do echo "gpu$i"; done\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(REPO),
           "SLURM_NNODES": "192", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu[001-192]",
           "DRY_RUN": "1"}
    result = run_script("train_gpt3_175b.sbatch", env=env)
    out = result.stdout
    assert result.returncode == 0, (result.returncode, out[-3000:])
    assert "launch: 192 nodes × 8 GPUs = 1536 GPUs; node rank 0; master gpu001:6000" in out
    assert "GPUs            1536 = TP 8 × PP 16 × CP 1 × DP 12" in out, out[-3000:]
    assert "micro-batches   128 per step = global batch 1536 / (micro-batch 1 × DP 12)" in out


@pytest.mark.slow
@pytest.mark.parametrize("gpus,how,micro_batches", [(8, "env", 8), (1, "arg", 64)])
def test_345m_dry_run_on_one_node(gpus, how, micro_batches):
    env = {"DATA_PATH": "mock", "GPU_TYPE": "A100-80GB"}
    if how == "env":
        env["GPUS_PER_NODE"] = str(gpus)
        result = run_script("train_gpt345m.sh", "--", "--dry-run", env=env)
    else:
        result = run_script("train_gpt345m.sh", gpus, env={**env, "DRY_RUN": "1"})
    out = result.stdout
    assert result.returncode == 0, out[-3000:]
    assert f"GPUs            {gpus} = TP 1 × PP 1 × CP 1 × DP {gpus}" in out
    assert f"micro-batches   {micro_batches} per step = global batch 512" in out
    assert "total           354,871,296 (354.87M)" in out


def test_minimal_loop_is_short():
    assert len((EXAMPLES / "run_simple_mcore_train_loop.py").read_text().splitlines()) < 300


@pytest.mark.slow
def test_minimal_loop_trains_and_round_trips_a_checkpoint_on_cpu(tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "run_simple_mcore_train_loop.py"), "--cpu", "--steps", "6",
         "--ckpt-dir", str(tmp_path / "ckpt")],
        cwd=tmp_path, env=entry_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=600)
    out = result.stdout
    assert result.returncode == 0, out[-3000:]
    losses = [float(x) for x in re.findall(r"^step +\d+ \| lm loss ([\d.]+)", out, re.M)]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert re.search(r"checkpoint: saved to .* and loaded back; \d+ tensors equal", out)
    assert any((tmp_path / "ckpt").iterdir())


@pytest.mark.slow
def test_resume_script_continues_from_the_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    result = run_script("resume.sh", run_dir, env={"TRAIN_ITERS": "6", "STOP_AT": "3",
                                                   "MEGAGPT_NO_PLOT": "0"})
    assert result.returncode == 0, result.stdout[-3000:]
    first = parse_losses((run_dir / "first.log").read_text())
    resumed_text = (run_dir / "resumed.log").read_text()
    resumed = parse_losses(resumed_text)
    assert sorted(first) == [1, 2, 3] and sorted(resumed) == [4, 5, 6]
    # The resumed run starts where the first stopped: 3 steps × 4 samples already consumed,
    # as the run folder's records of the two launches say.
    assert re.search(r"iteration +4/6 \| lm loss: ", resumed_text)
    records = [json.loads(line) for line in
               (run_dir / "checkpoints" / "iterations.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["consumed_samples"]) for r in records] == [
        (i, 4 * i) for i in range(1, 7)]
    assert (run_dir / "checkpoints" / "training.png").read_bytes()[:4] == b"\x89PNG"
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    png = run_dir / "resume.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _bare_shell_env() -> dict:
    """A shell as a new terminal gives one after ``make demo``: no activated environment, the
    system's python3 (without megatron) first on PATH."""
    return {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/bin:/bin",
            "OMP_NUM_THREADS": "1", "MEGAGPT_NO_PLOT": "1",
            **{k: v for k, v in os.environ.items() if k.startswith("MEGAGPT_CACHE")}}


@pytest.mark.slow
def test_readme_commands_work_from_a_shell_without_the_project_environment(tmp_path):
    """The examples and the tools find the project's .venv themselves."""
    env = _bare_shell_env()
    bare = subprocess.run(["bash", "-c", "command -v python3 && python3 -c 'import megatron'"],
                          env=env, capture_output=True, text=True)
    if not bare.stdout.strip():
        pytest.skip("no python3 on the system PATH to stand for a new shell's")
    assert bare.returncode != 0, "the system python3 has megatron: not a bare shell"
    example = subprocess.run(["bash", str(EXAMPLES / "train_gpt345m.sh"), "1"], cwd=tmp_path,
                             env={**env, "DRY_RUN": "1", "DATA_PATH": "mock"},
                             capture_output=True, text=True, timeout=300)
    assert example.returncode == 0, example.stderr[-3000:]
    assert "dry run OK: 1 GPU, 354.87M parameters" in example.stdout
    tool = subprocess.run(["python3", str(REPO / "tools" / "perplexity.py"), "--help"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert tool.returncode == 0 and "usage: tools/perplexity.py" in tool.stdout, tool.stderr
    assert "has no megatron-core: running with" in tool.stderr
    entry = subprocess.run(["python3", str(REPO / "pretrain_gpt.py"), "--cpu", "--hiden-size",
                            "3"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert entry.returncode == 2
    assert entry.stderr.splitlines()[-1] == ("error: --hiden-size: unknown option (did you mean "
                                             "--hidden-size?); pretrain_gpt.py --help lists "
                                             "them all")


def test_the_slurm_path_off_a_cluster_says_what_to_run():
    env = _bare_shell_env()
    result = subprocess.run(["bash", str(EXAMPLES / "train_gpt3_175b.sbatch")], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("error: srun not found: this file is submitted to SLURM")
    result = subprocess.run(["bash", str(EXAMPLES / "train_gpt3_175b_distributed.sh"), "2", "0"],
                            env={**env, "SLURM_JOB_NODELIST": "gpu[1-2]"}, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("error: SLURM_JOB_NODELIST is set but scontrol is not on "
                                    "PATH")

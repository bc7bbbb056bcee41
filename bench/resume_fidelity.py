#!/usr/bin/env python
"""Resume fidelity: N iterations uninterrupted vs. stopped at N/2 and resumed; same losses?

    # CPU, tiny model (about a minute on two cores)
    python bench/resume_fidelity.py --tiny-cpu --out runs/resume_fidelity

    # one GPU, GPT-2 345M in bf16 on real data
    python bench/resume_fidelity.py --iters 200 --out runs/resume_345m -- \\
        --config configs/gpt2_345m.yaml --bf16 --micro-batch-size 4 --global-batch-size 32 \\
        --data-path DATA_PREFIX --tokenizer-type HuggingFaceTokenizer --tokenizer-model TOKDIR

    # eight GPUs
    python bench/resume_fidelity.py --launcher "torchrun --nproc-per-node 8" ... -- ...

Three launches of ``pretrain_gpt.py`` with the flags after ``--``:
  1. ``uninterrupted``: ``--train-iters N``;
  2. ``first``: the same plus ``--save DIR/ckpt --load DIR/ckpt --save-interval N/2
     --exit-interval N/2``: megatron saves at N/2 and exits;
  3. ``resumed``: exactly the command of 2 again, which continues from the checkpoint.
``--train-iters``, ``--log-interval 1``, ``--eval-interval`` (past the end: evaluation
would not change the losses but costs time) and ``--deterministic-mode`` (leave it out with
``--no-deterministic``) are added. Writes into ``--out``: the three logs,
``losses.csv`` (iteration, uninterrupted, resumed-or-first), ``resume_fidelity.json``
(the comparison) and ``resume_fidelity.png`` (the curves, via ``megagpt.run_log.plots``).
Exit status 0 when every iteration's logged loss agrees within ``--tolerance`` (default 0:
bit-exact, as deterministic mode gives), 1 otherwise.

On GPUs, deterministic mode needs deterministic kernels: if torch reports an operation
without a deterministic implementation, rerun with ``--no-deterministic --tolerance 1e-3``
and read the JSON's ``max_abs_diff`` instead.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from helpers import TINY_MODEL, parse_losses  # noqa: E402
from run_info import run_info  # noqa: E402

TINY_CPU = [*TINY_MODEL, "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def launch(launcher: list[str], flags: list[str], log: Path, env: dict) -> float:
    """Run the entry once, output into ``log``; the wall time, or exit on failure."""
    command = [*launcher, str(REPO / "pretrain_gpt.py"), *flags]
    print(f"$ {shlex.join(command)}\n  > {log}", flush=True)
    start = time.time()
    with open(log, "w") as out:
        status = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if status != 0:
        sys.stderr.write("".join(log.read_text().splitlines(True)[-30:]))
        sys.exit(f"{log.name}: exit status {status}")
    return time.time() - start


def compare(reference: dict[int, float], resumed: dict[int, float], tolerance: float) -> dict:
    common = sorted(set(reference) & set(resumed))
    diffs = {i: abs(reference[i] - resumed[i]) for i in common}
    bad = [i for i in common if diffs[i] > tolerance]
    missing = sorted(set(reference) ^ set(resumed))
    return {
        "iterations_compared": len(common),
        "missing_iterations": missing,
        "max_abs_diff": max(diffs.values(), default=None),
        "identical": sum(d == 0 for d in diffs.values()),
        "first_differing_iteration": bad[0] if bad else None,
        "agree": not bad and not missing,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = []
    if "--" in argv:
        flags = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=None, help="N (default 200; 20 with --tiny-cpu)")
    p.add_argument("--out", default="runs/resume_fidelity", help="output folder")
    p.add_argument("--launcher", default=sys.executable,
                   help='how to start the entry, e.g. "torchrun --nproc-per-node 8"')
    p.add_argument("--tiny-cpu", action="store_true",
                   help="the tiny test model in CPU mode, with dropout 0.1")
    p.add_argument("--no-deterministic", action="store_true", help="leave out --deterministic-mode")
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="largest accepted |loss difference| (default 0: bit-exact)")
    opts = p.parse_args(argv)

    n = opts.iters or (20 if opts.tiny_cpu else 200)
    half = n // 2
    if opts.tiny_cpu:
        flags = [*TINY_CPU, *flags]
    if not flags:
        p.error("give the model's flags after --, or --tiny-cpu")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "ckpt"
    if ckpt.exists():
        import shutil
        shutil.rmtree(ckpt)  # stale checkpoints would be resumed from
    common = [*flags, "--train-iters", str(n), "--log-interval", "1",
              "--eval-interval", str(n + 1)]
    if not opts.no_deterministic:
        common.append("--deterministic-mode")
    stop_and_resume = [*common, "--save", str(ckpt), "--load", str(ckpt),
                       "--save-interval", str(half), "--exit-interval", str(half)]
    env = dict(os.environ)
    if "--cpu" in flags:
        env.setdefault("OMP_NUM_THREADS", "1")  # two cores: extra intra-op threads only wait
    launcher = shlex.split(opts.launcher)

    seconds = {
        "uninterrupted": launch(launcher, common, out / "uninterrupted.log", env),
        "first": launch(launcher, stop_and_resume, out / "first.log", env),
        "resumed": launch(launcher, stop_and_resume, out / "resumed.log", env),
    }
    reference = parse_losses((out / "uninterrupted.log").read_text())
    first = parse_losses((out / "first.log").read_text())
    resumed = parse_losses((out / "resumed.log").read_text())
    joined = {**first, **resumed}

    with open(out / "losses.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["iteration", "uninterrupted", "stopped_and_resumed", "run"])
        for i in sorted(set(reference) | set(joined)):
            writer.writerow([i, reference.get(i), joined.get(i),
                             "resumed" if i in resumed else "first"])
    result = {
        "info": run_info(),  # date, commit, machine, versions, command (bench/records.py)
        "iterations": n, "stopped_at": half, "tolerance": opts.tolerance,
        "deterministic_mode": not opts.no_deterministic, "flags": flags,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "all": compare(reference, joined, opts.tolerance),
        "after_resume": compare({i: v for i, v in reference.items() if i > half},
                                resumed, opts.tolerance),
        "first_after_resume": {"iteration": half + 1,
                               "uninterrupted": reference.get(half + 1),
                               "resumed": resumed.get(half + 1)},
    }
    (out / "resume_fidelity.json").write_text(json.dumps(result, indent=2) + "\n")

    try:
        from megagpt.run_log.plots import load_run, plot_runs

        runs = [load_run(str(out / "uninterrupted.log"), "uninterrupted"),
                load_run(str(out / "first.log"), f"stopped at {half}"),
                load_run(str(out / "resumed.log"), f"resumed from {half}")]
        plot_runs(runs, out / "resume_fidelity.png",
                  title=f"resume fidelity: max |diff| {result['all']['max_abs_diff']}")
    except Exception as exc:  # noqa: BLE001 - the numbers are the result; the plot is a view
        print(f"plot skipped: {exc}")

    verdict = "AGREE" if result["all"]["agree"] else "DIFFER"
    print(f"{verdict}: {result['all']['iterations_compared']} iterations, max |diff| "
          f"{result['all']['max_abs_diff']}, first differing: "
          f"{result['all']['first_differing_iteration']} -> {out / 'resume_fidelity.json'}")
    return 0 if result["all"]["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())

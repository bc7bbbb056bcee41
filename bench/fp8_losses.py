#!/usr/bin/env python3
"""FP8 against bf16 on real text, and checkpoints crossing between them (one GPU).

    MEGAGPT_CACHE_DIR=... python bench/fp8_losses.py --out OUT [--te-site DIR] [--iters 300]
                                   [--shape 345M|1.3B] [--seeds N] [--parallel K]
                                   [--precisions A,B] [--also DIR]

The embedded corpus (GPT-2 BPE Shakespeare), a shape of bench_throughput.py (345M unless
``--shape``), dropout 0, ``--lr 3e-4`` with ``--lr-warmup-iters 30`` and cosine decay to
``3e-5``, a loss logged every iteration. The launches share the GPU, several at once (their
losses do not depend on what else runs; their speed is not measured here):

1. **tracking**: ``bf16`` (the fast path's default), ``fp8`` (``--fp8-format hybrid``: the
   fast spec's FP8 linears, delayed scaling as TE's: scales of 1 before the first amax is
   recorded, gradients scaled by the backward before's amax) and, with ``--te-site`` (a
   folder holding Transformer Engine), ``tefp8`` (TE's layers, ``--fp8-format hybrid``) and
   ``tebf16`` (TE's layers in bf16: what tells TE's layers from TE's FP8 where TE's curve
   parts from ours); ``fp8cs`` and ``tefp8cs`` are the two FP8s under current scaling
   (``--fp8-recipe tensorwise``), named in ``--precisions``: every tensor scaled by its own
   amax, the first step's too, so they compare the FP8 arithmetic alone; ``fp8own`` is
   delayed scaling on each tensor's own amax in the first forward and for every gradient
   (``--fast-fp8-first-scales amax --fast-fp8-grad-scaling current``), ``fp8unit`` that
   started as TE's (scales of 1), ``fp8te`` the default's flags named,
   ``--iters`` iterations each, saving at the half way point; with ``--seeds N`` each of them
   N times (``--seed`` 1234, 1235, ...: ``NAME`` and ``NAME-seedK``), the goal's means taken
   over the seeds and each precision's spread between its seeds stated: on one GPU two calls
   of the same launch and seed ended 0.5 % apart (the kernels' sums are not deterministic),
   so one run per precision cannot tell a few tenths of a per cent apart. Two references
   more, named in ``--precisions``: ``local`` (megatron's own layers, loss, optimizer and
   step, no fast-path piece: what every path is held to) and ``fastlayers`` (the fast spec's
   layers with megatron's loss, optimizer and step): where a curve parts from bf16's, they
   tell the layers from the step; ``bf16flash`` and ``fp8flash`` (the fast path with torch's
   flash attention kernel rather than the one torch picks): they tell the attention kernel
   from the rest of the layer; ``bf16eager`` (the fast spec's layer uncompiled) and
   ``bf16unfused`` (torch's math attention) tell the compiler's kernels from the rest;
   ``bf16modules`` (the fast spec without its fused layer) the fused layer's arithmetic;
2. **crossing**: from the half-way checkpoints of bf16, fp8 and tefp8, 20 iterations under
   each of those (``SRC->DST``; the same one: the resume's own difference), compared with the
   uninterrupted run of the checkpoint's source. TE's launches here run with
   ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``: TE (2.20 on) unpickles the FP8 state it saved
   only then, and these checkpoints are the script's own;
3. **use**: ``tools/generate.py`` and ``tools/export_hf.py`` on the FP8 run's last checkpoint.

``--parallel K`` caps the launches sharing the GPU at once (default: all of a phase).
``--precisions`` picks the tracking runs (default: bf16, fp8 and, with ``--te-site``, TE's
two); ``--also DIR`` adds the tracking losses an earlier invocation wrote into
DIR/fp8_losses.csv to this one's figures, so that the plain install's runs can go while
Transformer Engine builds and TE's after it, in one call.

Writes OUT/fp8_losses.json (the figures, ``info``), OUT/fp8_losses.csv (every loss) and
OUT/fp8_losses.png (the tracking curves), and each launch's log. Exit status 0 when every
launch ran and the goals hold: FP8's mean loss over the last 50 iterations within 1 % of
bf16's and at most 0.5 % above TE's FP8, no NaN or Inf, each crossing's losses within 2 %
(relative) of its source's uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from bench_throughput import corpus_data_flags, parse_entry_log, shape_flags  # noqa: E402
from run_info import run_info  # noqa: E402

SHAPE = "345M"  # unless --shape
PRECISIONS = {
    "bf16": [],
    "fp8": ["--fp8-format", "hybrid"],
    "fp8cs": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    # the fast spec's delayed scaling with TE's first step only (every scale 1 before an
    # amax is recorded), gradients by their own amax
    "fp8unit": ["--fp8-format", "hybrid", "--fast-fp8-first-scales", "unit",
                "--fast-fp8-grad-scaling", "current"],
    # delayed scaling as TE's throughout, named (the default: fp8's)
    "fp8te": ["--fp8-format", "hybrid", "--fast-fp8-first-scales", "unit",
              "--fast-fp8-grad-scaling", "delayed"],
    # delayed scaling on each tensor's own amax at first and for gradients throughout
    "fp8own": ["--fp8-format", "hybrid", "--fast-fp8-first-scales", "amax",
               "--fast-fp8-grad-scaling", "current"],
    "tefp8": ["--transformer-impl", "transformer_engine", "--fast-cuda-graphs", "iteration",
              "--fp8-format", "hybrid"],
    "tefp8cs": ["--transformer-impl", "transformer_engine", "--fast-cuda-graphs", "iteration",
                "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "tebf16": ["--transformer-impl", "transformer_engine", "--fast-cuda-graphs", "iteration"],
    # the references: megatron's own everything, and the fast spec's layers on megatron's step;
    # megatron's local attention keeps the [b, heads, s, s] scores (13.5 GB more at 345M), so
    # it recomputes them (the same numbers: no dropout) to share the GPU with the others
    "local": ["--transformer-impl", "local", "--no-fast-spec", "--fast-cuda-graphs", "none",
              "--fast-disable", "optimizer,lm-loss,lm-grad-in-forward,bf16-grad-buffer,"
              "grad-write", "--recompute-granularity", "selective"],
    "fastlayers": ["--transformer-impl", "local", "--fast-cuda-graphs", "none",
                   "--fast-disable", "optimizer,lm-loss,lm-grad-in-forward,bf16-grad-buffer,"
                   "grad-write"],
    # the fast path with torch's flash attention kernel: on an H100 or H200 torch 2.11 picks
    # cuDNN's for the fast spec's attention, which TE's and megatron's layers do not run
    "bf16flash": ["--attention-backend", "flash"],
    "fp8flash": ["--fp8-format", "hybrid", "--attention-backend", "flash"],
    # the fast path's layer uncompiled (eager kernels, torch's pick of attention kernel), and
    # with torch's unfused math attention: they tell the compiler's kernels from the rest
    "bf16eager": ["--fast-compile", "off"],
    "bf16unfused": ["--attention-backend", "unfused"],
    # the fast spec without its fused layer: megatron's own layer modules around SDPA
    # attention, which tells the fused layer's arithmetic from the spec's other pieces
    "bf16modules": ["--fast-disable", "fused-layer"],
}
TE_PRECISIONS = {"tefp8", "tefp8cs", "tebf16"}
DEFAULT_PRECISIONS = ("bf16", "fp8", "tefp8", "tebf16")
CROSSED = ("bf16", "fp8", "tefp8")  # tebf16 is the tracking's reference only
# the variable under which TE unpickles its delayed-scaling FP8 state (checkpoint_guard)
TE_TRUSTS_PICKLES = {"NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE": "1"}
TRAINING = ["--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "3e-4",
            "--min-lr", "3e-5", "--lr-warmup-iters", "30", "--lr-decay-style", "cosine"]
CROSS_ITERS = 20
LAST = 50  # the tracking goal's window
SEED = 1234
CROSS_TOLERANCE = 2e-2  # relative: bf16 rounding of two sets of kernels (the TE GPU tests')


# ---- the figures (pure: tests/test_bench_tools.py runs them on the CPU) -------------------

def mean_last(losses: dict[int, float], n: int = LAST) -> float:
    """The mean loss over the last ``n`` iterations logged."""
    last = sorted(losses)[-n:]
    return statistics.fmean(losses[i] for i in last)


def nonfinite(losses: dict[int, float]) -> list[int]:
    """The iterations whose loss is NaN or Inf."""
    return [i for i, v in sorted(losses.items()) if not math.isfinite(v)]


def largest_excursion(run: dict[int, float], reference: dict[int, float], after: int
                      ) -> tuple[int, float] | None:
    """(iteration, relative excursion) where ``run`` is furthest above ``reference`` after
    iteration ``after`` (the warm-up); None where no iteration is shared."""
    shared = [i for i in sorted(set(run) & set(reference)) if i > after]
    if not shared:
        return None
    worst = max(shared, key=lambda i: (run[i] - reference[i]) / reference[i])
    return worst, (run[worst] - reference[worst]) / reference[worst]


def largest_relative_difference(run: dict[int, float], reference: dict[int, float]
                                ) -> float | None:
    shared = sorted(set(run) & set(reference))
    if not shared:
        return None
    return max(abs(run[i] - reference[i]) / abs(reference[i]) for i in shared)


# the fast path's FP8 runs, each held to bf16 and to TE's FP8 under the same recipe
FAST_FP8 = {"fp8": "tefp8", "fp8cs": "tefp8cs", "fp8unit": "tefp8", "fp8te": "tefp8",
            "fp8own": "tefp8"}


def tracking_figures(losses: dict[str, dict[int, float] | list[dict[int, float]]],
                     warmup: int) -> dict:
    """The tracking goal's figures from each precision's losses (bf16 and one of the fast
    path's FP8 runs at least): one run's, or a list of runs with different seeds, whose
    last-50 means are averaged (and their spread, largest less smallest over their average,
    stated); the excursions are the first seed's. Each fast-path FP8 run (``FAST_FP8``) is
    held to bf16 (within 1 %) and to TE's FP8 of its recipe where that ran (at most 0.5 %
    above): ``NAME_over_bf16``, ``NAME_over_TENAME``."""
    runs = {name: run if isinstance(run, list) else [run] for name, run in losses.items()}
    per_seed = {name: [mean_last(run) for run in seeded] for name, seeded in runs.items()}
    means = {name: statistics.fmean(values) for name, values in per_seed.items()}
    fast = [name for name in FAST_FP8 if name in means]
    out = dict(mean_last_50=means,
               nonfinite={name: sorted({i for run in seeded for i in nonfinite(run)})
                          for name, seeded in runs.items()})
    for name in fast:
        out[f"{name}_over_bf16"] = means[name] / means["bf16"] - 1
    if any(len(values) > 1 for values in per_seed.values()):
        out["seeds"] = {name: len(values) for name, values in per_seed.items()}
        out["mean_last_50_per_seed"] = per_seed
        out["seed_spread"] = {name: (max(values) - min(values)) / means[name]
                              for name, values in per_seed.items()}
    for name in fast:
        excursion = largest_excursion(runs[name][0], runs["bf16"][0], warmup)
        if excursion:
            out[f"{name}_largest_excursion_over_bf16"] = dict(iteration=excursion[0],
                                                               relative=excursion[1])
    # against TE's FP8 of the same recipe (for fp8cs and tefp8cs the first step included)
    against_te = {f"{name}_over_{FAST_FP8[name]}": means[name] / means[FAST_FP8[name]] - 1
                  for name in fast if FAST_FP8[name] in means}
    out.update(against_te)
    if "tebf16" in means:
        # TE's own FP8 against TE's own bf16: how much of TE's curve is its FP8
        out["tefp8_over_tebf16"] = means.get("tefp8", float("nan")) / means["tebf16"] - 1
        out["tebf16_over_bf16"] = means["tebf16"] / means["bf16"] - 1
    # every run against the fast path's bf16 (the references' too)
    out["over_bf16"] = {name: means[name] / means["bf16"] - 1 for name in means
                        if name != "bf16"}
    out["holds"] = (all(abs(out[f"{name}_over_bf16"]) <= 0.01 for name in fast)
                    and all(value <= 0.005 for value in against_te.values())
                    and not any(out["nonfinite"].values()))
    return out


# ---- the launches -------------------------------------------------------------------------

def entry_argv(precision: str, iters: int, data: list[str], seed: int = SEED,
               shape: str = SHAPE) -> list[str]:
    return ([sys.executable, str(ROOT / "pretrain_gpt.py")]
            + shape_flags(shape, iters, 1, seed, data) + TRAINING + PRECISIONS[precision])


def chosen_precisions(names: str | None, te: bool) -> list[str]:
    """``--precisions``' runs, in PRECISIONS' order; TE's need ``--te-site``. An empty one
    runs nothing: the figures of ``--also``'s runs alone."""
    if names is None:
        return [x for x in DEFAULT_PRECISIONS if x not in TE_PRECISIONS or te]
    wanted = [x for x in names.split(",") if x]
    unknown = [x for x in wanted if x not in PRECISIONS]
    if unknown:
        raise SystemExit(f"error: --precisions: unknown {', '.join(unknown)} "
                         f"(known: {', '.join(PRECISIONS)})")
    if not te and TE_PRECISIONS & set(wanted):
        raise SystemExit("error: --precisions names Transformer Engine's runs "
                         f"({', '.join(sorted(TE_PRECISIONS & set(wanted)))}): give --te-site")
    return [x for x in PRECISIONS if x in wanted]


def read_losses(csv_path: Path) -> dict[str, dict[int, float]]:
    """Every run's losses from an fp8_losses.csv (as ``main`` writes it; blanks left out)."""
    if not csv_path.exists():
        raise SystemExit(f"error: --also: no {csv_path}")
    lines = csv_path.read_text().splitlines()
    names = lines[0].split(",")[1:]
    runs: dict[str, dict[int, float]] = {name: {} for name in names}
    for line in lines[1:]:
        iteration, *values = line.split(",")
        for name, value in zip(names, values):
            if value:
                runs[name][int(iteration)] = float(value)
    return runs


def seeded_name(precision: str, k: int) -> str:
    """The k-th seed's run of ``precision`` (the first keeps the precision's own name)."""
    return precision if k == 0 else f"{precision}-seed{k}"


def start(name: str, argv: list[str], out: Path, env: dict) -> tuple:
    """A launch in a folder of its own (its working directory: the flight recorder's and
    the run folder's files stay apart), its output into OUT/NAME.log."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    log = open(out / f"{name}.log", "w")
    print(f"[fp8-losses] {name}: {shlex.join(argv)}", flush=True)
    proc = subprocess.Popen(argv, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return name, proc, log, time.time()


def run_phase(launches: list[tuple[str, list[str], dict]], out: Path, timeout: float,
              parallel: int | None) -> dict[str, dict]:
    """``launches`` (name, argv, environment), at most ``parallel`` at once (None: all),
    each batch given ``timeout`` seconds."""
    size = parallel or len(launches) or 1
    results = {}
    for i in range(0, len(launches), size):
        started = [start(name, argv, out, env) for name, argv, env in launches[i:i + size]]
        results.update(wait_all(started, timeout))
    return results


def wait_all(started: list, timeout: float) -> dict[str, dict]:
    results = {}
    deadline = time.time() + timeout
    for name, proc, log, t0 in started:
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = proc.wait()
            rc = f"timeout ({rc})"
        log.close()
        text = Path(log.name).read_text(errors="replace")
        parsed = parse_entry_log(text, 0)
        losses = {i: v for i, v in parsed["losses"] if v is not None}
        results[name] = dict(rc=rc, wall_s=round(time.time() - t0, 1), losses=losses)
        print(f"[fp8-losses] {name}: rc={rc}, {len(losses)} losses"
              + ("" if rc == 0 else "\n" + "\n".join(text.splitlines()[-15:])), flush=True)
    return results


def environment(precision: str, te_site: str | None, trusted: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1",
               **(trusted or {}))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if te_site and precision in TE_PRECISIONS:
        paths.append(te_site)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def resume_folder(saved: Path, at: int, into: Path) -> Path:
    """A checkpoint folder whose latest iteration is ``at`` (the half-way point of a run
    that went on), its iteration linked rather than copied."""
    into.mkdir(parents=True, exist_ok=True)
    name = f"iter_{at:07d}"
    link = into / name
    if not link.exists():
        link.symlink_to(saved / name, target_is_directory=True)
    (into / "latest_checkpointed_iteration.txt").write_text(str(at))
    return into


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--te-site", default=os.environ.get("TE_SITE"),
                   help="a folder holding Transformer Engine, for the tefp8 runs")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--shape", choices=("345M", "1.3B"), default=SHAPE)
    p.add_argument("--timeout", type=float, default=420,
                   help="seconds per phase (per batch of --parallel launches)")
    p.add_argument("--seeds", type=int, default=1,
                   help="tracking runs per precision, with seeds 1234, 1235, ...")
    p.add_argument("--parallel", type=int, default=None,
                   help="launches sharing the GPU at once (default: all of a phase)")
    p.add_argument("--skip", default="", help="phases to leave out: crossing,use")
    p.add_argument("--precisions", default=None,
                   help=f"tracking runs, of {', '.join(PRECISIONS)} (default: "
                        f"{', '.join(DEFAULT_PRECISIONS)}, TE's where --te-site is given)")
    p.add_argument("--also", action="append", default=[],
                   help="an earlier invocation's OUT: its tracking losses join the figures")
    a = p.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, a.skip.split(",")))
    precisions = chosen_precisions(a.precisions, bool(a.te_site))
    earlier, earlier_logs = {}, {}  # --also's runs: their losses, and their logs' paths
    for folder in a.also:
        for name, run in read_losses(Path(folder) / "fp8_losses.csv").items():
            earlier[name], earlier_logs[name] = run, Path(folder) / f"{name}.log"
    data = corpus_data_flags()
    half = a.iters // 2
    saves = {x: out / "ckpt" / x for x in precisions}

    # 1. tracking, saving at the half-way point (and at the end): the first seed's runs that
    # a later phase resumes or uses (a 345M checkpoint is some 4 GB: no others)
    kept = ({x for x in CROSSED if "crossing" not in skip}
            | ({"fp8"} if "use" not in skip else set()))
    launches = []
    for k in range(a.seeds):
        for x in precisions:
            saving = (["--save", str(saves[x]), "--save-interval", str(half)]
                      if k == 0 and x in kept else [])
            launches.append((seeded_name(x, k), entry_argv(x, a.iters, data, SEED + k, a.shape)
                             + saving, environment(x, a.te_site)))
    tracking = run_phase(launches, out, a.timeout, a.parallel)
    losses = {x: tracking[x]["losses"] for x in precisions}  # the first seed's
    seeded = {x: [tracking[seeded_name(x, k)]["losses"] for k in range(a.seeds)]
              for x in precisions}
    for name, run in earlier.items():  # --also: an earlier invocation's whole runs, by seed
        base = name.split("-seed")[0]
        if base in precisions or len(run) != a.iters:
            print(f"[fp8-losses] --also: {name} left out ({len(run)} losses"
                  + (", run here too)" if base in precisions else ")"), flush=True)
            continue
        seeded.setdefault(base, []).append(run)
    result = dict(info=run_info(), shape=a.shape, iters=a.iters, training=TRAINING,
                  seeds=[SEED + k for k in range(a.seeds)],
                  launches={x: dict(rc=r["rc"], wall_s=r["wall_s"]) for x, r in tracking.items()})
    ran = all(r["rc"] == 0 and len(r["losses"]) == a.iters for r in tracking.values())
    if earlier:
        result["also"] = dict(folders=a.also, runs=sorted(earlier))
    if ran and "bf16" in seeded and set(FAST_FP8) & set(seeded):
        result["tracking"] = tracking_figures(seeded, warmup=30)

    # 2. crossing: from each half-way checkpoint, CROSS_ITERS iterations under each precision
    if ran and "crossing" not in skip:
        sources = [x for x in CROSSED if x in precisions]
        pairs = [(s, d) for s in sources for d in sources]
        launches = []
        for src, dst in pairs:
            name = f"{src}-to-{dst}"
            folder = resume_folder(saves[src], half, out / "resume" / name)
            launches.append((name, entry_argv(dst, a.iters, data, shape=a.shape) + [
                "--load", str(folder), "--exit-interval", str(half + CROSS_ITERS)],
                environment(dst, a.te_site, TE_TRUSTS_PICKLES)))
        crossed = run_phase(launches, out, a.timeout, a.parallel)
        result["crossing"] = {}
        for (src, dst), (name, r) in zip(pairs, crossed.items()):
            diff = largest_relative_difference(r["losses"], losses[src])
            result["crossing"][name] = dict(
                rc=r["rc"], iterations=sorted(r["losses"]),
                first_loss=r["losses"].get(half + 1), source_loss=losses[src].get(half + 1),
                max_rel_diff_vs_source=diff)
            ran = ran and r["rc"] == 0 and sorted(r["losses"]) == list(
                range(half + 1, half + CROSS_ITERS + 1))
        result["crossing_holds"] = all(
            c["max_rel_diff_vs_source"] is not None
            and c["max_rel_diff_vs_source"] <= CROSS_TOLERANCE
            for c in result["crossing"].values())

    # 3. use: generation and the Hugging Face export of the FP8 run's checkpoint
    if tracking.get("fp8", {}).get("rc") == 0 and "use" not in skip:
        env = environment("fp8", None)
        gen = subprocess.run([sys.executable, str(ROOT / "tools" / "generate.py"), "--load",
                              str(saves["fp8"]), "--prompt", "ROMEO:", "--max-new-tokens",
                              "24", "--greedy"], cwd=out, env=env, capture_output=True,
                             text=True, timeout=300)
        export = subprocess.run([sys.executable, str(ROOT / "tools" / "export_hf.py"),
                                 "--load", str(saves["fp8"]), "--output", str(out / "hf"),
                                 "--overwrite"], cwd=out, env=env, capture_output=True,
                                text=True, timeout=300)
        (out / "use.log").write_text(gen.stdout + gen.stderr + export.stdout + export.stderr)
        result["use"] = dict(generate_rc=gen.returncode, sample=gen.stdout[-400:],
                             export_rc=export.returncode,
                             exported=sorted(x.name for x in (out / "hf").glob("*")))
        ran = ran and gen.returncode == 0 and export.returncode == 0

    # every loss (every seed's, --also's runs too), and the first seed's curves
    every = {**{name: run for name, run in earlier.items() if name not in tracking},
             **{name: r["losses"] for name, r in tracking.items()}}
    with open(out / "fp8_losses.csv", "w") as f:
        f.write("iteration," + ",".join(every) + "\n")
        for i in range(1, a.iters + 1):
            f.write(f"{i}," + ",".join(str(run.get(i, "")) for run in every.values()) + "\n")
    try:
        from megagpt.run_log.plots import load_run, plot_runs

        logs = {x: out / f"{x}.log" for x in losses if losses[x]}
        for name, log in earlier_logs.items():  # --also's first seeds
            if "-seed" not in name and name not in logs:
                logs[name] = log
        plot_runs([load_run(str(log), x) for x, log in logs.items() if log.exists()],
                  out / "fp8_losses.png", title=f"{a.shape} on text: bf16 and FP8")
    except Exception as e:  # noqa: BLE001 (the figures stand without the picture)
        print(f"[fp8-losses] no plot: {e}", flush=True)
    (out / "fp8_losses.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "info"}, indent=1,
                     default=str)[:6000], flush=True)
    holds = ran and result.get("tracking", {}).get("holds") and result.get("crossing_holds",
                                                                          True)
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())

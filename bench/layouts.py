#!/usr/bin/env python3
"""Megatron's parallel layouts through the entry, against one process: losses, throughput per
GPU, and a checkpoint resumed under another layout.

Each layout runs ``pretrain_gpt.py`` under torchrun with the same model, data, seed and global
batch; its per-iteration losses are compared with the one-process run's, and megatron's
logged throughput per GPU gives the scaling. ``--resume-check FROM,TO`` also saves a
checkpoint under layout FROM half-way, resumes it under layout TO (megatron's torch_dist
format reshards), and compares the resumed losses with FROM's uninterrupted run.

  # on a host with 2 GPUs, the 345M shape on the embedded corpus:
  python bench/layouts.py --gpus 2 --out /tmp/layouts --resume-check tp2,pp2 -- \\
      --data-path PREFIX --tokenizer-type GPT2BPETokenizer --vocab-file V --merge-file M
  # the same check on two CPU processes (gloo, fp32), a tiny model:
  python bench/layouts.py --cpu --shape tiny --gpus 2 --iters 6 --out /tmp/l -- --mock-data

Layouts (``--layouts``; those that need more GPUs than ``--gpus`` are skipped): ``tp2``,
``tp2sp`` (with sequence parallelism), ``pp2``, ``vpp2`` (interleaved pipeline, 2 virtual
stages per rank), ``dp2`` (distributed optimizer), ``cp2`` (context parallelism at twice the
sequence; needs Transformer Engine, else "not run" with the entry's reason), ``tp2pp2dp2`` (8
GPUs). Exit status 1 when a run fails, a layout's losses differ from one process's by
more than ``--tolerance`` (relative), or the resumed run's from the uninterrupted one's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

# same folder: run as ``python bench/layouts.py``
from bench_throughput import compare_losses, parse_entry_log, run_logged
from run_info import run_info

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from megagpt import vocab_padding  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SHAPES = {  # layers, hidden, heads, seq, micro-batch
    "345M": (24, 1024, 16, 1024, 4),
    "tiny": (4, 64, 4, 64, 2),
}
# one global batch for every layout: 4 micro-batches of the one-process run, so that DP=2 and
# both pipeline schedules (the interleaved one needs micro-batches in multiples of the stages)
# all see the same samples per step
MICRO_BATCHES = 4

LAYOUTS = {  # name: (processes, flags)
    "one": (1, []),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "vpp2": (2, ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]),
    # data parallelism as a launch gives it; the fast path holds the layers in per-layer graphs
    "dp2": (2, ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
    "dp2eager": (2, ["--use-distributed-optimizer", "--overlap-grad-reduce",
                     "--no-fast-layer-graphs"]),
    # the full-iteration graph with the data-parallel collectives inside (asked for)
    "dp2graph": (2, ["--use-distributed-optimizer", "--overlap-grad-reduce",
                     "--fast-cuda-graph"]),
    "tp2graphs": (2, ["--tensor-model-parallel-size", "2", "--fast-layer-graphs"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "tp2pp2dp2": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--use-distributed-optimizer"]),
}

ERROR_RE = re.compile(r"^error: (.*)$", re.M)


def model_flags(shape: str, seed: int, iters: int, cpu: bool, cp: int = 1) -> list[str]:
    layers, hidden, heads, seq, mb = SHAPES[shape]
    seq *= cp  # context parallelism is for long sequences: each rank keeps the base length
    flags = [
        "--num-layers", str(layers), "--hidden-size", str(hidden),
        "--num-attention-heads", str(heads), "--seq-length", str(seq),
        "--max-position-embeddings", str(seq),
        "--micro-batch-size", str(mb), "--global-batch-size", str(mb * MICRO_BATCHES),
        "--train-iters", str(iters), "--lr", "3e-4", "--min-lr", "3e-5",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(1, iters // 5)),
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", str(seed),
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--log-interval", "1", "--log-throughput", "--eval-iters", "0",
        "--eval-interval", str(10 * iters),
    ]
    flags += ["--cpu"] if cpu else ["--bf16"]
    return flags


def parse_log(text: str, skip: int) -> dict:
    """bench_throughput's figures from megatron's log (losses keyed by iteration, TFLOP/s per
    GPU), plus the entry's one-line refusal if it printed one."""
    parsed = parse_entry_log(text, warmup_iters=skip)
    out = dict(losses={i: v for i, v in parsed["losses"] if v is not None})
    if "ms_per_iter" in parsed:
        out["ms_per_iter"] = parsed["ms_per_iter"]
        out["tflops_per_gpu"] = parsed.get("tflops_logged")
    err = ERROR_RE.findall(text)
    if err:
        out["error"] = err[-1]
    return out


def run_layout(a, name: str, out_dir: Path, extra: list[str], tag: str = "") -> dict:
    nproc, flags = LAYOUTS[name]
    cp = 2 if name == "cp2" else 1
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", str(nproc), str(ROOT / "pretrain_gpt.py")]
    cmd = (launch + model_flags(a.shape, a.seed, a.iters, a.cpu, cp) + flags
           + a.data_args + extra)
    # CPU ranks share two cores: one intra-op thread each
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")} if a.cpu else None
    print(f"[layouts] {name}{tag}: {shlex.join(cmd)}", flush=True)
    text, rc, wall_s = run_logged(cmd, out_dir / f"{name}{tag}.log", a.timeout, env)
    res = dict(layout=name, processes=nproc, rc=rc, wall_s=round(wall_s, 1),
               command=shlex.join(cmd))
    res.update(parse_log(text, a.skip))
    if rc != 0 and "error" in res and not res["losses"]:
        # the entry refused the layout before any work (one "error:" line; torchrun reports
        # the rank's exit code 2 as 1), e.g. context parallelism without Transformer Engine:
        # not run, and why
        res["refused"] = res.pop("error")
        print(f"[layouts] {name}{tag} not run: {res['refused']}", flush=True)
    elif rc != 0:
        print(f"[layouts] {name}{tag} failed (rc={rc}): "
              f"{res.get('error') or text.splitlines()[-1:] }", flush=True)
    return res


def compare(base: dict, other: dict, first: int = 1) -> dict:
    """bench_throughput's loss comparison over the iterations from ``first`` on."""
    def pairs(run):
        return dict(losses=[(i, v) for i, v in sorted(run.get("losses", {}).items()) if i >= first])
    return compare_losses(pairs(base), pairs(other))


def tensor_parallel_size(layout: str) -> int:
    flags = LAYOUTS[layout][1]
    return int(flags[flags.index("--tensor-model-parallel-size") + 1]) \
        if "--tensor-model-parallel-size" in flags else 1


def tokenizer_vocab_size(data_args: list[str]) -> int | None:
    """The vocabulary the runs use: ``--vocab-size N``, or the entries of a GPT-2 style
    ``--vocab-file`` (JSON); None when neither says."""
    def value(flag):
        return data_args[data_args.index(flag) + 1] if flag in data_args[:-1] else None

    if value("--vocab-size"):
        return int(value("--vocab-size"))
    if value("--vocab-file"):
        try:
            return len(json.loads(Path(value("--vocab-file")).read_text()))
        except (OSError, ValueError):
            return None
    return None


def same_vocab_padding(src: str, dst: str, vocab_size: int | None) -> list[str]:
    """Flags under which ``src`` and ``dst`` pad the vocabulary alike (megatron loads only
    the same padding: GPT-2's 50257 tokens pad to 50304 rows at TP=1, 50432 at TP=2 with its
    default divisor of 128; a divisor of 64 gives 50304 at both)."""
    if vocab_size is None:
        return []
    divisor = vocab_padding.divisor_for(
        vocab_size, (tensor_parallel_size(src), tensor_parallel_size(dst)))
    # megatron's default already pads alike, or no divisor does: nothing to pass
    if divisor in (None, vocab_padding.DEFAULT_DIVISOR):
        return []
    return ["--make-vocab-size-divisible-by", str(divisor)]


def resume_check(a, out_dir: Path, src: str, dst: str, uninterrupted: dict | None) -> dict:
    """Save under ``src`` at half the run, resume under ``dst``, compare with ``src``
    uninterrupted (``uninterrupted``: that run when it exists already with these flags)."""
    ckpt = out_dir / f"ckpt_{src}_to_{dst}"
    shutil.rmtree(ckpt, ignore_errors=True)
    half = a.iters // 2
    save = ["--save", str(ckpt), "--save-interval", str(half), "--exit-interval", str(half)]
    padding = same_vocab_padding(src, dst, tokenizer_vocab_size(a.data_args))
    if padding:  # the uninterrupted run pads as the two below do (it changes the init)
        uninterrupted = run_layout(a, src, out_dir, padding, tag="_padded_alike")
    elif uninterrupted is None:
        uninterrupted = run_layout(a, src, out_dir, [])
    first = run_layout(a, src, out_dir, save + padding, tag=f"_saved_at_{half}")
    resumed = run_layout(a, dst, out_dir, ["--load", str(ckpt), "--save", str(ckpt),
                                            "--save-interval", str(10 * a.iters)] + padding,
                         tag=f"_resumed_from_{src}")
    shutil.rmtree(ckpt, ignore_errors=True)  # checkpoints stay out of the results
    ok = first["rc"] == 0 and resumed["rc"] == 0
    res = dict(saved_under=src, resumed_under=dst, saved_at=half, runs_ok=ok,
               vocab_padding=padding,
               resumed_iterations=sorted(i for i in resumed.get("losses", {}) if i > half))
    res["against_uninterrupted"] = compare(uninterrupted, resumed, first=half + 1)
    return res


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    data_args = []
    if "--" in argv:
        cut = argv.index("--")
        argv, data_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=2, help="processes available (GPUs, or CPU ranks)")
    p.add_argument("--layouts", default="tp2,tp2sp,pp2,vpp2,dp2,cp2,tp2pp2dp2")
    p.add_argument("--shape", default="345M", choices=sorted(SHAPES))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--skip", type=int, default=10, help="iterations left out of the timing")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--cpu", action="store_true", help="gloo processes on the CPU (fp32)")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="max relative loss difference counted as agreement (bf16 noise)")
    p.add_argument("--resume-check", default="", metavar="FROM,TO")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--one-log", default="", metavar="LOG",
                   help="compare with this earlier one-process log instead of running it again")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    a.data_args = data_args or ["--mock-data"]
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    unknown = [n for n in a.layouts.split(",") if n and n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")

    if a.one_log:  # the one-process run of an earlier invocation (same flags)
        results = {"one": dict(layout="one", processes=1, rc=0, log=a.one_log,
                               **parse_log(Path(a.one_log).read_text(), a.skip))}
    else:
        results = {"one": run_layout(a, "one", out_dir, [])}
    base = results["one"]
    for name in [n for n in a.layouts.split(",") if n]:
        nproc = LAYOUTS[name][0]
        if nproc > a.gpus:
            results[name] = dict(layout=name, skipped=f"needs {nproc} processes, --gpus {a.gpus}")
            continue
        res = run_layout(a, name, out_dir, [])
        if name != "cp2":  # a longer sequence: not the same losses
            res["against_one"] = compare(base, res)
        results[name] = res
    # date, commit, machine, versions, command: what bench/records.py makes rows of
    report = dict(info=run_info(), shape=a.shape, cpu=a.cpu, gpus=a.gpus, iterations=a.iters,
                  tolerance=a.tolerance, layouts=results)
    if a.resume_check:
        src, dst = a.resume_check.split(",")
        if max(LAYOUTS[src][0], LAYOUTS[dst][0]) > a.gpus:
            report["resume"] = dict(skipped=f"needs more than --gpus {a.gpus}")
        else:
            report["resume"] = resume_check(a, out_dir, src, dst, results.get(src))

    (out_dir / "layouts.json").write_text(json.dumps(report, indent=1))
    print_table(report)
    failed = [n for n, r in results.items()
              if r.get("rc") not in (0, None) and "skipped" not in r and "refused" not in r]
    disagree = [n for n, r in results.items()
                if r.get("against_one") and r["against_one"]["max_rel_diff"] > a.tolerance]
    resume = report.get("resume", {})
    resume_bad = bool(resume) and "skipped" not in resume and (
        not resume["runs_ok"] or not resume["against_uninterrupted"]
        or resume["against_uninterrupted"]["max_rel_diff"] > a.tolerance)
    if failed or disagree or resume_bad:
        print(f"[layouts] FAILED runs: {failed}; losses apart: {disagree}; "
              f"resume: {'bad' if resume_bad else 'ok'}", flush=True)
        return 1
    return 0


def print_table(report: dict) -> None:
    one = report["layouts"]["one"]
    base_tf = one.get("tflops_per_gpu")
    print(f"\nshape {report['shape']}, {report['iterations']} iterations, "
          f"{'CPU (gloo, fp32)' if report['cpu'] else 'GPU (bf16)'}")
    print(f"{'layout':10s} {'procs':>5s} {'ms/iter':>8s} {'TFLOP/s/GPU':>11s} {'vs one':>6s} "
          f"{'max |dloss|':>11s} {'max rel':>8s}")
    for name, r in report["layouts"].items():
        if "skipped" in r:
            print(f"{name:10s} skipped: {r['skipped']}")
            continue
        if "refused" in r:
            print(f"{name:10s} not run: {r['refused']}")
            continue
        if r.get("rc") != 0:
            print(f"{name:10s} failed: {r.get('error') or r.get('rc')}")
            continue
        tf = r.get("tflops_per_gpu")
        scale = f"{tf / base_tf:6.2f}" if tf and base_tf else "     -"
        c = r.get("against_one") or {}
        print(f"{name:10s} {r['processes']:5d} {r.get('ms_per_iter', float('nan')):8.1f} "
              f"{(tf or float('nan')):11.1f} {scale} "
              f"{c.get('max_abs_diff', float('nan')):11.4f} {c.get('max_rel_diff', float('nan')):8.4f}")
    res = report.get("resume")
    if res:
        if "skipped" in res:
            print(f"resume: skipped ({res['skipped']})")
        else:
            c = res["against_uninterrupted"]
            print(f"resume: saved under {res['saved_under']} at {res['saved_at']}, resumed under "
                  f"{res['resumed_under']}: {c.get('iterations', 0)} iterations, max |dloss| "
                  f"{c.get('max_abs_diff', float('nan')):.4f} against the uninterrupted run")


if __name__ == "__main__":
    raise SystemExit(main())

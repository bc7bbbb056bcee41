#!/usr/bin/env python3
"""Megatron's parallel layouts through the entry, against one process: losses, throughput per
GPU, and a checkpoint resumed under another layout.

Each layout runs ``pretrain_gpt.py`` under torchrun with the same model, data, seed and global
batch; its per-iteration losses are compared with the one-process run's, and megatron's
logged throughput per GPU gives the scaling. ``--resume-check FROM,TO`` (repeatable) also
saves a checkpoint under layout FROM half-way, resumes it under layout TO (megatron's
torch_dist format reshards), and compares the resumed losses with FROM's uninterrupted run.
``--micro-batch`` and ``--micro-batches`` set the batch (the global batch, which every layout
shares: DP=N takes 1/N of its micro-batches per rank).

  # on a host with 2 GPUs, the 345M shape on the embedded corpus:
  python bench/layouts.py --gpus 2 --out /tmp/layouts --resume-check tp2,pp2 -- \\
      --data-path PREFIX --tokenizer-type GPT2BPETokenizer --vocab-file V --merge-file M
  # the same check on two CPU processes (gloo, fp32), a tiny model:
  python bench/layouts.py --cpu --shape tiny --gpus 2 --iters 6 --out /tmp/l -- --mock-data

Layouts (``--layouts``; those that need more GPUs than ``--gpus`` are skipped): ``tp2``,
``tp2sp`` (with sequence parallelism), ``pp2``, ``vpp2`` (interleaved pipeline, 2 virtual
stages per rank), ``dp2`` / ``dp4`` / ``dp8`` (distributed optimizer, overlapped gradient
reduce; ``dp2eager`` without per-layer graphs, ``dp2graph`` / ``dp4graph`` / ``dp8graph`` with
the full-iteration graph), ``tp2graphs``, ``cp2`` (context parallelism at twice the sequence;
needs Transformer Engine, else "not run" with the entry's reason), ``tp2local`` / ``pp2local``
(the fast spec's layers, which TP and PP otherwise leave for TE's where TE is installed),
``tp2pp2dp2`` (8 GPUs).
Any other ``tpTppPdpD`` (each part optional, e.g. ``tp8``, ``tp2pp4``, ``pp8``, ``tp2dp4``)
is that tensor x pipeline x data-parallel layout, with the distributed optimizer and the
overlapped gradient reduce where D > 1. A layout the global batch does not split over is
skipped, with the reason. Exit status 1 when a run fails, a layout's losses differ from one
process's by more than ``--tolerance`` (relative), or the resumed run's from the
uninterrupted one's.

``--estimate GPU`` sets each layout's measured step beside the dry run's estimate of the same
launch on that GPU type (``--gpu-type``), and both rankings: whether the step-time model
orders tensor against pipeline parallelism as the GPUs do. ``--no-one`` leaves out the
one-process run (a shape too big for one GPU, or timing alone):

  # 8 GPUs of one host, a slice of Narayanan et al.'s 18.4B model (8 of its 40 layers):
  python bench/layouts.py --gpus 8 --shape 18.4B-slice --micro-batches 16 --no-one \
      --layouts tp8,tp4pp2,tp2pp4,pp8,tp2dp4,tp4dp2 --iters 20 --skip 8 --estimate H200 \
      --out /tmp/ranking -- --mock-data --recompute-granularity full \
      --recompute-method uniform --recompute-num-layers 1
"""

from __future__ import annotations

import argparse
import contextlib
import io
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
    "1.3B": (24, 2048, 16, 2048, 4),
    "tiny": (4, 64, 4, 64, 2),
    # Narayanan et al. 2021's 18.4B row (48 heads, hidden 6144, sequence 2048, micro-batch 1),
    # 8 of its 40 layers: 3.7B parameters, whose optimizer state fits one 80 GB GPU
    "18.4B-slice": (8, 6144, 48, 2048, 1),
}
# one global batch for every layout, by default 4 micro-batches of the one-process run, so that
# DP=2 and both pipeline schedules (the interleaved one needs micro-batches in multiples of the
# stages) all see the same samples per step (--micro-batches: more, for DP=4 and 8)
MICRO_BATCHES = 4
DP_FLAGS = ["--use-distributed-optimizer", "--overlap-grad-reduce"]

LAYOUTS = {  # name: (processes, flags)
    "one": (1, []),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "vpp2": (2, ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]),
    # data parallelism as a launch gives it; the fast path holds the layers in per-layer graphs
    "dp2": (2, DP_FLAGS),
    "dp2eager": (2, DP_FLAGS + ["--fast-cuda-graphs", "none"]),
    # the full-iteration graph with the data-parallel collectives inside (asked for)
    "dp2graph": (2, DP_FLAGS + ["--fast-cuda-graphs", "iteration"]),
    "dp4": (4, DP_FLAGS),
    "dp4graph": (4, DP_FLAGS + ["--fast-cuda-graphs", "iteration"]),
    "dp8": (8, DP_FLAGS),
    "dp8graph": (8, DP_FLAGS + ["--fast-cuda-graphs", "iteration"]),
    "tp2graphs": (2, ["--tensor-model-parallel-size", "2", "--fast-cuda-graphs", "layers"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    # where Transformer Engine is installed the entry takes TE's layers under TP and PP;
    # these are the fast spec's layers in the same layouts, to measure that choice against
    "tp2local": (2, ["--tensor-model-parallel-size", "2", "--transformer-impl", "local"]),
    "pp2local": (2, ["--pipeline-model-parallel-size", "2", "--transformer-impl", "local"]),
    "tp2pp2dp2": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--use-distributed-optimizer"]),
}

ERROR_RE = re.compile(r"^error: (.*)$", re.M)
SIZES_RE = re.compile(r"^(?:tp(\d+))?(?:pp(\d+))?(?:dp(\d+))?$")


def layout_spec(name: str) -> tuple[int, list[str]] | None:
    """(processes, flags) of a named layout or of ``tpTppPdpD``; None for neither."""
    if name in LAYOUTS:
        return LAYOUTS[name]
    sizes = SIZES_RE.match(name)
    if not name or sizes is None:
        return None
    tp, pp, dp = (int(x or 1) for x in sizes.groups())
    if min(tp, pp, dp) < 1:
        return None
    flags = []
    if tp > 1:
        flags += ["--tensor-model-parallel-size", str(tp)]
    if pp > 1:
        flags += ["--pipeline-model-parallel-size", str(pp)]
    return tp * pp * dp, flags + (DP_FLAGS if dp > 1 else [])


def model_flags(shape: str, seed: int, iters: int, cpu: bool, cp: int = 1,
                micro_batch: int | None = None, micro_batches: int = MICRO_BATCHES) -> list[str]:
    """The flags every layout shares: the shape, ``micro_batches`` micro-batches of
    ``micro_batch`` samples (default: the shape's) per step, the schedule, bf16 (fp32 on the
    CPU), no dropout, a log line per iteration."""
    layers, hidden, heads, seq, mb = SHAPES[shape]
    mb = micro_batch or mb
    seq *= cp  # context parallelism is for long sequences: each rank keeps the base length
    flags = [
        "--num-layers", str(layers), "--hidden-size", str(hidden),
        "--num-attention-heads", str(heads), "--seq-length", str(seq),
        "--max-position-embeddings", str(seq),
        "--micro-batch-size", str(mb), "--global-batch-size", str(mb * micro_batches),
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


def _size(flags: list[str], flag: str) -> int:
    return int(flags[flags.index(flag) + 1]) if flag in flags else 1


def data_parallel_size(layout: str) -> int:
    nproc, flags = layout_spec(layout)
    return nproc // (_size(flags, "--tensor-model-parallel-size")
                     * _size(flags, "--pipeline-model-parallel-size")
                     * _size(flags, "--context-parallel-size"))


def batch_unsplittable_reason(layout: str, micro_batches: int) -> str | None:
    """Why the global batch of ``micro_batches`` micro-batches cannot run under ``layout``
    (None when it can): each data-parallel rank takes an equal share of whole micro-batches,
    and the interleaved schedule wants a multiple of its pipeline stages per rank."""
    dp = data_parallel_size(layout)
    if micro_batches % dp:
        return f"{micro_batches} micro-batches per step do not split over DP={dp}"
    flags = layout_spec(layout)[1]
    pp = _size(flags, "--pipeline-model-parallel-size")
    if "--num-virtual-stages-per-pipeline-rank" in flags and (micro_batches // dp) % pp:
        return (f"the interleaved schedule needs a multiple of {pp} micro-batches per "
                f"data-parallel rank, not {micro_batches // dp}")
    return None


def run_layout(a, name: str, out_dir: Path, extra: list[str], tag: str = "") -> dict:
    nproc, flags = layout_spec(name)
    cp = 2 if name == "cp2" else 1
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", str(nproc), str(ROOT / "pretrain_gpt.py")]
    cmd = (launch + model_flags(a.shape, a.seed, a.iters, a.cpu, cp, a.micro_batch,
                                a.micro_batches) + flags + a.data_args + extra)
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


def estimate_layout(a, name: str) -> dict:
    """The dry run's step-time estimate of the launch ``run_layout`` made for ``name``, as on
    ``a.estimate`` GPUs in bf16 (``estimated_ms``), or why there is none."""
    from megagpt.launch import resolve
    from megagpt.errors import UserError
    from megagpt.preflight import make_plan

    nproc, flags = layout_spec(name)
    argv = (model_flags(a.shape, a.seed, a.iters, False, 2 if name == "cp2" else 1,
                        a.micro_batch, a.micro_batches) + flags + a.data_args
            + ["--dry-run", "--dry-run-world-size", str(nproc), "--gpu-type", a.estimate])
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            plan = make_plan(resolve(argv))
    except UserError as exc:
        return dict(estimate_error=str(exc))
    if plan.run is None:
        return dict(estimate_error=f"no speed figures for {a.estimate}")
    return dict(estimated_ms=plan.run.step.seconds * 1e3)


def ranks(values: dict[str, float]) -> dict[str, int]:
    """1 for the smallest value, 2 for the next, ..."""
    return {name: place for place, name in enumerate(sorted(values, key=values.get), 1)}


def compare(base: dict, other: dict, first: int = 1) -> dict:
    """bench_throughput's loss comparison over the iterations from ``first`` on."""
    def pairs(run):
        return dict(losses=[(i, v) for i, v in sorted(run.get("losses", {}).items()) if i >= first])
    return compare_losses(pairs(base), pairs(other))


def tensor_parallel_size(layout: str) -> int:
    return _size(layout_spec(layout)[1], "--tensor-model-parallel-size")


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


def same_optimizer(src: str, dst: str) -> list[str]:
    """Flags under which ``src`` saves the optimizer state ``dst`` loads: megatron loads the
    distributed optimizer's state only into the distributed optimizer (and the plain one's
    only into the plain one), so where either layout uses it both do (at DP=1 it shards
    nothing); saved in the format that reloads under another TP x PP where they differ."""
    uses = lambda layout: "--use-distributed-optimizer" in layout_spec(layout)[1]  # noqa: E731
    flags = ["--use-distributed-optimizer"] if uses(src) != uses(dst) else []
    model_parallel = lambda layout: (tensor_parallel_size(layout),  # noqa: E731
                                     _size(layout_spec(layout)[1], "--pipeline-model-parallel-size"))
    if (uses(src) or uses(dst)) and model_parallel(src) != model_parallel(dst):
        # its default format reloads only under the same TP x PP
        flags.append("--dist-ckpt-optim-fully-reshardable")
    return flags


def resume_check(a, out_dir: Path, src: str, dst: str, uninterrupted: dict | None) -> dict:
    """Save under ``src`` at half the run, resume under ``dst``, compare with ``src``
    uninterrupted (``uninterrupted``: that run when it exists already with these flags)."""
    ckpt = out_dir / f"ckpt_{src}_to_{dst}"
    shutil.rmtree(ckpt, ignore_errors=True)
    half = a.iters // 2
    save = ["--save", str(ckpt), "--save-interval", str(half), "--exit-interval", str(half)]
    padding = same_vocab_padding(src, dst, tokenizer_vocab_size(a.data_args))
    alike = padding + same_optimizer(src, dst)
    if alike:  # the uninterrupted run as the two below run (padding changes the init)
        uninterrupted = run_layout(a, src, out_dir, alike,
                                   tag=f"_as_saved_for_{dst}")
    elif uninterrupted is None:
        uninterrupted = run_layout(a, src, out_dir, [])
    first = run_layout(a, src, out_dir, save + alike, tag=f"_saved_at_{half}_for_{dst}")
    resumed = run_layout(a, dst, out_dir, ["--load", str(ckpt), "--save", str(ckpt),
                                            "--save-interval", str(10 * a.iters)] + alike,
                         tag=f"_resumed_from_{src}")
    shutil.rmtree(ckpt, ignore_errors=True)  # checkpoints stay out of the results
    ok = first["rc"] == 0 and resumed["rc"] == 0
    res = dict(saved_under=src, resumed_under=dst, saved_at=half, runs_ok=ok,
               vocab_padding=padding, flags_alike=alike,
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
    p.add_argument("--micro-batch", type=int, default=None,
                   help="samples per micro-batch (default: the shape's)")
    p.add_argument("--micro-batches", type=int, default=MICRO_BATCHES,
                   help=f"micro-batches per step, the global batch of every layout (default "
                        f"{MICRO_BATCHES}; the one-process run takes them all)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--skip", type=int, default=10, help="iterations left out of the timing")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--cpu", action="store_true", help="gloo processes on the CPU (fp32)")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="max relative loss difference counted as agreement (bf16 noise)")
    p.add_argument("--resume-check", action="append", default=[], metavar="FROM,TO",
                   help="save under FROM half-way, resume under TO (repeatable)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--one-log", default="", metavar="LOG",
                   help="compare with this earlier one-process log instead of running it again")
    p.add_argument("--no-one", action="store_true",
                   help="leave out the one-process run (and the loss comparison with it)")
    p.add_argument("--estimate", default="", metavar="GPU",
                   help="also the dry run's estimate of each layout's step on this GPU type")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    a.data_args = data_args or ["--mock-data"]
    pairs = [spec.split(",") for spec in a.resume_check]
    if any(len(pair) != 2 for pair in pairs):
        p.error("--resume-check takes FROM,TO")
    unknown = [n for n in a.layouts.split(",") + [n for pair in pairs for n in pair]
               if n and layout_spec(n) is None]
    if unknown:
        p.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}, or tpTppPdpD")
    if a.no_one and (a.one_log or pairs):
        p.error("--no-one leaves nothing for --one-log or --resume-check to compare with")
    if a.estimate:
        from megagpt.gpus import gpu_type_names

        if a.estimate not in gpu_type_names():
            p.error(f"--estimate {a.estimate}: not a GPU type the dry run knows "
                    f"({', '.join(gpu_type_names())})")

    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.no_one:
        results = {}
    elif a.one_log:  # the one-process run of an earlier invocation (same flags)
        results = {"one": dict(layout="one", processes=1, rc=0, log=a.one_log,
                               **parse_log(Path(a.one_log).read_text(), a.skip))}
    else:
        results = {"one": run_layout(a, "one", out_dir, [])}
    base = results.get("one")
    for name in [n for n in a.layouts.split(",") if n]:
        nproc = layout_spec(name)[0]
        if nproc > a.gpus:
            results[name] = dict(layout=name, skipped=f"needs {nproc} processes, --gpus {a.gpus}")
            continue
        unsplittable = batch_unsplittable_reason(name, a.micro_batches)
        if unsplittable:
            results[name] = dict(layout=name, skipped=unsplittable)
            continue
        res = run_layout(a, name, out_dir, [])
        if base is not None and name != "cp2":  # cp2: a longer sequence, other losses
            res["against_one"] = compare(base, res)
        results[name] = res
    if a.estimate:
        for name, res in results.items():
            if res.get("ms_per_iter"):
                res.update(estimate_layout(a, name))
    # date, commit, machine, versions, command: what bench/records.py makes rows of
    report = dict(info=run_info(), shape=a.shape, cpu=a.cpu, gpus=a.gpus, iterations=a.iters,
                  estimate_gpu=a.estimate or None,
                  micro_batch=a.micro_batch or SHAPES[a.shape][4],
                  micro_batches=a.micro_batches, tolerance=a.tolerance, layouts=results,
                  resumes=[])
    for src, dst in pairs:
        reason = next((r for r in (batch_unsplittable_reason(src, a.micro_batches),
                                   batch_unsplittable_reason(dst, a.micro_batches)) if r), None)
        if max(layout_spec(src)[0], layout_spec(dst)[0]) > a.gpus:
            reason = f"needs more than --gpus {a.gpus}"
        if reason:
            report["resumes"].append(dict(saved_under=src, resumed_under=dst, skipped=reason))
        else:
            report["resumes"].append(resume_check(a, out_dir, src, dst, results.get(src)))

    (out_dir / "layouts.json").write_text(json.dumps(report, indent=1))
    print_table(report)
    failed = [n for n, r in results.items()
              if r.get("rc") not in (0, None) and "skipped" not in r and "refused" not in r]
    disagree = [n for n, r in results.items()
                if r.get("against_one") and r["against_one"]["max_rel_diff"] > a.tolerance]
    resume_bad = any("skipped" not in r and (
        not r["runs_ok"] or not r["against_uninterrupted"]
        or r["against_uninterrupted"]["max_rel_diff"] > a.tolerance) for r in report["resumes"])
    if failed or disagree or resume_bad:
        print(f"[layouts] FAILED runs: {failed}; losses apart: {disagree}; "
              f"resume: {'bad' if resume_bad else 'ok'}", flush=True)
        return 1
    return 0


def print_table(report: dict) -> None:
    one = report["layouts"].get("one", {})
    base_tf = one.get("tflops_per_gpu")
    print(f"\nshape {report['shape']}, {report['iterations']} iterations of "
          f"{report.get('micro_batches', MICRO_BATCHES)} micro-batches, "
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
    timed = {n: r for n, r in report["layouts"].items() if r.get("estimated_ms")}
    if timed:
        measured = ranks({n: r["ms_per_iter"] for n, r in timed.items()})
        estimated = ranks({n: r["estimated_ms"] for n, r in timed.items()})
        print(f"\nmeasured against the dry run's estimate on {report['estimate_gpu']}:")
        print(f"{'layout':10s} {'ms/iter':>8s} {'estimate':>8s} {'error':>7s} {'rank':>4s} "
              f"{'est. rank':>9s}")
        for name, r in timed.items():
            error = r["estimated_ms"] / r["ms_per_iter"] - 1
            print(f"{name:10s} {r['ms_per_iter']:8.1f} {r['estimated_ms']:8.1f} "
                  f"{100 * error:+6.1f}% {measured[name]:4d} {estimated[name]:9d}")
    for name, r in report["layouts"].items():
        if r.get("estimate_error"):
            print(f"{name:10s} no estimate: {r['estimate_error']}")
    for res in report.get("resumes", []):
        if "skipped" in res:
            print(f"resume: {res['saved_under']} to {res['resumed_under']} skipped "
                  f"({res['skipped']})")
        else:
            c = res["against_uninterrupted"]
            print(f"resume: saved under {res['saved_under']} at {res['saved_at']}, resumed under "
                  f"{res['resumed_under']}: {c.get('iterations', 0)} iterations, max |dloss| "
                  f"{c.get('max_abs_diff', float('nan')):.4f} against the uninterrupted run")


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Training throughput on one GPU: the project's entry (local spec, fast spec) vs plain PyTorch.

One invocation, one GPU. For each requested path it runs

  local      pretrain_gpt.py --transformer-impl local --no-fast-spec
             --fast-disable optimizer,lm-loss   (megatron's local modules: upstream's path
             without TE)
  fast       pretrain_gpt.py   (the entry's default: the fast spec on one GPU)
  te         pretrain_gpt.py --transformer-impl transformer_engine --fast-cuda-graphs iteration
             (TE's layers under the full-iteration graph; needs TE)
  reference  bench/reference_gpt.py   (plain PyTorch: SDPA, fused AdamW, torch.compile)
  referencefp8
             the same with torchao's FP8 training of its linears (tensorwise; torchao
             importable, e.g. from TORCHAO_SITE, a folder put on its PYTHONPATH)

with mock data (``--corpus``: the embedded corpus; ``--data-args``: any data flags) and
upstream Megatron flags (``--mock-data --log-throughput --log-interval
--train-iters --bf16`` and the shape's flags), parses the entry's log, and prints for each:
tokens/s, TFLOP/s/GPU (megatron's count, ``num_floating_point_operations``), the share of
the bf16 matmul peak it measures itself (8192^3), peak memory (max allocated) and the
ratio to the reference. Iterations inside the first ``--warmup-iters`` (compilation,
allocator warm-up) are left out of the figures. ``OUT/bench_<shape>.json`` holds them with the
run's date, commit, machine, versions and command; ``python bench/records.py add`` makes the
rows of bench/benchmarks.md from it.

  python bench/bench_throughput.py --shape 345M --paths local,fast,reference --out runs/bench

``--compare-losses`` logs every iteration and prints how far the fast path's losses are from
the local spec's (same data, same seed; dropout makes them differ within noise).
Extra entry flags: ``--entry-args "--fast-compile off"`` (applied to every entry path);
extra paths: ``--variant fp32grads="--fast-disable bf16-grad-buffer"`` (the fast path plus those
flags), usable in ``--paths`` and ``--compare-paths fast,fp32grads``. A path run through another
checkout's entry, to compare two commits in one invocation (the record names the other
commit from .bench-base/COMMIT, or from git where it is a checkout of its own):

  mkdir .bench-base && git archive <commit> | tar -x -C .bench-base
  echo <commit> > .bench-base/COMMIT
  python bench/bench_throughput.py --paths base,fast --variant base= \
      --entry-of base=.bench-base/pretrain_gpt.py --baseline base
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from reference_gpt import SHAPES, megatron_flops, pad_vocab  # noqa: E402
from run_info import checkout_commit, run_info  # noqa: E402

VOCAB = 50257

ENTRY_PATH_FLAGS = {
    "local": ["--transformer-impl", "local", "--no-fast-spec",
              "--fast-disable", "optimizer,lm-loss"],
    "fast": [],  # the entry's default: the fast spec on one GPU, with or without TE
    # TE's layers (needs TE) under the full-iteration graph, which they take when asked
    "te": ["--transformer-impl", "transformer_engine", "--fast-cuda-graphs", "iteration"],
}

# the entry's iteration line (ms/iter, TFLOP/s/GPU) or megatron's (--megatron-iteration-log)
ITER_RE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+)\s*\|.*?(?:elapsed time per iteration \(ms\)|ms/iter):"
    r"\s*([\d.]+)"
)
TFLOPS_RE = re.compile(r"(?:throughput per GPU \(TFLOP/s/GPU\)|TFLOP/s/GPU):\s*([\d.]+)")
LOSS_RE = re.compile(r"lm loss:\s*([\d.Ee+-]+)")
MEM_RE = re.compile(r"max allocated:\s*([\d.]+)")
SPEC_RE = re.compile(r"(layer spec:[^\n]*)")


MOCK_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)]


def corpus_data_flags() -> list[str]:
    """The entry's flags for the embedded corpus (GPT-2 tokenized Shakespeare; built, or
    found under ``MEGAGPT_CACHE_DIR``, by ``megagpt.data.corpus``)."""
    sys.path.insert(0, str(ROOT))
    from megagpt.data.corpus import ensure_embedded_dataset

    ds = ensure_embedded_dataset()
    return ["--data-path", ds.prefix, "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", ds.vocab_file, "--merge-file", ds.merge_file]


def batch_of(shape: str, micro_batch: int | None = None, micro_batches: int = 1
             ) -> tuple[int, int]:
    """(micro-batch size, global batch size) of a run: the shape's micro-batch unless
    ``micro_batch`` is given, ``micro_batches`` of them per step on one GPU."""
    mb = micro_batch or SHAPES[shape][4]
    return mb, mb * micro_batches


def shape_flags(shape: str, train_iters: int, log_interval: int, seed: int,
                data_flags: list[str] | None = None, micro_batch: int | None = None,
                micro_batches: int = 1) -> list[str]:
    """The entry's flags for ``shape``; ``data_flags`` in place of mock data;
    ``micro_batch`` / ``micro_batches``: see ``batch_of``."""
    layers, hidden, heads, seq, _ = SHAPES[shape]
    mb, gbs = batch_of(shape, micro_batch, micro_batches)
    return [
        "--num-layers", str(layers), "--hidden-size", str(hidden),
        "--num-attention-heads", str(heads), "--seq-length", str(seq),
        "--max-position-embeddings", str(seq),
        "--micro-batch-size", str(mb), "--global-batch-size", str(gbs),
        "--train-iters", str(train_iters),
        "--lr", "1.5e-4", "--min-lr", "1.0e-5", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "0", "--weight-decay", "0.1", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--clip-grad", "1.0", "--init-method-std", "0.02",
        "--bf16", "--seed", str(seed),
        *(data_flags or MOCK_DATA),
        "--log-throughput", "--log-interval", str(log_interval),
        # the peak, once, at the end (the examples ask for no memory reports)
        "--log-memory-interval", str(train_iters),
        "--eval-iters", "0", "--eval-interval", str(10 * train_iters),
    ]


def parse_entry_log(text: str, warmup_iters: int) -> dict:
    """Figures from megatron's training log (intervals ending after ``warmup_iters``)."""
    rows = []
    for line in text.splitlines():
        m = ITER_RE.search(line)
        if not m:
            continue
        t = TFLOPS_RE.search(line)
        loss = LOSS_RE.search(line)
        rows.append(dict(iteration=int(m.group(1)), ms=float(m.group(3)),
                         tflops=float(t.group(1)) if t else None,
                         loss=float(loss.group(1)) if loss else None))
    mems = [float(x) for x in MEM_RE.findall(text)]
    spec = SPEC_RE.findall(text)
    steady = [r for r in rows if r["iteration"] > warmup_iters] or rows[-1:]
    out = dict(
        intervals=len(rows),
        losses=[(r["iteration"], r["loss"]) for r in rows],
        peak_mem_gb=(max(mems) * 2**20 / 1e9) if mems else None,
        peak_mem_mib=max(mems) if mems else None,  # megatron's "max allocated", MiB
        layer_spec=spec[-1] if spec else None,
    )
    if steady:
        out["ms_per_iter"] = statistics.median(r["ms"] for r in steady)
        tf = [r["tflops"] for r in steady if r["tflops"] is not None]
        out["tflops_logged"] = statistics.median(tf) if tf else None
    return out


def measure_matmul_peak(n: int = 8192, reps: int = 30) -> float:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    peak = 2 * n**3 / (statistics.median(times) / 1e3) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return peak


def entry_command(a, path: str, train_iters: int, log_interval: int) -> list[str]:
    # a script's own folder comes first on sys.path: another checkout's entry imports that
    # checkout's megagpt
    entry = str(ROOT / a.entry_of.get(path, a.entry))
    if a.launcher == "torchrun":
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", "1", entry]
    else:
        launch = [sys.executable, entry]
    return (launch + shape_flags(a.shape, train_iters, log_interval, a.seed,
                                 getattr(a, "data_flags", None), a.micro_batch,
                                 a.micro_batches)
            + ENTRY_PATH_FLAGS[path] + shlex.split(a.entry_args))


def run_logged(cmd: list[str], log_path: Path, timeout: float, env: dict | None = None):
    """Run ``cmd`` from the repo root, stdout and stderr into ``log_path``.

    Returns ``(text, rc, wall_s)``; ``rc`` is ``"timeout"`` when it ran past ``timeout``.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1",
               **(env or {}))
    t0 = time.time()
    # written straight into the log, so that a run stopped from outside leaves what it
    # printed
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_process_tree(p)
            rc = "timeout"
    return log_path.read_text(errors="replace"), rc, time.time() - t0


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first found first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def end_process_tree(p: subprocess.Popen, grace: float = 15) -> None:
    """Stop a launcher and everything it started. torchrun starts each worker in a session
    of its own, so the launcher's process group does not hold them: a hung layout's workers
    would keep the GPUs busy through the runs after it. SIGTERM first (torchrun then stops
    its workers itself), SIGKILL to whatever is left after ``grace`` seconds."""
    tree = _descendants(p.pid)  # before the launcher dies and its workers are re-parented
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    for pid in [p.pid, *tree]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # a worker's own session: its group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    p.wait()


def run_entry(a, path: str, out_dir: Path, train_iters: int, log_interval: int,
              tag: str = "") -> dict:
    cmd = entry_command(a, path, train_iters, log_interval)
    log_path = out_dir / f"entry_{path}{tag}_{a.shape}.log"
    print(f"[bench] {path}: {shlex.join(cmd)}", flush=True)
    text, rc, wall_s = run_logged(cmd, log_path, a.timeout)
    res = dict(path=path, rc=rc, wall_s=wall_s, log=str(log_path), command=shlex.join(cmd))
    res.update(parse_entry_log(text, a.warmup_iters))
    if rc != 0 or "ms_per_iter" not in res:
        tail = "\n".join(text.splitlines()[-25:])
        print(f"[bench] {path} failed (rc={rc}); log tail:\n{tail}", flush=True)
    return res


REFERENCE_PATHS = ("reference", "referencefp8")


def run_reference(a, out_dir: Path, path: str = "reference") -> dict:
    cmd = [sys.executable, str(HERE / "reference_gpt.py"), "--shape", a.shape,
           "--iters", str(max(5, a.train_iters - a.warmup_iters)),
           "--warmup", str(a.warmup_iters), "--dropout", str(a.reference_dropout)]
    env = None
    if path == "referencefp8":
        cmd += ["--fp8", "tensorwise"]
        site = os.environ.get("TORCHAO_SITE")
        if site:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [site, *filter(None, [os.environ.get("PYTHONPATH")])]))
    print(f"[bench] {path}: {shlex.join(cmd)}", flush=True)
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=a.timeout, env=env)
    (out_dir / f"{path}_{a.shape}.log").write_text(p.stderr + p.stdout)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        print(f"[bench] {path} failed (rc={p.returncode}):\n{p.stderr[-3000:]}", flush=True)
        return dict(path=path, rc=p.returncode, command=shlex.join(cmd))
    res = json.loads(lines[-1])
    res.update(path=path, rc=0, command=shlex.join(cmd))
    return res


def compare_losses(local: dict, fast: dict) -> dict:
    a = {i: v for i, v in local.get("losses", []) if v is not None}
    b = {i: v for i, v in fast.get("losses", []) if v is not None}
    common = sorted(set(a) & set(b))
    if not common:
        return {}
    diffs = [abs(a[i] - b[i]) for i in common]
    identical = sum(a[i] == b[i] for i in common)
    rel = [abs(a[i] - b[i]) / abs(a[i]) for i in common]
    return dict(iterations=len(common), max_abs_diff=max(diffs), max_rel_diff=max(rel),
                mean_abs_diff=statistics.mean(diffs), identical=identical,
                last=(common[-1], a[common[-1]], b[common[-1]]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="345M")
    p.add_argument("--paths", default="local,fast,reference",
                   help="comma-separated subset of local, fast, reference")
    p.add_argument("--train-iters", type=int, default=40)
    p.add_argument("--warmup-iters", type=int, default=10,
                   help="iterations left out of the figures (compile, warm-up)")
    p.add_argument("--log-interval", type=int, default=10,
                   help="megatron's --log-interval for the timed runs (10, as the 345M and "
                        "175B examples log)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="micro-batch size (default: the shape's, 8 at 345M, 4 at 1.3B)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches per step (the global batch on one GPU is their "
                   "product; the figures count every one)")
    p.add_argument("--entry", default="pretrain_gpt.py")
    p.add_argument("--launcher", choices=["torchrun", "python"], default="torchrun")
    p.add_argument("--entry-args", default="", help="extra flags for every entry run")
    p.add_argument("--seed", type=int, default=1234)
    data = p.add_mutually_exclusive_group()
    data.add_argument("--corpus", action="store_true",
                      help="entry runs train on the embedded corpus (real text, GPT-2 "
                      "tokenizer) instead of mock data: losses from text, whose first "
                      "iterations do not spike as mock data's do at 1.3B")
    data.add_argument("--data-args", default="",
                      help="the entry's data flags instead of mock data, e.g. \"--data-path P "
                      "--tokenizer-type GPT2BPETokenizer --vocab-file V --merge-file M\" "
                      f"(the figures count a vocabulary of {VOCAB}, GPT-2's)")
    p.add_argument("--reference-dropout", type=float, default=0.1,
                   help="dropout of the plain-PyTorch reference (megatron's default is 0.1)")
    p.add_argument("--compare-losses", type=int, default=0, metavar="N",
                   help="also run local and fast for N iterations logging every iteration "
                        "and compare their losses")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per run")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="an extra path: the fast path with FLAGS added (repeatable); name it "
                   "in --paths or --compare-paths")
    p.add_argument("--entry-of", action="append", default=[], metavar="PATH=ENTRY",
                   help="run path PATH through another entry file, e.g. an earlier commit's "
                   "checkout (repeatable)")
    p.add_argument("--compare-paths", default="local,fast",
                   help="the two entry paths --compare-losses runs (default local,fast)")
    p.add_argument("--baseline", default="reference",
                   help="the path the last column divides by (default: the plain-PyTorch "
                   "reference; e.g. fast, the single-GPU default, for the several-GPU path "
                   "on one GPU)")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench"))
    a = p.parse_args(argv)
    for spec in a.variant:
        name, sep, flags = spec.partition("=")
        if not sep or not name or name in ("local", "fast", *REFERENCE_PATHS):
            p.error(f"--variant wants NAME=FLAGS with a new name, got {spec!r}")
        ENTRY_PATH_FLAGS[name] = shlex.split(flags)
    entry_of = {}
    for spec in a.entry_of:
        name, sep, entry = spec.partition("=")
        if not sep or name not in ENTRY_PATH_FLAGS or not (ROOT / entry).is_file():
            p.error(f"--entry-of wants PATH=ENTRY with a known path and an existing entry "
                    f"file, got {spec!r}")
        entry_of[name] = dict(entry=entry, commit=checkout_commit((ROOT / entry).parent))
    a.entry_of = {name: e["entry"] for name, e in entry_of.items()}
    if a.corpus:
        from megagpt.data.cache import FetchError

        try:
            a.data_flags = corpus_data_flags()
        except FetchError as e:
            p.error(f"--corpus: the embedded corpus is not cached here and cannot be "
                    f"fetched ({e}); set MEGAGPT_CACHE_DIR to a copied cache")
    else:
        a.data_flags = shlex.split(a.data_args) or None
    paths = [x for x in a.paths.split(",") if x]
    compare_paths = [x for x in a.compare_paths.split(",") if x]
    if len(compare_paths) != 2:
        p.error("--compare-paths wants two paths")
    for x in paths + compare_paths:
        if x not in ENTRY_PATH_FLAGS and x not in REFERENCE_PATHS:
            p.error(f"unknown path {x!r}")
    if set(REFERENCE_PATHS) & set(paths) and (a.micro_batches != 1 or a.micro_batch not in (
            None, SHAPES[a.shape][4])):
        p.error("the reference runs one micro-batch of the shape's size per step: leave "
                "--micro-batch / --micro-batches out, or 'reference' out of --paths")
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    import torch

    if not torch.cuda.is_available():
        print("bench_throughput needs a CUDA GPU", file=sys.stderr)
        return 2
    # date, commit, machine, versions, command: what bench/records.py makes a row of
    info = dict(run_info(), gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                shape=a.shape)
    info["megatron_core"] = info["versions"].get("megatron-core", "unknown")
    peak = measure_matmul_peak()
    info["bf16_matmul_peak_tflops"] = peak
    print(f"[bench] {info}", flush=True)

    layers, hidden, heads, seq, _ = SHAPES[a.shape]
    mb, gbs = batch_of(a.shape, a.micro_batch, a.micro_batches)
    info.update(micro_batch=mb, global_batch=gbs)
    flops = megatron_flops(layers, hidden, heads, seq, gbs, pad_vocab(VOCAB))
    try:  # cross-check the written-out count against megatron's own function
        sys.path.insert(0, str(ROOT))
        from megatron_flops import megatron_flops as mflops

        m = mflops(layers, hidden, heads, seq, gbs, pad_vocab(VOCAB))
        if abs(m - flops) > 1e-6 * flops:
            print(f"[bench] warning: FLOP count {flops:.4e} != megatron's {m:.4e}; using megatron's")
            flops = m
    except Exception as e:  # noqa: BLE001
        print(f"[bench] megatron FLOP count unavailable ({e}); using the written-out formula")

    results = {}
    for path in paths:
        if path in REFERENCE_PATHS:
            results[path] = run_reference(a, out_dir, path)
        else:
            results[path] = run_entry(a, path, out_dir, a.train_iters, a.log_interval)
        r = results[path]
        if r.get("ms_per_iter"):
            r["tokens_per_s"] = gbs * seq / (r["ms_per_iter"] / 1e3)
            r["tflops_per_gpu"] = flops / (r["ms_per_iter"] / 1e3) / 1e12
            r["peak_share"] = r["tflops_per_gpu"] / peak

    loss_cmp = None
    if a.compare_losses:
        runs = {pth: run_entry(a, pth, out_dir, a.compare_losses, 1, tag="_losses")
                for pth in compare_paths}
        loss_cmp = compare_losses(runs[compare_paths[0]], runs[compare_paths[1]])
        loss_cmp["paths"] = compare_paths

    ref = results.get(a.baseline, {}).get("tflops_per_gpu")
    print()
    print(f"shape {a.shape}: {layers} layers x {hidden} hidden x {heads} heads, seq {seq}, "
          f"micro-batch {mb} x {gbs // mb}; {flops/1e12:.2f} TFLOP per iteration "
          "(megatron's count)")
    print(f"{info['gpu']}, torch {info['torch']}, megatron-core {info['megatron_core']}, "
          f"bf16 matmul peak {peak:.0f} TFLOP/s (8192^3, measured)")
    width = max([10, *(len(path) for path in results)])
    hdr = f"{'path':{width}s} {'ms/iter':>8s} {'tokens/s':>10s} {'TFLOP/s':>8s} " \
          f"{'logged':>7s} {'%peak':>6s} {'peak GB':>8s} {'vs ' + a.baseline[:6]:>10s}"
    print(hdr)
    for path, r in results.items():
        if not r.get("ms_per_iter"):
            print(f"{path:{width}s} FAILED (rc={r.get('rc')}); see {r.get('log', 'stderr')}")
            continue
        logged = r.get("tflops_logged")
        print(f"{path:{width}s} {r['ms_per_iter']:8.1f} {r['tokens_per_s']:10.0f} "
              f"{r['tflops_per_gpu']:8.1f} "
              f"{f'{logged:.1f}' if logged is not None else '-':>7} "
              f"{100 * r['peak_share']:5.1f}% "
              f"{r['peak_mem_gb'] if r.get('peak_mem_gb') is not None else float('nan'):8.2f} "
              f"{(r['tflops_per_gpu'] / ref) if ref else float('nan'):10.3f}")
    for path, r in results.items():
        if r.get("layer_spec"):
            print(f"  {path}: {r['layer_spec']}")
    if loss_cmp:
        print(f"losses, {loss_cmp['paths'][1]} vs {loss_cmp['paths'][0]}, first "
              f"{loss_cmp['iterations']} iterations: "
              f"max |diff| {loss_cmp['max_abs_diff']:.4f} (max rel {loss_cmp['max_rel_diff']:.2%}),"
              f" mean |diff| {loss_cmp['mean_abs_diff']:.4f}, {loss_cmp['identical']} identical;"
              f" last {loss_cmp['last']}")
    summary = dict(info=info, flops_per_iter=flops, results=results, loss_comparison=loss_cmp,
                   baseline=a.baseline,
                   path_flags={x: ENTRY_PATH_FLAGS[x] for x in paths + compare_paths
                               if x in ENTRY_PATH_FLAGS},
                   entry_args=a.entry_args,
                   entry_of=entry_of,
                   data="text" if a.data_flags else "mock")
    (out_dir / f"bench_{a.shape}.json").write_text(json.dumps(summary, indent=1, default=str))
    ok = all(r.get("ms_per_iter") for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Profile a few training iterations of the real entry (pretrain_gpt.py), in-process.

``profile_step`` measures megatron's step without the entry around it; this one runs the
whole entry — data loader, ``train_step``, logging, checkpoint hooks — and profiles
iterations ``--start``..``--start + --iters - 1`` with torch.profiler. It prints

  * per iteration: wall time and GPU busy time (union of kernels, copies and memsets);
  * the largest GPU idle gaps, each with the Python stack the CPU was in at the gap's middle
    (what kept the GPU waiting);
  * idle time on the GPU's own timeline, with the activity on both sides of the largest gaps;
  * the top GPU kernels by total time (every kernel, per iteration, in ``kernels.tsv``);
  * with ``--who NAME``: where kernels matching NAME were launched (operator + Python frames);
    with ``--ops N``: the N operators with the most GPU time (both without the CUDA graph);
  * after the run: the host time per iteration of train_step, optimizer.step, zero_grad
    and training_log (medians; the profiled iterations are slower);
  * before the window (iteration ``--start`` - 1): each place inside ``train_step`` where
    the host waited for the GPU (torch's sync debug mode), with its call stack.

and writes the chrome trace (gzip) to ``--out``.

  torchrun --nproc-per-node 1 bench/profile_entry.py --out runs/prof -- \\
      --num-layers 24 --hidden-size 1024 ... (the entry's flags)
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import megagpt  # noqa: E402,F401  before megatron imports TE: TE takes torch's cuDNN (as the entry does)


def _install_window(start: int, iters: int, out: Path, report, with_stack: bool = True):
    """Wrap megatron's train_step so that iterations [start, start+iters) are profiled."""
    import torch
    from megatron.training import training

    state = {"calls": 0, "prof": None}
    inner = training.train_step
    sync_iteration = start - 1

    def train_step(*args, **kwargs):
        state["calls"] += 1
        n = state["calls"]
        t0 = time.perf_counter()
        try:
            return _train_step(n, *args, **kwargs)
        finally:
            CPU_TIMES.setdefault("train_step", []).append((n, time.perf_counter() - t0))
            CPU_TIMES.setdefault("_step_starts", []).append((n, t0))

    def _train_step(n, *args, **kwargs):
        if n == sync_iteration:
            state["sync"] = _SyncReport()
            state["sync"].start()
        elif n == sync_iteration + 1 and "sync" in state:
            state.pop("sync").stop(n, out)
        if n == start:
            torch.cuda.synchronize()
            prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU,
                            torch.profiler.ProfilerActivity.CUDA],
                with_stack=with_stack)
            prof.__enter__()
            state["prof"] = prof
        if state["prof"] is not None:
            with torch.profiler.record_function(f"iteration {n}"):
                result = inner(*args, **kwargs)
            if n == start + iters - 1:
                torch.cuda.synchronize()
                prof = state["prof"]
                prof.__exit__(None, None, None)
                state["prof"] = None
                trace = out / "entry_trace.json"
                prof.export_chrome_trace(str(trace))
                report(trace, prof)
            return result
        return inner(*args, **kwargs)

    training.train_step = train_step


class _SyncReport:
    """Where the host waited for the GPU, from one train_step to the next (torch's sync
    debug mode: ``.item()``, blocking copies, ...), with call stacks."""

    def __init__(self):
        self.sites: dict = {}

    def _record(self, message, category, filename, lineno, file=None, line=None):
        import traceback

        stack = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                 for f in traceback.extract_stack()[:-2]
                 if "warnings.py" not in f.filename][-7:]
        key = " < ".join(reversed(stack))
        self.sites[key] = self.sites.get(key, 0) + 1

    def start(self):
        import warnings

        import torch

        torch.cuda.synchronize()
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        self._saved = warnings.showwarning
        warnings.showwarning = self._record
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self, n: int, out: Path):
        import warnings

        import torch

        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._saved
        self._catch.__exit__(None, None, None)
        lines = [f"host synchronisations in one iteration (train_step {n - 1} to {n}): "
                 f"{sum(self.sites.values())}"]
        lines += [f"  {count}x  {site}" for site, count in self.sites.items()]
        text = "\n".join(lines)
        print(text, flush=True)
        (out / "sync_sites.txt").write_text(text + "\n")


CPU_TIMES: dict = {}


def _time_calls(owner, name: str, label: str) -> None:
    """Record the host time of each call of ``owner.name`` (no GPU synchronisation)."""
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            CPU_TIMES.setdefault(label, []).append((None, time.perf_counter() - t0))

    setattr(owner, name, timed)


def cpu_time_report(skip: int) -> str:
    """Median host milliseconds per iteration, after the first ``skip`` iterations."""
    import statistics

    lines = [f"host time per iteration (median over iterations > {skip}; no GPU sync):"]
    starts = [t for n, t in CPU_TIMES.get("_step_starts", []) if n > skip]
    if len(starts) > 1:
        lines.append(f"  iteration (train_step to train_step): "
                     f"{statistics.median(b - a for a, b in zip(starts, starts[1:])) * 1e3:7.2f} ms")
    for label, rows in CPU_TIMES.items():
        if label.startswith("_"):
            continue
        vals = [dt for _, dt in rows][skip:] if rows and rows[0][0] is None else [
            dt for n, dt in rows if n > skip]
        if vals:
            lines.append(f"  {label:38s} {statistics.median(vals) * 1e3:7.2f} ms")
    return "\n".join(lines)


def _union(intervals):
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


# kernel name patterns -> kind, first match wins (cuBLAS on Hopper names its GEMMs nvjet_*)
KERNEL_KINDS = (
    ("attention (SDPA: cuDNN / flash / efficient)", ("sdpa", "flash", "fmha", "attention",
                                                     "compute_dot_do_o")),
    ("matmul (cuBLAS / CUTLASS)", ("nvjet", "gemm", "cutlass", "sm90_xmma", "ampere_", "sm80_")),
    ("optimizer (multi-tensor / fused Adam)", ("multi_tensor", "adam", "foreach")),
    ("communication (NCCL)", ("nccl",)),
    ("compiled elementwise / reductions (triton)", ("triton",)),
    ("aten reductions", ("reduce_kernel",)),
    ("aten elementwise / copies", ("elementwise", "vectorized", "copy", "fill")),
)


def kernel_categories(durations: dict) -> dict:
    """Total time per kind of kernel; ``durations`` maps kernel names to times."""
    out: dict = {}
    for name, dur in durations.items():
        low = name.lower()
        kind = next((k for k, needles in KERNEL_KINDS if any(n in low for n in needles)), "other")
        out[kind] = out.get(kind, 0) + dur
    return out


def gpu_timeline_gaps(events: list, iters: int, top: int = 12) -> list[str]:
    """Idle time on the GPU's own timeline, from its first to its last activity in the trace.

    The host runs ahead of the GPU, so a host-side iteration window says little about the
    GPU; this looks only at GPU activity (kernels, copies, memsets), which the window's
    closing synchronisation keeps whole, and names the activity on both sides of each of
    the largest gaps (a gap before the first kernel of a step means the GPU waited for the
    host)."""
    acts = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not acts:
        return []
    span = max(end for _, end, _ in acts) - acts[0][0]
    gaps, reach, last = [], acts[0][1], acts[0][2]
    for start, end, name in acts[1:]:
        if start > reach:
            gaps.append((start - reach, last, name))
        if end > reach:
            reach, last = end, name
    idle = sum(g for g, _, _ in gaps)
    short = sum(g for g, _, _ in gaps if g < 5)
    out = [(f"GPU timeline: {span / 1e3:.2f} ms from first to last activity, idle "
            f"{idle / 1e3:.2f} ms ({100 * idle / span:.1f} %, {idle / 1e3 / max(1, iters):.2f} ms "
            f"per iteration) in {len(gaps)} gaps; gaps under 5 us: {short / 1e3:.2f} ms; "
            f"largest {top} (before > after):")]
    for g, before, after in sorted(gaps, reverse=True)[:top]:
        out.append(f"  {g / 1e3:7.3f} ms  {before[:60]}  >  {after[:60]}")
    return out


def launch_stacks(events: list, needle: str, top: int = 8) -> list[str]:
    """Where kernels whose name contains ``needle`` were launched from: the operator and
    Python frames around each launch (matched by the trace's correlation ids), counted."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"
               and needle in e["name"]]
    wanted = {e.get("args", {}).get("correlation") for e in kernels}
    launches = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
                and e.get("args", {}).get("correlation") in wanted][:40]  # a sample is enough
    threads = {e.get("tid") for e in launches}
    enclosing = [e for e in events if e.get("ph") == "X" and e.get("tid") in threads
                 and e.get("cat") in ("python_function", "cpu_op")]
    counts: dict = {}
    for launch in launches:
        t = launch["ts"]
        frames = sorted((e for e in enclosing if e.get("tid") == launch.get("tid")
                         and e["ts"] <= t <= e["ts"] + e["dur"]), key=lambda e: e["ts"])
        key = " > ".join(e["name"].split("/")[-1][:50] for e in frames[-7:])
        counts[key] = counts.get(key, 0) + 1
    out = [f"launches of kernels matching {needle!r}: {len(kernels)} (stacks of {len(launches)})"]
    out += [f"  {n:5d}x  {key}" for key, n in sorted(counts.items(), key=lambda kv: -kv[1])[:top]]
    return out


def analyse(trace_path: Path, top_gaps: int = 15, kernel_table: Path | None = None,
            who: tuple = (), iterations: int | None = None) -> str:
    """The report for a torch.profiler trace (plain or .gz JSON): this tool's own, whose
    iterations are annotated, or another's such as megatron's ``--use-pytorch-profiler``
    (``iterations``: how many it spans, to give per-iteration figures)."""
    opener = gzip.open if str(trace_path).endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    iters = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                   and e["name"].startswith("iteration "))
    py = [e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function"]
    lines = []
    busy = _union(gpu)
    for s, e, name in iters:
        b = sum(max(0, min(e, be) - max(s, bs)) for bs, be in busy)
        lines.append(f"{name}: wall {(e - s) / 1e3:.2f} ms, GPU busy {b / 1e3:.2f} ms")
    if iters:
        lo, hi = iters[0][0], iters[-1][1]
        gaps = [(b2[0] - b1[1], b1[1], b2[0]) for b1, b2 in itertools.pairwise(busy)
                if b1[1] >= lo and b2[0] <= hi]
        gaps.sort(reverse=True)
        total = sum(g for g, _, _ in gaps)
        lines.append(f"GPU idle inside the window: {total / 1e3:.2f} ms in {len(gaps)} gaps;"
                     f" largest {top_gaps}:")
        for g, s, e in gaps[:top_gaps]:
            mid = (s + e) / 2
            stack = sorted((ev for ev in py if ev["ts"] <= mid <= ev["ts"] + ev["dur"]),
                           key=lambda ev: ev["ts"])
            names = [ev["name"].split("/")[-1] for ev in stack][-6:]
            lines.append(f"  {g / 1e3:7.3f} ms  " + " > ".join(names))
    if not iters and busy:  # not annotated: the whole trace's window
        span = busy[-1][1] - busy[0][0]
        on = sum(e - s for s, e in busy)
        lines.append(f"GPU busy {on / 1e3:.2f} ms of the {span / 1e3:.2f} ms from the first "
                     f"GPU activity to the last ({100 * on / span:.1f} %)")
    lines += gpu_timeline_gaps(events, len(iters) or iterations or 1)
    for needle in who:
        lines += launch_stacks(events, needle)
    kern = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            k = kern.setdefault(e["name"], [0, 0])
            k[0] += e["dur"]
            k[1] += 1
    per_iter = len(iters) or iterations or 1
    if kernel_table is not None:  # every kernel, for comparing runs offline
        rows = sorted(((dur, cnt, name) for name, (dur, cnt) in kern.items()), reverse=True)
        kernel_table.write_text("ms_per_iteration\tcalls_per_iteration\tkernel\n" + "".join(
            f"{dur / 1e3 / per_iter:.4f}\t{cnt / per_iter:g}\t{name}\n" for dur, cnt, name in rows))
    categories = kernel_categories({name: dur for name, (dur, _) in kern.items()})
    lines.append(f"GPU kernel time per iteration by kind (ms; totals / {per_iter} iterations —"
                 " inside a CUDA graph these are reliable where the busy figures above are not):")
    for kind, dur in sorted(categories.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {dur / 1e3 / per_iter:8.2f}  {kind}")
    lines.append(f"  {sum(categories.values()) / 1e3 / per_iter:8.2f}  all kernels")
    lines.append(f"top kernels over {per_iter} iterations (ms, count):")
    for name, (dur, cnt) in sorted(kern.items(), key=lambda kv: -kv[1][0])[:25]:
        lines.append(f"  {dur / 1e3:8.2f} {cnt:6d}  {name[:90]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--start", type=int, default=20, help="first profiled iteration (1-based)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default="runs/profile_entry")
    p.add_argument("--light", action="store_true",
                   help="no Python stacks in the trace (less host overhead while profiling)")
    p.add_argument("--who", action="append", default=[], metavar="NAME",
                   help="print where kernels whose name contains NAME were launched from "
                        "(needs Python stacks and no CUDA graph)")
    p.add_argument("--ops", type=int, default=0, metavar="N",
                   help="also print the N operators with the most GPU time, with their Python "
                        "stacks (attributes kernels to ops; run with --fast-cuda-graphs none, as "
                        "ops inside a replayed CUDA graph are not recorded)")
    p.add_argument("--analyse", metavar="TRACE",
                   help="only report on an existing trace (e.g. megatron's "
                        "--use-pytorch-profiler rank-0.json.gz; --iters: how many iterations "
                        "it spans)")
    p.add_argument("entry_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.analyse:
        print(analyse(Path(a.analyse), who=tuple(a.who), iterations=a.iters))
        return 0
    entry_args = a.entry_args[1:] if a.entry_args[:1] == ["--"] else a.entry_args
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def report(trace, prof):
        text = analyse(trace, kernel_table=out / "kernels.tsv", who=tuple(a.who))
        if a.ops:
            text += "\n" + prof.key_averages(group_by_stack_n=8).table(
                sort_by="self_device_time_total", row_limit=a.ops, max_name_column_width=60)
        (out / "entry_profile.txt").write_text(text + "\n")
        print(text, flush=True)
        with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace)

    _install_window(a.start, a.iters, out, report, with_stack=not a.light)
    from megatron.core.optimizer import optimizer as moo
    from megatron.training import training

    _time_calls(moo.ChainedOptimizer, "step", "optimizer.step")
    _time_calls(moo.ChainedOptimizer, "zero_grad", "optimizer.zero_grad")
    _time_calls(training, "training_log", "training_log")
    import pretrain_gpt

    t0 = time.time()
    rc = pretrain_gpt.main(entry_args)
    print(f"entry returned {rc} after {time.time() - t0:.1f} s")
    report_text = cpu_time_report(skip=5)
    print(report_text)
    (out / "cpu_times.txt").write_text(report_text + "\n")
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())

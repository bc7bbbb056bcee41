"""Loss, learning rate and throughput against iteration, for one run or several, into a PNG.

    python tools/plot_runs.py runs/a/checkpoints runs/b/train.log --labels a b --out runs.png
    python -m megagpt.run_log.plots ...                        (the same command)

A run is a run folder (its ``--save`` folder, where the entry appends each logged
iteration's figures to ``iterations.jsonl``), a training log (the text megatron prints, or
the entry's: ``iteration N/M | lm loss: ... |``), a TensorBoard folder (``--tensorboard-dir``)
or one of its event files. The entry draws ``training.png`` into the run folder at the end
of every launch; this draws it on request, for one run or several. Several runs are drawn
over each other with their labels: a resumed run over the original, two configs, two machines.

Throughput is TFLOP/s per GPU when every run logged it (``--log-throughput``; in TensorBoard
also ``--log-timers-to-tensorboard``), else samples per second from the global batch and the
iteration time. The first iteration of each run is left out of that panel: it includes start-up.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megagpt.errors import UserError


class PlotError(UserError, ValueError):
    """A run to plot is missing or holds no training iterations."""


@dataclass
class Run:
    label: str
    source: str
    loss: dict[int, float] = field(default_factory=dict)
    lr: dict[int, float] = field(default_factory=dict)
    tflops: dict[int, float] = field(default_factory=dict)  # TFLOP/s per GPU
    iteration_ms: dict[int, float] = field(default_factory=dict)
    batch: dict[int, float] = field(default_factory=dict)  # global batch size (samples)

    def samples_per_second(self) -> dict[int, float]:
        return {i: self.batch[i] / (ms / 1000) for i, ms in self.iteration_ms.items()
                if i in self.batch and ms > 0}


# ---------------------------------------------------------------------------
# Reading runs
# ---------------------------------------------------------------------------

_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|(.*)")
_LOG_FIELDS = {  # field name in megatron's log line, or the entry's -> Run attribute
    "lm loss": "loss",
    "learning rate": "lr",
    "lr": "lr",
    "throughput per GPU (TFLOP/s/GPU)": "tflops",
    "TFLOP/s/GPU": "tflops",
    "elapsed time per iteration (ms)": "iteration_ms",
    "ms/iter": "iteration_ms",
    "global batch size": "batch",
}
_TB_TAGS = {"lm loss": "loss", "learning-rate": "lr", "throughput": "tflops",
            "iteration-time": "iteration_ms", "batch-size": "batch"}


def read_log(path: Path, run: Run) -> None:
    """Training-iteration lines of a megatron log; a later line for an iteration wins."""
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        m = _ITERATION.search(line)
        if not m:
            continue
        iteration = int(m.group(1))
        for part in m.group(2).split("|"):
            name, _, value = part.partition(":")
            attr = _LOG_FIELDS.get(name.strip())
            if attr:
                try:
                    getattr(run, attr)[iteration] = float(value)
                except ValueError:
                    pass  # e.g. "nan" stays out


def read_tensorboard(path: Path, run: Run) -> None:
    """Scalars of a TensorBoard folder (all its event files) or of one event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags().get("scalars", []))
    for tag, attr in _TB_TAGS.items():
        if tag in tags:
            scale = 1000.0 if attr == "iteration_ms" else 1.0  # megatron writes seconds
            getattr(run, attr).update({e.step: e.value * scale for e in acc.Scalars(tag)})


RECORDS = "iterations.jsonl"  # megagpt.run_log.iteration_line's, in a run folder
_RECORD_FIELDS = {"loss": "loss", "lr": "lr", "tflops": "tflops", "ms": "iteration_ms",
                  "batch": "batch"}


def read_records(path: Path, run: Run) -> None:
    """The entry's iteration records (one JSON object per logged iteration, appended by
    every launch of a run): a later record for an iteration wins, as a resumed run logs
    again the iterations after its checkpoint."""
    import json

    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
            iteration = int(record["iteration"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a kill
        for key, attr in _RECORD_FIELDS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and value == value:  # NaN stays out
                getattr(run, attr)[iteration] = float(value)


def _is_tensorboard(path: Path) -> bool:
    if path.is_dir():
        return any(path.rglob("events.out.tfevents.*"))
    return path.name.startswith("events.out.tfevents.")


def load_run(source: str, label: str | None = None) -> Run:
    path = Path(source)
    if not path.exists():
        raise PlotError(f"{source}: no such file or folder")
    run = Run(label or (path.parent.name if path.name in ("train.log", "tensorboard",
                                                          "checkpoints", RECORDS)
                        else path.stem), source)
    if path.is_dir() and (path / RECORDS).is_file():
        read_records(path / RECORDS, run)
    elif path.name == RECORDS:
        read_records(path, run)
    elif _is_tensorboard(path):
        read_tensorboard(path, run)
    elif path.is_dir():
        raise PlotError(f"{source}: a folder without {RECORDS} (a run's --save folder has it) "
                        "or TensorBoard event files")
    else:
        read_log(path, run)
    if not run.loss and not run.lr:
        raise PlotError(f"{source}: no training iterations found (expected megatron's "
                        f"'iteration N/M | ... | lm loss: ...' lines or TensorBoard scalars)")
    return run


# ---------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------

def _throughput(runs: list[Run]) -> tuple[list[dict[int, float]], str]:
    if all(r.tflops for r in runs):
        return [r.tflops for r in runs], "TFLOP/s per GPU"
    return [r.samples_per_second() for r in runs], "samples / s"


def _without_first(series: dict[int, float]) -> dict[int, float]:
    return {i: v for i, v in sorted(series.items())[1:]}


def plot_runs(runs: list[Run], out: str | Path, title: str | None = None) -> Path:
    """Draw loss, learning rate and throughput of the runs into ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    throughput, unit = _throughput(runs)
    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    panels = [("lm loss", [r.loss for r in runs]), ("learning rate", [r.lr for r in runs]),
              (f"throughput ({unit})", [_without_first(s) for s in throughput])]
    for ax, (name, series) in zip(axes, panels):
        for i, (run, data) in enumerate(zip(runs, series)):
            if not data:
                continue
            xs, ys = zip(*sorted(data.items()))
            few = len(xs) <= 60
            ax.plot(xs, ys, label=run.label, linewidth=1.6, alpha=0.85,
                    marker="o" if few else None, markersize=3,
                    linestyle="-" if i == 0 else "--")
        if not any(series):
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center",
                    transform=ax.transAxes, color="gray")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    from matplotlib.ticker import MaxNLocator

    axes[0].ticklabel_format(axis="y", useOffset=False)  # "6.24", not "+6.2 ... 0.004"
    axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(loc="upper right")
    axes[-1].set_xlabel("iteration")
    fig.suptitle(title or "training runs")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megagpt.run_log.plots",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="training logs, TensorBoard folders or event files")
    p.add_argument("--labels", nargs="+", default=None, help="one label per run")
    p.add_argument("--out", default="runs.png", help="PNG to write (default: runs.png)")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    try:
        if a.labels is not None and len(a.labels) != len(a.runs):
            raise PlotError(f"{len(a.labels)} labels for {len(a.runs)} runs")
        labels = a.labels or [None] * len(a.runs)
        runs = [load_run(src, label) for src, label in zip(a.runs, labels)]
        out = plot_runs(runs, a.out, a.title)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for run in runs:
        its = sorted(run.loss)
        span = (f"iterations {its[0]}..{its[-1]}, "
                f"loss {run.loss[its[0]]:.3f} -> {run.loss[its[-1]]:.3f}") if its else "no loss"
        print(f"{run.label}: {span}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

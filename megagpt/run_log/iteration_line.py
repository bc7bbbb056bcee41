"""The training log's iteration line: what a user looks for, in one line of ~150 characters.

megatron's ``training_log`` prints a line of about 300 characters per ``--log-interval``
(consumed samples, milliseconds per iteration, learning rate, batch size, each loss, loss
scale, grad norm, skipped and NaN counts) without tokens per second, MFU or the time left.
This entry prints instead, from the same figures (megatron's line is parsed, so every
number is megatron's own, for the same iterations), in one line of the form::

     [DATE TIME] iteration N/TOTAL | lm loss: L | lr: LR | grad norm: G | tokens/s: T |
     TFLOP/s/GPU: F | MFU: M% | ms/iter: MS | time left: 1h 05m

(docs/train.md, "The log", shows one). TFLOP/s per GPU counts as megatron's
``--log-throughput`` does (``num_floating_point_operations``); MFU divides it by the dense
16-bit (or FP8) peak of the GPU
that the dry run plans for (``megagpt.gpus``: this machine's GPU, or ``--gpu-type``),
where that is known and the run trains in bf16, fp16 or FP8. Time left is the iterations to
``--train-iters`` at this line's rate. Skipped and NaN iterations, the loss scale (fp16) and
MoE/MTP losses appear when they say something. ``--megatron-iteration-log`` prints
megatron's own line instead. Each line's figures are also appended to the run folder's
``iterations.jsonl`` (``run_folder``), which the plot at the end of the run is drawn from.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

# megatron/training/training.py, training_log():
#   f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]" + " iteration {:8d}/{:8d} |" + ...
MEGATRON_LINE = re.compile(
    r"^ \[(?P<time>[^\]]+)\] iteration\s+(?P<iteration>\d+)/\s*(?P<total>\d+) \|(?P<rest>.*)$")
# Fields of that line that are not losses (the rest, 'lm loss' first, are)
NOT_LOSSES = {"consumed samples", "skipped samples", "elapsed time per iteration (ms)",
              "throughput per GPU (TFLOP/s/GPU)", "energy per GPU (J/iter/GPU)",
              "power per GPU (W/GPU)", "learning rate", "global batch size", "loss scale",
              "grad norm", "num zeros", "params norm", "number of skipped iterations",
              "number of nan iterations"}
RECORDS = "iterations.jsonl"


@dataclass(frozen=True)
class MegatronLine:
    """The figures of one of megatron's iteration lines."""

    iteration: int
    total: int
    time: str
    fields: dict[str, str]

    def number(self, name: str) -> float | None:
        try:
            return float(self.fields[name])
        except (KeyError, ValueError):
            return None

    @property
    def losses(self) -> dict[str, str]:
        return {k: v for k, v in self.fields.items() if k not in NOT_LOSSES}


def parse(text: str) -> MegatronLine | None:
    """megatron's iteration line, or None for any other text it prints."""
    match = MEGATRON_LINE.match(text)
    if match is None:
        return None
    fields = {}
    for part in match.group("rest").split("|"):
        name, sep, value = part.partition(":")
        if sep:
            fields[name.strip()] = value.strip()
    return MegatronLine(int(match.group("iteration")), int(match.group("total")),
                        match.group("time"), fields)


@dataclass(frozen=True)
class Peak:
    """What MFU is measured against."""

    tflops: float
    what: str  # e.g. "H200, 989 TFLOP/s dense bf16"


def peak_for(args, fp8: bool = False) -> tuple[Peak | None, str]:
    """The peak MFU divides by, and a sentence saying which (or why there is none). ``fp8``:
    the launch's linears run in FP8 (its ``FP8`` decision: TE's layers or the fast spec's)."""
    from megagpt.gpus import resolve_gpu

    if getattr(args, "cpu", False):
        return None, "no MFU on the CPU"
    precision = "FP8" if fp8 else "bf16" if args.bf16 else "fp16" if args.fp16 else None
    if precision is None:
        return None, "no MFU in fp32 (the GPU peaks are 16-bit and FP8 tensor-core rates)"
    gpu = resolve_gpu(getattr(args, "gpu_type", None), None)
    if gpu.spec is None:
        return None, f"no MFU: no peak known for {gpu.name} (--gpu-type names a known one)"
    tflops = gpu.spec.tensor_tflops(precision == "FP8")
    dense = "FP8" if precision == "FP8" else "16-bit"
    return (Peak(tflops, f"{gpu.name}, {tflops:g} TFLOP/s dense {dense}"),
            f"MFU against the {gpu.name}'s {tflops:g} TFLOP/s dense {dense} peak "
            f"({gpu.source}, as the dry run plans)")


def duration(seconds: float) -> str:
    """``43s``, ``12m 05s``, ``3h 20m``, ``2d 04h``."""
    seconds = max(0, int(round(seconds)))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def _rate(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


@dataclass
class Figures:
    """One line's figures, megatron's and the ones computed from them."""

    line: MegatronLine
    ms: float | None
    tokens_per_s: float | None
    tflops: float | None
    mfu: float | None
    left_s: float | None

    def record(self) -> dict:
        fields = self.line
        return {"iteration": fields.iteration, "loss": fields.number("lm loss"),
                "lr": fields.number("learning rate"), "grad_norm": fields.number("grad norm"),
                "batch": fields.number("global batch size"),
                "consumed_samples": fields.number("consumed samples"), "ms": self.ms,
                "tokens_per_s": self.tokens_per_s, "tflops": self.tflops, "mfu": self.mfu,
                "time": fields.time}


class IterationLine:
    """Turns megatron's iteration lines into this entry's (see the module docstring)."""

    def __init__(self, seq_length: int, world_size: int, flops_per_batch,
                 peak: Peak | None, records: Path | None = None):
        self.seq_length = seq_length
        self.world_size = world_size
        self.flops_per_batch = flops_per_batch  # global batch size -> FLOPs of one iteration
        self.peak = peak
        self.records = records
        self.lines = 0

    def figures(self, line: MegatronLine) -> Figures:
        ms = line.number("elapsed time per iteration (ms)")
        batch = line.number("global batch size")
        tokens = tflops = mfu = left = None
        if ms and ms > 0:
            if batch:
                tokens = batch * self.seq_length / (ms / 1000)
                tflops = line.number("throughput per GPU (TFLOP/s/GPU)")
                if tflops is None:
                    tflops = self.flops_per_batch(int(batch)) / (ms / 1000 * 1e12
                                                                 * self.world_size)
                if self.peak is not None:
                    mfu = 100 * tflops / self.peak.tflops
            if self.lines > 0:  # the first line's time includes the warm-up
                left = max(0, line.total - line.iteration) * ms / 1000
        return Figures(line, ms, tokens, tflops, mfu, left)

    def text(self, f: Figures) -> str:
        line = f.line
        width = len(str(line.total))
        parts = [f" [{line.time.split('.')[0]}] iteration {line.iteration:>{width}}/{line.total}"]
        for name, value in line.losses.items():
            parts.append(f"{name}: {value}")
        lr = line.number("learning rate")
        if lr is not None:
            parts.append(f"lr: {lr:.3E}")
        if "grad norm" in line.fields:
            parts.append(f"grad norm: {line.fields['grad norm']}")
        if f.tokens_per_s is not None:
            per_gpu = (f" ({f.tokens_per_s / self.world_size:,.0f} per GPU)"
                       if self.world_size > 1 else "")
            parts.append(f"tokens/s: {f.tokens_per_s:,.0f}{per_gpu}")
        if f.tflops is not None:
            parts.append(f"TFLOP/s/GPU: {_rate(f.tflops)}")
        if f.mfu is not None:
            parts.append(f"MFU: {f.mfu:.1f}%")
        if f.ms is not None:
            parts.append(f"ms/iter: {f.ms:.1f}")
        if f.left_s is not None:
            parts.append(f"time left: {duration(f.left_s)}")
        for name, label in (("number of skipped iterations", "skipped"),
                            ("number of nan iterations", "nan iterations")):
            count = line.number(name)
            if count:
                parts.append(f"{label}: {int(count)}")
        scale = line.number("loss scale")
        if scale is not None and scale != 1.0:
            parts.append(f"loss scale: {line.fields['loss scale']}")
        return " | ".join(parts)

    def take(self, text: str) -> str | None:
        """This entry's line for megatron's iteration line ``text``; None for other text.
        Records the figures."""
        line = parse(text)
        if line is None:
            return None
        figures = self.figures(line)
        self.lines += 1
        if self.records is not None:
            try:
                with open(self.records, "a") as f:
                    f.write(json.dumps(figures.record()) + "\n")
            except OSError:
                self.records = None  # an unwritable folder: the log line still comes
        return self.text(figures)

"""Progress lines and the end-of-run summary for preprocessing (to stderr)."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field


def human(n: float, unit: str = "") -> str:
    """12345678 -> '12.3M'."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.1f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


@dataclass
class Stats:
    records: int = 0  # lines (jsonl) or blocks (txt) read
    documents: int = 0  # written (per key the same count)
    tokens: int = 0  # written, over all keys, EOD included
    bytes_in: int = 0  # raw input bytes of the records read
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    empty_files: list = field(default_factory=list)

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def balanced(self) -> bool:
        """The invariant: every record read was either written or skipped with a reason."""
        return self.documents + self.skipped_total == self.records


class Progress:
    """Prints a line every ``interval`` documents: docs/s, tokens/s, MB/s since the start."""

    def __init__(self, stats: Stats, interval: int = 10000, stream=None, label: str = "preprocess"):
        self.stats = stats
        self.interval = max(1, int(interval)) if interval else 0
        self.stream = stream or sys.stderr
        self.label = label
        self.start = time.perf_counter()
        self._next = self.interval
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._printed = False

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def line(self) -> str:
        s, dt = self.stats, max(self.elapsed(), 1e-9)
        return (f"[{self.label}] {s.documents:,} docs | {human(s.tokens)} tokens | "
                f"{s.bytes_in / 1e6:.1f} MB | {s.documents / dt:,.0f} docs/s | "
                f"{human(s.tokens / dt)} tok/s | {s.bytes_in / 1e6 / dt:.2f} MB/s | {dt:.1f} s")

    def update(self) -> None:
        if not self.interval or self.stats.documents < self._next:
            return
        self._next = (self.stats.documents // self.interval + 1) * self.interval
        end = "\r" if self._tty else "\n"
        print(self.line(), end=end, file=self.stream, flush=True)
        self._printed = True

    def close(self) -> None:
        if self._printed and self._tty:
            print(file=self.stream)


def summary_lines(stats: Stats, unit: str, outputs: dict[str, int], seconds: float,
                  dtype_name: str) -> list[str]:
    """The end-of-run report: counts, the invariant, skips by reason, output sizes, time."""
    dt = max(seconds, 1e-9)
    skipped = ", ".join(f"{r}: {n:,}" for r, n in stats.skipped.most_common()) or "none"
    lines = [
        f"read {stats.records:,} {unit} = {stats.documents:,} documents written + "
        f"{stats.skipped_total:,} skipped ({skipped})",
        f"tokens written: {stats.tokens:,} ({dtype_name}); input {stats.bytes_in / 1e6:.2f} MB",
        f"time {seconds:.2f} s: {stats.documents / dt:,.0f} docs/s, {human(stats.tokens / dt)} tok/s, "
        f"{stats.bytes_in / 1e6 / dt:.2f} MB/s",
    ]
    if stats.empty_files:
        lines.append(f"empty input files skipped: {len(stats.empty_files)} "
                     f"({', '.join(stats.empty_files[:3])}{', ...' if len(stats.empty_files) > 3 else ''})")
    for path, size in outputs.items():
        lines.append(f"wrote {path} ({size / 1e6:.2f} MB)")
    return lines

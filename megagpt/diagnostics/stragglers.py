"""Slow ranks named: each rank's step split into compute and waiting, compared at the log
interval.

In a synchronous step every rank's wall time is the same: the slow one computes while the
others wait for it in the gradient collectives. So each rank measures, on the step that
ends each log interval, three host times (the device synchronised at each of them, so they
are the GPU's): the step's start, the start of megatron's ``finalize_model_grads`` (the
forward and backward passes are done: its *compute*) and its end (the gradient collectives,
where a rank waits for the slowest: its *wait*). At the log interval the ranks all-gather
these numbers (three per rank, one collective); rank 0 keeps the last ``window`` intervals
and names every rank whose compute is ``threshold`` or more above the median rank's, as the
median of the window and in the window's fastest interval alike (a straggler is slow in
every interval, where a shared host's scheduler slows a rank in some), with its host, in a
line of its own.

A rank slowed inside a tensor- or pipeline-parallel group holds its whole group back inside
the layers' own collectives, which are not timed apart: the report then names the group's
ranks together (and their host, when they fill it).

Cost: three device synchronisations and one all-gather of a few numbers per log interval
(bench/gpu_diagnostics.sh measures it on one GPU, with the flight recorder's: the default
against --no-flight-recorder --straggler-threshold 0).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from megagpt.diagnostics.hangs import ranks_text
from megagpt.diagnostics.settings import StragglerPolicy
from megagpt.megatron_change import TRAINING, WRAPS, Change

# A rank is not named for less than this much more compute per step than the median rank:
# on steps of a few tens of milliseconds the scheduling of a shared host moves a rank's time
# by a few milliseconds (seen on a loaded 2-core CPU), and that is not a straggler.
MIN_EXCESS_S = 0.005


@dataclass(frozen=True)
class StepSample:
    compute_s: float  # the step's start to the start of the gradient collectives
    wait_s: float  # the gradient collectives (nan where they were not seen: a captured graph)
    step_s: float


def _synchronize() -> None:
    """Wait for this rank's GPU; not while a CUDA graph is being captured (megatron's
    full-iteration graph captures the forward-backward function, gradient collectives
    included: there the capture's own replays are timed as a whole)."""
    import torch

    if torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()


# What ``StepClock``'s wrappers change in megatron (diagnostics.active installs them).
TRAIN_STEP = Change(
    TRAINING + "train_step", WRAPS, __name__,
    does="times the step that ends each log interval, the device synchronised at its start "
         "and end",
    why="the straggler report compares each rank's compute and waiting; outside the "
        "divergence guard's wrapper, so its host read of the gradient norm counts in the step",
    fingerprint="1823abf71532", outside=("megagpt.resilience.divergence",))
FINALIZE_MODEL_GRADS = Change(
    TRAINING + "finalize_model_grads", WRAPS, __name__,
    does="on the timed step, marks the end of the forward and backward passes and the length "
         "of the gradient collectives",
    why="its start ends a rank's compute, and its length is where a rank waits for the "
        "slowest",
    fingerprint="3f44cc8723b8")
MEGATRON_CHANGES = (TRAIN_STEP, FINALIZE_MODEL_GRADS)


class StepClock:
    """Times the step that ends each log interval on this rank (the wrappers below go over
    megatron's ``train_step`` and ``finalize_model_grads``)."""

    def __init__(self, log_interval: int, synchronize: Callable[[], None] = _synchronize):
        self.log_interval = log_interval
        self.synchronize = synchronize
        self.sampling = False
        self._marks: dict[str, float] = {}
        self.last: StepSample | None = None

    def timing_train_step(self, train_step):
        import functools

        @functools.wraps(train_step)
        def wrapper(*args, **kwargs):
            iteration = kwargs.get("iteration")
            self.sampling = iteration is not None and (iteration + 1) % self.log_interval == 0
            if not self.sampling:
                return train_step(*args, **kwargs)
            self._marks = {}
            self.synchronize()
            start = time.perf_counter()
            result = train_step(*args, **kwargs)
            self.synchronize()
            end = time.perf_counter()
            grads = self._marks.get("grads_start", end)
            wait = self._marks["grads_end"] - grads if "grads_end" in self._marks else math.nan
            self.last = StepSample(grads - start, wait, end - start)
            self.sampling = False
            return result

        wrapper._megagpt_original = train_step
        return wrapper

    def timing_gradient_collectives(self, finalize_model_grads):
        import functools

        @functools.wraps(finalize_model_grads)
        def wrapper(*args, **kwargs):
            if not self.sampling:
                return finalize_model_grads(*args, **kwargs)
            self.synchronize()
            self._marks["grads_start"] = time.perf_counter()
            result = finalize_model_grads(*args, **kwargs)
            self.synchronize()
            self._marks["grads_end"] = time.perf_counter()
            return result

        wrapper._megagpt_original = finalize_model_grads
        return wrapper

    def take(self) -> StepSample | None:
        sample, self.last = self.last, None
        return sample


def gather_samples(sample: StepSample | None) -> list[StepSample]:
    """Every rank's sample (nan where a rank has none), on every rank: one all-gather."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([sample.compute_s, sample.wait_s, sample.step_s] if sample
                        else [math.nan] * 3, dtype=torch.float64, device=device)
    every = torch.empty(dist.get_world_size() * 3, dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(every, mine)
    values = every.view(-1, 3).tolist()
    return [StepSample(*row) for row in values]


def gather_hosts() -> list[str]:
    import socket

    import torch.distributed as dist

    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts


@dataclass(frozen=True)
class Straggler:
    rank: int
    compute_s: float
    median_s: float

    @property
    def excess(self) -> float:
        return self.compute_s / self.median_s - 1 if self.median_s > 0 else math.inf


def _median(values) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


class StragglerWindow:
    """The last ``policy.window`` intervals' samples of every rank, and who is slow in them."""

    def __init__(self, policy: StragglerPolicy):
        self.policy = policy
        self.intervals: deque[list[StepSample]] = deque(maxlen=policy.window)

    def add(self, samples: list[StepSample]) -> None:
        self.intervals.append(samples)

    @property
    def full(self) -> bool:
        return len(self.intervals) == self.policy.window

    def per_rank(self, field: str) -> list[float]:
        ranks = len(self.intervals[-1]) if self.intervals else 0
        return [_median(getattr(interval[r], field) for interval in self.intervals)
                for r in range(ranks)]

    def fastest(self, field: str) -> list[float]:
        ranks = len(self.intervals[-1]) if self.intervals else 0
        return [min((v for interval in self.intervals
                     if not math.isnan(v := getattr(interval[r], field))), default=math.nan)
                for r in range(ranks)]

    def stragglers(self) -> list[Straggler]:
        """The ranks whose compute is ``threshold`` or more above the median rank's (once the
        window is full): as the median of the window, and in its fastest interval too (a
        straggler is slow in every interval; a shared host's scheduler slows a rank in some)."""
        if not self.full:
            return []
        compute, fastest = self.per_rank("compute_s"), self.fastest("compute_s")
        median, median_fastest = _median(compute), _median(fastest)
        if math.isnan(median) or math.isnan(median_fastest):
            return []
        grow = 1 + self.policy.threshold
        return [Straggler(r, c, median) for r, (c, f) in enumerate(zip(compute, fastest))
                if not math.isnan(c) and c >= grow * median and c - median >= MIN_EXCESS_S
                and f >= grow * median_fastest]


def _who(stragglers: list[Straggler], hosts: list[str]) -> list[str]:
    """Ranks named with their hosts; a host all of whose ranks are slow as the host."""
    named = {s.rank for s in stragglers}
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    parts, done = [], set()
    for s in sorted(stragglers, key=lambda s: -s.excess):
        if s.rank in done:
            continue
        host = hosts[s.rank]
        ranks = by_host[host]
        if len(by_host) > 1 and len(ranks) > 1 and set(ranks) <= named:
            worst = max(stragglers, key=lambda t: t.excess if t.rank in ranks else -1)
            parts.append(f"host {host} (ranks {ranks_text(ranks)}) +{100 * worst.excess:.0f} %")
            done |= set(ranks)
        else:
            parts.append(f"rank {s.rank} ({host}) +{100 * s.excess:.0f} %")
            done.add(s.rank)
    return parts


def straggler_line(stragglers: list[Straggler], window: StragglerWindow, hosts: list[str],
                   iterations: tuple[int, int]) -> str:
    """The report's line for ``stragglers`` (not empty)."""
    wait = window.per_rank("wait_s")
    waiting = [w for r, w in enumerate(wait)
               if r not in {s.rank for s in stragglers} and not math.isnan(w)]
    median = stragglers[0].median_s
    noun = "straggler" if len(stragglers) == 1 else "stragglers"
    slowest = max(stragglers, key=lambda s: s.excess)
    line = (f"{noun}: {', '.join(_who(stragglers, hosts))} compute per step above the median "
            f"rank's {median:.3f} s (slowest {slowest.compute_s:.3f} s; median of log "
            f"intervals at iterations {iterations[0]}-{iterations[1]}, threshold "
            f"{100 * window.policy.threshold:g} %)")
    if waiting:
        line += f"; the other ranks wait up to {max(waiting):.3f} s per step in the gradient " \
                "collectives"
    return line


class StragglerReport:
    """At each log interval: gather every rank's sample, and on rank 0 name the slow ranks
    when they change, and again every ``window`` intervals while they stay."""

    def __init__(self, policy: StragglerPolicy, clock: StepClock, log: Callable[[str], None],
                 gather: Callable[[StepSample | None], list[StepSample]] = gather_samples,
                 hosts: Callable[[], list[str]] = gather_hosts, rank: int = 0):
        self.policy = policy
        self.clock = clock
        self.log = log
        self.gather = gather
        self.hosts_of = hosts
        self.rank = rank
        self.window = StragglerWindow(policy)
        self._hosts: list[str] | None = None
        self._iterations: deque[int] = deque(maxlen=policy.window)
        self._named: frozenset[int] = frozenset()
        self._since_named = 0

    def log_interval_done(self, iteration: int) -> None:
        """Every rank calls it at each log interval (it is a collective)."""
        samples = self.gather(self.clock.take())
        if self._hosts is None:
            self._hosts = self.hosts_of()
        if self.rank != 0:
            return
        self.window.add(samples)
        self._iterations.append(iteration)
        stragglers = self.window.stragglers()
        named = frozenset(s.rank for s in stragglers)
        self._since_named += 1
        if named and (named != self._named or self._since_named >= self.policy.window):
            self.log(straggler_line(stragglers, self.window, self._hosts,
                                    (self._iterations[0], self._iterations[-1])))
            self._since_named = 0
        elif self._named and not named:
            self.log(f"stragglers: none at iteration {iteration} (ranks "
                     f"{ranks_text(self._named)} are back within "
                     f"{100 * self.policy.threshold:g} % of the median rank)")
        self._named = named

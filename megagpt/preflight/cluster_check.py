"""``megagpt-check``: every GPU, node and link measured in seconds, before the big run.

    megagpt-check                                        # this node's GPUs (starts torchrun)
    torchrun --nnodes N --nproc-per-node 8 ... -m megagpt.preflight.cluster_check   # every node
    megagpt-check --cpu                                  # gloo processes on a CPU (tests)

Three measurements, each against the others of its kind and against the figure the dry run
plans with for this GPU (``megagpt.gpus``, through ``megagpt.preflight.step_time``):
  - GEMM TFLOP/s of every GPU (square 16-bit products; the dry run's sustained rate is the
    datasheet's dense peak times its GEMM efficiency);
  - all-reduce bus bandwidth inside every node (one group per node: NVLink), as nccl-tests
    counts it (algorithm bandwidth × 2(n-1)/n);
  - all-reduce bus bandwidth across nodes, one group per local rank (each GPU's own NIC: its
    rail), when there is more than one node.
A GPU, node or rail more than ``--margin`` below the median of its kind or below the dry run's
figure is named in one ``error:`` line (rank 0's), and the command exits 1; else it exits 0.
Each figure is the best of a few short bursts, so that a moment of contention on a shared
host does not name a healthy GPU, while a slow one stays slow in every burst.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

DEFAULT_MARGIN_PERCENT = 15.0
BURSTS = 5


@dataclass(frozen=True)
class Sizes:
    gemm_n: int  # square GEMM side
    burst_s: float  # each GEMM burst runs this long (longer than a moment of contention)
    allreduce_bytes: int
    allreduce_repeats: int  # per burst (the same on every rank: they are collectives)


GPU_SIZES = Sizes(gemm_n=8192, burst_s=0.2, allreduce_bytes=256 * 2**20, allreduce_repeats=10)
CPU_SIZES = Sizes(gemm_n=256, burst_s=0.25, allreduce_bytes=4 * 2**20, allreduce_repeats=5)


@dataclass(frozen=True)
class Place:
    rank: int
    node: int  # torchrun's GROUP_RANK: the node's index
    local_rank: int
    host: str

    def describe(self) -> str:
        return f"rank {self.rank} ({self.host}, node {self.node}, local rank {self.local_rank})"


@dataclass(frozen=True)
class Reference:
    """The dry run's figures for this GPU; None where there are none (a CPU, an unknown GPU)."""

    name: str
    gemm_tflops: float | None
    inside_node_gb_s: float | None
    across_nodes_gb_s: float | None


def reference_for(gpu_type: str | None, cpu: bool) -> Reference:
    from megagpt.gpus import resolve_gpu
    from megagpt.preflight.step_time import bus_bandwidth

    if cpu:
        return Reference("CPU", None, None, None)
    gpu = resolve_gpu(gpu_type, None)
    spec = gpu.spec
    if spec is None:
        return Reference(gpu.name, None, None, None)
    return Reference(gpu.name, spec.dense_16bit_tflops * spec.gemm_efficiency,
                     bus_bandwidth(spec, True) / 1e9, bus_bandwidth(spec, False) / 1e9)


# ---------------------------------------------------------------------------
# Measurements (every rank)
# ---------------------------------------------------------------------------

def _device(cpu: bool):
    import torch

    return torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())


def _synchronize(cpu: bool) -> None:
    import torch

    if not cpu:
        torch.cuda.synchronize()


def gemm_tflops(sizes: Sizes, cpu: bool) -> float:
    """This rank's best rate over ``BURSTS`` bursts of square products, each ``burst_s`` long."""
    import torch

    n = sizes.gemm_n
    dtype = torch.float32 if cpu else torch.bfloat16
    a = torch.randn(n, n, dtype=dtype, device=_device(cpu))
    b = torch.randn(n, n, dtype=dtype, device=_device(cpu))
    torch.matmul(a, b)  # the first product picks its kernel
    best = 0.0
    for _ in range(BURSTS):
        _synchronize(cpu)
        start, products = time.perf_counter(), 0
        while True:
            torch.matmul(a, b)
            products += 1
            _synchronize(cpu)  # a product of 8192² takes a millisecond or more: a wait's worth
            elapsed = time.perf_counter() - start
            if elapsed >= sizes.burst_s:
                break
        best = max(best, 2 * n**3 * products / elapsed / 1e12)
    return best


def allreduce_bus_gb_s(group, group_size: int, sizes: Sizes, cpu: bool) -> float:
    """The best bus bandwidth of an all-reduce over ``group``, as nccl-tests counts it."""
    import torch
    import torch.distributed as dist

    dtype = torch.float32 if cpu else torch.bfloat16
    elements = sizes.allreduce_bytes // torch.tensor([], dtype=dtype).element_size()
    data = torch.ones(elements, dtype=dtype, device=_device(cpu))
    dist.all_reduce(data, group=group)  # connections are made on the first one
    best = 0.0
    for _ in range(BURSTS):
        dist.barrier(group=group)
        _synchronize(cpu)
        start = time.perf_counter()
        for _ in range(sizes.allreduce_repeats):
            dist.all_reduce(data, group=group)
        _synchronize(cpu)
        seconds = (time.perf_counter() - start) / sizes.allreduce_repeats
        best = max(best, sizes.allreduce_bytes * 2 * (group_size - 1) / group_size / seconds / 1e9)
    return best


def _groups(places: list[Place], key) -> dict[int, list[int]]:
    """Ranks grouped by ``key(place)``, in rank order."""
    groups: dict[int, list[int]] = {}
    for place in places:
        groups.setdefault(key(place), []).append(place.rank)
    return groups


def _measure_groups(groups: dict[int, list[int]], rank: int, sizes: Sizes, cpu: bool
                    ) -> float | None:
    """Every group made on every rank (in the same order), this rank's measured in its own."""
    import torch.distributed as dist

    mine = None
    for ranks in groups.values():
        group = dist.new_group(ranks)
        if rank in ranks and len(ranks) > 1:
            mine = (group, len(ranks))
    dist.barrier()
    return allreduce_bus_gb_s(*mine, sizes, cpu) if mine else None


# ---------------------------------------------------------------------------
# Findings (rank 0)
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Finding:
    what: str  # "rank 3 (host, node 0, local rank 3)", "node 1 (host)", "rail 2"
    measured: float
    unit: str
    median: float
    reference: float | None

    def describe(self, margin: float) -> str:
        reasons = []
        if self.median > 0 and self.measured < (1 - margin) * self.median:
            reasons.append(f"{100 * (1 - self.measured / self.median):.0f} % below the median "
                           f"{_number(self.median)}")
        if self.reference and self.measured < (1 - margin) * self.reference:
            reasons.append(f"{100 * (1 - self.measured / self.reference):.0f} % below the dry "
                           f"run's {_number(self.reference)}")
        return f"{self.what} {_number(self.measured)} {self.unit} ({', '.join(reasons)})"


def findings(values: dict[str, float], unit: str, reference: float | None, margin: float
             ) -> list[Finding]:
    """The entries of ``values`` more than ``margin`` below their median or the reference."""
    if not values:
        return []
    median = statistics.median(values.values())
    slow = []
    for what, measured in values.items():
        below_median = len(values) > 1 and measured < (1 - margin) * median
        below_reference = reference is not None and measured < (1 - margin) * reference
        if below_median or below_reference:
            slow.append(Finding(what, measured, unit, median if len(values) > 1 else 0.0,
                                reference))
    return slow


def _number(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _span(values) -> str:
    low, high = min(values), max(values)
    return _number(low) if _number(low) == _number(high) else f"{_number(low)}-{_number(high)}"


def report_lines(places: list[Place], gemm: list[float], inside: list[float | None],
                 across: list[float | None], reference: Reference, margin: float
                 ) -> tuple[list[str], str | None]:
    """(the summary lines, the error line or None) from every rank's measurements."""
    nodes = _groups(places, lambda p: p.node)
    gemm_by = {places[r].describe(): gemm[r] for r in range(len(places))}
    inside_by = {f"node {n} ({places[ranks[0]].host})": inside[ranks[0]]
                 for n, ranks in nodes.items() if inside[ranks[0]] is not None}
    rails = _groups(places, lambda p: p.local_rank)
    across_by = {f"rail {lr} (local rank {lr} of every node)": across[ranks[0]]
                 for lr, ranks in rails.items() if across[ranks[0]] is not None}
    ref = (lambda v: f"; the dry run's {reference.name} figure: {_number(v)}" if v else
           f"; no dry-run figure for {reference.name}")
    lines = [f"check: {len(places)} ranks on {len(nodes)} node{'s' if len(nodes) > 1 else ''}",
             f"  GEMM            {_span(gemm)} TFLOP/s per GPU{ref(reference.gemm_tflops)}"]
    if inside_by:
        lines.append(f"  inside nodes    {_span(inside_by.values())} GB/s all-reduce bus "
                     f"bandwidth{ref(reference.inside_node_gb_s)}")
    if across_by:
        lines.append(f"  across nodes    {_span(across_by.values())} GB/s all-reduce bus "
                     f"bandwidth per rail{ref(reference.across_nodes_gb_s)}")
    slow = (findings(gemm_by, "TFLOP/s", reference.gemm_tflops, margin)
            + findings(inside_by, "GB/s inside its node", reference.inside_node_gb_s, margin)
            + findings(across_by, "GB/s across nodes", reference.across_nodes_gb_s, margin))
    if not slow:
        lines.append(f"check OK: nothing more than {100 * margin:g} % below the median or the "
                     "dry run's figures")
        return lines, None
    return lines, (f"{len(slow)} slow: " + "; ".join(f.describe(margin) for f in slow)
                   + f" (margin {100 * margin:g} %)")


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------

def parse_args(argv):
    parser = argparse.ArgumentParser(prog="megagpt-check", description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true",
                        help="gloo processes on a CPU, fp32 (tests; no figures to compare)")
    parser.add_argument("--gpu-type", default=None, metavar="NAME",
                        help="the GPU whose dry-run figures to compare with (default: this "
                             "machine's)")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN_PERCENT,
                        metavar="PERCENT", help="how far below the median or the dry run's "
                        f"figure a GPU, node or rail may be (default {DEFAULT_MARGIN_PERCENT:g})")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                        help="without torchrun: how many processes to start (default: this "
                             "node's GPUs; 2 with --cpu)")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write every rank's measurements and the dry run's figures "
                             "to FILE (rank 0)")
    parser.add_argument("--status-file", default=None, metavar="FILE",
                        help="write ok or slow to FILE and exit 0 (under torchrun, whose own "
                             "report of a failed rank would follow the error line)")
    return parser.parse_args(argv)


def _launch_under_torchrun(args, argv) -> int:
    """Started without torchrun: start this module under torchrun on this node."""
    import subprocess

    import torch

    nproc = args.nproc_per_node or (2 if args.cpu else torch.cuda.device_count())
    if nproc < 1:
        print("error: megagpt-check: no GPU here (--cpu checks gloo processes on the CPU)",
              file=sys.stderr)
        return 2
    import tempfile

    with tempfile.TemporaryDirectory(prefix="megagpt-check-") as folder:
        status = os.path.join(folder, "status")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(nproc), "-m", "megagpt.preflight.cluster_check", *argv,
                   "--status-file", status]
        code = subprocess.call(command)
        if code == 0 and os.path.exists(status):
            with open(status) as f:
                return 0 if f.read().strip() == "ok" else 1
        return code or 1


def check(args) -> int:
    import socket

    import torch
    import torch.distributed as dist

    cpu = args.cpu
    if not cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo" if cpu else "nccl")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        here = Place(rank, int(os.environ.get("GROUP_RANK", "0")),
                     int(os.environ.get("LOCAL_RANK", "0")), socket.gethostname())
        places: list = [None] * world
        dist.all_gather_object(places, here)
        sizes = CPU_SIZES if cpu else GPU_SIZES
        mine = [gemm_tflops(sizes, cpu)]
        mine.append(_measure_groups(_groups(places, lambda p: p.node), rank, sizes, cpu))
        several_nodes = len({p.node for p in places}) > 1
        mine.append(_measure_groups(_groups(places, lambda p: p.local_rank), rank, sizes, cpu)
                    if several_nodes else None)
        every: list = [None] * world
        dist.all_gather_object(every, mine)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    reference = reference_for(args.gpu_type, cpu)
    lines, error = report_lines(places, [m[0] for m in every], [m[1] for m in every],
                                [m[2] for m in every], reference, args.margin / 100)
    print("\n".join(lines), flush=True)
    if args.json:
        _write_json(args.json, places, every, reference, error)
    if error:
        print(f"error: {error}", file=sys.stderr, flush=True)
    if args.status_file:
        with open(args.status_file, "w") as f:
            f.write("slow" if error else "ok")
        return 0
    return 1 if error else 0


def _write_json(path: str, places: list[Place], every: list, reference: Reference,
                error: str | None) -> None:
    import dataclasses
    import json

    ranks = [{**dataclasses.asdict(p), "gemm_tflops": m[0], "inside_node_gb_s": m[1],
              "across_nodes_gb_s": m[2]} for p, m in zip(places, every)]
    with open(path, "w") as f:
        json.dump({"reference": dataclasses.asdict(reference), "ranks": ranks,
                   "error": error}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.margin <= 0 or args.margin >= 100:
        print(f"error: --margin {args.margin:g}: a percentage between 0 and 100",
              file=sys.stderr)
        return 2
    if "LOCAL_RANK" not in os.environ:
        return _launch_under_torchrun(args, argv)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())

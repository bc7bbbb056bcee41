"""Timing a GPU function under a CUDA graph, for the microbenchmarks: capture it (warmed on a
side stream, as capture asks), then time a replay with CUDA events."""

from __future__ import annotations

import torch


def capture(fn, reps: int) -> torch.cuda.CUDAGraph:
    """A graph holding ``reps`` calls of ``fn``, after three warm-up calls on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph


def replay_us(graph, reps: int) -> float:
    """Microseconds per repetition of one replay of a graph that holds ``reps`` of them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000

"""Run a function on N real gloo processes (CPU), for tests of distributed hooks."""

from __future__ import annotations

import contextlib
import os
import tempfile
import traceback

import torch.multiprocessing as mp


def _worker(rank, world_size, store_file, fn, args, errors):
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                                world_size=world_size)
        fn(rank, world_size, *args)
    except BaseException:  # report to the parent, which fails the test
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn, world_size: int, *args, timeout: float = 120) -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; raise on failure.

    ``fn`` must be importable (module level) so the spawned processes can find it. The
    ranks meet through a file, not a port: a port chosen free here could be taken by
    another test's process in the seconds before rank 0, spawned, binds it.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="gloo_ranks_") as folder:
        store_file = os.path.join(folder, "store")
        procs = [ctx.Process(target=_worker, args=(r, world_size, store_file, fn, args, errors))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    if alive:
        messages.append(f"{len(alive)} rank(s) did not finish within {timeout}s")
    failed = [p.exitcode for p in procs if p.exitcode not in (0, None)]
    if messages or failed:
        raise AssertionError("\n".join(messages) or f"exit codes {failed}")


@contextlib.contextmanager
def single_gloo_rank(backend: str = "gloo"):
    """This process as rank 0 of a one-process gloo group with megatron's parallel state
    (what megatron's dataset builder and model constructors ask for). ``backend="nccl"``
    for megatron's DDP on a GPU: its gradient all-reduce is coalesced, which gloo refuses
    for CUDA tensors."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    # one process: an in-memory store, no port to race another test's processes for
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()

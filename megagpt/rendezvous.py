"""Launch without torchrun: one process gets what torchrun would have given it."""

import os


def default_single_process_env():
    """``python pretrain_gpt.py ...`` on one GPU (or one CPU) needs no launcher: RANK,
    LOCAL_RANK, WORLD_SIZE and MASTER_ADDR are filled in when no launcher set them.

    Returns the store megatron's ``init_process_group`` is to use: an in-memory one for a
    world of one process that names no master port, else None (the launcher's rendezvous,
    through the environment). A world of one needs no TCP store, and choosing a free port
    for one is a race: the port is free when it is chosen and is bound only seconds later,
    after megatron's imports and checks, by when another process (a neighbouring launch's
    gloo connections draw from the same ephemeral range) may hold it.
    """
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" in os.environ or os.environ["WORLD_SIZE"] != "1":
        return None
    import torch.distributed as dist

    return dist.HashStore()

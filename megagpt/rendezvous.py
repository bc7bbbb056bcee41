"""Launch without torchrun: one process gets the variables torchrun would have set."""

import os
import socket


def default_single_process_env() -> None:
    """``python pretrain_gpt.py ...`` on one GPU (or one CPU) needs no launcher: RANK,
    WORLD_SIZE and a free local MASTER_PORT are filled in when torchrun did not set them."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])

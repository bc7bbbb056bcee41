"""One-line messages from the entry, printed once per job (on global rank 0)."""

import os
import sys


def log(message: str) -> None:
    """Print ``[megagpt] message`` on rank 0 (RANK as torchrun sets it), flushed."""
    if os.environ.get("RANK", "0") == "0":
        print(f"[megagpt] {message}", file=sys.stdout, flush=True)

"""A launch ends its process groups on the way out, and never waits on them for long.

NCCL's teardown at interpreter exit is what hangs (the flight recorder's monitor takes it
for a timed-out collective: megagpt/diagnostics/process_exit.py); gloo's groups, which run
here, go through the same ``destroy_process_group``.
"""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

ONE_RANK_GLOO = """
import os, socket, torch.distributed as dist
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
"""


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_the_process_groups_are_ended():
    p = run_python(ONE_RANK_GLOO + """
from megagpt.diagnostics.process_exit import end_or_leave
end_or_leave(0, print)
print("initialized after:", dist.is_initialized())
""")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "initialized after: False"


def test_a_teardown_that_does_not_end_leaves_with_the_status_and_one_line():
    # NCCL's hanging teardown needs GPUs; a destroy that never returns stands in for it
    p = run_python(ONE_RANK_GLOO + """
import threading
from megagpt.diagnostics import process_exit
dist.destroy_process_group = lambda: threading.Event().wait()
process_exit.end_or_leave(3, print, wait_s=1, before_leaving=lambda: print("traceback here"))
print("not reached")
""")
    assert p.returncode == 3, p.stderr
    assert p.stdout.splitlines() == [
        "process groups did not end within 1 s (a peer rank is gone?); exiting without them",
        "traceback here"]


def test_no_groups_is_nothing_to_do():
    p = run_python("""
from megagpt.diagnostics.process_exit import end_process_groups
print(end_process_groups(wait_s=0.1))
""")
    assert p.returncode == 0 and p.stdout.strip() == "True", p.stderr


def test_the_entry_leaves_no_process_group_behind(tmp_path):
    tiny = ["--cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings",
            "64", "--micro-batch-size", "2", "--vocab-size", "512", "--lr", "1e-3",
            "--train-iters", "2"]
    start = time.monotonic()
    p = run_python(f"""
import torch.distributed as dist
import pretrain_gpt
status = pretrain_gpt.main({tiny!r})
print("status", status, "initialized after main:", dist.is_initialized())
""", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines()[-1] == "status 0 initialized after main: False"
    assert time.monotonic() - start < 300


def test_groups_a_caller_made_are_left_to_the_caller():
    p = run_python(ONE_RANK_GLOO + """
from megagpt.diagnostics.process_exit import LaunchProcessGroups
LaunchProcessGroups().end_or_leave(0, print)
print("initialized after:", dist.is_initialized())
""")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "initialized after: True"

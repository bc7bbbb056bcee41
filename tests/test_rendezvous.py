"""A process started without a launcher is a world of one that meets through an in-memory
store (no port to choose, none to lose to another process); a launcher's environment is used
as it is. The launch decides it (``launch.rendezvous.choose_rendezvous``, a step of its resolution)
and its writer sets the environment."""

import argparse
import subprocess
import sys

import pytest

from megagpt.launch.planner import Planner
from megagpt.launch.writer import write
from megagpt.launch.rendezvous import RENDEZVOUS, Rendezvous, choose_rendezvous, store_for

LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def rendezvous_of(environ: dict):
    """The launch's rendezvous step over ``environ`` alone, and the environment its writer
    leaves (``environ`` itself is not changed)."""
    p = Planner(argparse.Namespace(), frozenset(), None, environ)
    choose_rendezvous(p)
    launch = p.launch()
    written = dict(environ)
    write(launch, argparse.Namespace(), written)
    return launch, written


def test_without_a_launcher_the_process_is_rank_0_of_one_with_an_in_memory_store():
    import torch.distributed as dist

    launch, env = rendezvous_of({})
    assert launch[RENDEZVOUS] is Rendezvous.IN_MEMORY
    assert isinstance(store_for(launch), dist.HashStore)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("0", "0", "1")
    assert "MASTER_PORT" not in env  # no port was chosen


@pytest.mark.parametrize("launcher_env", [
    {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
     "MASTER_PORT": "29500"},  # torchrun's second rank
    {"WORLD_SIZE": "1", "MASTER_PORT": "29500"},  # a port the user named
    {"WORLD_SIZE": "2"},  # several processes: their launcher's rendezvous, not ours
], ids=["torchrun", "user_port", "several"])
def test_a_launchers_environment_is_its_rendezvous(launcher_env):
    launch, env = rendezvous_of(launcher_env)
    assert launch[RENDEZVOUS] is Rendezvous.LAUNCHERS
    assert store_for(launch) is None
    for name, value in launcher_env.items():
        assert env[name] == value


def test_the_launch_of_a_bare_process_decides_its_rendezvous(monkeypatch):
    """The whole resolution, as the entry runs it: the rendezvous is one of its choices, and
    its writer fills in the environment."""
    from megagpt.launch import resolve

    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    launch = resolve(["--mock-data", "--num-layers", "2", "--hidden-size", "64",
                      "--num-attention-heads", "4", "--seq-length", "64",
                      "--max-position-embeddings", "64", "--micro-batch-size", "2",
                      "--lr", "1e-3", "--train-iters", "2", "--cpu"], environ={})
    assert launch[RENDEZVOUS] is Rendezvous.IN_MEMORY
    assert dict(launch.environ)["WORLD_SIZE"] == "1"


def test_the_store_rendezvouses_a_gloo_group_of_one():
    """The store is what megatron's init_process_group gets: a real gloo group of one forms
    on it and reduces (in a process of its own, with no launcher variables)."""
    code = "\n".join([
        "import argparse, os, torch, torch.distributed as dist",
        f"for name in {LAUNCH_VARIABLES!r}: os.environ.pop(name, None)",
        "from megagpt.launch.planner import Planner",
        "from megagpt.launch.writer import write",
        "from megagpt.launch.rendezvous import choose_rendezvous, store_for",
        "p = Planner(argparse.Namespace(), frozenset(), None, os.environ)",
        "choose_rendezvous(p); launch = p.launch(); write(launch, argparse.Namespace())",
        "dist.init_process_group('gloo', store=store_for(launch),",
        "                        rank=int(os.environ['RANK']),",
        "                        world_size=int(os.environ['WORLD_SIZE']))",
        "t = torch.ones(3); dist.all_reduce(t); print(t.tolist(), dist.get_world_size())",
        "dist.destroy_process_group()",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == "[1.0, 1.0, 1.0] 1"


def test_a_plan_or_a_tools_arguments_made_in_process_leave_no_launcher_behind(monkeypatch):
    """The dry run's plan and a tool's model arguments are library calls: the launch's
    environment is theirs while megatron validates, then put back. Left behind, LOCAL_RANK
    made megagpt-check started later from the same process skip its torchrun and stop on
    'MASTER_PORT expected'."""
    import os

    from megagpt.inference.model_flags import parse_model_args
    from megagpt.launch import resolve
    from megagpt.preflight.dry_run import make_plan

    for name in LAUNCH_VARIABLES + ("CUDA_DEVICE_MAX_CONNECTIONS",):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    tiny = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size",
            "2", "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-3",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--cpu"]
    launch = resolve(tiny)
    assert any(name == "LOCAL_RANK" for name, _ in launch.environ)  # it is the launch's
    assert make_plan(launch).params.total > 0
    parse_model_args(tiny, cpu=True)
    assert dict(os.environ) == before

"""A process started without a launcher is a world of one that meets through an in-memory
store (no port to choose, none to lose to another process); a launcher's environment is used
as it is."""

import subprocess
import sys

import pytest

from megagpt.rendezvous import default_single_process_env

LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def bare_env(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_without_a_launcher_the_process_is_rank_0_of_one_with_an_in_memory_store(bare_env):
    import os

    import torch.distributed as dist

    store = default_single_process_env()
    assert isinstance(store, dist.HashStore)
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == (
        "0", "0", "1")
    assert "MASTER_PORT" not in os.environ  # no port was chosen


@pytest.mark.parametrize("launcher_env", [
    {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
     "MASTER_PORT": "29500"},  # torchrun's second rank
    {"WORLD_SIZE": "1", "MASTER_PORT": "29500"},  # a port the user named
    {"WORLD_SIZE": "2"},  # several processes: their launcher's rendezvous, not ours
], ids=["torchrun", "user_port", "several"])
def test_a_launchers_environment_is_its_rendezvous(bare_env, launcher_env):
    import os

    for name, value in launcher_env.items():
        bare_env.setenv(name, value)
    assert default_single_process_env() is None
    for name, value in launcher_env.items():
        assert os.environ[name] == value


def test_the_store_rendezvouses_a_gloo_group_of_one():
    """The store is what megatron's init_process_group gets: a real gloo group of one forms
    on it and reduces (in a process of its own, with no launcher variables)."""
    code = "\n".join([
        "import os, torch, torch.distributed as dist",
        f"for name in {LAUNCH_VARIABLES!r}: os.environ.pop(name, None)",
        "from megagpt.rendezvous import default_single_process_env",
        "dist.init_process_group('gloo', store=default_single_process_env(),",
        "                        rank=int(os.environ['RANK']),",
        "                        world_size=int(os.environ['WORLD_SIZE']))",
        "t = torch.ones(3); dist.all_reduce(t); print(t.tolist(), dist.get_world_size())",
        "dist.destroy_process_group()",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == "[1.0, 1.0, 1.0] 1"

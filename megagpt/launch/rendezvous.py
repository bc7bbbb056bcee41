"""Launch without torchrun: one process gets what torchrun would have given it.

``choose_rendezvous`` is a step of the launch's resolution (over its planner ``p``):
``python pretrain_gpt.py ...`` on one GPU (or one CPU) needs no launcher, so RANK,
LOCAL_RANK, WORLD_SIZE and MASTER_ADDR are filled in where no launcher set them (the launch's
writer sets them), and the launch chooses how its processes meet (``RENDEZVOUS``). ``store_for(launch)`` is the store megatron's ``init_process_group`` then
uses.
"""

from __future__ import annotations

from .plan import Decision, Label, Reason, Why


class Rendezvous(Label):
    """How a launch's processes meet."""

    IN_MEMORY = "in-memory store"
    LAUNCHERS = "the launcher's"


RENDEZVOUS: Decision[Rendezvous] = Decision("rendezvous", Rendezvous)

# what torchrun would have set for the only process of a world of one
SINGLE_PROCESS_ENV = (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                      ("MASTER_ADDR", "127.0.0.1"))


def choose_rendezvous(p) -> None:
    """A world of one process that names no master port meets through an in-memory store;
    any other through its launcher's rendezvous (the environment). A world of one needs no
    TCP store, and choosing a free port for one is a race: the port is free when it is chosen
    and is bound only seconds later, after megatron's imports and checks, by when another
    process (a neighbouring launch's gloo connections draw from the same ephemeral range) may
    hold it."""
    for name, value in SINGLE_PROCESS_ENV:
        if name not in p.environ:
            p.set_env(name, value)
    world = p.environ.get("WORLD_SIZE", "1")
    if "MASTER_PORT" in p.environ:
        p.choose(RENDEZVOUS, Rendezvous.LAUNCHERS, Reason(Why.ENVIRONMENT, "MASTER_PORT is set"))
    elif world != "1":
        p.choose(RENDEZVOUS, Rendezvous.LAUNCHERS, Reason(
            Why.ENVIRONMENT, f"WORLD_SIZE={world}: several processes"))
    else:
        p.choose(RENDEZVOUS, Rendezvous.IN_MEMORY, Reason(
            Why.ENVIRONMENT, "one process, no MASTER_PORT: no port to choose, none to lose to "
            "another process"))


def store_for(launch):
    """The store megatron's ``init_process_group`` is to use for ``launch``: an in-memory one
    where its rendezvous is, else None (the launcher's, through the environment)."""
    if launch[RENDEZVOUS] is not Rendezvous.IN_MEMORY:
        return None
    import torch.distributed as dist

    return dist.HashStore()

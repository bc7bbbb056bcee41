"""The test helpers' own rule: a torchrun launch whose master port was taken in the moment
between choosing it and binding it is launched again on a new port; other failures are not."""

import subprocess

from helpers import _with_a_free_port

TAKEN = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any "
         "local network address. port: 34735, useIpv6: false, code: -98, name: EADDRINUSE, "
         "message: address already in use")


def launches(*results):
    runs = iter(results)
    made = []

    def run():
        made.append(next(runs))
        return made[-1]

    return run, made


def test_a_taken_port_is_tried_again_on_a_new_one():
    run, made = launches(subprocess.CompletedProcess([], 1, "", TAKEN),
                         subprocess.CompletedProcess([], 0, "trained", ""))
    assert _with_a_free_port(run, nproc=2).returncode == 0 and len(made) == 2


def test_other_failures_and_single_processes_are_not_repeated():
    run, made = launches(subprocess.CompletedProcess([], 1, "error: bad flag", ""))
    assert _with_a_free_port(run, nproc=2).returncode == 1 and len(made) == 1
    run, made = launches(subprocess.CompletedProcess([], 1, TAKEN, ""))
    assert _with_a_free_port(run, nproc=1).returncode == 1 and len(made) == 1


def test_it_gives_up_after_three_launches():
    run, made = launches(*[subprocess.CompletedProcess([], 1, TAKEN, "")] * 3)
    assert _with_a_free_port(run, nproc=2).returncode == 1 and len(made) == 3

"""--async-save on a plain install: the writer chosen, the persistent worker, the log line.

The real asynchronous save and resume are in test_resume.py (losses equal an uninterrupted
run's) and test_checkpoint_faults.py (a kill during the save)."""

import argparse

import pytest

from megagpt.resilience import async_save


def megatron_args(argv=()):
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    args = parser.parse_args(list(argv))
    args.cpu = False
    return args


def chosen(args, given, nvrx_installed: bool):
    """(``args`` as the launch's async-save step decides them, its log lines)."""
    from megagpt.launch import resilience
    from megagpt.launch.planner import Planner

    p = Planner(args, frozenset(given), None)
    resilience.choose_writer(p, nvrx_installed=nvrx_installed)
    return p.v, p.lines


def test_megatrons_defaults_need_both_changes_on_a_plain_install():
    # what megatron 0.19 would do with --async-save alone: nvrx's writer, and no worker
    args = megatron_args(["--async-save"])
    assert args.async_strategy == "nvrx" and not args.use_persistent_ckpt_worker
    args, lines = chosen(args, {"--async-save"}, nvrx_installed=False)
    assert args.async_strategy == "mcore" and args.use_persistent_ckpt_worker
    assert lines == ["async save: megatron's own writer (--async-strategy mcore) in a persistent "
                     "writer process (--use-persistent-ckpt-worker; without it megatron 0.19 "
                     "saves synchronously); nvidia-resiliency-ext is not installed; pip install "
                     "'megagpt[resilience]' for its writer"]


def test_nvidia_resiliency_ext_is_used_when_installed():
    args, lines = chosen(megatron_args(["--async-save", "--use-persistent-ckpt-worker"]),
                         {"--async-save", "--use-persistent-ckpt-worker"}, nvrx_installed=True)
    assert args.async_strategy == "nvrx" and lines == []


def test_explicit_nvrx_without_the_package_is_one_line():
    args = megatron_args(["--async-save", "--async-strategy", "nvrx"])
    with pytest.raises(async_save.AsyncSaveError, match=r"needs nvidia-resiliency-ext.*"
                                                        r"--async-strategy mcore"):
        chosen(args, {"--async-save", "--async-strategy"}, nvrx_installed=False)


def test_cpu_mode_uses_megatrons_writer_even_with_the_package():
    args = megatron_args(["--async-save"])
    args.cpu = True
    args, lines = chosen(args, {"--async-save"}, nvrx_installed=True)
    assert args.async_strategy == "mcore" and "CPU mode" in lines[0]


def test_nothing_changes_without_async_save_or_for_the_legacy_format():
    for argv in ([], ["--async-save", "--ckpt-format", "torch"]):
        from megagpt.launch import resilience
        from megagpt.launch.planner import Planner

        p = Planner(megatron_args(argv), frozenset(argv), None)
        resilience.choose_writer(p, nvrx_installed=False)
        assert p.decided == {} and p.lines == [] and p.choices == []


def test_the_entry_makes_the_choice_while_parsing():
    from megagpt import launch
    from megagpt.command_line import arguments

    args = launch.parse_arguments([
        "--cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "4", "--save", "ckpt",
        "--save-interval", "2", "--async-save"])
    arguments.validate_arguments(args, device_arch=0)
    assert args.async_save  # megatron's validate_args kept it on (the worker is on)
    expected = "nvrx" if async_save.resiliency_ext_installed() and not args.cpu else "mcore"
    assert args.async_strategy == expected


def test_finalize_adds_wraps_the_scheduling_for_the_block_only(monkeypatch):
    """The request scheduled inside gets the function among its finalize functions; the
    wrapper is the registry's, taken off when the block ends."""
    import megatron.training.checkpointing as mckpt

    from megagpt import megatron_wrappers

    scheduled = []
    monkeypatch.setattr(mckpt, "schedule_async_save", scheduled.append)  # megatron's queue

    class Request:
        def __init__(self):
            self.finalize = []

        def add_finalize_fn(self, fn):
            self.finalize.append(fn)

    def snapshot():
        pass

    request = Request()
    with async_save.finalize_adds(snapshot):
        assert megatron_wrappers.installed(mckpt, "schedule_async_save") == [
            "megagpt.resilience.async_save"]
        mckpt.schedule_async_save(request)
    assert scheduled == [request] and request.finalize == [snapshot]
    assert mckpt.schedule_async_save == scheduled.append
    assert megatron_wrappers.installed(mckpt, "schedule_async_save") == []

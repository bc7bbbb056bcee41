"""The ledger of megatron changes: every entry still matches the installed megatron, every
change the launch's context makes is listed, and wrappers of one function compose in the order
the context installs them."""

import importlib
import json
import subprocess
import sys

import pytest

from helpers import REPO
from megatron_parts import megatron_changes_in_place
from megagpt import megatron_ledger, megatron_source, megatron_wrappers
from megagpt.megatron_ledger import LEDGER, REPLACES, WRAPS


@pytest.mark.parametrize("change", LEDGER,
                         ids=[f"{c.target.rsplit('.', 2)[-2]}.{c.target.rsplit('.', 1)[-1]}"
                              f"<-{c.owner.rsplit('.', 1)[-1]}" for c in LEDGER])
def test_entry_matches_the_installed_megatron(change):
    """Fails when megatron's source of an entry changes (an upgrade): re-read the workaround
    against the new code, then update the entry's fingerprint and ``checked`` (the message
    gives the new fingerprint and signature), or remove the workaround."""
    assert megatron_ledger.state(change) == "ok", (
        f"{change.target} ({change.how}, by {change.owner}: {change.why}): "
        f"{megatron_ledger.state(change)}")


def test_owners_are_megagpt_modules():
    for change in LEDGER:
        assert change.owner.startswith("megagpt.")
        importlib.import_module(change.owner)


def test_the_fingerprint_notices_a_changed_definition(tmp_path, monkeypatch):
    """The check reads megatron's file: a copy of a module with one line changed gets
    another fingerprint, and a removed function is reported gone."""
    import megatron.core.datasets.utils as dataset_utils

    original = open(dataset_utils.__file__).read()
    package = tmp_path / "megatron_copy"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "utils.py").write_text(original)
    monkeypatch.syspath_prepend(str(tmp_path))
    megatron_source._parsed.cache_clear()
    same = megatron_source.fingerprint("megatron_copy.utils.compile_helpers")
    assert same == megatron_source.fingerprint("megatron.core.datasets.utils.compile_helpers")

    (package / "utils.py").write_text(original.replace("def compile_helpers():",
                                                       "def compile_helpers(verbose=False):"))
    megatron_source._parsed.cache_clear()
    assert megatron_source.fingerprint("megatron_copy.utils.compile_helpers") != same
    assert megatron_source.signature_text("megatron_copy.utils.compile_helpers") == \
        "(verbose=False)"
    (package / "utils.py").write_text(original.replace("def compile_helpers(", "def gone("))
    megatron_source._parsed.cache_clear()
    with pytest.raises(megatron_source.DefinitionNotFound):
        megatron_source.fingerprint("megatron_copy.utils.compile_helpers")
    megatron_source._parsed.cache_clear()


def test_every_change_the_installers_make_is_in_the_ledger():
    """The launch's one context of megatron changes (every change turned on), the validation
    without a GPU and the preflight, run in a fresh process: each megatron attribute they
    change has a ``wraps`` or ``replaces`` entry and was installed through
    ``megagpt.megatron_wrappers`` (so its owner can take it off), and all of it is undone."""
    out = subprocess.run([sys.executable, str(REPO / "tests" / "megatron_changes_probe.py")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    listed = {c.target for c in LEDGER if c.how in (WRAPS, REPLACES)}
    for step in ("launch", "launch on the CPU", "validation", "preflight"):
        assert report[step], step  # the probe saw the installers work
        unlisted = set(report[step]) - listed
        assert not unlisted, f"{step}: changed in megatron but not in the ledger: {unlisted}"
        bypassed = set(report[step]) - set(report["registered"][step])
        assert not bypassed, f"{step}: changed outside megagpt.megatron_wrappers: {bypassed}"
    assert report["left"] == [] == report["registered"]["left"]  # every change undone
    for name in ("training.training.training_log", "core.optimizer.Adam",
                 "core.full_cuda_graph.FullCudaGraphWrapper.__call__"):
        assert "megatron." + name in report["launch"], name
    assert "megatron.training.training.initialize_megatron" in report["launch on the CPU"]


@pytest.fixture()
def setup_function_untouched():
    """megatron's setup_model_and_optimizer with no wrapper over it (none stays installed
    outside a context), and none left afterwards."""
    import megatron.training.training as mtraining

    assert megatron_wrappers.installed(mtraining, "setup_model_and_optimizer") == []
    yield mtraining
    for owner in ("megagpt.train_step.async_step", "megagpt.train_step.flat_adam"):
        megatron_wrappers.remove(mtraining, "setup_model_and_optimizer", owner)


def _tagging(tag):
    """A wrapper factory whose wrapped function says what it wraps."""
    def wrap(fn):
        def wrapped(*args, **kwargs):
            return fn(*args, **kwargs)
        wrapped.tag, wrapped.inner = tag, fn
        return wrapped
    return wrap


def _layers(fn):
    tags = []
    while hasattr(fn, "tag"):
        tags.append(fn.tag)
        fn = fn.inner
    return tags, fn


def test_wrappers_of_one_function_compose_in_the_order_they_are_installed(
        setup_function_untouched):
    mtraining = setup_function_untouched
    original = mtraining.setup_model_and_optimizer
    flat, asynchronous = "megagpt.train_step.flat_adam", "megagpt.train_step.async_step"

    # either order: the first installed goes next to megatron's function
    for first, second in ((flat, asynchronous), (asynchronous, flat)):
        megatron_wrappers.install(mtraining, "setup_model_and_optimizer", first,
                                  _tagging("first"))
        megatron_wrappers.install(mtraining, "setup_model_and_optimizer", second,
                                  _tagging("second"))
        tags, bottom = _layers(mtraining.setup_model_and_optimizer)
        assert tags == ["second", "first"] and bottom is original
        assert megatron_wrappers.installed(mtraining, "setup_model_and_optimizer") == [
            first, second]
        # the inner one taken away: the outer one stays, now over megatron's function
        megatron_wrappers.remove(mtraining, "setup_model_and_optimizer", first)
        tags, bottom = _layers(mtraining.setup_model_and_optimizer)
        assert tags == ["second"] and bottom is original
        megatron_wrappers.remove(mtraining, "setup_model_and_optimizer", second)
        assert mtraining.setup_model_and_optimizer is original


def test_the_launchs_context_composes_in_its_stated_order_and_undoes_it(
        setup_function_untouched):
    """``launch.megatron_changes``: the flat step inside the asynchronous step, the
    asynchronous step's training_log inside resume fidelity's, the fast path's optimizer
    under CPU mode's fallbacks (where megatron bound CUDA-only kernels); all gone on exit."""
    import dataclasses

    import megatron.core.optimizer as mopt

    from megagpt.launch import resolve, write
    from megagpt.launch.cpu import CPU_OPTIMIZER, CpuOptimizer
    from megagpt.launch.megatron_changes import launched
    from megagpt.launch.optimizer_kernels import ASYNC_STEP, OPTIMIZER, OptimizerKernels

    mtraining = setup_function_untouched
    resolved = resolve(["--cpu", "--mock-data", "--num-layers", "2", "--hidden-size", "64",
                        "--num-attention-heads", "4", "--seq-length", "64",
                        "--max-position-embeddings", "64", "--micro-batch-size", "2",
                        "--lr", "1e-3", "--train-iters", "2"])
    every = {OPTIMIZER: OptimizerKernels.FLAT_ADAMW, ASYNC_STEP: True,
             CPU_OPTIMIZER: CpuOptimizer.MEGATRONS_FALLBACKS}
    launch = dataclasses.replace(resolved, choices=tuple(
        dataclasses.replace(c, value=every.get(c.decision, c.value)) for c in resolved.choices))
    original = mtraining.setup_model_and_optimizer
    with launched(launch, write(resolved, environ={})):
        assert megatron_wrappers.installed(mtraining, "setup_model_and_optimizer") == [
            "megagpt.train_step.flat_adam", "megagpt.train_step.async_step"]
        assert mtraining.setup_model_and_optimizer.__wrapped__.__wrapped__ is original
        assert megatron_wrappers.installed(mtraining, "training_log") == [
            "megagpt.train_step.async_step", "megagpt.resilience.fidelity"]
        assert megatron_wrappers.installed(mopt, "Adam") == [
            "megagpt.train_step.optimizer", "megagpt.cpu_mode"]
        assert mopt.Adam is __import__("torch").optim.AdamW  # CPU mode's, outermost
    assert megatron_changes_in_place() == []
    assert mtraining.setup_model_and_optimizer is original


def test_a_change_the_ledger_does_not_list_is_refused():
    import megatron.training.training as mtraining

    before = mtraining.evaluate
    with pytest.raises(LookupError, match="not in megagpt.megatron_ledger"):
        megatron_wrappers.install(mtraining, "evaluate", "megagpt.resilience.fidelity",
                                  _tagging("x"))
    assert mtraining.evaluate is before


def test_a_replacement_outside_the_wrappers_is_noticed(setup_function_untouched):
    mtraining = setup_function_untouched
    original = mtraining.setup_model_and_optimizer
    owner = "megagpt.train_step.flat_adam"
    megatron_wrappers.install(mtraining, "setup_model_and_optimizer", owner, _tagging("a"))
    mtraining.setup_model_and_optimizer = original  # behind the wrappers' back
    try:
        with pytest.raises(RuntimeError, match="replaced outside"):
            megatron_wrappers.remove(mtraining, "setup_model_and_optimizer", owner)
    finally:
        megatron_wrappers._CHAINS.pop("megatron.training.training.setup_model_and_optimizer")
    assert mtraining.setup_model_and_optimizer is original


def test_a_replacement_is_undone_by_its_owner_and_wrapped_over():
    """A value put in place of megatron's (``replace``) comes off with ``remove_all`` of its
    owner, which leaves other owners' changes alone; ``original`` reads megatron's under it."""
    import megatron.core.optimizer as mopt
    import megatron.core.optimizer.clip_grads as mclip

    from megagpt.train_step import optimizer as optim

    owner = "megagpt.train_step.optimizer"
    using, norm = mopt.USING_PYTORCH_OPTIMIZER, mclip.l2_norm_impl
    try:
        megatron_wrappers.replace(mopt, "USING_PYTORCH_OPTIMIZER", owner, not using)
        megatron_wrappers.replace(mclip, "l2_norm_impl", owner, optim.foreach_multi_tensor_l2norm)
        assert mopt.USING_PYTORCH_OPTIMIZER is (not using)
        assert megatron_wrappers.original(mopt, "USING_PYTORCH_OPTIMIZER") is using
        assert sorted(megatron_wrappers.installed_by(owner)) == [
            "megatron.core.optimizer.USING_PYTORCH_OPTIMIZER",
            "megatron.core.optimizer.clip_grads.l2_norm_impl"]
        with pytest.raises(LookupError, match="not in megagpt.megatron_ledger"):
            megatron_wrappers.replace(mopt, "Adam", "megagpt.inference", object())
    finally:
        megatron_wrappers.remove_all(owner)
    assert mopt.USING_PYTORCH_OPTIMIZER is using and mclip.l2_norm_impl is norm
    assert megatron_wrappers.installed_by(owner) == []


def test_class_attributes_come_back_as_they_were_stored():
    """A classmethod is wrapped and put back as the classmethod object (not a bound method),
    and a method a class inherits is removed from it again, not copied into it."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
    from megatron.core.distributed import DistributedDataParallel

    from megagpt import cpu_mode

    stored = vars(PersistentAsyncCaller)["_get_process"]
    with megatron_wrappers.wrapped(PersistentAsyncCaller,
                                   [("_get_process", "megagpt.cpu_mode", cpu_mode._forking)]):
        now = vars(PersistentAsyncCaller)["_get_process"]
        assert isinstance(now, classmethod) and now is not stored
        assert megatron_wrappers.original(PersistentAsyncCaller, "_get_process") is stored
    assert vars(PersistentAsyncCaller)["_get_process"] is stored

    class Subclass(DistributedDataParallel):
        pass

    chain = megatron_wrappers._Chain(Subclass, "zero_grad_buffer",
                                     megatron_wrappers._read(Subclass, "zero_grad_buffer"),
                                     megatron_wrappers._own(Subclass, "zero_grad_buffer"))
    chain.layers.append(("x", _tagging("x"), None))
    chain.rebuild_from(0)
    assert "zero_grad_buffer" in vars(Subclass)
    del chain.layers[0]
    chain.rebuild_from(0)
    assert "zero_grad_buffer" not in vars(Subclass)
    assert Subclass.zero_grad_buffer is DistributedDataParallel.zero_grad_buffer


def test_a_global_megatron_sets_itself_supersedes_the_replacement():
    """megatron clears its tokenizer (unset_global_variables): the replacement is then over,
    neither an error nor put back, and the next one starts from megatron's value."""
    from megatron.training import global_vars

    owner, name = "megagpt.command_line.arguments", "_GLOBAL_TOKENIZER"
    before = global_vars._GLOBAL_TOKENIZER
    first, second = object(), object()
    try:
        megatron_wrappers.replace(global_vars, name, owner, first, megatron_sets=True)
        assert global_vars._GLOBAL_TOKENIZER is first
        global_vars._GLOBAL_TOKENIZER = None  # as megatron's unset_global_variables
        megatron_wrappers.replace(global_vars, name, owner, second, megatron_sets=True)
        assert global_vars._GLOBAL_TOKENIZER is second
        assert megatron_wrappers.original(global_vars, name) is None
        global_vars._GLOBAL_TOKENIZER = first
        megatron_wrappers.remove(global_vars, name, owner)
        assert global_vars._GLOBAL_TOKENIZER is first  # megatron's since: left as it is
        assert megatron_wrappers.installed(global_vars, name) == []
    finally:
        megatron_wrappers.remove_all(owner)
        global_vars._GLOBAL_TOKENIZER = before

"""The launch's table of megatron changes (megagpt/launch/megatron_changes.py): what its pieces
install when they are entered, for real, is what the table says, in its order; the order keeps
every change outside the wrappers it must wrap; every change is declared beside its code and
listed in the ledger once; docs/step.md is what the table writes now."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass

import pytest

from helpers import REPO
from megatron_parts import megatron_changes_in_place, with_every_change
from megagpt import megatron_ledger, megatron_wrappers
from megagpt.launch import megatron_changes, step_doc
from megagpt.launch.megatron_changes import CHANGES, PIECES


def test_the_committed_page_is_what_the_table_writes():
    assert step_doc.render() == step_doc.PAGE.read_text(), (
        "docs/step.md differs from the launch's table: run make step-doc")


def _declaring_modules() -> list[str]:
    names = []
    for path in sorted((REPO / "megagpt").rglob("*.py")):
        if "MEGATRON_CHANGES = " in path.read_text():
            parts = path.relative_to(REPO).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_change_is_declared_beside_its_code_and_in_the_ledger_once():
    """Each record a module declares (its MEGATRON_CHANGES) is its own, and is in the ledger
    exactly once; each change the ledger says is installed is declared by its owner, which
    is what megatron_wrappers lets install it."""
    declared = []
    for name in _declaring_modules():
        module = importlib.import_module(name)
        for change in module.MEGATRON_CHANGES:
            assert change.owner == name, f"{change.target}: declared by {name}, not its owner"
            assert change.installed, f"{change.target} ({change.how}) belongs in DEPENDS_ON"
            declared.append(change)
    assert len(declared) == len(set(declared))
    ledger = list(megatron_ledger.LEDGER)
    for change in declared:
        assert ledger.count(change) == 1, f"{change.target} <- {change.owner}"
    installed = [c for c in ledger if c.installed]
    assert sorted(installed, key=repr) == sorted(declared, key=repr)
    assert all(c in megatron_wrappers.declared_by(c.owner) for c in installed)
    assert not any(c.installed for c in megatron_ledger.DEPENDS_ON)
    assert len(CHANGES) == len(set(CHANGES))  # each change in one piece, once


def test_the_table_keeps_each_wrapper_outside_those_it_must_wrap():
    """A record's ``outside`` names owners of the same megatron function: each of their
    changes there is installed before it (inner), whichever pieces a launch enters."""
    for position, change in enumerate(CHANGES):
        for owner in change.outside:
            inner = [i for i, c in enumerate(CHANGES)
                     if c.target == change.target and c.owner == owner]
            assert inner, f"{change.owner}: no change of {owner} to {change.target} to wrap"
            assert max(inner) < position, (
                f"{change.target}: {change.owner} must be installed after {owner}")


@dataclass(frozen=True)
class Case:
    """A launch whose pieces are entered: one of the page's, on what is installed here (as
    the table reads it), and with ``every`` change turned on."""

    title: str
    example: step_doc.Example
    every: bool = False
    cpu_fallbacks: bool = False

    def launch(self):
        return _launch(self)


@functools.cache
def _launch(case: Case):
    from megagpt.compat import Installed

    resolved = case.example.resolved(Installed.detect())
    return with_every_change(resolved, case.cpu_fallbacks) if case.every else resolved


ONE_GPU, EIGHT_GPUS, ON_THE_CPU = step_doc.EXAMPLES
CASES = [
    *(Case(example.title, example) for example in step_doc.EXAMPLES),
    Case("every change, one GPU", ONE_GPU, every=True),
    Case("every change, --cpu, megatron's torch fallbacks", ON_THE_CPU, every=True,
         cpu_fallbacks=True),
    Case("--fast-disable optimizer, --cpu", dataclasses.replace(
        ON_THE_CPU, argv=(*ON_THE_CPU.argv, "--fast-disable", "optimizer"))),
]


def _recording(monkeypatch) -> list[tuple[object, str, str]]:
    """The (module, name, owner) of each install through megatron_wrappers, in order (the
    installs themselves happen as they would)."""
    installs = []
    install = megatron_wrappers.install

    def recording_install(module, name, owner, wrapper, megatron_sets=False):
        installs.append((module, name, owner))
        return install(module, name, owner, wrapper, megatron_sets)

    monkeypatch.setattr(megatron_wrappers, "install", recording_install)
    return installs


@pytest.mark.parametrize("case", CASES, ids=[case.title for case in CASES])
def test_what_the_pieces_install_is_the_table(case, tmp_path, monkeypatch):
    """Each launch's pieces entered for real (``launched``): the changes installed, in the
    order installed, are the table's for that launch (``entered``), and each megatron
    function's wrappers compose in that order; all undone on exit."""
    from megagpt.launch import write

    monkeypatch.chdir(tmp_path)  # where a GPU launch's flight recorder folder is made
    launch = case.launch()
    args = write(launch, environ=dict(case.example.environ))
    expected = megatron_changes.entered(launch, bool(args.cpu))
    installs = _recording(monkeypatch)
    with megatron_changes.launched(launch, args):
        got = [(megatron_wrappers._target(module, name), owner)
               for module, name, owner in installs]
        assert got == [(c.target, c.owner) for _, changes in expected for c in changes]
        for module, name, _ in installs:
            target = megatron_wrappers._target(module, name)
            assert megatron_wrappers.installed(module, name) == [
                c.owner for _, changes in expected for c in changes if c.target == target]
    assert megatron_changes_in_place() == []
    assert [name for name, _ in megatron_changes.pieces(launch, args)] == [
        piece.name for piece, _ in expected]


def test_the_cases_reach_every_piece_and_every_change():
    """No piece or change of the table goes untested above."""
    entered = [megatron_changes.entered(case.launch(), bool(case.launch().arg("cpu")))
               for case in CASES]
    assert {p.name for p in PIECES} == {p.name for one in entered for p, _ in one}
    assert set(CHANGES) == {c for one in entered for _, changes in one for c in changes}

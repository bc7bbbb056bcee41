"""Wrappers of megatron's functions (module-level, or a class's), composed in one stated order.

Several concerns wrap the same megatron function: ``training_log`` (the asynchronous step,
resume fidelity), ``setup_model_and_optimizer`` (the flat AdamW step, the asynchronous
step), ``save_checkpoint`` (the configuration snapshot, the divergence guard). Each installs
its wrapper here under its own module's name, and the function megatron calls is rebuilt as
megatron's original with the installed wrappers applied in the order of their entries in
``megagpt.megatron_ledger``, the first innermost. So the composition does not depend on which
concern is installed first, and removing one wrapper keeps the others (restoring a saved
attribute instead would also drop every wrapper installed after it).

Only what the ledger lists can be installed (``wraps`` or ``replaces`` entries of that
owner): a change to megatron that is not in the ledger is an error here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

from megagpt.megatron_ledger import REPLACES, WRAPS, entries_for

Wrapper = Callable[[Callable], Callable]


@dataclass
class _Chain:
    """megatron's function and the wrappers installed over it, innermost first."""

    module: object
    name: str
    original: Callable
    layers: list[tuple[str, Wrapper, Callable]] = field(default_factory=list)  # owner, wrap, built

    @property
    def top(self) -> Callable:
        return self.layers[-1][2] if self.layers else self.original

    def rebuild_from(self, index: int) -> None:
        fn = self.layers[index - 1][2] if index else self.original
        for i in range(index, len(self.layers)):
            owner, wrap, _ = self.layers[i]
            fn = wrap(fn)
            self.layers[i] = (owner, wrap, fn)
        setattr(self.module, self.name, fn)


_CHAINS: dict[str, _Chain] = {}


def _target(module, name: str) -> str:
    if isinstance(module, type):  # a class attribute, e.g. a megatron layer's __init__
        return f"{module.__module__}.{module.__qualname__}.{name}"
    return f"{module.__name__}.{name}"


def _order(target: str, owner: str) -> list[str]:
    owners = [c.owner for c in entries_for(target) if c.how in (WRAPS, REPLACES)]
    if owner not in owners:
        raise LookupError(f"{target} wrapped by {owner}: not in megagpt.megatron_ledger; "
                          "list the change there (why, when, fingerprint) first")
    return owners


def _chain(module, name: str) -> _Chain | None:
    chain = _CHAINS.get(_target(module, name))
    if chain is not None and getattr(module, name) is not chain.top:
        raise RuntimeError(f"{_target(module, name)} was replaced outside "
                           "megagpt.megatron_wrappers; install every wrapper through it")
    return chain


def install(module, name: str, owner: str, wrapper: Wrapper) -> None:
    """Put ``wrapper`` (original -> wrapped function) over ``module.name`` at ``owner``'s
    place in the ledger's order; an owner's second install replaces its first."""
    target = _target(module, name)
    order = _order(target, owner)
    chain = _chain(module, name)
    if chain is None:
        chain = _CHAINS[target] = _Chain(module, name, getattr(module, name))
    owners = [layer[0] for layer in chain.layers]
    if owner in owners:
        index = owners.index(owner)
        chain.layers[index] = (owner, wrapper, None)
    else:
        index = sum(order.index(o) < order.index(owner) for o in owners)
        chain.layers.insert(index, (owner, wrapper, None))
    chain.rebuild_from(index)


def remove(module, name: str, owner: str) -> None:
    """Take ``owner``'s wrapper off ``module.name``; the others stay, in order."""
    chain = _chain(module, name)
    owners = [layer[0] for layer in chain.layers] if chain else []
    if owner not in owners:
        return
    index = owners.index(owner)
    del chain.layers[index]
    chain.rebuild_from(index)
    if not chain.layers:
        del _CHAINS[_target(module, name)]


def installed(module, name: str) -> list[str]:
    """The owners whose wrappers are over ``module.name``, innermost first."""
    chain = _CHAINS.get(_target(module, name))
    return [layer[0] for layer in chain.layers] if chain else []


@contextlib.contextmanager
def wrapped(module, wrappers: list[tuple[str, str, Wrapper]]) -> Iterator[None]:
    """``install`` each ``(name, owner, wrapper)`` for the duration of the block, then
    ``remove`` them."""
    done = []
    try:
        for name, owner, wrapper in wrappers:
            install(module, name, owner, wrapper)
            done.append((name, owner))
        yield
    finally:
        for name, owner in reversed(done):
            remove(module, name, owner)

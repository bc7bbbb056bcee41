"""Every wrapper or replacement of a megatron attribute (a module's, or a class's), installed
in one place, composed in the order it is installed and taken off by its owner.

Several concerns wrap the same megatron function: ``training_log`` (the asynchronous step,
resume fidelity), ``setup_model_and_optimizer`` (the flat AdamW step, the asynchronous
step), ``save_checkpoint`` (the configuration snapshot, the divergence guard). Each installs
its wrapper here under its own module's name, and the function megatron calls is rebuilt as
megatron's original with the installed wrappers applied in the order they were installed, the
first innermost. Which order that is, is the launch's table of megatron changes
(``megagpt.launch.megatron_changes``). Removing one wrapper keeps the others in their order
(restoring a saved attribute instead would also drop every wrapper installed after it).

A replacement (``replace``: a value, a class, a function that does not call megatron's) is a
layer that ignores what is under it. Every change the project makes to a megatron attribute
goes through here, so each can be taken off again by its owner (``remove``, ``remove_all``;
``wrapped`` and ``wrapped_all`` for the duration of a block) without a copy of megatron's
value kept anywhere else.

Only what its owner declares can be installed (a ``wraps`` or ``replaces`` record of that
target in the owner module's ``MEGATRON_CHANGES``, ``megagpt.megatron_change``, which
``megagpt.megatron_ledger`` gathers): any other change to megatron is an error here.
"""

from __future__ import annotations

import contextlib
import importlib
import signal
from dataclasses import dataclass, field
from typing import Callable, Iterator

from megagpt.megatron_change import Change

Wrapper = Callable[[Callable], Callable]


@dataclass
class _Chain:
    """megatron's function and the wrappers installed over it, innermost first."""

    module: object
    name: str
    original: object
    own: bool  # the original is in the module's (or class's) own namespace, not inherited
    layers: list[tuple[str, Wrapper, Callable]] = field(default_factory=list)  # owner, wrap, built
    megatron_sets: bool = False  # a global megatron assigns itself (see ``replace``)

    @property
    def top(self) -> Callable:
        return self.layers[-1][2] if self.layers else self.original

    def rebuild_from(self, index: int) -> None:
        fn = self.layers[index - 1][2] if index else self.original
        for i in range(index, len(self.layers)):
            owner, wrap, _ = self.layers[i]
            fn = wrap(fn)
            self.layers[i] = (owner, wrap, fn)
        if self.layers or self.own:
            setattr(self.module, self.name, fn)
        else:  # an inherited attribute: the class's own one goes, the base's shows again
            delattr(self.module, self.name)


_CHAINS: dict[str, _Chain] = {}


def _target(module, name: str) -> str:
    if isinstance(module, type):  # a class attribute, e.g. a megatron layer's __init__
        return f"{module.__module__}.{module.__qualname__}.{name}"
    return f"{module.__name__}.{name}"


def _read(module, name: str) -> object:
    """``module.name`` as stored: for a class, the object in its (or a base's) namespace, so
    that a classmethod or staticmethod is what is wrapped and put back, not a bound method."""
    if isinstance(module, type):
        for klass in module.__mro__:
            if name in vars(klass):
                return vars(klass)[name]
        raise AttributeError(f"{module.__qualname__} has no attribute {name!r}")
    return getattr(module, name)


def _own(module, name: str) -> bool:
    return not isinstance(module, type) or name in vars(module)


def declared_by(owner: str) -> tuple[Change, ...]:
    """The records of what ``owner`` (a module's name) changes in megatron: its
    ``MEGATRON_CHANGES``, beside its code (none where the module has none)."""
    try:
        module = importlib.import_module(owner)
    except ImportError:
        return ()
    return tuple(getattr(module, "MEGATRON_CHANGES", ()))


def _check_listed(target: str, owner: str) -> None:
    if not any(c.target == target and c.installed for c in declared_by(owner)):
        raise LookupError(f"{target} wrapped by {owner}: not in megagpt.megatron_ledger; "
                          f"declare the change in {owner}.MEGATRON_CHANGES, beside its code "
                          "(what it does, why, fingerprint), first")


def _chain(module, name: str) -> _Chain | None:
    chain = _CHAINS.get(_target(module, name))
    if chain is not None and _read(module, name) is not chain.top:
        if chain.megatron_sets:  # megatron has set its own value since: ours is over
            del _CHAINS[_target(module, name)]
            return None
        raise RuntimeError(f"{_target(module, name)} was replaced outside "
                           "megagpt.megatron_wrappers; install every wrapper through it")
    return chain


# Signals whose Python handlers raise: torch's DataLoader raises from SIGCHLD when a worker
# dies, the launch from SIGTERM and SIGINT. Raised between a chain's layers and the attribute
# it sets, the chain no longer matches the attribute, and every later install or remove of
# it fails (seen once: a worker killed after a SIGTERM, during the unwinding).
_HELD = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Those signals held back while a chain and its attribute change together; they are
    delivered, and their handlers run, once both agree again."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def install(module, name: str, owner: str, wrapper: Wrapper, megatron_sets: bool = False
            ) -> None:
    """Put ``wrapper`` (original -> wrapped function) over ``module.name``, outside the
    wrappers installed before it; an owner's second install replaces its first in place."""
    with _signals_held():
        _install(module, name, owner, wrapper, megatron_sets)


def _install(module, name: str, owner: str, wrapper: Wrapper, megatron_sets: bool) -> None:
    target = _target(module, name)
    _check_listed(target, owner)
    chain = _chain(module, name)
    if chain is None:
        chain = _CHAINS[target] = _Chain(module, name, _read(module, name),
                                         _own(module, name), megatron_sets=megatron_sets)
    owners = [layer[0] for layer in chain.layers]
    if owner in owners:
        index = owners.index(owner)
        chain.layers[index] = (owner, wrapper, None)
    else:
        index = len(owners)
        chain.layers.append((owner, wrapper, None))
    chain.rebuild_from(index)


def replacing(value: object) -> Wrapper:
    """The layer of a replacement: ``value`` in place of whatever is under it."""
    return lambda _megatrons: value


def replace(module, name: str, owner: str, value: object, megatron_sets: bool = False
            ) -> None:
    """Set ``module.name`` to ``value`` (a ``replaces`` entry of ``owner``) until ``remove``;
    wrappers listed after it in the ledger wrap ``value``.

    ``megatron_sets``: a global that megatron assigns itself (its tokenizer, which
    ``unset_global_variables`` clears): a value megatron has set since the replacement
    supersedes it (a later install starts from megatron's value; ``remove`` leaves it),
    where any other change made outside this module is an error."""
    install(module, name, owner, replacing(value), megatron_sets=megatron_sets)


def remove(module, name: str, owner: str) -> None:
    """Take ``owner``'s wrapper off ``module.name``; the others stay, in order."""
    with _signals_held():
        _remove(module, name, owner)


def _remove(module, name: str, owner: str) -> None:
    chain = _chain(module, name)
    owners = [layer[0] for layer in chain.layers] if chain else []
    if owner not in owners:
        return
    index = owners.index(owner)
    del chain.layers[index]
    chain.rebuild_from(index)
    if not chain.layers:
        del _CHAINS[_target(module, name)]


def remove_all(owner: str) -> list[str]:
    """Take every wrapper and replacement of ``owner`` off; returns the targets it left."""
    left = []
    for target, chain in list(_CHAINS.items()):
        if owner in (layer[0] for layer in chain.layers):
            remove(chain.module, chain.name, owner)
            left.append(target)
    return left


def installed_by(owner: str) -> list[str]:
    """The targets ``owner`` has a wrapper or replacement over."""
    return [target for target, chain in _CHAINS.items()
            if owner in (layer[0] for layer in chain.layers)]


def original(module, name: str) -> object:
    """megatron's own ``module.name``, under whatever is installed over it."""
    chain = _CHAINS.get(_target(module, name))
    return chain.original if chain else _read(module, name)


def installed(module, name: str) -> list[str]:
    """The owners whose wrappers are over ``module.name``, innermost first."""
    chain = _CHAINS.get(_target(module, name))
    return [layer[0] for layer in chain.layers] if chain else []


@contextlib.contextmanager
def wrapped(module, wrappers: list[tuple[str, str, Wrapper]]) -> Iterator[None]:
    """``install`` each ``(name, owner, wrapper)`` of ``module`` for the duration of the
    block, in that order, then ``remove`` them."""
    with wrapped_all([(module, name, owner, wrapper) for name, owner, wrapper in wrappers]):
        yield


@contextlib.contextmanager
def wrapped_all(changes: list[tuple[object, str, str, Wrapper]]) -> Iterator[None]:
    """``install`` each ``(module, name, owner, wrapper)`` for the duration of the block, in
    that order, then ``remove`` them."""
    done = []
    try:
        for module, name, owner, wrapper in changes:
            install(module, name, owner, wrapper)
            done.append((module, name, owner))
        yield
    finally:
        for module, name, owner in reversed(done):
            remove(module, name, owner)

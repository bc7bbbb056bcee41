"""The source text of a megatron definition, read from its file, and a fingerprint of it.

The ledger of megatron changes (``megagpt.megatron_ledger``) keeps, for every megatron
function, class or module-level name the project wraps, replaces or relies on, a
fingerprint of that definition's source at the version it was checked against. The source
is read from the installed file with ``ast``, not from the live object: in a process where
the project's wrappers are installed the live attribute is the wrapper, and a module-level
variable (``USING_PYTORCH_OPTIMIZER``) has no source of its own.

A target is a dotted path ``package.module[.Class].name``. What counts as its source:
a ``def`` or ``class`` at module level (inside ``if``/``try`` blocks too) or in the named
class; a name bound only by one ``from megatron... import name`` is followed to the module
that defines it (``megatron.training.training.save_checkpoint`` is
``megatron.training.checkpointing.save_checkpoint``); any other name is the text of every
module-level statement that binds it (the three imports of ``megatron.core.optimizer.Adam``).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import textwrap
from pathlib import Path


class DefinitionNotFound(LookupError):
    """The target names nothing in the installed megatron (renamed, moved or removed)."""


@functools.lru_cache(maxsize=None)
def _parsed(module: str) -> tuple[str, ast.Module]:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise DefinitionNotFound(f"no Python source for module {module}")
    text = Path(spec.origin).read_text(encoding="utf-8")
    return text, ast.parse(text)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def split_target(target: str) -> tuple[str, list[str]]:
    """``a.b.C.f`` -> (``a.b``, [``C``, ``f``]): the longest prefix that is a module."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        if _is_module(".".join(parts[:cut])):
            return ".".join(parts[:cut]), parts[cut:]
    raise DefinitionNotFound(f"no module in {target}")


def _module_statements(body: list[ast.stmt]):
    """Module-level statements, looking inside ``if``/``try`` blocks (megatron binds its
    fallbacks in ``try: ... except ImportError: ...``)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _module_statements(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            blocks = node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                blocks += handler.body
            yield from _module_statements(blocks)


def _binds(node: ast.stmt, name: str) -> bool:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names)
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    return False


def _segment(text: str, node: ast.AST) -> str:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    lines = text.splitlines()[first - 1:node.end_lineno]
    return "\n".join(lines)


def _imported_from(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` statement of ``module`` reads from."""
    if not node.level:
        return node.module or ""
    is_package = importlib.util.find_spec(module).submodule_search_locations is not None
    base = module if is_package else module.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        base = base.rsplit(".", 1)[0]
    return f"{base}.{node.module}" if node.module else base


def definition_source(target: str, _hops: int = 0) -> str:
    """The source text that defines ``target`` (see the module docstring)."""
    module, names = split_target(target)
    text, tree = _parsed(module)
    body: list[ast.stmt] = tree.body
    for depth, name in enumerate(names):
        top = depth == 0
        statements = list(_module_statements(body)) if top else body
        defs = [n for n in statements
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and n.name == name]
        if defs:
            if depth == len(names) - 1:
                return "\n".join(_segment(text, d) for d in defs)
            if not isinstance(defs[-1], ast.ClassDef):
                break
            body = defs[-1].body
            continue
        bindings = [n for n in statements if _binds(n, name)]
        single = bindings[0] if len(bindings) == 1 else None
        if top and isinstance(single, ast.ImportFrom) and _hops < 4:
            origin = _imported_from(module, single)
            alias = next(a for a in single.names if (a.asname or a.name) == name)
            if origin.startswith("megatron"):
                rest = ".".join([alias.name, *names[1:]])
                return definition_source(f"{origin}.{rest}", _hops + 1)
        if bindings and depth == len(names) - 1:
            return "\n".join(_segment(text, n) for n in bindings)
        break
    raise DefinitionNotFound(f"{target}: not defined in {module}")


def fingerprint(target: str) -> str:
    """The first 12 hex digits of the sha256 of ``definition_source(target)``."""
    return hashlib.sha256(definition_source(target).encode()).hexdigest()[:12]


def signature_text(target: str) -> str | None:
    """``(arg, ...)`` of a function target, for messages; None for anything else."""
    try:
        node = ast.parse(textwrap.dedent(definition_source(target))).body[0]
    except (SyntaxError, IndexError, DefinitionNotFound):
        return None
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"({ast.unparse(node.args)})"
    return None

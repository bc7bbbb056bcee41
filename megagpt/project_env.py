"""The entry and the tools run with the project's environment from any shell.

``make venv`` (and so ``make demo``) installs everything into ``.venv`` beside this package,
without activating it, so a new shell's ``python`` is the system's, without torch or
megatron. Run with an interpreter that cannot find megatron-core, ``pretrain_gpt.py`` and
``tools/*.py`` start again under ``.venv/bin/python`` (one line on stderr says so); with
neither, one ``error:`` line says what to run. An interpreter that has megatron-core (an
activated environment, a ``pip install -e .``) is used as it is. Imports nothing outside
the standard library: it runs before anything else.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
_AGAIN = "MEGAGPT_PROJECT_PYTHON"  # set for the restarted process: it must not restart again


def has_megatron() -> bool:
    try:
        return importlib.util.find_spec("megatron") is not None \
            and importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def use_project_environment(script: str) -> None:
    """Restart ``script`` under ``.venv/bin/python`` when this interpreter lacks megatron."""
    if has_megatron():
        return
    here = sys.executable or "python"
    if VENV_PYTHON.is_file() and os.environ.get(_AGAIN) != "1" and \
            Path(here).absolute() != VENV_PYTHON.absolute():
        print(f"[megagpt] {here} has no megatron-core: running with {VENV_PYTHON}",
              file=sys.stderr, flush=True)
        os.environ[_AGAIN] = "1"
        os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), script, *sys.argv[1:]])
    print(f"error: megatron-core is not installed for {here}: run `make venv` in {REPO} (it "
          "creates .venv, which the entry and the tools then use by themselves), or "
          f"`pip install -e {REPO}` into this environment", file=sys.stderr)
    sys.exit(2)

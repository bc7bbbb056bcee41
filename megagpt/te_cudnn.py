"""Transformer Engine loads the cuDNN library that torch runs on, not a second one.

At import, TE loads cuDNN itself, globally (``RTLD_GLOBAL``), and it prefers a system copy
(``CUDNN_HOME``, ``CUDNN_PATH``, ``CUDA_HOME``, ``/usr/local/cuda``, then the dynamic
loader's path) to the one in Python's ``nvidia`` packages. torch's pip wheels bundle their
own cuDNN in those packages. Then TE's core library is loaded, which names cuDNN's
sub-libraries (``libcudnn_ops``, ``_cnn``, ``_adv``, ``_heuristic``, ``_engines_*``) as its
own dependencies without a search path for them, so the dynamic loader takes the first copy
of each it finds by name: the system's, where one is installed, unless a library of that
name is already in the process. torch maps only ``libcudnn`` and ``libcudnn_graph`` at
import (cuDNN opens the rest when first used).

On a machine with a system cuDNN the process thus ends with parts of two cuDNN versions.
torch's ``scaled_dot_product_attention`` then loses its cuDNN kernel and runs flash
attention instead, and a launch that never calls TE gets slower (bench/notes/transformer-engine.md,
"Which cuDNN TE loads"); where the sub-libraries do not fit together, TE's import
stops ("undefined symbol ... libcudnn_graph.so.9"); where torch was imported after TE,
``torch.backends.cudnn`` refuses to start ("cuDNN version incompatibility").

Before TE is first imported, ``use_torchs_cudnn_for_te`` therefore points ``CUDNN_HOME`` at
torch's bundled cuDNN (TE's own ``libcudnn`` is then torch's) and maps every library of that
cuDNN into the process (TE's core then finds each of its dependencies already there).
Nothing is changed where the user's ``CUDNN_HOME`` or ``CUDNN_PATH`` names another folder,
where torch bundles no cuDNN (a torch built against the system's, as in NVIDIA's containers), or once TE has
been imported.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable

ENV_VARS = ("CUDNN_HOME", "CUDNN_PATH")  # TE reads them in this order, before anything else


def torchs_cudnn_folder(site: Path | None = None) -> Path | None:
    """The folder of the cuDNN torch's wheel links (``<site-packages>/nvidia/cudnn``, which
    torch's libraries name in their run path), or None where torch bundles none. ``site``:
    the folder holding torch (found without importing it)."""
    if site is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.origin:
            return None
        site = Path(spec.origin).parent.parent
    folder = site / "nvidia" / "cudnn"
    return folder if any((folder / "lib").glob("libcudnn.so*")) else None


def torchs_cudnn_libraries(folder: Path) -> list[Path]:
    """Every library of the cuDNN in ``folder``, ``libcudnn_graph`` (which the others link)
    first."""
    return sorted((p for p in (folder / "lib").glob("libcudnn*.so*") if p.is_file()),
                  key=lambda p: (not p.name.startswith("libcudnn_graph."), p))


def map_torchs_cudnn(folder: Path, load: Callable[[str], object] | None = None) -> list[str]:
    """Map each of the cuDNN libraries in ``folder`` into this process, globally, so that a
    library loaded later that names one of them (TE's core) finds it already there. Returns
    the paths mapped; stops at a library that does not load (the rest are left to TE)."""
    load = load or (lambda path: ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL))
    mapped = []
    for library in torchs_cudnn_libraries(folder):
        try:
            load(str(library))
        except OSError:
            break
        mapped.append(str(library))
    return mapped


def use_torchs_cudnn_for_te(environ=os.environ, site: Path | None = None,
                            load: Callable[[str], object] | None = None) -> str | None:
    """Make TE run on torch's cuDNN where TE would otherwise mix in the system's: set
    ``CUDNN_HOME`` to torch's cuDNN and map that cuDNN's libraries. Returns the folder when
    it did, None when it left things as they were (TE not installed or already imported,
    the user's own setting, no cuDNN bundled with torch)."""
    if ("transformer_engine" in sys.modules
            or importlib.util.find_spec("transformer_engine") is None):
        return None
    folder = torchs_cudnn_folder(site)
    if folder is None:
        return None
    given = [environ[name] for name in ENV_VARS if environ.get(name)]
    if given and not _same_folder(given[0], folder):
        return None  # the user's own cuDNN
    # a process started by one that imported megagpt (torchrun's workers under a launcher,
    # a tool's subprocesses) inherits CUDNN_HOME set to torch's folder: it still needs the
    # libraries mapped, which no environment variable carries over
    if not given:
        environ["CUDNN_HOME"] = str(folder)
    map_torchs_cudnn(folder, load)
    return str(folder)


def _same_folder(a, b) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def mapped_cudnn_folders(maps: str = "/proc/self/maps") -> list[str]:
    """The folders this process maps cuDNN libraries from (empty where that cannot be read)."""
    try:
        with open(maps) as lines:
            paths = {line.split()[-1] for line in lines if "libcudnn" in line}
    except OSError:
        return []
    return sorted({os.path.dirname(p) for p in paths if p.startswith("/")})


def cudnn_te_loads(environ=os.environ, folders: list[str] | None = None) -> str:
    """Which cuDNN TE loads, for the log, and where the process maps cuDNN from more than one
    folder (``folders``: ``mapped_cudnn_folders()``), which."""
    folder = torchs_cudnn_folder()
    said = "the system's cuDNN first" if folder is not None else "the system's cuDNN"
    for name in ENV_VARS:
        if environ.get(name):
            same = folder is not None and Path(environ[name]) == folder
            said = (f"torch's cuDNN, {name}={environ[name]}" if same
                    else f"the cuDNN under {name}={environ[name]}")
            break
    folders = mapped_cudnn_folders() if folders is None else folders
    if len(folders) > 1:
        said += (f"; cuDNN is mapped from {len(folders)} folders ({', '.join(folders)}), so "
                 "torch's cuDNN attention may be unavailable")
    return said

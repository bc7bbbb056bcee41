"""Transformer Engine loads the cuDNN library that torch runs on, not a second one.

At import, TE loads cuDNN itself, globally (``RTLD_GLOBAL``), and it prefers a system copy
(``CUDNN_HOME``, ``CUDNN_PATH``, ``CUDA_HOME``, ``/usr/local/cuda``, then the dynamic
loader's path) to the one in Python's ``nvidia`` packages. torch's pip wheels bundle their
own cuDNN in those packages. On a machine that also has a system cuDNN the process then maps
two, and torch's cuDNN calls reach TE's copy: torch's ``scaled_dot_product_attention`` loses
its cuDNN kernel (the version torch was built against no longer matches) and falls back to
flash attention, and a launch that never calls TE gets slower (docs/speed.md, "With
Transformer Engine installed"). Where torch was imported after TE, ``torch.backends.cudnn``
refuses to start at all ("cuDNN version incompatibility").

Pointing ``CUDNN_HOME`` at torch's bundled cuDNN before TE is first imported makes TE load
that very library. Nothing is changed where the user set ``CUDNN_HOME`` or ``CUDNN_PATH``,
where torch bundles no cuDNN (a torch built against the system's, as in NVIDIA's containers),
or once TE has been imported.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

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


def point_te_at_torchs_cudnn(environ=os.environ, site: Path | None = None) -> str | None:
    """Set ``CUDNN_HOME`` to torch's cuDNN where that decides which cuDNN TE loads; returns
    the folder when it did, None when it left things as they were (TE not installed or
    already imported, the user's own setting, no cuDNN bundled with torch)."""
    if any(environ.get(name) for name in ENV_VARS) or "transformer_engine" in sys.modules \
            or importlib.util.find_spec("transformer_engine") is None:
        return None
    folder = torchs_cudnn_folder(site)
    if folder is None:
        return None
    environ["CUDNN_HOME"] = str(folder)
    return str(folder)


def cudnn_te_loads(environ=os.environ) -> str:
    """Which cuDNN TE loads, for the log."""
    folder = torchs_cudnn_folder()
    for name in ENV_VARS:
        if environ.get(name):
            same = folder is not None and Path(environ[name]) == folder
            return f"torch's cuDNN, {name}={environ[name]}" if same else \
                f"the cuDNN under {name}={environ[name]}"
    return "the system's cuDNN first" if folder is not None else "the system's cuDNN"

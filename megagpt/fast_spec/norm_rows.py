"""Inductor's choice for rows of 1025 to 4096 elements: each row reduced in one block.

Inductor reduces a row in one block of threads (a *persistent* reduction: the row is read
once and kept in registers) only up to 1024 elements. Longer rows are reduced in a loop, so
a layer norm reads its row twice (statistics, then normalisation), and where the normalised
row feeds a pointwise epilogue the normalisation becomes a kernel of its own. At hidden 2048
(the 1.3B shape) both of the fused layer's norms are such rows, and reading each once
instead of twice takes nearly half off their forward kernels (figures: docs/speed.md,
"Fused layer"; ``--no-fast-one-block-rows`` in docs/benchmarks.md). Rows of 1024 or fewer (the 345M
shape) are persistent either way.

``compile_with_one_block_rows(fn, **torch_compile_kwargs)`` is ``torch.compile`` with rows of
up to ``MAX_ROW`` elements in one block: its calls run inside ``one_block_rows()``, where
inductor compiles with the choice, and its options carry a marker that keeps inductor's FX
graph cache from mixing its kernels with those compiled without the choice. Only the forward graph is compiled under the choice: the
backward graph compiles lazily in autograd's device thread, where inductor's own choice
stands (the norms' backward kernels are persistent there already).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

# rows up to this many elements are reduced in one block; at 4096 a block of 8 warps holds
# 16 fp32 values per thread and per input, well within the registers of a thread
MAX_ROW = 4096
INDUCTOR_MAX_ROW = 1024  # inductor's own limit for row (inner) reductions


def unavailable_reason() -> Optional[str]:
    """Why this torch cannot take the choice (None: it can)."""
    try:
        from torch._inductor.choices import InductorChoices
        from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: F401
        from torch._inductor.virtualized import V
    except ImportError as e:
        return f"this torch's inductor lacks {e.name or e}"
    if not hasattr(V, "set_choices_handler") or not hasattr(
            InductorChoices, "should_use_persistent_reduction"):
        return "this torch's inductor has no replaceable persistent-reduction choice"
    return None


def row_in_one_block(reduction_numel, hint, cooperative: bool) -> bool:
    """Whether a row reduction of ``reduction_numel`` elements (a static size) goes in one
    block under this choice, where inductor's own would loop."""
    from torch._inductor import config
    from torch._inductor.runtime.hints import ReductionHint

    if cooperative or not config.triton.persistent_reductions or hint != ReductionHint.INNER:
        return False
    try:
        n = int(reduction_numel)
    except TypeError:  # a symbolic size: leave it to inductor
        return False
    return INDUCTOR_MAX_ROW < n <= MAX_ROW


@functools.lru_cache(maxsize=1)
def _choices():
    from torch._inductor.choices import InductorChoices

    class OneBlockRows(InductorChoices):
        """Inductor's choices, with rows of up to ``MAX_ROW`` elements in one block."""

        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction, *args, **kwargs):
            strict_rblock = getattr(features, "strict_sum_rblock", lambda: None)()
            if strict_rblock is None and row_in_one_block(
                    features.reduction_numel, features.get_reduction_hint(),
                    cooperative_reduction):
                return True
            return InductorChoices.should_use_persistent_reduction(
                features, cooperative_reduction, *args, **kwargs)

    return OneBlockRows()


@functools.lru_cache(maxsize=1)
def _cache_marker():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class OneBlockRowsMarker(CustomGraphPass):
        """A post-grad pass that changes nothing: its ``uuid`` enters inductor's FX graph
        cache key, which does not see the choices handler."""

        def __call__(self, graph) -> None:
            return None

        def uuid(self) -> str:
            return f"megagpt.fast_spec.norm_rows:one-block-up-to-{MAX_ROW}"

    return OneBlockRowsMarker()


def compile_with_one_block_rows(fn: Callable, **torch_compile_kwargs) -> Callable:
    """``torch.compile(fn, **torch_compile_kwargs)`` (inductor, no ``mode``) under the choice.
    The cache marker takes the place of a post-grad pass set in inductor's config for this
    compile."""
    import torch

    kwargs = dict(torch_compile_kwargs)
    kwargs["options"] = {**(kwargs.get("options") or {}),
                         "post_grad_custom_post_pass": _cache_marker()}
    return run_in_one_block_rows(torch.compile(fn, **kwargs))


def one_block_rows():
    """A context in which inductor compiles (in this thread) with the one-block choice."""
    from torch._inductor.virtualized import V

    return V.set_choices_handler(_choices())


def run_in_one_block_rows(compiled: Callable) -> Callable:
    """``compiled`` called inside ``one_block_rows()``: its compiles (the first call, and any
    recompile) take the choice; calls that compile nothing pay one context switch."""

    @functools.wraps(compiled)
    def run(*args, **kwargs):
        with one_block_rows():
            return compiled(*args, **kwargs)

    run.in_one_block_rows = True
    return run

"""torch.compile's own failures, told from the computation's.

A compiled piece of the fast path (the fused layer, the chunked loss's kernels, the flat AdamW
step) that the compiler cannot build runs the same arithmetic eagerly; an error raised by the
computation itself (a shape, a device) is the caller's and propagates.
"""

from __future__ import annotations

# where dynamo, inductor and the FX tracer raise their own exceptions
COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "torch.fx")


def is_compile_error(e: BaseException) -> bool:
    """Whether ``e`` was raised by dynamo / inductor themselves (not by the computation)."""
    return (type(e).__module__ or "").startswith(COMPILER_MODULES)

"""megatron's vocabulary padding, and the divisor that keeps it the same across TP sizes.

megatron pads the tokenizer's vocabulary to a multiple of ``--make-vocab-size-divisible-by``
x the tensor-parallel size (GPT-2's 50257 tokens: 50304 rows at TP=1, 50432 at TP=2 with the
default 128), and on load it requires the checkpoint's divisor and embedding shape. A
checkpoint therefore moves between TP sizes only if both pad alike, which the divisor chosen
at the first launch decides.
"""

from __future__ import annotations

from typing import Iterable, Optional

DEFAULT_DIVISOR = 128  # megatron's --make-vocab-size-divisible-by
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8, 16, 32, 64)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def divisor_for(vocab_size: int, tensor_parallel_sizes: Iterable[int],
                largest: int = DEFAULT_DIVISOR) -> Optional[int]:
    """The largest power-of-two divisor up to ``largest`` under which every TP size pads
    ``vocab_size`` to the same number of rows (None if there is none)."""
    sizes = list(tensor_parallel_sizes)
    divisor = largest
    while divisor >= 1:
        if len({padded_vocab_size(vocab_size, divisor, t) for t in sizes}) == 1:
            return divisor
        divisor //= 2
    return None


def tensor_parallel_sizes_with(vocab_size: int, divisible_by: int, padded: int) -> list[int]:
    """The TP sizes under which ``divisible_by`` pads ``vocab_size`` to ``padded`` rows."""
    return [t for t in TENSOR_PARALLEL_SIZES
            if padded_vocab_size(vocab_size, divisible_by, t) == padded]

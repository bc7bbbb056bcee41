"""FLOPs per iteration as megatron's ``--log-throughput`` counts them.

``megatron_flops(layers, hidden, heads, seq, global_batch, vocab_padded)`` calls
``megatron.training.training.num_floating_point_operations`` with a namespace holding
megatron's argument defaults for a dense GPT of that shape (the values ``validate_args``
would fill in: kv_channels, ffn_hidden_size, num_query_groups).
"""

from __future__ import annotations

import argparse


def megatron_args_for_shape(layers, hidden, heads, seq, vocab_padded, extra=()):
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_megatron_arguments(parser)
    args, _ = parser.parse_known_args(
        ["--num-layers", str(layers), "--hidden-size", str(hidden),
         "--num-attention-heads", str(heads), "--seq-length", str(seq), *extra]
    )
    args.padded_vocab_size = vocab_padded
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * hidden
    if args.kv_channels is None:
        args.kv_channels = hidden // heads
    if args.num_query_groups is None:
        args.num_query_groups = heads
    return args


def megatron_flops(layers, hidden, heads, seq, global_batch, vocab_padded) -> float:
    from megatron.training.training import num_floating_point_operations

    args = megatron_args_for_shape(layers, hidden, heads, seq, vocab_padded)
    return float(num_floating_point_operations(args, global_batch))

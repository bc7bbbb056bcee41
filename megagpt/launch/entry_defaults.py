"""The entry's own defaults and limits, as steps of the launch's resolution (each over its
planner ``p``: ``planner.Planner``)."""

from __future__ import annotations

from megagpt.command_line.arguments import ArgumentError, check_entry_limits

from .plan import Decision, Reason, Why

GPUS: Decision[int] = Decision("GPUs", int)
TOKENIZER: Decision[str] = Decision("tokenizer", str)

# A vocabulary for --mock-data runs that name no tokenizer: GPT-2's size.
MOCK_DATA_VOCAB_SIZE = 50257

# megatron 0.19 has no default --eval-interval and fails deep in training; upstream's was 1000.
EVAL_INTERVAL = 1000

DEVICE_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def planned_world(p) -> None:
    """A dry run plans for ``--dry-run-world-size`` GPUs (default: WORLD_SIZE as torchrun
    sets it, which megatron's parser has read, else 1), as rank 0 of them."""
    if not p.v.dry_run:
        return
    if p.v.dry_run_world_size is not None:
        p.set("world_size", p.v.dry_run_world_size)
    if p.v.rank != 0:
        p.set("rank", 0)
    p.choose(GPUS, p.v.world_size, Reason(Why.GIVEN, "--dry-run-world-size")
             if p.v.dry_run_world_size is not None
             else Reason(Why.ENVIRONMENT, "WORLD_SIZE, as torchrun sets it (1 where unset)"))


def default_tokenizer(p) -> None:
    """NullTokenizer for mock data and for a dry run that names no tokenizer."""
    args = p.v
    if args.tokenizer_type is not None:
        return
    if not (args.mock_data or args.dry_run):
        raise ArgumentError("--tokenizer-type is required with real data (--data-path ...); "
                            "e.g. --tokenizer-type GPT2BPETokenizer --vocab-file V --merge-file M")
    p.set("tokenizer_type", "NullTokenizer")
    if args.vocab_size is None:
        p.set("vocab_size", MOCK_DATA_VOCAB_SIZE)
    why = "mock data" if args.mock_data else "dry run without a tokenizer"
    p.choose(TOKENIZER, f"NullTokenizer, vocabulary {args.vocab_size}", Reason(Why.GIVEN, why))
    p.log(f"{why}: --tokenizer-type NullTokenizer --vocab-size {args.vocab_size}")


def refuse_what_the_entry_cannot_run(p) -> None:
    """``arguments.check_entry_limits``: what megatron accepts and this entry cannot honour."""
    check_entry_limits(p.v)


def eval_interval(p) -> None:
    if p.v.eval_interval is None:
        p.set("eval_interval", EVAL_INTERVAL)


def device_connections(p) -> None:
    """megatron orders tensor- and context-parallel communication on one hardware queue:
    ``CUDA_DEVICE_MAX_CONNECTIONS=1``, set before CUDA starts (it has not yet)."""
    tp = p.v.tensor_model_parallel_size or 1
    cp = p.v.context_parallel_size or 1
    if (tp > 1 or cp > 1) and DEVICE_CONNECTIONS not in p.environ:
        p.set_env(DEVICE_CONNECTIONS, "1")
        p.log(f"{DEVICE_CONNECTIONS}=1 (tensor/context parallelism)")

"""Complete prompts with a trained checkpoint.

    python tools/generate.py --load CKPT --prompt "To be, or not" [--prompt ...] [--max-new-tokens 64]
        [--greedy | --temperature T --top-k K --top-p P --seed S] [--json] [--cpu]
        [--prompts FILE.jsonl] [--engine auto|megatron|kv] [megatron model flags ...]

The model's shape and tokenizer come from the configuration the trainer saved beside the
checkpoint; megatron flags given after the options override it (``--tokenizer-model DIR``,
say). One GPU in bf16 (``--dtype fp32`` for full precision), or ``--cpu`` (fp32). Output:
each prompt with its completion, then one line of timing; with ``--json`` one JSON object
per prompt on stdout (``prompt``, ``completion``, ``completion_tokens``, ``prompt_tokens``)
and the timing on stderr. Without ``--greedy`` the completion is sampled from the model's
distribution at ``--temperature`` (default 1), seeded by ``--seed`` (default 1234).
Exit status 2 with one ``error:`` line for bad input, before the model is loaded.
"""

from __future__ import annotations

import argparse
import json
import sys

from megagpt.inference.generation import ENGINES
from megagpt.inference.sampling import Sampling, SamplingError

DEFAULT_SEED = 1234


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tools/generate.py", allow_abbrev=False,
        description="Complete prompts with a trained checkpoint (megatron flags after the "
                    "options override what the checkpoint saved).")
    p.add_argument("--load", required=True, metavar="CKPT",
                   help="a training run's --save directory, an iter_* folder or an imported "
                        "checkpoint")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", default=None,
                     help="the prompt text (empty: an unconditional sample from the "
                          "end-of-document token); given several times, several prompts")
    src.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                     help='one {"prompt": "..."} per line')
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--greedy", action="store_true", help="the most likely token at each step")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="sampling temperature (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample among the K most likely tokens (default: all)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample among the most likely tokens whose probability reaches P")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="sampling seed")
    p.add_argument("--ignore-eod", action="store_true",
                   help="generate --max-new-tokens tokens even past the end-of-document token")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (fp32)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="weights on the GPU (default bf16; the CPU always uses fp32)")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="megatron.core.inference's static engine, the KV decoder (CUDA graphs "
                        "on a GPU), or auto: kv on a GPU where it covers the model")
    p.add_argument("--batch-size", type=int, default=16, metavar="B",
                   help="prompts generated together (default 16)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the KV decoder's step (fewer, fused kernels per token: "
                        "faster decoding after a compile of tens of seconds)")
    return p


def sampling_from(opts) -> Sampling:
    if opts.greedy:
        given = [flag for flag, value in (("--temperature", opts.temperature),
                                          ("--top-k", opts.top_k), ("--top-p", opts.top_p))
                 if value is not None]
        if given:
            raise SamplingError(f"--greedy takes no {', '.join(given)}: it always picks the "
                                "most likely token")
        return Sampling(greedy=True, seed=opts.seed)
    return Sampling(temperature=1.0 if opts.temperature is None else opts.temperature,
                    top_k=opts.top_k or 0, top_p=1.0 if opts.top_p is None else opts.top_p,
                    seed=opts.seed)


def check_lengths(prompts, tokenizer, max_new_tokens: int, positions: int) -> None:
    """Every prompt and its new tokens must fit the model's positions."""
    from megagpt.inference.generation import prompt_ids
    from megagpt.inference.prompts import PromptError

    for prompt in prompts:
        length = len(prompt_ids(tokenizer, prompt.text))
        if length + max_new_tokens > positions:
            raise PromptError(f"{prompt.where}: {length} prompt tokens + {max_new_tokens} "
                              f"new ones exceed the model's {positions} positions")


def run(opts, overrides: list[str]) -> int:
    from megagpt.inference import loading, prompts as prompt_source
    from megagpt.inference.generation import EngineError, Generator

    if opts.max_new_tokens < 1:
        raise SamplingError(f"--max-new-tokens {opts.max_new_tokens}: must be at least 1")
    if opts.batch_size < 1:
        raise SamplingError(f"--batch-size {opts.batch_size}: must be at least 1")
    if opts.compile and (opts.cpu or opts.engine == "megatron"):
        raise EngineError("--compile compiles the KV decoder's step on a GPU; "
                          + ("--cpu runs it eagerly" if opts.cpu else
                             "--engine megatron has no such step"))
    sampling = sampling_from(opts)
    prompts = prompt_source.gather(opts.prompt, opts.prompts)
    loading.require_device(opts.cpu)
    prepared = loading.prepare(opts.load, overrides, cpu=opts.cpu, bf16=opts.dtype == "bf16")
    sampling.check(prepared.vocab_size)
    check_lengths(prompts, prepared.tokenizer, opts.max_new_tokens,
                  prepared.args.max_position_embeddings)
    with loading.loaded(prepared, seed=opts.seed) as (model, device):
        generator = Generator(model, prepared.tokenizer, prepared.vocab_size, device,
                              engine=opts.engine, batch_size=opts.batch_size,
                              compile_step=opts.compile)
        report = generator.complete([p.text for p in prompts], opts.max_new_tokens, sampling,
                                    stop_at_eod=not opts.ignore_eod)
    for completion in report.completions:
        if opts.json:
            print(json.dumps(completion.as_json(), ensure_ascii=False), flush=True)
        else:
            print(f"{completion.prompt}{completion.text}\n", flush=True)
    summary = f"[generate] {prepared.folder}: {sampling.describe()}; {report.summary()}"
    print(summary, file=sys.stderr if opts.json else sys.stdout, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from megagpt.inference.world import run_tool

    return run_tool(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Generation speed on one GPU: megagpt's two engines against transformers' generate, on the
same weights, in one invocation.

    python bench/bench_generate.py                       # 345M, prompts of 128, 256 new, batch 1 and 16
    python bench/bench_generate.py --shape tiny --new-tokens 16 --repeats 1     # a smoke run
    python bench/bench_generate.py --cpu --shape tiny ...    # the same code on the CPU (tests)

One megatron GPT of the shape (random weights, bf16; GPT-2 medium's 24 x 1024 x 16 heads
at 345M, vocabulary 50257 padded to 50304) is exported to a transformers folder the way
tools/export_hf.py writes one, and loaded back as ``GPT2LMHeadModel``. Then, for each batch
size, the same random prompts go through

  transformers  ``model.generate`` (greedy, KV cache, ``min_new_tokens`` = ``max_new_tokens``)
  megatron      tools/generate.py's ``--engine megatron`` (megatron.core.inference static engine)
  kv            tools/generate.py's ``--engine kv`` (the KV decoder, a CUDA graph per step)
  kv-compiled   the same with ``--compile`` (its step through torch.compile, then graphed)

each warmed up once (the KV decoder captures its graph there), then timed ``--repeats``
times from prompt tokens to every new token on the host, the end-of-document token ignored
(every row generates ``--new-tokens``). New tokens per second = batch x new tokens / the
fastest repeat. Also reported: for how many leading tokens each engine's greedy output
agrees with transformers' (bf16 kernels differ, so rows part eventually) and with the
other engine's. A table on stdout, everything in ``OUT/bench_generate.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SHAPES = {
    "345M": ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--seq-length", "1024", "--max-position-embeddings", "1024"],
    "tiny": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "512", "--max-position-embeddings", "512"],
}
GPT2_VOCAB = 50257
# measured for transformers 5.17 on one H200 (bench/benchmarks.md): the goal is a multiple
GOALS = {1: 10.0, 16: 5.0}


def build_model(shape: str, dtype: str, seed: int, cpu: bool):
    """(args, launch, tokenizer) for the shape's megatron GPT with random weights, GPT-2's
    vocabulary (NullTokenizer: ids only, end-of-document 50256)."""
    from megagpt.inference import model_flags

    argv = [*SHAPES[shape], "--tokenizer-type", "NullTokenizer", "--vocab-size",
            str(GPT2_VOCAB), "--seed", str(seed),
            *model_flags.device_flags(cpu=cpu, bf16=dtype == "bf16")]
    args, launch = model_flags.parse_model_args(argv, cpu=cpu)
    args.perform_initialization = True  # random weights: the arithmetic is what is timed
    return args, launch, model_flags.build_tokenizer(args)


def exported_transformers_model(model, vocab: int, eod: int, dtype: torch.dtype, device):
    """``model`` written as tools/export_hf.py writes it, read back by transformers."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    from megagpt.hf import architectures, weights
    from megagpt.hf.export_hf import write_folder
    from megagpt.inference.architecture import Architecture

    arch = Architecture.of(model)
    target = architectures.transformers_class(arch)
    tensors = weights.to_transformers(model.state_dict(), arch, target, vocab, dtype)
    config = architectures.transformers_config(arch, target, vocab, eod, eod,
                                               str(dtype).replace("torch.", ""))
    transformers_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        write_folder(folder, {k: v.cpu() for k, v in tensors.items()}, config, eod, eod)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    return hf.to(device).eval()


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run, device, repeats: int) -> tuple[float, list[list[int]]]:
    """(fastest of ``repeats`` wall times in s, the last run's new tokens)."""
    best, tokens = float("inf"), None
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        tokens = run()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best, tokens


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """(fewest, mean) leading tokens on which two engines' rows agree."""
    def prefix(x, y):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n

    counts = [prefix(x, y) for x, y in zip(a, b)]
    return min(counts), sum(counts) / len(counts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="345M")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--engines", default=None,
                   help="comma-separated; transformers is the reference of the ratios "
                        "(default transformers,megatron,kv,kv-compiled; with --cpu, where "
                        "nothing is compiled, the first three)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default="runs/bench_generate")
    p.add_argument("--cpu", action="store_true",
                   help="run on the CPU in fp32 (no CUDA graphs): checks the script, times nothing "
                        "of interest")
    p.add_argument("--profile-step", action="store_true",
                   help="also profile 10 replays of each KV engine's captured decode step: "
                        "kernels per step, their time, the costliest kernels")
    p.add_argument("--gemv-max-rows", type=int, default=None,
                   help="override kv_decoder.GEMV_MAX_ROWS (a compiled step's linear layers "
                        "run as reductions up to this many rows; 0: always cuBLAS)")
    a = p.parse_args(argv)
    if a.cpu:
        a.dtype = "fp32"
    elif not torch.cuda.is_available():
        print("error: bench_generate.py needs a CUDA GPU (or --cpu to check it)", file=sys.stderr)
        return 2
    from megagpt.inference import kv_decoder, loading
    from megagpt.inference.generation import Generator
    from megagpt.inference.sampling import Sampling
    from megagpt.inference.world import megatron_world, quiet_megatron

    quiet_megatron()
    if a.gemv_max_rows is not None:
        kv_decoder.GEMV_MAX_ROWS = a.gemv_max_rows
    engines = (a.engines or ("transformers,megatron,kv" if a.cpu else
                             "transformers,megatron,kv,kv-compiled")).split(",")
    args, launch, tokenizer = build_model(a.shape, a.dtype, a.seed, a.cpu)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    eod, greedy = int(tokenizer.eod), Sampling(greedy=True)
    prompts = torch.randint(0, GPT2_VOCAB, (max(a.batch_sizes), a.prompt_tokens),
                            generator=torch.Generator().manual_seed(a.seed)).tolist()
    rows, outputs = [], {}
    with megatron_world(args, seed=a.seed) as device:
        model = loading.build_model(args, launch).eval()
        for param in model.parameters():
            param.requires_grad_(False)
        hf = exported_transformers_model(model, GPT2_VOCAB, eod, dtype, device) \
            if "transformers" in engines else None
        for batch in a.batch_sizes:
            batch_prompts = prompts[:batch]
            for engine in engines:
                if engine == "transformers":
                    ids = torch.tensor(batch_prompts, device=device)

                    def run(n=a.new_tokens, ids=ids):
                        with torch.inference_mode():
                            out = hf.generate(ids, attention_mask=torch.ones_like(ids),
                                              max_new_tokens=n, min_new_tokens=n,
                                              do_sample=False, pad_token_id=eod)
                        return out[:, ids.shape[1]:].tolist()
                    run(8)  # warm-up
                else:
                    generator = Generator(model, tokenizer, GPT2_VOCAB, device,
                                          engine.removesuffix("-compiled"), batch,
                                          compile_step=engine.endswith("-compiled"))

                    def run(n=a.new_tokens, generator=generator, batch_prompts=batch_prompts):
                        return generator.token_ids(batch_prompts, n, greedy, stop_at_eod=False)
                    run()  # warm-up: the KV decoder captures its graph here
                seconds, tokens = timed(run, device, a.repeats)
                outputs[(engine, batch)] = tokens
                rows.append({"engine": engine, "batch": batch, "new_tokens": a.new_tokens,
                             "seconds": seconds,
                             "tokens_per_second": batch * a.new_tokens / seconds})
                print(f"  {engine:12s} batch {batch:3d}: {seconds:8.3f} s, "
                      f"{rows[-1]['tokens_per_second']:10.1f} new tokens/s", flush=True)
                if a.profile_step and engine.startswith("kv") and device.type == "cuda":
                    rows[-1]["step_profile"] = profile_step(generator._decoder, batch)
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    report(rows, outputs, engines, a, gpu)
    return 0


def profile_step(decoder, batch: int, replays: int = 10) -> dict:
    """Kernels per replay of the decoder's captured step, their time, the costliest ones."""
    from torch.profiler import ProfilerActivity, profile

    _, _, run = decoder._step(batch)
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:8]
    result = {"kernels_per_step": len(kernels) / replays,
              "kernel_us_per_step": sum(e.device_time for e in kernels) / replays,
              "top": [{"kernel": name[:90], "calls_per_step": len(t) / replays,
                       "mean_us": sum(t) / len(t)} for name, t in top]}
    print(f"    step: {result['kernels_per_step']:.0f} kernels, "
          f"{result['kernel_us_per_step']:.1f} us of kernel time")
    for k in result["top"]:
        print(f"      {k['calls_per_step']:5.0f} x {k['mean_us']:6.2f} us  {k['kernel']}")
    return result


def report(rows, outputs, engines, a, gpu) -> None:
    import megatron.core
    import transformers

    from megagpt.inference import kv_decoder

    reference = {r["batch"]: r["tokens_per_second"] for r in rows
                 if r["engine"] == "transformers"}
    print(f"\n{a.shape}, {a.dtype}, prompts of {a.prompt_tokens} tokens, {a.new_tokens} new, "
          f"fastest of {a.repeats}; {gpu}")
    print(f"{'engine':12s} {'batch':>5s} {'seconds':>9s} {'tokens/s':>10s} "
          f"{'x transformers':>15s}  agreement with transformers (fewest / mean tokens)")
    for r in rows:
        ratio = r["tokens_per_second"] / reference[r["batch"]] if r["batch"] in reference else None
        r["x_transformers"] = ratio
        agree = ""
        if ("transformers", r["batch"]) in outputs and r["engine"] != "transformers":
            low, mean = agreement(outputs[(r["engine"], r["batch"])],
                                  outputs[("transformers", r["batch"])])
            r["agreement_with_transformers"] = {"fewest": low, "mean": mean}
            agree = f"{low} / {mean:.1f}"
        ratio_text = f"{ratio:14.1f}x" if ratio else f"{'':15s}"
        print(f"{r['engine']:12s} {r['batch']:5d} {r['seconds']:9.3f} "
              f"{r['tokens_per_second']:10.1f} {ratio_text}  {agree}")
    for batch in a.batch_sizes:
        if ("kv", batch) in outputs and ("megatron", batch) in outputs:
            low, mean = agreement(outputs[("kv", batch)], outputs[("megatron", batch)])
            print(f"kv against megatron at batch {batch}: agree for {low} / {mean:.1f} tokens")
    for r in rows:
        goal = GOALS.get(r["batch"])
        if r["engine"].startswith("kv") and goal and r.get("x_transformers"):
            verdict = "met" if r["x_transformers"] >= goal else "NOT met"
            print(f"goal at batch {r['batch']}: >= {goal:g}x transformers ({r['engine']}): "
                  f"{r['x_transformers']:.1f}x, {verdict}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": gpu,
              "shape": a.shape, "dtype": a.dtype, "prompt_tokens": a.prompt_tokens,
              "new_tokens": a.new_tokens, "repeats": a.repeats, "rows": rows,
              "gemv_max_rows": kv_decoder.GEMV_MAX_ROWS,
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__,
                           "megatron-core": getattr(megatron.core, "__version__", "?")},
              "command": " ".join([os.path.relpath(__file__), *sys.argv[1:]])}
    (out / "bench_generate.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {out / 'bench_generate.json'}")


if __name__ == "__main__":
    sys.exit(main())

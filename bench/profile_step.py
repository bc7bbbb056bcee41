#!/usr/bin/env python3
"""Development benchmark: megatron's GPT training step with each fast-path piece on/off.

Builds megatron-core's GPTModel the way megatron's training loop does (bf16 Float16Module,
megatron DDP with fp32 gradient buffers, ``get_megatron_optimizer`` with fp32 master
weights, ``forward_backward_no_pipelining``) on one GPU, with random tokens, and times
forward+backward and the optimizer step separately. A variant is a base and "+" flags:

  local         megatron's local spec
  sdpa          fast spec with --fast-disable fused-layer (SDPA core attention only)
  fused-eager   fast spec, fused layer without torch.compile
  fused         fast spec, fused layer torch.compile'd
  +opt          fast optimizer (torch fused AdamW, foreach norm / scale / copies)
  +ce           chunked LM-head cross entropy (GPTModel output_processor)
  +graph        forward+backward as one CUDA graph (megatron's FullCudaGraphWrapper,
                as --cuda-graph-impl full_iteration does in megatron.training)

e.g. ``local`` is upstream's path without TE and ``fused+opt+ce+graph`` the fast path.

It is not the project's entry (``bench/bench_throughput.py`` runs that); it exists to see
where time goes without the data loader and logging. Run on a GPU:

  python bench/profile_step.py --shape 345M \
      --variants local,sdpa+opt,fused+opt+ce+graph --profile fused+opt+ce+graph --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
from functools import partial

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # megagpt, from this checkout

from reference_gpt import SHAPES  # noqa: E402

VOCAB = 50257
VOCAB_PADDED = 50304


def _init_dist(graph_rng=False):
    import torch.distributed as dist

    if dist.is_initialized():
        return
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), world_size=1, rank=0)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    # megatron.training uses the graph-safe RNG tracker whenever CUDA graphs are on
    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=graph_rng)


def _config(shape, dropout):
    from megatron.core.transformer.transformer_config import TransformerConfig

    L, h, heads, seq, mb = SHAPES[shape]
    return TransformerConfig(
        num_layers=L,
        hidden_size=h,
        num_attention_heads=heads,
        ffn_hidden_size=4 * h,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        init_method_std=0.02,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=True,
        bias_dropout_fusion=True,
        apply_query_key_layer_scaling=False,
    )


def _parts(variant):
    base, *flags = variant.split("+")
    assert base in ("local", "sdpa", "fused-eager", "fused"), variant
    assert set(flags) <= {"opt", "ce", "graph"}, variant
    return base, set(flags)


def _spec(variant):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megagpt.fast_spec.layer import FusedLayerOptions
    from megagpt.fast_spec.spec import get_fast_gpt_layer_spec

    variant, _ = _parts(variant)
    if variant == "local":
        return get_gpt_layer_local_spec()
    fused = (FusedLayerOptions.make(compile=not variant.startswith("fused-eager"))
             if variant.startswith("fused") else None)
    return get_fast_gpt_layer_spec(argparse.Namespace(fast_spec=True), fused)


def build(shape, variant, dropout):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    _, flags = _parts(variant)
    config = _config(shape, dropout)
    L, h, heads, seq, mb = SHAPES[shape]
    torch.manual_seed(1234)
    model = GPTModel(
        config,
        _spec(variant),
        vocab_size=VOCAB_PADDED,
        max_sequence_length=seq,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    model.cuda(torch.cuda.current_device())
    model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    if "graph" in flags:
        # as megatron.training does for --cuda-graph-impl full_iteration
        from megatron.core.full_cuda_graph import get_shared_capture_stream

        stream = get_shared_capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model = DistributedDataParallel(config, ddp_config, module=model)
        torch.cuda.current_stream().wait_stream(stream)
    else:
        model = DistributedDataParallel(config, ddp_config, module=model)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-4,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        bf16=True,
        params_dtype=torch.bfloat16,
        clip_grad=1.0,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync
    return config, model, optimizer


def _batch(shape):
    L, h, heads, seq, mb = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (mb, seq + 1), device="cuda", generator=g)
    return dict(
        tokens=tokens[:, :-1].contiguous(),
        labels=tokens[:, 1:].contiguous(),
        loss_mask=torch.ones(mb, seq, device="cuda"),
        attention_mask=torch.triu(
            torch.ones(mb, 1, seq, seq, dtype=torch.bool, device="cuda"), diagonal=1
        ),
        position_ids=torch.arange(seq, device="cuda").unsqueeze(0).expand(mb, -1).contiguous(),
    )


def _loss_func(loss_mask, output):
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}


_OUTPUT_PROCESSOR = {"fn": None}


def _forward_step(data_iterator, model):
    b = next(data_iterator)
    kw = {}
    if _OUTPUT_PROCESSOR["fn"] is not None:
        kw["output_processor"] = _OUTPUT_PROCESSOR["fn"]
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"], **kw)
    return out, partial(_loss_func, b["loss_mask"])


def _iterator(batch):
    while True:
        yield batch


def run_variant(shape, variant, iters, warmup, dropout, profile_dir=None, log=print):
    """One variant built and timed; with +opt megatron's optimizer modules hold the fast
    path's kernels while it is built and steps."""
    from megagpt.compat import Installed
    from megagpt.train_step import optimizer as fast_optimizer

    _, flags = _parts(variant)
    kernels = (fast_optimizer.fast_kernels(Installed.detect().megatron_fused_optimizer)
               if "opt" in flags else contextlib.nullcontext())
    with kernels:
        return _timed(shape, variant, iters, warmup, dropout, profile_dir, log)


def _timed(shape, variant, iters, warmup, dropout, profile_dir, log):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()
    L, h, heads, seq, mb = SHAPES[shape]
    t_build = time.time()
    config, model, optimizer = build(shape, variant, dropout)
    batch = _batch(shape)
    it = _iterator(batch)
    fb = get_forward_backward_func()
    _, flags = _parts(variant)
    from megagpt.fast_spec.lm_loss import fused_lm_head_loss

    _OUTPUT_PROCESSOR["fn"] = fused_lm_head_loss if "ce" in flags else None
    if "graph" in flags:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper

        fb = FullCudaGraphWrapper(fb, cuda_graph_warmup_steps=2)
        fb.reset_cuda_graph()

    def step():
        model.zero_grad_buffer()
        optimizer.zero_grad()
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        out = fb(
            forward_step_func=_forward_step,
            data_iterator=it,
            model=[model],
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=mb,
            forward_only=False,
        )
        e1.record()
        ok, grad_norm, _ = optimizer.step()
        e2.record()
        e2.synchronize()
        loss = out[0]["lm loss"]
        return e0.elapsed_time(e1), e1.elapsed_time(e2), float(loss[0] / loss[1]), grad_norm

    t0 = time.time()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warm_s = time.time() - t0
    fwdbwd, opt, losses, walls = [], [], [], []
    for _ in range(iters):
        w0 = time.perf_counter()
        a, b, loss, gn = step()
        walls.append((time.perf_counter() - w0) * 1e3)
        fwdbwd.append(a)
        opt.append(b)
        losses.append(loss)
    from megatron_flops import megatron_flops

    flops = megatron_flops(L, h, heads, seq, mb, VOCAB_PADDED)
    ms = statistics.median(walls)
    res = dict(
        path=variant,
        shape=shape,
        ms_per_iter=ms,
        fwd_bwd_ms=statistics.median(fwdbwd),
        optimizer_ms=statistics.median(opt),
        tokens_per_s=mb * seq / (ms / 1e3),
        tflops_per_gpu=flops / (ms / 1e3) / 1e12,
        peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9,
        warmup_s=warm_s,
        build_s=t0 - t_build,
        losses=losses,
    )
    log(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()
                    if k != "losses"}))
    if profile_dir:
        res["profile"] = profile(step, variant, profile_dir, log)
    if "graph" in flags:
        fb.reset_cuda_graph()
    del model, optimizer, config, fb
    return res


def profile(step, variant, out_dir, log):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof

    with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    ka = prof.key_averages()
    dev_attr = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
    busy_us = 0.0
    n_kernels = 0
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            busy_us += e.time_range.elapsed_us()
            n_kernels += 1
    table = ka.table(sort_by=dev_attr, row_limit=25)
    cpu_table = ka.table(sort_by="self_cpu_time_total", row_limit=25)
    name = variant.replace("+", "_")
    with open(os.path.join(out_dir, f"prof_{name}.txt"), "w") as f:
        f.write(f"wall {wall_ms:.1f} ms for 3 iterations; GPU busy {busy_us/1e3:.1f} ms; "
                f"{n_kernels} kernels\n\n")
        f.write(table)
        f.write("\n\nby self CPU time\n")
        f.write(cpu_table)
    summary = dict(wall_ms=wall_ms / 3, gpu_busy_ms=busy_us / 1e3 / 3, kernels=n_kernels / 3)
    log(f"profile {variant}: {json.dumps(summary)}")
    top = sorted(ka, key=lambda e: -getattr(e, dev_attr))[:12]
    for e in top:
        log(f"  {getattr(e, dev_attr)/1e3/3:8.2f} ms/iter  x{e.count//3:5d}  {e.key[:90]}")
    return summary


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="345M", choices=sorted(SHAPES))
    p.add_argument("--variants", default="local,sdpa+opt,fused-eager+opt+ce,fused+opt+ce+graph")
    p.add_argument("--profile", default="", help="comma-separated variants to profile")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args(argv)
    _init_dist(graph_rng=any("+graph" in v for v in a.variants.split(",")))
    prof = set(filter(None, a.profile.split(",")))
    results = []
    for v in a.variants.split(","):
        try:
            results.append(run_variant(a.shape, v, a.iters, a.warmup, a.dropout,
                                       a.out if v in prof else None))
        except Exception as e:  # keep going: one failing variant must not hide the others
            import traceback

            traceback.print_exc()
            results.append(dict(path=v, shape=a.shape, error=repr(e)[:500]))
    with open(os.path.join(a.out, f"profile_step_{a.shape}.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{'variant':18s} {'ms/it':>8s} {'fwd+bwd':>8s} {'opt':>7s} {'TFLOP/s':>8s} {'GB':>6s}")
    for r in results:
        if "losses" in r:
            print(f"  {r['path']:16s} first losses {[round(x, 4) for x in r['losses'][:6]]}")
    for r in results:
        if "error" in r:
            print(f"{r['path']:18s} ERROR {r['error'][:100]}")
        else:
            print(f"{r['path']:18s} {r['ms_per_iter']:8.1f} {r['fwd_bwd_ms']:8.1f} "
                  f"{r['optimizer_ms']:7.1f} {r['tflops_per_gpu']:8.1f} {r['peak_mem_gb']:6.1f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Plain-PyTorch GPT of the same shape and FLOP count as megatron's GPT, for comparison.

The yardstick of the fast path: what one GPU does without megatron — torch SDPA (flash/cuDNN),
fp32 master parameters under bf16 autocast, fused AdamW, ``torch.compile`` of the model.
Same architecture as megatron's default GPT: learned absolute positions, pre-LayerNorm,
fused QKV with biases, GeLU (tanh approximation, as megatron's bias-GeLU fusion), 4h MLP,
final LayerNorm, output layer tied to the word embedding, vocabulary padded to a
multiple of 128, dropout 0.1 on attention and hidden states by default (megatron's
defaults), gradient clipping at 1.0, fused AdamW (betas 0.9, 0.95; weight decay 0.1 on all
parameters, where megatron exempts biases and norms: the same arithmetic either way).

FLOPs per iteration are megatron's count (``num_floating_point_operations``) for this
shape, written out for a dense GPT with multi-head attention; ``bench_throughput.py``
checks it against megatron's own function.

``--fp8 tensorwise`` (or ``rowwise``) is what a torchtitan user turns on for FP8: torchao's
``convert_to_float8_training`` over the blocks' linears (the tied output layer is no
``nn.Linear`` and stays in bf16), recipe by name; it needs torchao importable.

Prints one JSON line: {"path": "reference", "ms_per_iter": ..., "tokens_per_s": ...,
"tflops_per_gpu": ..., "peak_mem_gb": ..., "losses": [...]}.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

SHAPES = {
    # name: (layers, hidden, heads, seq, micro-batch)
    "345M": (24, 1024, 16, 1024, 8),
    "1.3B": (24, 2048, 16, 2048, 4),
    # a wide shape where matmuls dominate (FP8's case): 8 layers of a 6.7B-wide model
    "wide": (8, 4096, 32, 4096, 1),
}


def megatron_flops(layers, hidden, heads, seq, batch, vocab_padded, ffn=None) -> float:
    """megatron's num_floating_point_operations for a dense MHA GPT (no GLU, no MoE/MTP)."""
    ffn = ffn or 4 * hidden
    tokens = batch * seq
    per_token = layers * (24 * hidden * hidden + 12 * hidden * ffn) + 6 * hidden * vocab_padded
    core = 6 * hidden * layers * batch * seq * seq  # causal QK^T and PV, fwd + bwd
    return float(tokens * per_token + core)


def pad_vocab(vocab: int, multiple: int = 128) -> int:
    return int(math.ceil(vocab / multiple) * multiple)


class Block(nn.Module):
    def __init__(self, h, heads, attn_p, hidden_p):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)
        self.attn_p, self.hidden_p = attn_p, hidden_p

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.attn_p if self.training else 0.0
        )
        o = o.transpose(1, 2).reshape(b, s, h)
        x = x + F.dropout(self.proj(o), self.hidden_p, self.training)
        m = self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))
        return x + F.dropout(m, self.hidden_p, self.training)


class GPT(nn.Module):
    def __init__(self, layers, h, heads, seq, vocab, attn_p=0.1, hidden_p=0.1):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(seq, h)
        self.drop = nn.Dropout(hidden_p)
        self.blocks = nn.ModuleList(Block(h, heads, attn_p, hidden_p) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        for n, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if n.endswith(("proj.weight", "fc2.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif n.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, labels):
        s = idx.size(1)
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(s, device=idx.device)))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied output layer
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1))


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def to_float8_training(model: nn.Module, recipe: str) -> nn.Module:
    """torchao's FP8 training for every ``nn.Linear`` of ``model`` (as torchtitan converts a
    model's linears), ``recipe`` one of torchao's recipe names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, fqn: isinstance(module, nn.Linear))


def run(shape="345M", iters=40, warmup=10, vocab=50257, dropout=0.1, compile_model=True,
        seed=1234, clip_grad=1.0, log=_log, fp8: str | None = None) -> dict:
    layers, h, heads, seq, mb = SHAPES[shape]
    vpad = pad_vocab(vocab)
    torch.manual_seed(seed)
    dev = "cuda"
    model = GPT(layers, h, heads, seq, vpad, dropout, dropout).to(dev)
    if fp8:
        import torchao

        model = to_float8_training(model, fp8)
        log(f"reference: torchao {torchao.__version__} FP8 training, recipe {fp8}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    step_model = torch.compile(model) if compile_model else model
    g = torch.Generator(device=dev).manual_seed(seed)
    tokens = torch.randint(0, vocab, (mb, seq + 1), device=dev, generator=g)
    idx, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(idx, labels)
        loss.backward()
        if clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad, foreach=True)
        opt.step()
        return loss

    losses, times = [], []
    t0 = time.time()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    log(f"reference: warm-up ({warmup} iterations, compile included) {time.time() - t0:.1f} s")
    torch.cuda.reset_peak_memory_stats()
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        loss = step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
        losses.append(loss.item())
    ms = statistics.median(times)
    flops = megatron_flops(layers, h, heads, seq, mb, vpad)
    return {
        "path": "reference",
        "shape": shape,
        "ms_per_iter": ms,
        "tokens_per_s": mb * seq / (ms / 1e3),
        "tflops_per_gpu": flops / (ms / 1e3) / 1e12,
        "flops_per_iter": flops,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9,
        "peak_mem_mib": torch.cuda.max_memory_allocated() / 2**20,
        "losses": losses,
        "dropout": dropout,
        "compile": compile_model,
        "fp8": fp8,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="345M")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--fp8", choices=("tensorwise", "rowwise"), default=None,
                   help="torchao's FP8 training of the linears, this recipe")
    a = p.parse_args(argv)
    r = run(a.shape, a.iters, a.warmup, dropout=a.dropout, compile_model=not a.no_compile,
            fp8=a.fp8)
    print(json.dumps(r))


if __name__ == "__main__":
    main()

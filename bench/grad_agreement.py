#!/usr/bin/env python3
"""One step's gradients of the fast spec's layers and of megatron's local layers, each in bf16
against the same weights in fp32, parameter by parameter (one GPU; the CPU for a smoke run).

A loss curve that parts from megatron's can be the layers' arithmetic or anything after it
(the loss, the optimizer, the step). This takes the layers alone: one GPTModel per path built
from the same weights (megatron's local spec; the fast spec's fused layer run eagerly and
compiled, as the launch compiles it), one batch of tokens, the per-token losses summed, and
every parameter's gradient compared with the fp32 local model's (TF32 off):

  rel err   ||g - g32|| / ||g32|| over the parameter kind's elements (all layers together)
  sign      the share of elements whose sign differs from fp32's, among those above 1e-3 of
            the kind's largest: Adam's first steps move each element by about the learning
            rate in its gradient's sign, so a wrong sign is a wrong step of full size
  adam sign the same among every element above Adam's eps (1e-8): each of them takes a
            step of full size in Adam's first steps, the smallest with the sign rounding gave

Kinds: the parameter's name with its layer number taken out (``decoder.layers.N.mlp.
linear_fc1.weight`` -> ``mlp.linear_fc1.weight``).

  python bench/grad_agreement.py [--shape 345M] [--layers 4]
                                 [--paths local,fast,fast-compiled,fast-compiled@flash,...]
                                 [--inductor KEY=VALUE ...] [--json OUT]

A fast path's attention kernels are torch's pick unless ``@BACKEND`` follows its name
(megatron's ``--attention-backend``: flash, fused = cuDNN's, unfused = the math kernel).
``--inductor`` sets ``torch._inductor.config`` entries for the compiled path (e.g.
``triton.mix_order_reduction=False``), for telling which of the compiler's choices matters.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_info import run_info  # noqa: E402

# hidden, heads, seq, micro-batch (bench_layer.py's shapes); the vocabulary is GPT-2's, padded
SHAPES = {"345M": (1024, 16, 1024, 8), "1.3B": (2048, 16, 2048, 4), "tiny": (64, 4, 32, 2)}
VOCAB = 50304
PATHS = ("local", "fast", "fast-compiled")
# a fast path's attention kernels, as --attention-backend narrows them (sdpa_kernels.py):
# "fast-compiled@flash"; without a suffix torch picks (cuDNN's kernel on an H100 or H200)
BACKENDS = ("auto", "flash", "fused", "unfused")
ADAM_EPS = 1e-8  # megatron's --adam-eps default


def _parallel_state(device: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)
    parallel_state.initialize_model_parallel()
    if device == "cuda":
        model_parallel_cuda_manual_seed(1234)
        return
    # (the inference tracker keeps its states off torch.cuda)
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True, force_reset_rng=True)
    # a smoke run on the CPU: megatron's local attention takes its scores' buffer, and its
    # rotary and RNG code the device, from torch.cuda (two stand-ins of its own, not
    # megagpt.cpu_mode.active(), which also turns torch.compile off: the compiled layer is
    # one of the paths compared)
    import functools
    import operator

    import megatron.core.utils as mutils

    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        return torch.empty(functools.reduce(operator.mul, shape, 1), dtype=dtype).view(*shape)

    mutils.GlobalMemoryBuffer.get_tensor = get_tensor
    torch.cuda.current_device = lambda: "cpu"


def _config(hidden: int, heads: int, layers: int, bf16: bool, backend: str = "auto"):
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    # the entry's GPT settings without TE or apex: bias-GeLU and bias-dropout fusions on
    return TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                             hidden_dropout=0.0, attention_dropout=0.0, bf16=bf16,
                             params_dtype=dtype, pipeline_dtype=dtype,
                             use_cpu_initialization=True, masked_softmax_fusion=False,
                             persist_layer_norm=False, gradient_accumulation_fusion=False,
                             bias_activation_fusion=True, bias_dropout_fusion=True,
                             attention_backend=AttnBackend[backend])


def _fast_spec(compiled: bool):
    from megagpt.fast_spec.layer import FusedLayerOptions
    from megagpt.fast_spec.spec import get_fast_gpt_layer_spec

    args = argparse.Namespace(fast_spec=True, fast_spec_fused_layer=True,
                              fast_spec_compile=compiled, normalization="LayerNorm",
                              qk_layernorm=False, num_experts=None, reset_attention_mask=False,
                              context_parallel_size=1)
    return get_fast_gpt_layer_spec(args, FusedLayerOptions.make(compile=compiled))


def build(path: str, shape: tuple, layers: int, bf16: bool, state: dict | None,
          device: str):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module

    hidden, heads, seq, _ = shape
    path, _, backend = path.partition("@")
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        # megatron's model build sets TE's switches from the backend and stops on others
        os.environ.pop(name, None)
    config = _config(hidden, heads, layers, bf16, backend or "auto")
    spec = get_gpt_layer_local_spec() if path == "local" else _fast_spec(path == "fast-compiled")
    torch.manual_seed(0)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=seq,
                     position_embedding_type="learned_absolute")
    if state is not None:
        model.load_state_dict(state, strict=True)
    model = model.to(device)
    return Float16Module(config, model) if bf16 else model


def gradients(model, batch) -> tuple[float, dict]:
    tokens, labels = batch
    s = tokens.shape[1]
    pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=tokens.device), 1)
    model.zero_grad(set_to_none=True)
    losses = model(tokens, pos, mask, labels=labels)
    loss = losses.float().mean()
    loss.backward()
    # (a Float16Module's names start with "module.")
    return loss.item(), {n.removeprefix("module."): p.grad.detach().float()
                         for n, p in model.named_parameters() if p.grad is not None}


def kind_of(name: str) -> str:
    return re.sub(r"^decoder\.layers\.\d+\.", "", name)


def compare(grads: dict, ref: dict) -> dict:
    """Per kind: the relative error and the share of wrong signs against ``ref``."""
    by_kind = defaultdict(list)
    for name in ref:
        by_kind[kind_of(name)].append(name)
    out = {}
    for kind, names in sorted(by_kind.items()):
        missing = [n for n in names if n not in grads]
        if missing:
            out[kind] = {"missing": len(missing)}
            continue
        diff = sum(float((grads[n] - ref[n]).pow(2).sum()) for n in names) ** 0.5
        norm = sum(float(ref[n].pow(2).sum()) for n in names) ** 0.5
        top = max(float(ref[n].abs().max()) for n in names)
        big = wrong = moved = moved_wrong = 0
        for n in names:
            differs = torch.sign(grads[n]) != torch.sign(ref[n])
            above = ref[n].abs() > 1e-3 * top
            big += int(above.sum())
            wrong += int((above & differs).sum())
            # Adam's first steps move every element whose gradient is above its eps by about
            # the learning rate, however small the gradient: a wrong sign there is a full step
            # the wrong way, and rounding decides the signs of the smallest
            steps = ref[n].abs() > ADAM_EPS
            moved += int(steps.sum())
            moved_wrong += int((steps & differs).sum())
        out[kind] = {"rel_err": diff / norm if norm else float("nan"),
                     "sign_wrong": wrong / big if big else 0.0,
                     "adam_sign_wrong": moved_wrong / moved if moved else 0.0}
    return out


def _inductor_settings(pairs: list[str]) -> None:
    import torch._inductor.config as inductor

    for pair in pairs:
        key, _, value = pair.partition("=")
        target = inductor
        *parents, leaf = key.split(".")
        for parent in parents:
            target = getattr(target, parent)
        if not hasattr(target, leaf):
            sys.exit(f"error: --inductor {key}: torch._inductor.config has no such entry")
        setattr(target, leaf, ast.literal_eval(value))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="345M", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    paths = [x for x in a.paths.split(",") if x]
    for path in paths:
        name, at, backend = path.partition("@")
        if name not in PATHS or (at and (name == "local" or backend not in BACKENDS)):
            p.error(f"--paths: {path!r}: a path is one of {', '.join(PATHS)}, a fast one "
                    f"with @BACKEND after it ({', '.join(BACKENDS)})")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and any(path.endswith("@fused") for path in paths):
        p.error("--paths: @fused is cuDNN's attention, which runs on NVIDIA GPUs only")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    _inductor_settings(a.inductor)
    _parallel_state(device)

    shape = SHAPES[a.shape]
    hidden, heads, seq, batch = shape
    g = torch.Generator().manual_seed(a.seed)
    tokens = torch.randint(0, 50257, (batch, seq), generator=g).to(device)
    labels = torch.roll(tokens, -1, dims=1)

    ref_model = build("local", shape, a.layers, False, None, device)
    state = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
             for k, v in ref_model.state_dict().items()}
    ref_loss, ref = gradients(ref_model, (tokens, labels))
    del ref_model
    print(f"shape {a.shape}, {a.layers} layers, hidden {hidden}, seq {seq}, micro-batch {batch},"
          f" {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), torch "
          f"{torch.__version__}; fp32 local loss {ref_loss:.6f}")
    report = {"shape": a.shape, "layers": a.layers, "fp32_loss": ref_loss,
              "inductor": a.inductor, "info": run_info(), "paths": {}}
    for path in paths:
        model = build(path, shape, a.layers, True, state, device)
        loss, grads = gradients(model, (tokens, labels))
        del model
        report["paths"][path] = {"loss": loss, "kinds": compare(grads, ref)}
        if device == "cuda":
            torch.cuda.empty_cache()
    kinds = sorted(next(iter(report["paths"].values()))["kinds"]) if paths else []
    print(f"{'kind':44s}" + "".join(f"{p + ' rel err':>22s}{'sign':>8s}{'adam':>8s}"
                                     for p in paths))
    for kind in kinds:
        row = f"{kind:44s}"
        for path in paths:
            r = report["paths"][path]["kinds"][kind]
            row += (f"{r['rel_err']:22.3e}{100 * r['sign_wrong']:7.2f}%"
                    f"{100 * r['adam_sign_wrong']:7.2f}%" if "rel_err" in r
                    else f"{'missing':>38s}")
        print(row)
    print("loss (bf16): " + ", ".join(f"{p} {report['paths'][p]['loss']:.6f}" for p in paths))
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

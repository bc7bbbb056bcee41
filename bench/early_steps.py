#!/usr/bin/env python3
"""The loss each path's bf16 forward gives at the weights two Adam steps from initialisation,
against fp32's: where two implementations of one layer part in bf16 (CPU or one GPU).

Early in training every bias is about as small as the learning rate (Adam moves each element
by about it, 1e-5 in a warm-up): smaller than half a unit in the last place of the bf16
activations it is added to. Whether such a bias reaches the residual stream depends on where
an implementation rounds, and a loss curve that parts from megatron's at the third iteration
(the first taken after a step of non-zero learning rate, megatron's warm-up starting at 0)
can be that rather than the gradients. This separates the two: one fp32 model takes two Adam
steps (learning rates 0 and ``--lr``/``--warmup``, as megatron's linear warm-up gives them;
clip 1.0) from its own fp32 gradients, and each path's bf16 model (megatron's local layers,
the fast spec's fused layer eager and compiled) computes the loss of a third batch at those
weights, rounded to bf16 as megatron's optimizer copies them; and, to tell the gradients'
part, the fp32 loss after the same two steps taken from each path's bf16 gradients.

    python bench/early_steps.py [--hidden 256 --heads 4 --layers 4 --seq 128 --batch 8]
                                [--paths local,fast,fast-compiled] [--json OUT]

Tokens: the embedded corpus (GPT-2 BPE Shakespeare), batches drawn with ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import grad_agreement as ga  # noqa: E402
from run_info import run_info  # noqa: E402


def corpus_tokens() -> torch.Tensor:
    """Every token of the embedded corpus, in order."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megagpt.data.corpus import ensure_embedded_dataset

    ds = IndexedDataset(ensure_embedded_dataset().prefix)
    return torch.from_numpy(np.concatenate([ds[i] for i in range(len(ds))]).astype("int64"))


def batches(tokens: torch.Tensor, n: int, batch: int, seq: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
        rows = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()]).to(device)
        out.append((rows[:, :-1], rows[:, 1:]))
    return out


def adam_steps(model, grads: list[dict], lrs: list[float]) -> dict:
    """``model``'s state after Adam steps with ``grads`` at ``lrs`` (megatron's defaults for
    GPT: betas 0.9 / 0.95, eps 1e-8, gradients clipped to norm 1; no weight decay, which
    moves nothing this early)."""
    params = dict(model.named_parameters())
    names = list(grads[0])
    opt = torch.optim.AdamW([params[n] for n in names], lr=0.0, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    for gr, lr in zip(grads, lrs):
        for n in names:
            params[n].grad = gr[n].to(params[n].dtype).clone()
        torch.nn.utils.clip_grad_norm_([params[n] for n in names], 1.0)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def loss_at(model, state: dict, batch) -> float:
    inner = getattr(model, "module", model)  # a Float16Module rounds what it loads to bf16
    inner.load_state_dict(state, strict=False)
    tokens, labels = batch
    s = tokens.shape[1]
    pos = torch.arange(s, device=tokens.device).unsqueeze(0).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=tokens.device), 1)
    with torch.no_grad():
        return float(model(tokens, pos, mask, labels=labels).float().mean())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--paths", default="local,fast,fast-compiled")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    paths = [x for x in a.paths.split(",") if x]
    unknown = [x for x in paths if x not in ga.PATHS]
    if unknown:
        p.error(f"--paths: {', '.join(unknown)}: a path is one of {', '.join(ga.PATHS)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ga._parallel_state(device)
    shape = (a.hidden, a.heads, a.seq, a.batch)
    data = batches(corpus_tokens(), 3, a.batch, a.seq, a.seed, device)

    ref = ga.build("local", shape, a.layers, False, None, device)
    init = {k: v.detach().clone() for k, v in ref.state_dict().items() if torch.is_tensor(v)}
    grads = [ga.gradients(ref, b)[1] for b in data[:2]]
    stepped = adam_steps(ref, grads, [0.0, a.lr / a.warmup])
    report = {"shape": dict(hidden=a.hidden, heads=a.heads, layers=a.layers, seq=a.seq,
                            batch=a.batch),
              "lrs": [0.0, a.lr / a.warmup], "device": device, "info": run_info(),
              "fp32": {"init": loss_at(ref, init, data[2]),
                       "stepped": loss_at(ref, stepped, data[2])}, "paths": {}}
    for path in paths:
        model = ga.build(path, shape, a.layers, True, init, device)
        report["paths"][path] = {"init": loss_at(model, init, data[2]),
                                 "stepped": loss_at(model, stepped, data[2])}
        # the same two steps from this path's bf16 gradients, the loss in fp32: what the
        # gradients' rounding alone does
        getattr(model, "module", model).load_state_dict(init, strict=False)
        grads16 = [ga.gradients(model, b)[1] for b in data[:2]]
        del model
        ref.load_state_dict(init, strict=False)
        report["paths"][path]["fp32_after_its_gradients"] = loss_at(
            ref, adam_steps(ref, grads16, [0.0, a.lr / a.warmup]), data[2])
    ref32 = report["fp32"]
    print(f"hidden {a.hidden}, {a.heads} heads, {a.layers} layers, seq {a.seq}, batch {a.batch}, "
          f"{device}, torch {torch.__version__}; learning rates 0 and {a.lr / a.warmup:g}")
    print(f"{'path':20s}{'loss at init':>14s}{'vs fp32':>10s}{'two steps on':>14s}"
          f"{'vs fp32':>10s}{'its gradients':>15s}")
    print(f"{'fp32':20s}{ref32['init']:14.5f}{'':>10s}{ref32['stepped']:14.5f}")
    for path, r in report["paths"].items():
        r["init_vs_fp32"] = r["init"] / ref32["init"] - 1
        r["stepped_vs_fp32"] = r["stepped"] / ref32["stepped"] - 1
        r["its_gradients_vs_fp32"] = r["fp32_after_its_gradients"] / ref32["stepped"] - 1
        print(f"{path + ' bf16':20s}{r['init']:14.5f}{r['init_vs_fp32']:+10.1e}"
              f"{r['stepped']:14.5f}{r['stepped_vs_fp32']:+10.1e}"
              f"{r['its_gradients_vs_fp32']:+15.1e}")
    print("(its gradients: the fp32 loss after the two steps taken from the path's bf16 "
          "gradients)")
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""With NVIDIA apex installed, alone and beside Transformer Engine, as NVIDIA's PyTorch
containers ship them: launches train, say once what they take from apex, and checkpoints cross
between apex, plain and TE installs (skipped without apex and a CUDA GPU).

Real launches of a tiny bf16 GPT on mock data. An install is the same interpreter with some
folders left off PYTHONPATH: "plain" without apex and TE, "apex" without TE, "te" without
apex, "apex_te" with both; one whose package sits in the interpreter's own site-packages
cannot be hidden, and its cases skip. bench/gpu_record_apex.sh runs this file on the GPU
machine with apex (bench/gpu_apex_build.sh) and, where it was built, TE on PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from helpers import fetched_or_skip, parse_losses, run_entry, run_tool

pytestmark = [
    pytest.mark.apex_gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("amp_C") is None
                       or importlib.util.find_spec("apex") is None,
                       reason="needs NVIDIA apex built (bench/gpu_apex_build.sh)"),
]

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
APEX_LINE = "apex: what this launch takes from it:"

TINY = ["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
        "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-iters", "0", "--bf16",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7"]
# eager: what is tested is which kernels and checkpoints meet, not the compiled layer again
EAGER = ["--fast-cuda-graphs", "none", "--fast-compile", "off"]


def _site_of(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin).resolve()
    # a package's folder is its __init__'s parent; a compiled module sits in the site itself
    return origin.parent.parent if origin.name == "__init__.py" else origin.parent


def install_env(name: str) -> dict:
    """PYTHONPATH for install ``name`` (plain, apex, te, apex_te); skips where it cannot be
    made from this process's."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    te = _site_of("transformer_engine")
    if "te" in name.split("_") and te is None:
        pytest.skip("needs Transformer Engine")
    hide = {"plain": ("amp_C", "apex", "transformer_engine"), "apex": ("transformer_engine",),
            "te": ("amp_C", "apex"), "apex_te": ()}[name]
    folders = {_site_of(m) for m in hide} - {None}
    kept = [p for p in paths if Path(p).resolve() not in folders]
    still = [m for m in hide if importlib.util.find_spec(m) is not None
             and _site_of(m) not in {Path(p).resolve() for p in paths}]
    if still:
        pytest.skip(f"{', '.join(still)} installed in the interpreter itself: cannot hide it")
    return {"PYTHONPATH": os.pathsep.join(kept)}


def why(text: str) -> str:
    """A failed launch's log: its first lines naming an error, then its end."""
    first = [line for line in text.splitlines()
             if any(word in line for word in ("error", "Error", "ERROR", "Traceback"))][:25]
    return "\n".join(first) + "\n...\n" + text[-2500:]


def trained(out, iterations) -> dict[int, float]:
    """The losses of a launch that must have trained ``iterations`` without a traceback."""
    assert out.returncode == 0 and "Traceback" not in out.stdout, why(out.stdout)
    losses = parse_losses(out.stdout)
    assert sorted(losses) == list(iterations), why(out.stdout)
    assert all(map(math.isfinite, losses.values())), losses
    return losses


def apex_line(text: str) -> str:
    lines = [line for line in text.splitlines() if APEX_LINE in line]
    assert len(lines) == 1, f"{len(lines)} apex lines\n{why(text)}"
    return lines[0]


# Each shipped config cut to one GPU and a few steps (as the TE tests cut them)
ONE_GPU_FEW_STEPS = ["--num-layers", "2", "--tensor-model-parallel-size", "1",
                     "--pipeline-model-parallel-size", "1", "--micro-batch-size", "1",
                     "--global-batch-size", "2", "--train-iters", "3", "--lr-warmup-iters", "0",
                     "--eval-iters", "0", "--log-interval", "1", "--mock-data",
                     "--vocab-size", "512"]


@pytest.mark.parametrize("install", ["apex", "apex_te"])
@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_shipped_config_trains_with_apex(tmp_path, config, install):
    out = run_entry(["--config", str(config), *ONE_GPU_FEW_STEPS], cwd=tmp_path,
                    env=install_env(install), timeout=600)
    trained(out, [1, 2, 3])
    apex_line(out.stdout)


# flags -> what the apex line must say is taken (a fragment before "Installed, not taken")
LAYER_CHOICES = [
    ("apex", [], "amp_C multi-tensor kernels"),
    ("apex", ["--use-distributed-optimizer"], "FusedAdam (the distributed optimizer's Adam)"),
    ("apex", ["--fast-disable", "optimizer"], "FusedAdam (megatron's Adam)"),
    ("apex", ["--transformer-impl", "local", "--no-fast-spec"],
     "FusedLayerNorm (fused_layer_norm_cuda) (megatron's local spec's LayerNorms"),
    # a hidden size apex's persistent kernel has: left (measured slower) unless asked for
    ("apex", ["--spec", "local", "--attention-backend", "local", "--hidden-size", "1024",
              "--num-attention-heads", "8"],
     "megatron's local spec's LayerNorms; persistent kernel: apex's persistent kernel measured "
     "slower"),
    ("apex", ["--spec", "local", "--attention-backend", "local", "--hidden-size", "1024",
              "--num-attention-heads", "8", "--persist-layer-norm"],
     "persistent layer norm (fast_layer_norm) (megatron's local spec's LayerNorms)"),
    ("apex", ["--fast-disable", "lm-loss"], "gradient-accumulation fusion in the output layer"),
    ("apex", ["--apply-layernorm-1p"], "FusedLayerNorm"),
    # the fast spec beside TE: megatron takes TE's optimizer kernels first
    ("apex_te", [], "takes from it: nothing"),
    ("apex_te", ["--transformer-impl", "transformer_engine"],
     "gradient-accumulation fusion in the output layer"),
    ("apex_te", ["--transformer-impl", "transformer_engine", "--use-distributed-optimizer"],
     "gradient-accumulation fusion in the output layer"),
    ("apex_te", ["--transformer-impl", "local", "--no-fast-spec"], "FusedLayerNorm"),
]


@pytest.mark.parametrize("install,flags,takes", LAYER_CHOICES,
                         ids=[f"{i}:{' '.join(f) or 'default'}" for i, f, _ in LAYER_CHOICES])
def test_every_layer_choice_trains_with_apex(tmp_path, install, flags, takes):
    out = run_entry([*TINY, "--train-iters", "4", *flags], cwd=tmp_path,
                    env=install_env(install), timeout=600)
    trained(out, [1, 2, 3, 4])
    line = apex_line(out.stdout)
    assert takes in line.split(". Installed, not taken:")[0], line


def _run(tmp_path, name: str, install: str, until: int, flags=()) -> tuple[Path, dict]:
    """Iterations up to ``until`` of a six-iteration run under ``install``, saved at
    iteration 3 into (and resumed from) ``tmp_path/name``."""
    ckpt = tmp_path / name
    out = run_entry([*TINY, *EAGER, "--train-iters", "6", "--exit-interval", str(until),
                     "--save", str(ckpt), "--save-interval", "3", "--load", str(ckpt), *flags],
                    cwd=tmp_path, env=install_env(install), timeout=600)
    assert out.returncode == 0 and "Traceback" not in out.stdout, why(out.stdout)
    return ckpt, parse_losses(out.stdout)


def _greedy(tmp_path, ckpt, install: str, *flags) -> list[int]:
    run = run_tool("generate", ["--load", str(ckpt), "--prompt", "1 2 3 4 5", "--greedy",
                                "--json", "--max-new-tokens", "16", "--ignore-eod",
                                "--dtype", "fp32", "--engine", "megatron", *flags],
                   cwd=tmp_path, env=install_env(install))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)["completion_tokens"]


DISTRIBUTED = ["--use-distributed-optimizer"]
# the distributed optimizer's state by parameter rather than by gradient bucket: the format
# that loads under other layers (TE's and the fast spec's fill their buckets differently)
BY_PARAMETER = DISTRIBUTED + ["--dist-ckpt-optim-fully-reshardable"]
TE_LAYERS = ["--transformer-impl", "transformer_engine"]
LOCAL_SPEC = ["--transformer-impl", "local", "--no-fast-spec"]
# (trained under, its flags, resumed under, its flags)
CROSSINGS = [
    ("apex", [], "plain", []),
    ("plain", [], "apex", []),
    ("apex", DISTRIBUTED, "plain", DISTRIBUTED),  # apex's FusedAdam's layout to torch's Adam
    ("plain", DISTRIBUTED, "apex", DISTRIBUTED),
    ("apex", LOCAL_SPEC, "plain", []),  # apex's FusedLayerNorm to the fast spec's torch norm
    ("apex_te", TE_LAYERS + BY_PARAMETER, "apex", BY_PARAMETER),
    ("apex", BY_PARAMETER, "te", TE_LAYERS + BY_PARAMETER),
    # megatron's default format, by gradient bucket: the fast path keeps float32 gradients
    # where it saves or resumes it (fast_path_reasons), as TE's layers do
    ("apex_te", TE_LAYERS + DISTRIBUTED, "apex", DISTRIBUTED),
    ("apex", DISTRIBUTED, "te", TE_LAYERS + DISTRIBUTED),
]


@pytest.mark.parametrize("before,before_flags,after,after_flags", CROSSINGS,
                         ids=[f"{b}{' ' + ' '.join(bf) if bf else ''}->{a}"
                              f"{' ' + ' '.join(af) if af else ''}"
                              for b, bf, a, af in CROSSINGS])
def test_checkpoints_cross_between_installs(tmp_path, before, before_flags, after, after_flags):
    """Saved at iteration 3 under one install, resumed under another: iterations 4-6 within
    bf16 rounding of two sets of kernels of the uninterrupted run, and the checkpoint's greedy
    tokens (fp32) the same under both."""
    _, uninterrupted = _run(tmp_path, "whole", before, 6, before_flags)
    moved, _ = _run(tmp_path, "moved", before, 3, before_flags)
    tokens_before = _greedy(tmp_path, moved, before)
    _, after_move = _run(tmp_path, "moved", after, 6, after_flags)
    assert sorted(after_move) == [4, 5, 6], after_move
    worst = max(abs(after_move[i] - uninterrupted[i]) / uninterrupted[i] for i in (4, 5, 6))
    print(f"{before} -> {after}: largest relative loss difference {worst:.2e}")
    assert worst < 2e-2, (after_move, uninterrupted)
    assert _greedy(tmp_path, moved / "iter_0000003", after) == tokens_before


def test_bf16_gradient_buckets_crossing_to_tes_layers_is_one_line(tmp_path):
    """megatron's default format of the distributed optimizer names its buckets by their
    parameter and gradient dtypes: bf16 gradient buckets (the fast path saved them on one GPU
    before it kept float32 ones for this format) against TE's float32 ones is one error line
    before TE's layers are built, naming the ways out (on an H100 it was megatron's bare
    AssertionError after the build)."""
    moved, _ = _run(tmp_path, "moved", "apex", 3, DISTRIBUTED + ["--grad-reduce-in-bf16"])
    out = run_entry([*TINY, *EAGER, "--train-iters", "6", "--load", str(moved), *TE_LAYERS,
                     *DISTRIBUTED], cwd=tmp_path, env=install_env("te"), timeout=600)
    errors = [line for line in out.stdout.splitlines() if line.startswith("error:")]
    assert out.returncode != 0 and "Traceback" not in out.stdout, why(out.stdout)
    assert len(errors) == 1 and "saved its state by gradient bucket" in errors[0], errors
    assert "bfloat16/bfloat16 (parameters/gradients) there and bfloat16/float32 here" in errors[0]
    assert "--no-load-optim" in errors[0] and "--dist-ckpt-optim-fully-reshardable" in errors[0]


def test_an_apex_checkpoint_generates_and_exports_under_every_install(tmp_path):
    """Trained with apex (the default launch, GPT-2's tokenizer): its greedy tokens are the
    same with apex, without it, beside TE, on the CPU, and from the Hugging Face folder it
    exports with apex installed."""
    from megagpt.data.gpt2_files import ensure_gpt2_files

    gpt2 = fetched_or_skip(ensure_gpt2_files, "GPT-2 files")
    tiny = [f for i, f in enumerate(TINY) if f != "--vocab-size" and TINY[i - 1] != "--vocab-size"]
    saved = tmp_path / "saved"
    out = run_entry([*tiny, *EAGER, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                     gpt2.vocab_file, "--merge-file", gpt2.merge_file, "--train-iters", "3",
                     "--save", str(saved), "--save-interval", "3"], cwd=tmp_path,
                    env=install_env("apex"), timeout=600)
    trained(out, [1, 2, 3])
    prompt = ["--prompt", "To be, or not to be", "--greedy", "--json", "--max-new-tokens",
              "12", "--ignore-eod", "--engine", "megatron"]

    def greedy(install, *flags) -> list[int]:
        run = run_tool("generate", ["--load", str(saved), *prompt, *flags], cwd=tmp_path,
                       env=install_env(install))
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout)["completion_tokens"]

    with_apex = greedy("apex", "--dtype", "fp32")
    assert greedy("plain", "--dtype", "fp32") == with_apex
    assert greedy("apex", "--cpu") == with_apex
    if _site_of("transformer_engine") is not None:
        assert greedy("apex_te", "--dtype", "fp32", "--transformer-impl",
                      "transformer_engine") == with_apex
    folder = tmp_path / "hf"
    run = run_tool("export_hf", ["--load", str(saved), "--output", str(folder), "--dtype",
                                 "fp32"], cwd=tmp_path, env=install_env("apex"))
    assert run.returncode == 0, run.stderr[-3000:]
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids = tokenizer("To be, or not to be", return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = model.generate(ids, max_new_tokens=12, do_sample=False,
                                eos_token_id=None)[0, ids.shape[1]:].tolist()
    assert theirs == with_apex
    shutil.rmtree(folder)

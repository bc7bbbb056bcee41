"""Generation on a GPU: the KV decoder's CUDA graphs against its eager steps and megatron's
engine, the generate tool end to end, and the generation bench (skipped without CUDA)."""

import json

import pytest
import torch

from helpers import PYTHON, REPO, entry_env, run_entry, run_tool
from megatron_parts import tiny_gpt
from megagpt.inference import kv_decoder, megatron_engine
from megagpt.inference.sampling import Sampling

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB, EOD = 96, 95
PROMPTS = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32]]


class _Tokenizer:
    eod = EOD

    def detokenize(self, ids, **kwargs):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("variant", ["gpt2", "llama_gqa"])
def test_graph_replays_give_the_eager_steps_and_megatrons_tokens(variant):
    """fp32 on the GPU: greedy and seeded tokens from the captured step (first call: capture,
    second: replay only) equal the eager decoder's and, greedy, megatron's engine's."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from gloo_ranks import single_gloo_rank

    device = torch.device("cuda")
    with single_gloo_rank(), torch.no_grad():
        model_parallel_cuda_manual_seed(0)
        model = tiny_gpt(variant, vocab_size=VOCAB, on_gpu=True)
        graphed = kv_decoder.KVDecoder(model, 3, 32, use_graphs=True)
        eager = kv_decoder.KVDecoder(model, 3, 32, use_graphs=False)
        for sampling in (Sampling(greedy=True), Sampling(temperature=1.2, top_p=0.9, seed=3)):
            args = (PROMPTS, 20, sampling, VOCAB, EOD, False)
            captured, replayed, plain = graphed.generate(*args), graphed.generate(*args), \
                eager.generate(*args)
            assert captured == replayed == plain
        theirs = megatron_engine.generate(model, _Tokenizer(), PROMPTS, 20, Sampling(greedy=True),
                                          VOCAB, EOD, False, 3, device)
        assert graphed.generate(PROMPTS, 20, Sampling(greedy=True), VOCAB, EOD, False) == theirs


def test_generate_tool_on_a_gpu(tmp_path):
    """A tiny model trained on the GPU; the tool completes with either engine (fp32: the same
    tokens), and by default (bf16) with the KV decoder's CUDA graphs."""
    ckpt = tmp_path / "ckpt"
    out = run_entry(["--mock-data", "--vocab-size", "512", "--num-layers", "2", "--hidden-size",
                     "64", "--num-attention-heads", "4", "--seq-length", "64",
                     "--max-position-embeddings", "64", "--micro-batch-size", "2",
                     "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "2",
                     "--eval-iters", "0", "--bf16", "--no-fast-spec", "--save", str(ckpt),
                     "--save-interval", "2"], cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:]
    ask = ["--load", str(ckpt), "--prompt", "1 2 3 4 5", "--greedy", "--json",
           "--max-new-tokens", "24", "--ignore-eod"]
    tokens = {}
    for engine in ("kv", "megatron"):
        run = run_tool("generate", [*ask, "--engine", engine, "--dtype", "fp32"], cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        tokens[engine] = json.loads(run.stdout)["completion_tokens"]
    assert tokens["kv"] == tokens["megatron"] and len(tokens["kv"]) == 24
    run = run_tool("generate", ask, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "KV decoder, CUDA graphs, bfloat16" in run.stderr and "tokens/s" in run.stderr


def test_bench_generate_runs_on_a_gpu(tmp_path):
    import subprocess

    out = subprocess.run([PYTHON, str(REPO / "bench" / "bench_generate.py"), "--shape", "tiny",
                          "--prompt-tokens", "16", "--new-tokens", "24", "--repeats", "1",
                          "--profile-step", "--out", str(tmp_path)], cwd=tmp_path, env=entry_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    record = json.loads((tmp_path / "bench_generate.json").read_text())
    assert [(r["engine"], r["batch"]) for r in record["rows"]] == [
        (e, b) for b in (1, 16) for e in ("transformers", "megatron", "kv", "kv-compiled")]
    assert "goal at batch 1" in out.stdout
    for row in record["rows"]:  # the captured step's kernels, profiled
        profiled = row.get("step_profile")
        assert (profiled is not None) == row["engine"].startswith("kv")
        if profiled:
            assert profiled["kernels_per_step"] > 10 and profiled["kernel_us_per_step"] > 0

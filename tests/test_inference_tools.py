"""The inference and conversion tools end to end on checkpoints the entry trained (CPU).

Two tiny models, each trained three iterations by pretrain_gpt.py --cpu: GPT-2-style (GPT-2
BPE, learned positions, LayerNorm, GeLU, tied) and Llama-style (a 512-token BPE, RoPE,
RMSNorm, SwiGLU, grouped-query attention, untied, no biases). Each is exported and read
back by transformers; the export is imported, continued under PP=2 (GPT-2) or TP=2
(Llama), and that run's checkpoint exported again against its own layout's forward pass.

Every tool runs once as a real process (``run_tool``: the ``tools/*.py`` front, its exit
status and output); further calls of a tool run its ``main`` in this process
(``call_tool``), which saves the seconds of importing megatron each time.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from helpers import (
    REPO,
    call_tool,
    first_training_samples,
    parse_losses,
    run_entry,
    run_tool,
    tiny_hf_tokenizer,
)

pytestmark = pytest.mark.slow

SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
TRAIN = ["--cpu", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0"]
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--group-query-attention", "--num-query-groups", "2"]
PROMPTS = ["To be, or not to be, that is the question", "The"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("inference")


@pytest.fixture(scope="module")
def tokenizers(work, gpt2):
    return {"gpt2": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2.vocab_file,
                     "--merge-file", gpt2.merge_file],
            "llama": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                      tiny_hf_tokenizer(work / "bpe512")]}


@pytest.fixture(scope="module")
def trained(work, tokenizers):
    """{arch: checkpoint folder} of the two models, three iterations each."""
    runs = {}
    for arch, extra in (("gpt2", []), ("llama", LLAMA)):
        ckpt = work / f"{arch}_ckpt"
        out = run_entry([*TRAIN, *SHAPE, *extra, *tokenizers[arch], "--train-iters", "3",
                         "--save", str(ckpt), "--save-interval", "3"], cwd=work)
        assert out.returncode == 0, out.stdout[-3000:]
        runs[arch] = ckpt
    return runs


@pytest.fixture(scope="module")
def exported(work, trained):
    from megagpt.hf.export_hf import main as export_main

    folders = {}
    for arch, ckpt in trained.items():
        folder = work / f"{arch}_hf"
        args = ["--load", str(ckpt), "--output", str(folder)]
        out = run_tool("export_hf", args, cwd=work) if arch == "gpt2" else \
            call_tool(export_main, args)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "[export]" in out.stdout
        folders[arch] = folder
    return folders


def transformers_model(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(str(folder)).eval(),
            AutoTokenizer.from_pretrained(str(folder)))


def megatron_logits(ckpt, tokens, layout=()):
    """The checkpoint's logits [batch, seq, real vocabulary] from megatron's forward pass,
    loaded in this process through megagpt.inference (one CPU rank)."""
    from megagpt.inference import loading

    prepared = loading.prepare(str(ckpt), list(layout), cpu=True)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with loading.loaded(prepared) as (model, _), torch.no_grad():
        return model(tokens, positions, None)[..., :prepared.vocab_size]


def a_batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(5))


# ---------------------------------------------------------------------------
# Export and generation
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("arch, cls", [("gpt2", "GPT2LMHeadModel"),
                                       ("llama", "LlamaForCausalLM")])
def test_transformers_logits_equal_megatrons_forward(trained, exported, arch, cls):
    hf, tokenizer = transformers_model(exported[arch])
    assert type(hf).__name__ == cls
    assert hf.config.vocab_size == len(tokenizer)  # padding rows dropped (GPT-2: 50304 rows)
    tokens = a_batch(len(tokenizer))
    with torch.no_grad():
        ours = hf(tokens).logits
    torch.testing.assert_close(ours, megatron_logits(trained[arch], tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch, engine", [("gpt2", "megatron"), ("llama", "kv")])
def test_greedy_generation_is_transformers_greedy_generate(work, trained, exported, arch,
                                                           engine):
    prompts = work / f"prompts_{arch}.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = run_tool("generate", ["--load", str(trained[arch]), "--cpu", "--greedy", "--json",
                                "--prompts", str(prompts), "--max-new-tokens", str(NEW_TOKENS),
                                "--engine", engine], cwd=work)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["prompt"] for r in results] == PROMPTS
    assert "tokens/s" in out.stderr
    hf, tokenizer = transformers_model(exported[arch])
    for result in results:
        ids = tokenizer(result["prompt"], return_tensors="pt").input_ids
        assert result["prompt_tokens"] == ids[0].tolist()
        with torch.no_grad():
            theirs = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert result["completion_tokens"] == theirs[0, ids.shape[1]:].tolist()
        eod = tokenizer.eos_token_id
        shown = [t for t in result["completion_tokens"] if t != eod]
        assert result["completion"] == tokenizer.decode(shown)


def test_a_checkpoint_of_tes_layers_generates_without_te(work, trained):
    """A run under TE's layers saves ``--transformer-impl transformer_engine`` (and, from an
    earlier version, fast-path options today's parser refuses) in its command line; where TE
    is missing the checkpoint still generates, with the tokens of the same weights."""
    import shutil

    import yaml

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TE is installed here: the replay would run TE's layers")
    te_run = work / "as_if_te"
    shutil.copytree(trained["gpt2"], te_run)
    from megagpt.resilience import checksums

    for snapshot in te_run.rglob("megagpt_config.yaml"):
        saved = yaml.safe_load(snapshot.read_text())
        saved["entry"]["argv"] += ["--transformer-impl", "transformer_engine",
                                   "--fast-cuda-graphs", "iteration", "--no-fast-hash-dropout"]
        snapshot.write_text(yaml.safe_dump(saved))
        folder = str(snapshot.parent)  # the checksums such a run recorded for its files
        checksums.write_manifest(folder, checksums.digest_files(
            folder, checksums.checkpoint_files(folder))[0])

    def greedy(ckpt) -> list[int]:
        out = run_tool("generate", ["--load", str(ckpt), "--cpu", "--greedy", "--json",
                                    "--prompt", PROMPTS[0], "--max-new-tokens", "6"], cwd=work)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)["completion_tokens"]

    assert greedy(te_run) == greedy(trained["gpt2"])


def test_engines_agree_sampling_is_seeded_and_top_k_1_is_greedy(trained):
    """Through the generator tools/generate.py runs, with both engines."""
    from megagpt.inference import loading
    from megagpt.inference.generation import Generator
    from megagpt.inference.sampling import Sampling

    prepared = loading.prepare(str(trained["gpt2"]), [], cpu=True)
    with loading.loaded(prepared) as (model, device):
        greedy = {}
        for engine in ("megatron", "kv"):
            gen = Generator(model, prepared.tokenizer, prepared.vocab_size, device, engine)

            def tokens(sampling):
                report = gen.complete(PROMPTS, 16, sampling, stop_at_eod=False)
                return [c.tokens for c in report.completions]

            seeded = tokens(Sampling(temperature=1.0, seed=11))
            assert tokens(Sampling(temperature=1.0, seed=11)) == seeded
            assert tokens(Sampling(temperature=1.0, seed=12)) != seeded
            greedy[engine] = tokens(Sampling(greedy=True))
            assert tokens(Sampling(top_k=1, seed=11)) == greedy[engine]
        assert greedy["megatron"] == greedy["kv"]


def test_perplexity_is_transformers_loss_on_the_same_windows(work, trained, exported):
    held_out = work / "held_out.txt"
    held_out.write_text((REPO / "README.md").read_text()[:3000])
    out = run_tool("perplexity", ["--load", str(trained["gpt2"]), "--cpu", "--json",
                                  "--input", str(held_out)], cwd=work)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    hf, tokenizer = transformers_model(exported["gpt2"])
    stream = tokenizer(held_out.read_text()).input_ids + [tokenizer.eos_token_id]
    total, count = 0.0, 0
    for start in range(0, len(stream) - 1, 64):
        window = torch.tensor([stream[start:start + 65]])
        if window.shape[1] < 2:
            continue
        with torch.no_grad():
            logits = hf(window[:, :-1]).logits
        total += float(torch.nn.functional.cross_entropy(logits[0], window[0, 1:],
                                                         reduction="sum"))
        count += window.shape[1] - 1
    assert result["tokens"] == count
    assert result["loss"] == pytest.approx(total / count, abs=1e-4)
    assert result["perplexity"] == pytest.approx(torch.tensor(total / count).exp().item(),
                                                 rel=1e-4)


# ---------------------------------------------------------------------------
# Import, continued training, export under TP=2 and PP=2
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def imported(work, exported):
    """The exports imported back: GPT-2 for TP 1 (its 50257 tokens then need no padding),
    Llama for TP 2 (512 tokens: no padding with divisor 128)."""
    from megagpt.hf.import_hf import main as import_main

    ckpts = {}
    for arch, tp in (("gpt2", "1"), ("llama", "2")):
        ckpt = work / f"{arch}_imported"
        args = ["--hf", str(exported[arch]), "--save", str(ckpt),
                "--tensor-model-parallel-size", tp]
        out = run_tool("import_hf", args, cwd=work) if arch == "gpt2" else \
            call_tool(import_main, args)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "no padding rows" in out.stdout
        ckpts[arch] = ckpt
    return ckpts


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_import_then_export_is_bit_exact(work, exported, imported, arch):
    from safetensors.torch import load_file

    from megagpt.hf.export_hf import main as export_main

    again = work / f"{arch}_hf_again"
    out = call_tool(export_main, ["--load", str(imported[arch]), "--output", str(again)])
    assert out.returncode == 0, out.stderr[-3000:]
    before = load_file(str(exported[arch] / "model.safetensors"))
    after = load_file(str(again / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for name in before:
        assert before[name].dtype == after[name].dtype and torch.equal(before[name], after[name])
    assert json.loads((again / "config.json").read_text()) == \
        json.loads((exported[arch] / "config.json").read_text())


# Continued pretraining from an import: one iteration of one sample, saved.
CONTINUE = ["--cpu", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--lr", "1e-4", "--train-iters", "1", "--eval-iters", "0", "--log-interval", "1",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--save-interval", "1"]
LAYOUTS = {"gpt2": ["--pipeline-model-parallel-size", "2"],
           "llama": ["--tensor-model-parallel-size", "2"]}


@pytest.fixture(scope="module")
def continued(work, imported):
    """{arch: (first training loss, checkpoint saved under the arch's layout, the run's argv
    but its layout)}."""
    runs = {}
    for arch, layout in LAYOUTS.items():
        ckpt = work / f"{arch}_continued"
        argv = ["--config", str(imported[arch] / "model.yaml"), "--load", str(imported[arch]),
                *CONTINUE]
        out = run_entry([*argv, *layout, "--save", str(ckpt)], cwd=work, nproc=2)
        assert out.returncode == 0, out.stdout[-3000:]
        assert "loading release distributed checkpoint" in out.stdout
        runs[arch] = (parse_losses(out.stdout)[1], ckpt, argv)
    return runs


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_first_loss_after_import_is_transformers_loss_on_that_batch(exported, continued, arch):
    loss, _, argv = continued[arch]
    sample = first_training_samples(argv, 1)[0]
    hf, _ = transformers_model(exported[arch])
    with torch.no_grad():
        logits = hf(torch.as_tensor(sample["tokens"])[None]).logits[0]
    per_token = torch.nn.functional.cross_entropy(logits, torch.as_tensor(sample["labels"]),
                                                  reduction="none")
    mask = torch.as_tensor(sample["loss_mask"]).float()
    assert loss == pytest.approx(float((per_token * mask).sum() / mask.sum()), abs=2e-5)


@pytest.fixture(scope="module")
def layout_logits(work, continued):
    """{arch: (the continued checkpoint's export, a batch, the logits of megatron's forward
    pass on it in the run's own layout)}: both layouts in one torchrun call."""
    import subprocess

    from helpers import TORCHRUN, _free_port, _with_a_free_port, entry_env
    from megagpt.hf.export_hf import main as export_main

    jobs, batches = [], {}
    for arch, (_, ckpt, _) in continued.items():
        folder = work / f"{arch}_continued_hf"
        out = call_tool(export_main, ["--load", str(ckpt), "--output", str(folder)])
        assert out.returncode == 0, out.stderr[-3000:]
        _, tokenizer = transformers_model(folder)
        batches[arch] = (folder, a_batch(len(tokenizer)))
        torch.save(batches[arch][1], work / f"{arch}_tokens.pt")
        jobs.append({"load": str(ckpt), "tokens": str(work / f"{arch}_tokens.pt"),
                     "out": str(work / f"{arch}_layout_logits.pt"), "layout": LAYOUTS[arch]})
    (work / "jobs.json").write_text(json.dumps(jobs))
    out = _with_a_free_port(lambda: subprocess.run(
        [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(_free_port()),
         str(Path(__file__).with_name("parallel_forward.py")), str(work / "jobs.json")],
        cwd=work, env=entry_env(), capture_output=True, text=True, timeout=300), nproc=2)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return {arch: (folder, tokens, torch.load(work / f"{arch}_layout_logits.pt"))
            for arch, (folder, tokens) in batches.items()}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_export_of_a_tp2_or_pp2_checkpoint_gives_that_layouts_logits(layout_logits, arch):
    folder, tokens, theirs = layout_logits[arch]
    hf, tokenizer = transformers_model(folder)
    with torch.no_grad():
        ours = hf(tokens).logits
    torch.testing.assert_close(ours, theirs[..., :len(tokenizer)], atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------
# Bad input: one line naming what and where, exit status 2, nothing written
# ---------------------------------------------------------------------------

def one_error_line(out) -> str:
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stdout == ""
    return errors[0]


def nothing_beside(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}"))


def test_a_load_with_no_checkpoint(tmp_path):
    missing = tmp_path / "nothing"
    line = one_error_line(run_tool("generate", ["--load", str(missing), "--cpu", "--prompt",
                                                "x"], cwd=tmp_path))
    assert line == f"error: --load {missing}: no such directory"
    empty = tmp_path / "empty"
    empty.mkdir()
    line = one_error_line(run_tool("export_hf", ["--load", str(empty), "--output",
                                                 str(tmp_path / "out")], cwd=tmp_path))
    assert line.startswith(f"error: --load {empty}: no checkpoint there")
    line = one_error_line(run_tool("perplexity", ["--load", str(empty), "--cpu", "--input",
                                                  str(REPO / "README.md")], cwd=tmp_path))
    assert line.startswith(f"error: --load {empty}: no checkpoint there")
    assert not (tmp_path / "out").exists() and nothing_beside(tmp_path / "out") == []


def test_compile_where_no_step_is_compiled(tmp_path):
    """--compile is the KV decoder's, on a GPU: refused before any checkpoint is read."""
    missing = tmp_path / "nothing"
    for extra, reason in ((["--cpu"], "--cpu runs it eagerly"),
                          (["--engine", "megatron"], "--engine megatron has no such step")):
        line = one_error_line(run_tool("generate", ["--load", str(missing), "--prompt", "x",
                                                    "--compile", *extra], cwd=tmp_path))
        assert line == f"error: --compile compiles the KV decoder's step on a GPU; {reason}"


def test_an_architecture_without_a_transformers_class(work, exported, tmp_path):
    folder = tmp_path / "mistral"
    folder.mkdir()
    config = json.loads((exported["llama"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    save = tmp_path / "ckpt"
    line = one_error_line(run_tool("import_hf", ["--hf", str(folder), "--save", str(save)],
                                   cwd=tmp_path))
    assert line == f"error: --hf {folder}: model_type 'mistral' is not supported (gpt2 and " \
                   "llama are)"
    assert not save.exists() and nothing_beside(save) == []


def test_a_model_transformers_has_no_class_for_is_not_exported(trained, tmp_path):
    """The trained GPT-2 rebuilt with q/k layer norms (flags override what was saved): the
    export refuses it by the feature, before reading any weight."""
    from megagpt.hf.export_hf import main as export_main

    output = tmp_path / "out"
    line = one_error_line(call_tool(export_main, ["--load", str(trained["gpt2"]), "--output",
                                                  str(output), "--qk-layernorm"]))
    assert line == (f"error: --load {trained['gpt2'] / 'iter_0000003'}: no transformers "
                    "equivalent for q/k layer norms (--qk-layernorm)")
    assert not output.exists() and nothing_beside(output) == []


def test_a_tokenizer_that_does_not_fit_the_checkpoint(trained, tokenizers, tmp_path):
    from megagpt.hf.export_hf import main as export_main

    output = tmp_path / "out"
    line = one_error_line(call_tool(export_main, ["--load", str(trained["gpt2"]), "--output",
                                                  str(output), *tokenizers["llama"]]))
    folder = trained["gpt2"] / "iter_0000003"
    assert line == (f"error: the tokenizer ({' '.join(tokenizers['llama'])}) has 512 tokens, "
                    f"but the checkpoint {folder} has 50304 embedding rows, which megatron's "
                    "padding (multiples of 128) gives for 50177 to 50304 tokens: give the "
                    "tokenizer the model was trained with")
    assert not output.exists() and nothing_beside(output) == []


def test_an_existing_output_is_left_as_it_was(trained, exported, tmp_path):
    output = tmp_path / "taken"
    output.mkdir()
    (output / "mine.txt").write_text("keep")
    line = one_error_line(run_tool("export_hf", ["--load", str(trained["gpt2"]), "--output",
                                                 str(output)], cwd=tmp_path))
    assert line == f"error: --output {output}: exists and is not empty; pass --overwrite to " \
                   "replace it"
    assert [p.name for p in output.iterdir()] == ["mine.txt"]
    line = one_error_line(run_tool("import_hf", ["--hf", str(exported["gpt2"]), "--save",
                                                 str(output)], cwd=tmp_path))
    assert line.startswith(f"error: --save {output}: exists and is not empty")
    assert [p.name for p in output.iterdir()] == ["mine.txt"] and nothing_beside(output) == []

"""Every shipped config loads, passes the dry run at the GPU counts its comments name, and
its comments' numbers (parameters, tokens per step, layout) are what the preflight computes."""

import re
from pathlib import Path

import pytest
import yaml

from megagpt.launch import resolve
from megagpt.preflight import LayoutError, make_plan

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
DATA_FLAGS = {"data-path", "train-data-path", "tokenizer-type", "vocab-file", "merge-file",
              "split", "tokenizer-model"}
LAYOUT = re.compile(r"(\d+) GPUs? = TP (\d+) × PP (\d+) × DP (\d+)")


def layouts(path: Path) -> list[tuple[int, int, int, int]]:
    line = next(l for l in path.read_text().splitlines() if l.startswith("# layout:"))
    return [tuple(int(x) for x in m) for m in LAYOUT.findall(line)]


def comment_number(path: Path, label: str) -> int:
    m = re.search(rf"^# {label}: ([\d,]+)", path.read_text(), re.M)
    assert m, f"{path.name} has no '# {label}:' line"
    return int(m.group(1).replace(",", ""))


def plan_for(path: Path, gpus: int, *extra: str):
    argv = ["--config", str(path), "--dry-run", "--dry-run-world-size", str(gpus),
            "--gpu-type", "A100-80GB", *extra]
    if "mock-data" not in yaml.safe_load(path.read_text()):
        argv.append("--mock-data")  # NullTokenizer of GPT-2's 50257 tokens: same padded vocab
    return make_plan(resolve(argv))


def test_the_family_is_shipped():
    names = {p.stem for p in CONFIGS}
    assert {"tiny", "gpt2_345m", "gpt3_125m", "gpt3_350m", "gpt3_760m", "gpt3_1.3b",
            "gpt3_2.7b", "gpt3_6.7b", "gpt3_13b", "gpt3_175b"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_keeps_data_flags_out(path):
    keys = {k.lstrip("-").replace("_", "-") for k in yaml.safe_load(path.read_text())}
    assert not keys & DATA_FLAGS, "model configs combine with --data-path on the command line"


@pytest.mark.parametrize("path,layout", [(p, lay) for p in CONFIGS for lay in layouts(p)],
                         ids=lambda v: v.stem if isinstance(v, Path) else f"{v[0]}gpus")
def test_config_passes_the_dry_run_at_its_intended_size(path, layout):
    gpus, tp, pp, dp = layout
    assert gpus == tp * pp * dp, f"{path.name}: the layout comment's arithmetic is wrong"
    plan = plan_for(path, gpus)
    args = plan.args
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.data_parallel_size) == (tp, pp, dp)
    assert plan.fits, f"{path.name} at {gpus} GPUs: {plan.memory.total / 2**30:.1f} GiB"
    assert plan.params.total == comment_number(path, "parameters")
    tokens = re.search(r"^# tokens per step: (\d+) sequences × (\d+) tokens = ([\d,]+)",
                       path.read_text(), re.M)
    assert (int(tokens.group(1)), int(tokens.group(2))) == (args.global_batch_size,
                                                            args.seq_length)
    assert int(tokens.group(3).replace(",", "")) == args.global_batch_size * args.seq_length
    assert f"× {plan.args.global_batch_size // (args.micro_batch_size * dp)} micro-batches × DP {dp}" \
        in path.read_text()
    memory = re.search(r"dry run: ([\d.]+) GiB per GPU", path.read_text())
    if memory and layout == layouts(path)[0]:  # the comment's figure is for the first layout
        assert f"{plan.memory.total / 2**30:.2f}" == memory.group(1)


def test_gpt2_345m_is_gpt2_medium():
    # Hugging Face's gpt2-medium has 354,823,168 parameters with the unpadded 50257 vocabulary.
    path = next(p for p in CONFIGS if p.stem == "gpt2_345m")
    plan = plan_for(path, 1, "--make-vocab-size-divisible-by", "1")
    assert plan.params.total == 354_823_168


def test_gpt3_175b_passes_at_128_gpus_and_fails_at_8_with_the_arithmetic():
    path = next(p for p in CONFIGS if p.stem == "gpt3_175b")
    plan = plan_for(path, 128)
    assert plan.args.data_parallel_size == 1
    assert plan.args.global_batch_size // plan.args.micro_batch_size == 1536
    with pytest.raises(LayoutError, match=r"world size 8 is not divisible by "
                                          r"TP 8 × PP 16 × CP 1 = 128"):
        plan_for(path, 8)

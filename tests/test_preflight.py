"""The preflight: exact parameter counts, the layout checks with their numbers, the dry run's
output and exit codes, and the same checks on a real launch."""

import contextlib
import io
import re

import pytest
import yaml

import pretrain_gpt
from gloo_ranks import single_gloo_rank
from helpers import REPO
from megagpt.command_line.arguments import ArgumentError
from megagpt.launch import resolve
from megagpt.errors import UserError
from megagpt.preflight import LayoutError, MemoryBudgetError, make_plan
from megagpt.preflight import estimate as est

TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
        "--vocab-size", "512", "--lr", "1e-3", "--train-iters", "2", "--dry-run"]


def plan(*extra, world_size=1):
    launch = resolve([*TINY, "--dry-run-world-size", str(world_size), *extra])
    with contextlib.redirect_stdout(io.StringIO()):
        return make_plan(launch)


# ---------------------------------------------------------------------------
# Parameters: the count is exact against the model the entry builds
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_gloo_rank():
    with single_gloo_rank():
        yield


VARIANTS = {
    "gpt": [],
    "llama-like": ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
                   "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
                   "--group-query-attention", "--num-query-groups", "2"],
    "kv-channels-qk-norm": ["--ffn-hidden-size", "96", "--kv-channels", "8", "--qk-layernorm",
                            "--add-qkv-bias", "--disable-bias-linear"],
    "local-spec": ["--no-fast-spec"],
}


@pytest.mark.parametrize("extra", VARIANTS.values(), ids=VARIANTS.keys())
def test_parameter_count_matches_the_built_model(extra, one_gloo_rank):
    from megagpt import cpu_mode
    from model_provider import model_provider

    resolved = resolve([*TINY, "--dry-run-world-size", "1", "--cpu", "--global-batch-size", "4",
                        *extra])
    with contextlib.redirect_stdout(io.StringIO()):
        p = make_plan(resolved)
    with cpu_mode.active():
        model_config, _, _ = pretrain_gpt.build_configs(p.args, resolved)
        model = model_provider(model_config)
    assert sum(t.numel() for t in model.parameters()) == p.params.total


def test_pipeline_stages_split_layers_and_the_last_keeps_a_tied_embedding_copy():
    p = plan("--num-layers", "8", "--pipeline-model-parallel-size", "4",
             "--tensor-model-parallel-size", "2", "--global-batch-size", "4", world_size=8)
    stages = p.params.stages
    assert [s.layers for s in stages] == [2, 2, 2, 2]
    word = p.args.padded_vocab_size * 64
    assert stages[-1].tied_copy == word and stages[0].tied_copy == 0
    assert sum(s.total - s.tied_copy for s in stages) == p.params.total
    layer = est.layer_params(p.args)
    assert stages[1].per_tp_rank == 2 * (layer.sharded // 2 + layer.replicated)
    assert p.params.most_per_gpu == stages[0].per_tp_rank  # embeddings + positions + 2 layers


# ---------------------------------------------------------------------------
# Impossible layouts: each fails before megatron, with its numbers
# ---------------------------------------------------------------------------

IMPOSSIBLE = {
    "world-size": (["--tensor-model-parallel-size", "8", "--num-attention-heads", "8"], 12,
                   r"world size 12 is not divisible by TP 8 × PP 1 × CP 1 = 8 GPUs per model "
                   r"replica \(12 / 8 = 1.50 replicas\); use a multiple of 8 GPUs"),
    "heads": (["--tensor-model-parallel-size", "8"], 8,
              r"--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"),
    "query-groups": (["--group-query-attention", "--num-query-groups", "2",
                      "--tensor-model-parallel-size", "4"], 4,
                     r"--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
    "hidden-by-heads": (["--num-attention-heads", "6"], 1,
                        r"--hidden-size 64 is not divisible by --num-attention-heads 6 "
                        r"\(64 / 6 = 10.67\)"),
    "layers": (["--pipeline-model-parallel-size", "4"], 4,
               r"--num-layers 2 is not divisible by --pipeline-model-parallel-size 4 "
               r"\(2 / 4 = 0.50 layers per stage\)"),
    "global-batch": (["--global-batch-size", "4"], 3,
                     r"--global-batch-size 4 is not divisible by --micro-batch-size 2 × DP 3 = 6 "
                     r"\(4 / 6 = 0.67 micro-batches per step"),
    "schedule-with-fixed-batch": (["--global-batch-size", "4", "--step-batch-size-schedule",
                                   "0:4 1K:8"], 1,
                                  r"cannot be combined with a fixed --global-batch-size 4"),
    "schedule-batch": (["--step-batch-size-schedule", "0:4 1K:6"], 2,
                       r"schedule batch 6 is not divisible by micro-batch 2 × DP 2 = 4"),
    "rampup": (["--global-batch-size", "4", "--rampup-batch-size", "2", "2", "100"], 1,
               r"--rampup-batch-size 2 2 100 is ignored by megatron-core 0.19"),
    "sequence-longer-than-positions": (["--seq-length", "128"], 1,
                                       r"--seq-length 128 is longer than the position table "
                                       r"--max-position-embeddings 64"),
}


@pytest.mark.parametrize("extra,world_size,message", IMPOSSIBLE.values(), ids=IMPOSSIBLE.keys())
def test_impossible_layout_fails_with_its_numbers(extra, world_size, message):
    with pytest.raises(LayoutError, match=message):
        plan(*extra, world_size=world_size)


def test_every_problem_is_listed_at_once():
    with pytest.raises(LayoutError, match=r"2 problems") as info:
        plan("--pipeline-model-parallel-size", "4", "--seq-length", "128", world_size=4)
    assert "layers per stage" in str(info.value) and "position table" in str(info.value)


def test_a_step_schedule_without_a_fixed_batch_passes():
    p = plan("--step-batch-size-schedule", "0:4 1K:8", world_size=2)
    assert p.args.data_parallel_size == 2


def test_megatron_validation_runs_after_ours_and_its_assertions_become_user_errors():
    with pytest.raises(ArgumentError, match="invalid arguments"):
        plan("--global-batch-size", "4", "--min-lr", "1e-2")  # megatron: min_lr <= lr


def test_the_estimate_follows_the_launchs_choices_where_the_raw_arguments_would_mislead():
    """The fast path's switches stay on in the arguments where the launch turns their piece
    off for a reason they do not show; the dry run's memory follows the launch. At TP 2 the
    output layer is tensor-parallel, so megatron's loss keeps the [tokens, vocab/TP] logits
    in 16-bit and their fp32 softmax (6 bytes each); in fp16 the flat AdamW step, which reads
    the 16-bit gradients in place, does not run, so the step makes fp32 copies of them."""
    from megagpt.launch.optimizer_kernels import OptimizerKernels

    p = plan("--tensor-model-parallel-size", "2", "--global-batch-size", "4", world_size=2)
    assert p.args.fast_lm_loss and p.runs.path == "fast"  # what the arguments alone say
    assert not p.runs.chunked_loss  # the launch: "LM loss  megatron's — tensor-parallel ..."
    tokens = 64 * 2  # sequence × micro-batch
    logits = tokens * p.args.padded_vocab_size / 2 * 6
    assert est._logits_bytes(p.args, p.runs) == logits > 0

    p = plan("--fp16", "--global-batch-size", "4")
    assert p.args.fast_flat_adam and p.args.fast_optimizer  # on in the arguments
    assert p.runs.optimizer is OptimizerKernels.FUSED_ADAMW  # the launch: the flat step is bf16's only
    assert est.bytes_per_parameter(p.args)[1] == 2  # fp16 gradients in the buffer
    assert p.memory.gradient_copies == 4 * p.params.most_per_gpu > 0
    bf16 = plan("--bf16", "--global-batch-size", "4")
    assert bf16.runs.optimizer is OptimizerKernels.FLAT_ADAMW and bf16.memory.gradient_copies == 0


def test_memory_above_the_gpu_fails_naming_the_parts():
    from megagpt.preflight import run_dry_run

    launch = resolve([*TINY, "--global-batch-size", "4", "--gpu-type", "A100-80GB",
                      "--gpu-memory-gb", "1"])
    with pytest.raises(MemoryBudgetError, match=r"estimated memory per GPU .* GiB \(weights .* "
                                                r"is above the A100-80GB's 1.0 GiB"):
        with contextlib.redirect_stdout(io.StringIO()):
            run_dry_run(launch)


# ---------------------------------------------------------------------------
# Numbers: memory parts and FLOPs
# ---------------------------------------------------------------------------

def test_bytes_per_parameter_follow_precision_and_the_distributed_optimizer():
    mixed = plan("--bf16", "--use-distributed-optimizer", "--global-batch-size", "16", world_size=8)
    assert est.bytes_per_parameter(mixed.args) == (2, 4, 12 / 8)  # fp32 master + Adam over DP 8
    fp32 = plan("--global-batch-size", "4")
    assert est.bytes_per_parameter(fp32.args) == (4, 4, 8)
    n = fp32.params.most_per_gpu
    assert (fp32.memory.weights, fp32.memory.optimizer) == (4 * n, 8 * n)


def test_torch_adamw_temporaries_count_at_the_optimizer_step():
    """Without TE or apex megatron steps with torch's AdamW, whose foreach form allocates the
    square root of the second moment for every parameter at once (4 bytes each); the fast
    optimizer's fused AdamW allocates none; the distributed optimizer steps a 1/DP shard."""
    foreach = plan("--bf16", "--no-fast-spec", "--fast-disable", "optimizer", "--global-batch-size", "4")
    n = foreach.params.most_per_gpu
    assert foreach.memory.optimizer_temporaries == 4 * n
    assert foreach.memory.optimizer_step == foreach.memory.gradient_copies + 4 * n
    assert plan("--bf16", "--no-fast-spec", "--global-batch-size", "4").memory \
        .optimizer_temporaries == 0
    sharded = plan("--bf16", "--fast-disable", "optimizer", "--use-distributed-optimizer",
                   "--global-batch-size", "16", world_size=8)
    assert sharded.memory.optimizer_temporaries == 4 * sharded.params.most_per_gpu / 8


def test_flops_are_megatrons_count_for_the_global_batch():
    from megatron.training.training import num_floating_point_operations

    p = plan("--global-batch-size", "8", world_size=2)
    assert est.flops_per_iteration(p.args) == num_floating_point_operations(p.args, 8)
    # About 6 FLOPs per parameter per token (forward + backward), plus attention and logits.
    ratio = est.flops_per_iteration(p.args) / (6 * p.params.total * 8 * 64)
    assert 1.0 < ratio < 2.0


# ---------------------------------------------------------------------------
# The command line: --dry-run output and exit codes, and the real launch
# ---------------------------------------------------------------------------

def test_dry_run_prints_the_plan_alone(capsys):
    code = pretrain_gpt.main([*TINY, "--global-batch-size", "8", "--dry-run-world-size", "2",
                              "--gpu-type", "H200"])
    out = capsys.readouterr().out
    assert code == 0
    plan = [line for line in out.splitlines() if not line.startswith("[megagpt]")]
    assert plan[0] == "layout:" and plan[-1].startswith("dry run OK: 2 GPUs")
    for line in ("GPUs            2 = TP 1 × PP 1 × CP 1 × DP 2",
                 "micro-batches   2 per step = global batch 8 / (micro-batch 2 × DP 2)",
                 "tokens/step     512 = 8 sequences × 64 tokens",
                 "H200 140.4 GiB", "model FLOPs"):
        assert line in out
    assert "resolved configuration" not in out and "num_layers" not in out


def test_dry_run_yaml_writes_the_resolved_configuration_or_prints_it_after_the_plan(
        tmp_path, capsys):
    path = tmp_path / "resolved.yaml"
    flags = [*TINY, "--global-batch-size", "8", "--dry-run-world-size", "2"]
    assert pretrain_gpt.main([*flags, "--dry-run-yaml", str(path)]) == 0
    assert f"resolved configuration: {path}" in capsys.readouterr().out
    resolved = yaml.safe_load(path.read_text())
    assert resolved["num_layers"] == 2 and resolved["data_parallel_size"] == 2
    assert resolved["world_size"] == 2

    assert pretrain_gpt.main([*flags, "--dry-run-yaml", "-"]) == 0
    out = capsys.readouterr().out
    plan, printed = out.split("# resolved configuration\n", 1)
    assert "dry run OK: 2 GPUs" in plan
    shown = yaml.safe_load(printed)
    differ = {k for k in resolved if shown[k] != resolved[k]}
    assert differ == {"dry_run_yaml", "entry_argv"}  # the flag itself is the one change


def test_dry_run_at_345m_prints_the_plan_in_at_most_80_lines(capfd):
    """What a user sees (both streams, megatron's logging included) for a real config."""
    code = pretrain_gpt.main(["--config", str(REPO / "configs" / "gpt2_345m.yaml"),
                              "--dry-run", "--gpu-type", "H200"])
    out, err = capfd.readouterr()
    lines = (out + err).splitlines()
    assert code == 0
    assert len(lines) <= 80, "\n".join(lines)
    assert "layout:" in lines and "total           354,871,296 (354.87M)" in out


def test_dry_run_world_size_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    launch = resolve([*TINY, "--global-batch-size", "8"])
    with contextlib.redirect_stdout(io.StringIO()):
        p = make_plan(launch)
    assert p.args.world_size == 4 and p.args.data_parallel_size == 4


def test_dry_run_error_exits_2_with_the_message(capsys):
    code = pretrain_gpt.main([*TINY, "--global-batch-size", "4", "--dry-run-world-size", "3"])
    assert code == 2
    assert "error: --global-batch-size 4 is not divisible by --micro-batch-size 2 × DP 3 = 6" \
        in capsys.readouterr().err


def test_the_real_launch_runs_the_same_checks_before_megatron(monkeypatch, capsys):
    env = {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29599"}
    for name, value in env.items():  # restored after the test
        monkeypatch.setenv(name, value)
    argv = [a for a in TINY if a != "--dry-run"]
    code = pretrain_gpt.main([*argv, "--cpu", "--pipeline-model-parallel-size", "4"])
    assert code == 2
    # Megatron's own assertion would say 'Number of layers should be divisible ...'.
    assert "error: --num-layers 2 is not divisible by --pipeline-model-parallel-size 4 " \
           "(2 / 4 = 0.50 layers per stage)" in capsys.readouterr().err


def test_gpu_types_set_memory_and_arch():
    from megagpt.gpus import resolve_gpu

    assert (resolve_gpu("A100-40GB", None).memory_gib, resolve_gpu("A100-40GB", None).arch) == (40, 8)
    h100 = resolve_gpu("H100", 70)
    assert (h100.memory_gib, h100.arch) == (70, 9)
    assert issubclass(LayoutError, UserError)


# ---------------------------------------------------------------------------
# The estimate: time, cost and the layout search under the plan
# ---------------------------------------------------------------------------

def test_dry_run_estimates_time_and_cost_under_the_plan(capsys):
    code = pretrain_gpt.main([*TINY, "--global-batch-size", "8", "--dry-run-world-size", "2",
                              "--gpu-type", "H100-SXM", "--gpu-hour-price", "2.5"])
    out = capsys.readouterr().out
    assert code == 0
    assert "time (estimate on H100-SXM: 989 TFLOP/s dense 16-bit" in out
    per_iteration = next(line for line in out.splitlines() if "  per iteration " in line)
    assert "tokens/s per GPU" in per_iteration and "MFU" in per_iteration
    assert "  step            matmuls" in out
    run = next(line for line in out.splitlines() if "whole run" in line)
    assert "2 iterations" in run and "GPU-hours" in run and "at 2.5 per GPU-hour" in run
    # a tiny run on 2 GPUs: its GPU-hours are not rounded to a bare 0
    assert " on 2 GPUs = under 0.01 GPU-hours" in run, run
    code = pretrain_gpt.main([*TINY, "--global-batch-size", "8", "--dry-run-world-size", "1",
                              "--gpu-type", "H100-SXM"])
    one = next(line for line in capsys.readouterr().out.splitlines() if "whole run" in line)
    assert code == 0 and " on 1 GPU = " in one, one


def test_the_estimate_uses_megatrons_flop_count_for_tflops_and_mfu():
    p = plan("--global-batch-size", "8", "--gpu-type", "A100-80GB", world_size=2)
    run = p.run
    assert run.flops_per_iteration == est.flops_per_iteration(p.args)
    assert run.tflops_per_gpu == pytest.approx(run.flops_per_iteration / run.step.seconds / 2e12)
    assert run.mfu == pytest.approx(run.tflops_per_gpu / 312)
    assert sum(run.step.parts.values()) == pytest.approx(run.step.seconds)


@pytest.mark.parametrize("extra,message", [
    (["--gpu-type", "B200"], "error: --gpu-type B200: unknown GPU; known: A100-40GB, A100-80GB, "
                             "H100-SXM, H200"),
    (["--gpu-hour-price", "-1"], "error: --gpu-hour-price -1.0: must be 0 or more"),
])
def test_bad_gpu_type_or_price_is_one_error_line(extra, message, capsys):
    code = pretrain_gpt.main([*TINY, "--global-batch-size", "4", *extra])
    assert code == 2
    assert message in capsys.readouterr().err


def test_cpu_plan_has_no_speed_figures(capsys):
    assert pretrain_gpt.main([*TINY, "--global-batch-size", "4", "--cpu"]) == 0
    assert "time: no speed figures for this GPU" in capsys.readouterr().out


def test_search_layouts_ranks_the_fitting_layouts_and_places_the_launch(capsys):
    code = pretrain_gpt.main([*TINY, "--num-layers", "4", "--global-batch-size", "16",
                              "--dry-run-world-size", "4", "--gpu-type", "A100-40GB",
                              "--search-layouts"])
    out = capsys.readouterr().out
    assert code == 0
    assert "layouts (the 5 fastest of" in out and "  1. TP " in out
    assert "  as launched: TP 1 × PP 1 × DP 4, micro-batch 2, recompute none" in out
    # each layout with the flags that launch it, which megatron then accepts
    first = re.search(r"  1\. TP (\d+) × PP (\d+) × DP \d+, micro-batch (\d+).*\n.*\n"
                      r"     flags: (.*)\n", out)
    tp, pp, micro_batch, flags = first.groups()
    assert flags.startswith(f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size "
                            f"{pp} --micro-batch-size {micro_batch}")
    pasted = [t for t in flags.split(" (and")[0].split()]
    with contextlib.redirect_stdout(io.StringIO()):
        assert pretrain_gpt.main([*TINY, "--num-layers", "4", "--global-batch-size", "16",
                                  "--dry-run-world-size", "4", "--gpu-type", "A100-40GB",
                                  *pasted]) == 0


def test_full_recompute_keeps_only_layer_inputs():
    flags = ("--num-layers", "8", "--global-batch-size", "4", "--bf16")
    none = plan(*flags).memory.activations
    full = plan(*flags, "--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1").memory.activations
    assert full < none / 2


def test_train_samples_give_the_runs_iterations_and_search_needs_the_dry_run(capsys):
    i = TINY.index("--train-iters")
    by_samples = TINY[:i] + TINY[i + 2:]
    launch = resolve([*by_samples, "--global-batch-size", "8", "--train-samples", "100",
                      "--lr-decay-samples", "100", "--gpu-type", "H200",
                      "--dry-run-world-size", "2"])
    with contextlib.redirect_stdout(io.StringIO()):
        assert make_plan(launch).run.iterations == 13  # 100 samples in batches of 8
    argv = [a for a in TINY if a != "--dry-run"]
    assert pretrain_gpt.main([*argv, "--global-batch-size", "4", "--search-layouts"]) == 2
    assert "error: --search-layouts ranks layouts in the dry run" in capsys.readouterr().err


def test_a_local_gpu_is_known_by_its_cuda_name():
    from megagpt.gpus import KNOWN_GPUS, _spec_by_device_name

    assert _spec_by_device_name("NVIDIA H100 80GB HBM3", 79.6) is KNOWN_GPUS["H100-SXM"].spec
    assert _spec_by_device_name("NVIDIA A100-SXM4-40GB", 39.4) is KNOWN_GPUS["A100-40GB"].spec
    assert _spec_by_device_name("NVIDIA H100 PCIe", 79.6) is None

"""Pieces of the benchmark scripts that run without a GPU."""

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from helpers import REPO, fetched_or_skip

sys.path.insert(0, str(REPO / "bench"))


def test_profile_kernel_kinds():
    from profile_entry import kernel_categories

    names = {
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": 10.0,
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": 4.0,
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>": 0.5,
        "triton_poi_fused__unsafe_view_add_gelu_3": 2.0,
        "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float>>": 1.0,
        "void multi_tensor_apply_kernel<FusedAdamMathFunctor>": 3.0,
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": 0.25,
        "some_unknown_kernel": 0.125,
    }
    kinds = kernel_categories(names)
    assert kinds["matmul (cuBLAS / CUTLASS)"] == 10.0
    assert kinds["attention (SDPA: cuDNN / flash / efficient)"] == 4.5
    assert kinds["compiled elementwise / reductions (triton)"] == 2.0
    assert kinds["aten reductions"] == 1.0
    assert kinds["optimizer (multi-tensor / fused Adam)"] == 3.0
    assert kinds["communication (NCCL)"] == 0.25
    assert kinds["other"] == 0.125
    assert sum(kinds.values()) == sum(names.values())


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1, "args": args}


def test_gpu_timeline_gaps_count_idle_between_gpu_activity_only():
    from profile_entry import gpu_timeline_gaps

    events = [
        _x("kernel", "a", 0, 10), _x("kernel", "b", 5, 10),  # overlapping: no gap
        _x("gpu_memset", "zero", 17, 1),  # 2 us gap
        _x("kernel", "graph_first", 118, 2),  # 100 us gap: waited for the host
        _x("python_function", "host.py", 0, 500),  # host activity is not GPU activity
    ]
    lines = gpu_timeline_gaps(events, iters=2)
    assert "120.00 ms" not in lines[0] and "0.12 ms from first to last" in lines[0]
    assert "idle 0.10 ms" in lines[0] and "in 2 gaps" in lines[0]
    assert "gaps under 5 us: 0.00 ms" in lines[0]
    assert "zero  >  graph_first" in lines[1] and "b  >  zero" in lines[2]


def test_launch_stacks_name_the_frames_around_each_launch():
    from profile_entry import launch_stacks

    events = [
        _x("python_function", "ddp.py(10): hook", 0, 100),
        _x("cpu_op", "aten::sum", 10, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 12, 2, correlation=7),
        _x("kernel", "reduce_kernel<float>", 50, 5, correlation=7),
        _x("cuda_runtime", "cudaLaunchKernel", 200, 2, correlation=8),
        _x("kernel", "other_kernel", 250, 5, correlation=8),
    ]
    lines = launch_stacks(events, "reduce_kernel")
    assert lines[0].startswith("launches of kernels matching 'reduce_kernel': 1")
    assert lines[1].split() == ["1x", "ddp.py(10):", "hook", ">", "aten::sum"]


def test_layout_log_parsing_and_comparison():
    from layouts import compare, parse_log

    log = "\n".join(
        f" [t] iteration {i}/ 4 | consumed samples: {8 * i} | elapsed time per iteration (ms):"
        f" {100 + i}.0 | throughput per GPU (TFLOP/s/GPU): {300 + i}.0 | lm loss: {10 - i}.5E+00 |"
        for i in range(1, 5))
    parsed = parse_log(log + "\nerror: something refused\n", skip=1)
    assert parsed["losses"] == {1: 9.5, 2: 8.5, 3: 7.5, 4: 6.5}
    assert parsed["ms_per_iter"] == 103.0 and parsed["tflops_per_gpu"] == 303.0
    assert parsed["error"] == "something refused"
    other = {"losses": {1: 9.5, 2: 8.6, 3: 7.5, 5: 1.0}}
    c = compare(parsed, other)
    assert c["iterations"] == 3 and abs(c["max_abs_diff"] - 0.1) < 1e-9
    assert compare(parsed, other, first=3)["iterations"] == 1


def test_run_logged_timeout_ends_the_launchers_workers_too(tmp_path):
    """A launcher that times out takes its workers with it, also workers in sessions of
    their own, as torchrun starts them (they would otherwise keep the GPUs busy through the
    runs after it: seen on two H200s)."""
    import time

    from bench_throughput import run_logged

    pid_file = tmp_path / "worker.pid"
    # a "launcher" that starts a long-lived worker and waits for it, as torchrun does
    script = (f"import signal, subprocess, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
              f"start_new_session=True); open({str(pid_file)!r}, 'w').write(str(w.pid)); "
              f"print('started', flush=True); w.wait()")
    text, rc, wall_s = run_logged([sys.executable, "-c", script], tmp_path / "log.txt", 3)
    assert rc == "timeout" and wall_s < 40  # 3 s, then 15 s of grace for a deaf launcher
    assert "started" in (tmp_path / "log.txt").read_text()
    worker = int(pid_file.read_text())
    for _ in range(50):  # the kill is asynchronous; give the kernel a moment to reap
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"worker {worker} outlived the timed-out launcher")


def test_run_logged_returns_output_and_exit_status(tmp_path):
    from bench_throughput import run_logged

    text, rc, _ = run_logged([sys.executable, "-c", "print('hello'); raise SystemExit(3)"],
                             tmp_path / "log.txt", 30)
    assert rc == 3 and "hello" in text


def test_layouts_resume_pads_the_vocabulary_alike_under_both_layouts(tmp_path):

    from layouts import same_vocab_padding, tokenizer_vocab_size

    vocab_file = tmp_path / "vocab.json"
    vocab_file.write_text(json.dumps({f"t{i}": i for i in range(50257)}))
    gpt2 = tokenizer_vocab_size(["--data-path", "x", "--vocab-file", str(vocab_file)])
    assert gpt2 == 50257
    assert same_vocab_padding("tp2", "pp2", gpt2) == ["--make-vocab-size-divisible-by", "64"]
    assert same_vocab_padding("pp2", "tp2", gpt2) == ["--make-vocab-size-divisible-by", "64"]
    assert same_vocab_padding("dp2", "pp2", gpt2) == []  # one TP size: nothing to align
    mock = tokenizer_vocab_size(["--mock-data", "--vocab-size", "512"])
    assert same_vocab_padding("tp2", "pp2", mock) == []  # 512 pads alike already
    assert same_vocab_padding("tp2", "pp2", None) == []


def test_analyse_reports_on_a_trace_megatron_wrote(tmp_path):
    """megatron's --use-pytorch-profiler writes rank-N.json.gz without our iteration
    annotations: the report gives the busy share of the whole window and per-iteration
    kernel times for the iterations the caller says it spans."""
    import gzip

    from profile_entry import main

    events = [_x("kernel", "nvjet_sm90_tst_256x128_NNT", 0, 300),
              _x("kernel", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 1000, 100),
              _x("kernel", "nvjet_sm90_tst_256x128_NNT", 3900, 100)]
    trace = tmp_path / "rank-0.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    from io import StringIO
    from contextlib import redirect_stdout

    out = StringIO()
    with redirect_stdout(out):
        assert main(["--analyse", str(trace), "--iters", "2"]) == 0
    text = out.getvalue()
    assert "GPU busy 0.50 ms of the 4.00 ms from the first GPU activity to the last (12.5 %)" \
        in text
    assert "0.20  matmul (cuBLAS / CUTLASS)" in text  # 0.4 ms over 2 iterations
    assert "0.05  communication (NCCL)" in text


def test_bench_layer_settings_and_kernel_summary():
    from bench_layer import SETTINGS, _fp8_arguments, settings, summarise_kernels

    chosen = settings(["default", "no mix-order"], [32])
    assert chosen == {"default": {}, "no mix-order": {"triton.mix_order_reduction": False},
                      "mix-order 32": {"triton.mix_order_reduction_split_size": 32}}
    assert set(SETTINGS) >= {"default", "no mix-order", "multi-kernel"}
    for name, grads in (("fp8 delayed", False), ("fp8 delayed gradients", True)):
        arguments = _fp8_arguments(SETTINGS[name]["_fp8"], "cpu")
        assert arguments["fp8"].delayed and arguments["fp8"].delayed_grads == grads
        assert arguments["fp8_history"].shape[1] == 12 and not arguments["fp8_warm"]
    summary = summarise_kernels({
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": 2.0,
        "triton_per_fused__unsafe_view_add_native_layer_norm_backward_2": 0.25,
        "void at::native::reduce_kernel<128, 4>": 0.125,
        "triton_red_fused_sum_4": 0.5,
        "triton_poi_fused_gelu_view_2": 1.0,
        "_cast_transpose_kernel": 0.5,
    })
    assert summary == {"kernels_ms": 4.375, "norm_and_sum_kernels_ms": 0.875,
                       "by_kind_ms": {"gemm": 2.0, "fused (inductor)": 1.75, "other": 0.125,
                                      "fp8 cast": 0.5}}


@pytest.mark.gpu
def test_bench_layer_runs_on_a_gpu():
    """The script end to end on a tiny layer: every setting compiles, captures and times."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import bench_layer

    results = {}
    for name in ("default", "no mix-order"):
        results.update(bench_layer.main(["--shapes", "tiny", "--settings", name])["tiny"])
    for name in ("default", "no mix-order"):
        row = results[name]
        assert row["wall_ms"] > 0 and row["kernels_ms"] > 0
        assert any("layer_norm" in k for k in row["kernels"]), row["kernels"]


def test_throughput_runs_train_on_mock_data_or_the_given_data(embedded_corpus_flags):
    """Mock data by default; ``--corpus`` / ``--data-args`` put real data flags in its place."""
    from bench_throughput import MOCK_DATA, shape_flags

    mock = shape_flags("345M", 20, 10, 1234)
    assert mock[mock.index("--mock-data"):][:len(MOCK_DATA)] == MOCK_DATA
    real = shape_flags("345M", 20, 10, 1234, embedded_corpus_flags)
    assert "--mock-data" not in real and "NullTokenizer" not in real
    prefix = real[real.index("--data-path") + 1]
    assert Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file()
    assert real[real.index("--tokenizer-type") + 1] == "GPT2BPETokenizer"
    # the rest of the run is the same
    strip = lambda flags, data: [f for f in flags if f not in data]  # noqa: E731
    assert strip(real, embedded_corpus_flags) == strip(mock, MOCK_DATA)


def test_throughput_micro_batches_set_the_global_batch_and_the_flops():
    """``--micro-batch`` / ``--micro-batches``: the entry's batch flags, and the FLOPs the
    figures divide by count every micro-batch of the step."""
    from bench_throughput import batch_of, shape_flags
    from reference_gpt import megatron_flops

    flags = shape_flags("345M", 20, 10, 1234, micro_batch=4, micro_batches=8)
    assert flags[flags.index("--micro-batch-size") + 1] == "4"
    assert flags[flags.index("--global-batch-size") + 1] == "32"
    assert batch_of("1.3B") == (4, 4) and batch_of("1.3B", None, 8) == (4, 32)
    one = megatron_flops(24, 1024, 16, 1024, 4, 50304)
    assert megatron_flops(24, 1024, 16, 1024, 32, 50304) == pytest.approx(8 * one)


@pytest.fixture()
def embedded_corpus_flags():
    from bench_throughput import corpus_data_flags

    return fetched_or_skip(corpus_data_flags, "embedded corpus")


@pytest.mark.slow
def test_bench_preprocess_end_to_end_times_both_commands_with_identical_outputs(gpt2, tmp_path):
    import subprocess

    from megagpt.data.corpus import ensure_embedded_dataset

    fetched_or_skip(ensure_embedded_dataset, "the embedded corpus")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_preprocess.py"),
                        "--end-to-end", "--mb", "0.05", "--repeat", "1", "--workers", "1",
                        "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "outputs byte-identical: True" in r.stdout
    assert "| megagpt: tools/preprocess_data.py |" in r.stdout


def test_dropout_floor_counts_the_decisions_an_attention_dropout_draws():
    """bench_kernels' floor: one decision per causal score, forward and backward, 24 layers;
    its Philox kernel, run by Triton's interpreter on a CPU (in a process of its own: the
    interpreter is chosen when Triton is imported), keeps 230 of 256 byte values (p = 0.1
    to a byte) with 10 rounds and with 7, and the two draw different numbers."""
    pytest.importorskip("triton")
    import subprocess

    import bench_kernels

    assert bench_kernels.attention_dropout_decisions(8, 16, 1024) == 8 * 16 * 524800 * 2 * 24
    script = (
        "import json, sys; sys.path.insert(0, 'bench'); import bench_kernels\n"
        "draw = bench_kernels._keep_count_kernel()\n"
        "print(json.dumps({r: draw(16 * 1024 * 8, 0.1, r).tolist() for r in (10, 7)}))\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    counts = json.loads(r.stdout.splitlines()[-1])
    for rounds, per_program in counts.items():
        kept = sum(per_program) / (len(per_program) * 1024 * 16)
        assert len(per_program) == 8 and abs(kept - 230 / 256) < 0.003, (rounds, kept)
    assert counts["10"] != counts["7"]


@pytest.mark.gpu
def test_bench_dropout_forms_drop_what_they_should_on_a_gpu(tmp_path):
    """Every residual-dropout form of bench_dropout.py keeps ~90 % of the elements (all of
    them without dropout), and each mask kernel is timed."""

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import bench_dropout

    assert bench_dropout.main(["--shapes", "345M", "--out", str(tmp_path / "d.json")]) == 0
    forms = json.loads((tmp_path / "d.json").read_text())["345M"]
    for name, row in forms.items():
        if "kept" in row:
            expected = 1.0 if "no dropout" in name else 0.9
            assert abs(row["kept"] - expected) < 0.005, (name, row)
            assert row["us_fwd_bwd"] > 0
        else:
            assert row["us"] > 0, name


def test_run_info_names_the_given_commit_else_the_checkouts(monkeypatch):
    """A record's commit: MEGAGPT_COMMIT where it is set (a copy over a stale checkout), else
    the checkout's HEAD (with +changes when tracked files differ)."""
    import subprocess

    from run_info import ROOT, commit

    monkeypatch.setenv("MEGAGPT_COMMIT", "abc1234")
    assert commit() == "abc1234"
    monkeypatch.delenv("MEGAGPT_COMMIT")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    assert commit().removesuffix("+changes") == head


def test_an_archive_unpacked_inside_the_checkout_is_its_own_commit(tmp_path):
    """``--entry-of base=DIR/pretrain_gpt.py`` with DIR another commit's ``git archive``
    unpacked under this checkout (git ignores it): DIR's commit is what DIR/COMMIT names, and
    never this checkout's HEAD (which every such comparison recorded as its own base)."""
    import shutil
    import subprocess

    from run_info import checkout_commit

    subprocess.run(["git", "init", "-q", str(tmp_path / "repo")], check=True)
    repo = tmp_path / "repo"
    (repo / "a.txt").write_text("a")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(git + ["add", "a.txt"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "a"], check=True)
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert checkout_commit(repo) == head
    base = repo / ".bench-base"
    base.mkdir()
    assert checkout_commit(base) is None  # git answers with repo's HEAD there
    (base / "COMMIT").write_text("915d805\n")
    assert checkout_commit(base) == "915d805"
    outside = tmp_path / "copied"
    shutil.copytree(base, outside)
    assert checkout_commit(outside) == "915d805"


def test_fp8_losses_figures():
    """bench/fp8_losses.py's goal figures from losses made up so that each one is known."""
    import fp8_losses

    bf16 = {i: 10.0 - i / 100 for i in range(1, 301)}
    fp8 = {i: v * (1.004 if i != 120 else 1.03) for i, v in bf16.items()}
    tefp8 = {i: v * 1.002 for i, v in bf16.items()}
    figures = fp8_losses.tracking_figures(dict(bf16=bf16, fp8=fp8, tefp8=tefp8), warmup=30)
    assert figures["fp8_over_bf16"] == pytest.approx(0.004, rel=1e-9)
    assert figures["fp8_over_tefp8"] == pytest.approx(1.004 / 1.002 - 1, rel=1e-9)
    assert figures["fp8_largest_excursion_over_bf16"] == dict(iteration=120,
                                                              relative=pytest.approx(0.03))
    assert figures["holds"] and figures["nonfinite"] == dict(bf16=[], fp8=[], tefp8=[])
    # the last 50 iterations only; a NaN anywhere, or FP8 too far above TE's, fails
    assert fp8_losses.mean_last({1: 100.0, **{i: 2.0 for i in range(2, 52)}}) == 2.0
    fp8[7] = float("nan")
    assert not fp8_losses.tracking_figures(dict(bf16=bf16, fp8=fp8), warmup=30)["holds"]
    slower = {i: v * 1.008 for i, v in bf16.items()}
    assert not fp8_losses.tracking_figures(dict(bf16=bf16, fp8=slower, tefp8=bf16),
                                           warmup=30)["holds"]
    assert fp8_losses.largest_relative_difference({151: 2.02}, {151: 2.0, 152: 1.9}) == \
        pytest.approx(0.01)
    # with TE's bf16 beside: how much of TE's curve is its FP8, and how much its layers
    tebf16 = {i: v * 0.99 for i, v in bf16.items()}
    figures = fp8_losses.tracking_figures(dict(bf16=bf16, fp8=slower, tefp8=tefp8,
                                               tebf16=tebf16), warmup=30)
    assert figures["tefp8_over_tebf16"] == pytest.approx(1.002 / 0.99 - 1, rel=1e-9)
    assert figures["tebf16_over_bf16"] == pytest.approx(-0.01, rel=1e-9)


def test_fp8_losses_compares_current_scaling_with_current_scaling():
    """fp8cs and tefp8cs (--fp8-recipe tensorwise on both sides) are held to each other by
    the same 0.5 % bound as the delayed-scaling pair, and the shape reaches the entry."""
    import fp8_losses

    bf16 = {i: 5.0 for i in range(1, 301)}
    runs = dict(bf16=bf16, fp8=bf16, fp8cs={i: 5.02 for i in bf16},
                tefp8cs={i: 5.0 for i in bf16})
    figures = fp8_losses.tracking_figures(runs, warmup=30)
    assert figures["fp8cs_over_tefp8cs"] == pytest.approx(0.004)
    assert figures["over_bf16"]["fp8cs"] == pytest.approx(0.004) and figures["holds"]
    runs["fp8cs"] = {i: 5.03 for i in bf16}
    assert not fp8_losses.tracking_figures(runs, warmup=30)["holds"]
    for name in ("fp8cs", "tefp8cs"):
        flags = fp8_losses.PRECISIONS[name]
        assert flags[flags.index("--fp8-recipe") + 1] == "tensorwise"
    assert fp8_losses.chosen_precisions("tefp8cs,fp8cs", te=True) == ["fp8cs", "tefp8cs"]
    with pytest.raises(SystemExit, match="give --te-site"):
        fp8_losses.chosen_precisions("tefp8cs", te=False)
    argv = fp8_losses.entry_argv("fp8cs", 300, ["--mock-data"], shape="1.3B")
    assert argv[argv.index("--hidden-size") + 1] == "2048"
    assert argv[argv.index("--micro-batch-size") + 1] == "4"


def test_fp8_losses_holds_te_started_delayed_scaling_to_tes():
    """fp8unit (the fast spec's delayed scaling started with scales of 1, as TE's) is held to
    TE's delayed scaling, and its flags reach the entry's parser."""
    import fp8_losses
    from megagpt.command_line.fast_path_options import add_fast_path_arguments

    bf16 = {i: 5.0 for i in range(1, 301)}
    figures = fp8_losses.tracking_figures(
        dict(bf16=bf16, fp8=bf16, fp8unit={i: 4.98 for i in bf16},
             tefp8={i: 4.97 for i in bf16}), warmup=30)
    assert figures["fp8unit_over_tefp8"] == pytest.approx(4.98 / 4.97 - 1)
    # without the default recipe's run: TE's recipe alone is held, to bf16 and to TE's
    figures = fp8_losses.tracking_figures(
        dict(bf16=bf16, fp8te={i: 4.99 for i in bf16}, tefp8={i: 4.97 for i in bf16}),
        warmup=30)
    assert "fp8_over_bf16" not in figures and figures["holds"]
    assert figures["fp8te_over_bf16"] == pytest.approx(-0.002)
    assert not fp8_losses.tracking_figures(
        dict(bf16=bf16, fp8te={i: 5.0 for i in bf16}, tefp8={i: 4.97 for i in bf16}),
        warmup=30)["holds"]
    argv = fp8_losses.entry_argv("fp8unit", 300, ["--mock-data"])
    parsed, _ = add_fast_path_arguments(argparse.ArgumentParser()).parse_known_args(argv)
    assert (parsed.fast_fp8_first_scales, parsed.fast_fp8_grad_scaling) == ("unit", "current")
    parsed, _ = add_fast_path_arguments(argparse.ArgumentParser()).parse_known_args(
        fp8_losses.entry_argv("fp8own", 300, ["--mock-data"]))
    assert (parsed.fast_fp8_first_scales, parsed.fast_fp8_grad_scaling) == ("amax", "current")
    parsed, _ = add_fast_path_arguments(argparse.ArgumentParser()).parse_known_args(
        fp8_losses.entry_argv("fp8te", 300, ["--mock-data"]))
    assert (parsed.fast_fp8_first_scales, parsed.fast_fp8_grad_scaling) == ("unit", "delayed")


def test_fp8_losses_figures_over_seeds():
    """With several seeds per precision the goal compares the seeds' average of the last-50
    means, and says each precision's spread; the excursion is the first seed's."""
    import fp8_losses

    def run(level, bump_at=None):
        return {i: (level + (0.5 if i == bump_at else 0.0)) for i in range(1, 301)}

    seeded = dict(bf16=[run(5.0), run(5.1)], fp8=[run(5.02, bump_at=200), run(5.08)],
                  tefp8=[run(5.0), run(5.0)])
    figures = fp8_losses.tracking_figures(seeded, warmup=30)
    assert figures["mean_last_50"]["bf16"] == pytest.approx(5.05)
    # fp8's average over its seeds: the bump at 200 is outside the last 50
    assert figures["fp8_over_bf16"] == pytest.approx(5.05 / 5.05 - 1, abs=1e-12)
    assert figures["fp8_over_tefp8"] == pytest.approx(5.05 / 5.0 - 1)
    assert figures["seeds"] == dict(bf16=2, fp8=2, tefp8=2)
    assert figures["seed_spread"]["bf16"] == pytest.approx(0.1 / 5.05)
    assert figures["seed_spread"]["tefp8"] == 0.0
    assert figures["fp8_largest_excursion_over_bf16"]["iteration"] == 200
    assert not figures["holds"]  # 1 % above TE's FP8
    # one run per precision says nothing about seeds
    assert "seed_spread" not in fp8_losses.tracking_figures(
        dict(bf16=run(5.0), fp8=[run(5.0)]), warmup=30)
    assert fp8_losses.seeded_name("fp8", 0) == "fp8"
    assert fp8_losses.seeded_name("fp8", 2) == "fp8-seed2"


def test_fp8_losses_precisions_and_an_earlier_invocations_losses(tmp_path):
    """--precisions picks the runs (TE's only with a TE site, an unknown name refused);
    --also reads the CSV an earlier invocation wrote, blanks left out, and its runs stand
    beside this one's in the figures, each against bf16."""
    import fp8_losses

    assert fp8_losses.chosen_precisions(None, te=False) == ["bf16", "fp8"]
    assert fp8_losses.chosen_precisions(None, te=True) == ["bf16", "fp8", "tefp8", "tebf16"]
    assert fp8_losses.chosen_precisions("local,bf16", te=False) == ["bf16", "local"]
    with pytest.raises(SystemExit, match="unknown fp16"):
        fp8_losses.chosen_precisions("bf16,fp16", te=True)
    with pytest.raises(SystemExit, match="give --te-site"):
        fp8_losses.chosen_precisions("tebf16", te=False)
    # megatron's own layers and step: nothing of the fast path
    local = fp8_losses.PRECISIONS["local"]
    assert "--no-fast-spec" in local and "optimizer,lm-loss" in " ".join(local)
    assert "--no-fast-spec" not in fp8_losses.PRECISIONS["fastlayers"]
    # the attention kernel's references: the fast path's own runs with flash attention
    assert fp8_losses.PRECISIONS["bf16flash"] == ["--attention-backend", "flash"]
    assert fp8_losses.PRECISIONS["fp8flash"] == (fp8_losses.PRECISIONS["fp8"]
                                                 + ["--attention-backend", "flash"])

    (tmp_path / "fp8_losses.csv").write_text(
        "iteration,bf16,local,local-seed1\n1,5.0,5.1,\n2,4.0,4.1,4.2\n")
    runs = fp8_losses.read_losses(tmp_path / "fp8_losses.csv")
    assert runs == {"bf16": {1: 5.0, 2: 4.0}, "local": {1: 5.1, 2: 4.1}, "local-seed1": {2: 4.2}}
    with pytest.raises(SystemExit, match="no .*missing"):
        fp8_losses.read_losses(tmp_path / "missing" / "fp8_losses.csv")

    flat = {i: 5.0 for i in range(1, 301)}
    figures = fp8_losses.tracking_figures(
        dict(bf16=flat, fp8=flat, local={i: 5.05 for i in flat}), warmup=30)
    assert figures["over_bf16"]["local"] == pytest.approx(0.01)
    assert figures["over_bf16"]["fp8"] == 0.0


@pytest.mark.slow
def test_grad_agreement_measures_each_parameters_gradient_against_fp32(tmp_path):
    """bench/grad_agreement.py on the CPU (tiny shape, 2 layers): every parameter kind of each
    path is compared with the fp32 local model's gradients, and the fast spec's bf16
    gradients, its fused layer eager and with torch's math attention kernel, are no further
    from them than megatron's local layers' (within a factor); a backend on the local path
    is refused in one line."""
    import subprocess

    out = tmp_path / "grads.json"
    script = [sys.executable, str(REPO / "bench" / "grad_agreement.py"), "--shape", "tiny",
              "--layers", "2"]
    r = subprocess.run(script + ["--paths", "local,fast,fast@unfused", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    local = report["paths"]["local"]["kinds"]
    assert {"input_layernorm.weight", "self_attention.linear_qkv.weight", "mlp.linear_fc2.bias",
            "embedding.word_embeddings.weight", "output_layer.weight"} <= local.keys()
    for path in ("fast", "fast@unfused"):
        kinds = report["paths"][path]["kinds"]
        assert kinds.keys() == local.keys()
        for kind, figures in kinds.items():
            assert 0 < figures["rel_err"] < 0.05, (path, kind, figures)
            assert figures["rel_err"] <= 2 * local[kind]["rel_err"] + 1e-3, (path, kind)
            assert figures["sign_wrong"] < 0.02, (path, kind, figures)
            assert figures["adam_sign_wrong"] < 0.05, (path, kind, figures)
    assert "rel err" in r.stdout and "fast@unfused" in r.stdout

    refused = subprocess.run(script + ["--paths", "local@flash"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "error: --paths: 'local@flash'" in refused.stderr


@pytest.mark.slow
def test_early_steps_eager_layer_rounds_as_megatrons_layers(tmp_path):
    """bench/early_steps.py on the CPU: at the weights two Adam steps from initialisation
    (biases about 1e-5) the fused layer run eagerly gives megatron's local layers' bf16 loss
    to 5e-5 (it lost those biases in the residual sums, 2.4e-4 apart, before it rounded them
    once), and both stay within 1e-3 of fp32's."""
    import subprocess

    out = tmp_path / "early.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "early_steps.py"), "--paths",
                        "local,fast", "--json", str(out)], cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["lrs"] == [0.0, pytest.approx(1e-5)]
    local, fast = report["paths"]["local"], report["paths"]["fast"]
    assert report["fp32"]["stepped"] < report["fp32"]["init"]  # the two steps moved it
    assert abs(fast["stepped"] / local["stepped"] - 1) < 5e-5, r.stdout
    for figures in (local, fast):
        assert abs(figures["stepped_vs_fp32"]) < 1e-3 and abs(figures["init_vs_fp32"]) < 1e-3
    assert "two steps on" in r.stdout


@pytest.mark.gpu
def test_fast_spec_gradients_on_a_gpu_as_close_to_fp32_as_megatrons(tmp_path):
    """On the GPU, with the kernels a launch runs (the compiled fused layer, the attention
    kernel torch picks), one step's bf16 gradients of the fast spec's layers are as close to
    the same weights' fp32 gradients as megatron's local layers' are, for every parameter
    kind of the layers (345M width, 4 layers)."""
    import subprocess

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "grads.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "grad_agreement.py"), "--shape",
                        "345M", "--layers", "4", "--paths", "local,fast-compiled", "--json",
                        str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)
    paths = json.loads(out.read_text())["paths"]
    local, fast = paths["local"]["kinds"], paths["fast-compiled"]["kinds"]
    worse = {kind: (fast[kind]["rel_err"], local[kind]["rel_err"]) for kind in local
             if fast[kind]["rel_err"] > 1.5 * local[kind]["rel_err"] + 1e-3}
    assert not worse, f"fast spec's gradients further from fp32 than megatron's: {worse}"


def test_sdpa_agreement_compares_each_layout_and_compile_with_fp32(tmp_path):
    """bench/sdpa_agreement.py on the CPU (the math kernel, tiny shape): strided and
    contiguous inputs, eager and compiled, each compared with fp32 on the same inputs; bf16
    rounding alone separates them (a few 1e-3), and no sign of a gradient is lost."""
    import subprocess

    out = tmp_path / "sdpa.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "sdpa_agreement.py"), "--shape",
                        "tiny", "--sharpness", "8", "--json", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(x["sharpness"], x["layout"], x["compiled"]) for x in rows} == {
        (8.0, layout, c) for layout in ("strided", "contiguous")
        for c in (False, True)}
    for row in rows:
        for name in ("out", "dq", "dk", "dv"):
            assert 0 < row[name]["rel_err"] < 1e-2, (row, name)
        assert row["dq"]["sign_wrong"] < 0.01 and row["dk"]["sign_wrong"] < 0.01, row


@pytest.mark.gpu
def test_sdpa_kernels_on_a_gpu_as_close_to_fp32_in_the_fused_layers_layout(tmp_path):
    """On the GPU, cuDNN's attention gradients in the strided layout the fused layer hands
    SDPA are as close to fp32's as flash's (within 1.5x), eager and compiled (345M's heads)."""
    import subprocess

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "sdpa.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "sdpa_agreement.py"), "--shape",
                        "345M", "--kernels", "cudnn,flash", "--json", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)
    rows = {(x["sharpness"], x["kernel"], x["layout"], x["compiled"]): x
            for x in json.loads(out.read_text())["rows"]}
    for (sharpness, kernel, layout, compiled), row in rows.items():
        if kernel != "cudnn":
            continue
        flash = rows[(sharpness, "flash", layout, compiled)]
        for name in ("out", "dq", "dk", "dv"):
            assert row[name]["rel_err"] <= 1.5 * flash[name]["rel_err"], (row, flash, name)


def test_fp8_losses_phases_run_at_most_parallel_launches_at_once(tmp_path):
    import fp8_losses
    # each launch notes when it started and ended; a batch waits for the one before it
    script = ("import sys, time; t0 = time.time(); time.sleep(0.5); "
              "print(sys.argv[1], t0, time.time())")
    launches = [(f"r{i}", [sys.executable, "-c", script, f"r{i}"], dict(os.environ))
                for i in range(3)]
    results = fp8_losses.run_phase(launches, tmp_path, timeout=60, parallel=2)
    assert list(results) == ["r0", "r1", "r2"]
    assert all(r["rc"] == 0 for r in results.values())
    spans = {}
    for name in results:
        _, start, end = (tmp_path / f"{name}.log").read_text().split()
        spans[name] = (float(start), float(end))
    assert spans["r2"][0] >= max(spans["r0"][1], spans["r1"][1])
    assert spans["r1"][0] < spans["r0"][1]  # the first two shared the time


def test_fp8_losses_resume_folder_points_at_the_half_way_iteration(tmp_path):
    import fp8_losses

    saved = tmp_path / "saved"
    (saved / "iter_0000150").mkdir(parents=True)
    (saved / "iter_0000300").mkdir()
    (saved / "latest_checkpointed_iteration.txt").write_text("300")
    folder = fp8_losses.resume_folder(saved, 150, tmp_path / "resume")
    assert (folder / "latest_checkpointed_iteration.txt").read_text() == "150"
    assert sorted(x.name for x in folder.iterdir()) == ["iter_0000150",
                                                        "latest_checkpointed_iteration.txt"]
    assert (folder / "iter_0000150").resolve() == (saved / "iter_0000150").resolve()


def _fp8_call_output(shape, date, ms):
    """bench_throughput.py's output of one invocation: ``ms`` per path."""
    info = dict(date=date, commit="abc1234", machine="NVIDIA H100 80GB HBM3",
                versions={"torch": "2.11.0", "megatron-core": "0.19.2"}, shape=shape,
                command=f"python bench/bench_throughput.py --shape {shape} --out /tmp/x/a")
    return dict(info=info, results={p: dict(ms_per_iter=v, tflops_per_gpu=47940.0 / v)
                                    for p, v in ms.items()})


def test_fp8_records_of_the_weights_step_name_the_forwards_own_cast():
    """bench/gpu_fp8.sh's ``weights`` step: the fast path's bf16, FP8 with its weights
    written by the optimizer and FP8 with the forward's own cast, then TE's FP8; one record
    per path, its table row named."""
    import fp8_records
    import tables
    from table_specs import TABLES

    outputs = [_fp8_call_output("wide", "2026-12-08 10:00 UTC",
                                {"fast": 96.2, "fp8": 74.0, "fp8cast": 77.1}),
               _fp8_call_output("wide", "2026-12-08 10:04 UTC", {"tefp8": 86.8})]
    made = {r["row"]["path"]: r for r in fp8_records.make_records(outputs)}
    assert list(made) == ["fast", "fp8", "fp8cast", "tefp8"]
    assert made["fp8cast"]["figures"]["vs_fast_bf16"] == round(96.2 / 77.1, 3)
    assert made["fp8"]["figures"]["vs_te_fp8"] == round(86.8 / 74.0, 3)
    spec = next(t for t in TABLES if t.name == "fp8-fast")
    text = "\n".join(tables.render_table(spec, list(made.values()), list(made.values())))
    assert ("| wide | 2026-12-08 10:00 UTC | fast path, FP8, delayed scaling, weights cast in "
            "the forward | 77.1 |") in text


def test_fp8_records_of_one_call_set_each_row_against_fast_bf16_and_tes_fp8(tmp_path):
    """bench/gpu_fp8.sh's three invocations of one call (the fast path's rows, TE's rows, the
    earlier recipe with a second bf16 run) become one record per path, each against the
    call's first bf16 run and TE's delayed-scaling FP8, keyed by the call's first date."""
    import fp8_records
    import records
    import tables
    from table_specs import TABLES

    outputs = [_fp8_call_output("wide", "2026-12-07 09:41 UTC",
                                {"fast": 99.9, "fp8": 78.7, "referencefp8": 103.0}),
               _fp8_call_output("wide", "2026-12-07 09:44 UTC",
                                {"tefp8": 86.8, "tefp8cs": 89.8}),
               _fp8_call_output("wide", "2026-12-07 09:46 UTC",
                                {"fast": 98.0, "fp8own": 80.0})]
    made = {r["row"]["path"]: r for r in fp8_records.make_records(
        outputs, note="one call", te_version="2.20.2", torchao_version="0.18.0")}
    assert list(made) == ["fast", "fp8", "referencefp8", "tefp8", "tefp8cs", "fp8own"]
    assert {r["row"]["call"] for r in made.values()} == {"2026-12-07 09:41 UTC"}
    assert made["fp8"]["figures"] == dict(ms_per_iter=78.7, tflops_per_gpu=609.1,
                                          vs_fast_bf16=round(99.9 / 78.7, 3),
                                          vs_te_fp8=round(86.8 / 78.7, 3))
    assert made["fast"]["figures"]["ms_per_iter"] == 99.9  # the call's first bf16 run
    assert made["fp8own"]["figures"]["vs_fast_bf16"] == round(99.9 / 80.0, 3)
    assert made["tefp8"]["versions"]["transformer-engine"] == "2.20.2"
    assert "transformer-engine" not in made["fp8"]["versions"]
    assert made["referencefp8"]["versions"]["torchao"] == "0.18.0"
    assert made["tefp8"]["date"] == "2026-12-07 09:44 UTC"
    assert made["fp8"]["command"].endswith("--out OUT")
    assert all(records.problems(r) == [] for r in made.values())
    spec = next(t for t in TABLES if t.name == "fp8-fast")
    text = "\n".join(tables.render_table(spec, list(made.values()), list(made.values())))
    assert "| wide | 2026-12-07 09:41 UTC | fast path, FP8, delayed scaling | 78.7 |" in text
    with pytest.raises(ValueError, match="one shape per run"):
        fp8_records.make_records([outputs[0], _fp8_call_output("1.3B", "x", {"fast": 1.0})])
    # the command line: a missing output is one error line, nothing written
    assert fp8_records.main([str(tmp_path / "none.json")]) == 2

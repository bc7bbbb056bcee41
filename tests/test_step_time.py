"""The step-time model against published runs and this project's own measurements.

Each published row is compared as iteration time: the published TFLOP/s per GPU are turned
back into seconds per iteration with the FLOP count the publication used. Every row must be
within ±15 % and the median |error| of the published rows at most 8 %; the project's H200
rows (bench/benchmarks.md) within ±10 %. Assumptions where a publication leaves a setting out
are stated with its table; ``python tests/test_step_time.py`` prints the tables for
bench/notes/cost-model.md.
"""

import contextlib
import io
import statistics

import pytest

from megagpt.gpus import KNOWN_GPUS
from megagpt.preflight.step_time import StepShape, bus_bandwidth, estimate_step

A100 = KNOWN_GPUS["A100-80GB"].spec
H100 = KNOWN_GPUS["H100-SXM"].spec

# ---------------------------------------------------------------------------------------------
# Narayanan et al. 2021 (arXiv 2104.04473), Table 1: A100-80GB (Selene), fp16, sequence 2048,
# vocabulary 51,200, activation recompute. Their TFLOP/s count the recomputed forward:
# 96·B·s·l·h²·(1 + s/6h + V/16lh) FLOPs per iteration.
# Assumed (the table does not say): micro-batch 1, the plain 1F1B schedule, dropout 0.1,
# megatron's fused kernels of the time (unfused attention with the fused softmax, fused Adam),
# fp16 gradients reduced without overlap, no sequence parallelism.
# (name, heads, hidden, layers, TP, PP, GPUs, global batch, TFLOP/s per GPU)
NARAYANAN = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
NARAYANAN_SEQ, NARAYANAN_VOCAB = 2048, 51200


def narayanan_shape(heads, hidden, layers, tp, pp, gpus, batch) -> StepShape:
    return StepShape(
        hidden=hidden, heads=heads, query_groups=heads, head_dim=hidden // heads,
        ffn=4 * hidden, layers=layers, vocab=NARAYANAN_VOCAB, seq=NARAYANAN_SEQ, glu=False,
        micro_batch=1, global_batch=batch, tp=tp, pp=pp, dp=gpus // (tp * pp),
        recompute="full", precision="fp16", path="te", flash_attention=False,
        attention_dropout=0.1, hidden_dropout=0.1, grad_bytes=2)


def narayanan_published_seconds(heads, hidden, layers, tp, pp, gpus, batch, tflops) -> float:
    s, v = NARAYANAN_SEQ, NARAYANAN_VOCAB
    flops = (96 * batch * s * layers * hidden**2
             * (1 + s / (6 * hidden) + v / (16 * layers * hidden)))
    return flops / (tflops * 1e12 * gpus)


# ---------------------------------------------------------------------------------------------
# Megatron-LM README, "Training Speed and Scalability": H100 weak scaling, Megatron-Core 0.8,
# sequence 4096, vocabulary 131,072, bf16 with Transformer Engine, data-parallel
# (--overlap-grad-reduce --overlap-param-gather, distributed optimizer) and tensor-parallel
# (--tp-comm-overlap, sequence parallel) communication overlapped; DP 48 in every row. Its TFLOP/s
# are megatron's count of the time: 72·B·s·l·h²·(1 + s/6h + V/12lh).
# Assumed (the README gives the shapes and batch only in an image): shapes from the parameter
# counts with untied embeddings and 128-wide heads (177B is GPT-3's 96 × 12288, 314B Narayanan's
# 96 × 16384); global batch 1152 (the README's strong-scaling batch), micro-batch 1, the most
# virtual stages up to 8 that divide a stage's layers, megatron's default dropout 0.1.
# (name, hidden, layers, TP, PP, GPUs, TFLOP/s per GPU)
MEGATRON_H100 = [
    ("1.7B", 2048, 24, 1, 1, 48, 408.8),
    ("7.1B", 4096, 30, 2, 1, 96, 465.9),
    ("16B", 6144, 32, 4, 1, 192, 489.1),
    ("32B", 6144, 68, 8, 1, 384, 459.6),
    ("70B", 8192, 84, 8, 2, 768, 419.7),
    ("119B", 10240, 92, 8, 4, 1536, 420.5),
    ("177B", 12288, 96, 8, 6, 2304, 432.8),
    ("314B", 16384, 96, 8, 8, 3072, 474.4),
    ("462B", 18432, 112, 8, 16, 6144, 459.9),
]
H100_SEQ, H100_VOCAB, H100_BATCH = 4096, 131072, 1152


def _virtual_stages(layers: int, pp: int) -> int:
    if pp == 1:
        return 1
    return max(v for v in range(1, 9) if (layers // pp) % v == 0)


def megatron_h100_shape(hidden, layers, tp, pp, gpus) -> StepShape:
    return StepShape(
        hidden=hidden, heads=hidden // 128, query_groups=hidden // 128, head_dim=128,
        ffn=4 * hidden, layers=layers, vocab=H100_VOCAB, seq=H100_SEQ, glu=False,
        micro_batch=1, global_batch=H100_BATCH, tp=tp, pp=pp, dp=gpus // (tp * pp),
        virtual_stages=_virtual_stages(layers, pp), sequence_parallel=tp > 1,
        distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
        tp_comm_overlap=tp > 1, precision="bf16", path="te", attention_dropout=0.1,
        hidden_dropout=0.1, grad_bytes=4)


def megatron_h100_published_seconds(hidden, layers, tp, pp, gpus, tflops) -> float:
    s, v, b = H100_SEQ, H100_VOCAB, H100_BATCH
    flops = 72 * b * s * layers * hidden**2 * (1 + s / (6 * hidden) + v / (12 * layers * hidden))
    return flops / (tflops * 1e12 * gpus)


def _params_per_gpu(hidden, layers, tp, pp, vocab, untied=False) -> float:
    return layers // pp * 12 * hidden**2 / tp + vocab * hidden / tp * (1 + untied * (pp == 1))


def narayanan_rows():
    for name, heads, h, l, tp, pp, n, b, tflops in NARAYANAN:
        shape = narayanan_shape(heads, h, l, tp, pp, n, b)
        estimate = estimate_step(shape, A100, _params_per_gpu(h, l, tp, pp, NARAYANAN_VOCAB))
        yield name, estimate, narayanan_published_seconds(heads, h, l, tp, pp, n, b, tflops)


def megatron_h100_rows():
    for name, h, l, tp, pp, n, tflops in MEGATRON_H100:
        shape = megatron_h100_shape(h, l, tp, pp, n)
        estimate = estimate_step(shape, H100, _params_per_gpu(h, l, tp, pp, H100_VOCAB, True))
        yield name, estimate, megatron_h100_published_seconds(h, l, tp, pp, n, tflops)


def _error(estimate, published) -> float:
    return estimate.seconds / published - 1


@pytest.mark.parametrize("row", list(narayanan_rows()), ids=[r[0] for r in NARAYANAN])
def test_narayanan_2021_iteration_time_within_15_percent(row):
    name, estimate, published = row
    assert abs(_error(estimate, published)) <= 0.15, (name, estimate.seconds, published)


@pytest.mark.parametrize("row", list(megatron_h100_rows()), ids=[r[0] for r in MEGATRON_H100])
def test_megatron_h100_weak_scaling_iteration_time_within_15_percent(row):
    name, estimate, published = row
    assert abs(_error(estimate, published)) <= 0.15, (name, estimate.seconds, published)


def test_median_error_over_the_published_runs_is_at_most_8_percent():
    errors = [abs(_error(e, p)) for _, e, p in [*narayanan_rows(), *megatron_h100_rows()]]
    assert statistics.median(errors) <= 0.08


# ---------------------------------------------------------------------------------------------
# This project's H200 rows (bench/benchmarks.md, first table): one GPU, bf16, mock data, global
# batch = micro-batch, through the dry run of the launch line bench/bench_throughput.py uses.
# (shape, path, dropout, ms/iter, peak MiB)
H200_RUNS = [
    ("345M", "local", 0.1, 170.2, 30710),
    ("345M", "fast", 0.1, 48.6, 12315),
    ("345M", "fast", 0.0, 44.7, 12115),
    ("1.3B", "fast", 0.1, 143.2, 33766),
    ("1.3B", "fast", 0.0, 135.0, 33366),
]
BENCH_SHAPES = {"345M": (24, 1024, 16, 1024, 8), "1.3B": (24, 2048, 16, 2048, 4)}
PATH_FLAGS = {"local": ["--no-fast-spec", "--fast-disable", "optimizer,lm-loss"],
              "fast": []}


def h200_plan(shape, path, dropout):
    from megagpt.launch import resolve
    from megagpt.preflight import make_plan

    layers, hidden, heads, seq, mb = BENCH_SHAPES[shape]
    argv = ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", str(seq),
            "--max-position-embeddings", str(seq), "--micro-batch-size", str(mb),
            "--global-batch-size", str(mb), "--train-iters", "30", "--lr", "1.5e-4",
            "--bf16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "50257", "--transformer-impl", "local", "--no-persist-layer-norm",
            "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion",
            "--hidden-dropout", str(dropout), "--attention-dropout", str(dropout),
            *PATH_FLAGS[path], "--dry-run", "--dry-run-world-size", "1", "--gpu-type", "H200"]
    with contextlib.redirect_stdout(io.StringIO()):
        return make_plan(resolve(argv))


@pytest.fixture(scope="module")
def h200_plans():
    return {(s, p, d): h200_plan(s, p, d) for s, p, d, _, _ in H200_RUNS}


@pytest.mark.parametrize("run", H200_RUNS, ids=[f"{r[0]}-{r[1]}-dropout{r[2]}" for r in H200_RUNS])
def test_own_h200_runs_time_and_peak_memory_within_10_percent(run, h200_plans):
    shape, path, dropout, ms, peak_mib = run
    plan = h200_plans[(shape, path, dropout)]
    assert abs(plan.run.step.seconds * 1e3 / ms - 1) <= 0.10
    # torch's max_memory_allocated: the model's total less the runtime reserve
    allocated = (plan.memory.total - plan.memory.reserve) / 2**20
    assert abs(allocated / peak_mib - 1) <= 0.10, (allocated, peak_mib)


# ---------------------------------------------------------------------------------------------
# The model's parts behave as their physics says

def test_interleaving_shrinks_the_bubble_and_overlap_hides_the_dp_reduce():
    base = narayanan_shape(128, 16384, 96, 8, 16, 1920, 2160)
    params = _params_per_gpu(16384, 96, 8, 16, NARAYANAN_VOCAB)
    plain = estimate_step(base, A100, params)
    interleaved = estimate_step(StepShape(**{**base.__dict__, "virtual_stages": 3}), A100, params)
    assert interleaved.parts["pipeline bubble"] == pytest.approx(plain.parts["pipeline bubble"] / 3,
                                                                 rel=0.01)
    small = narayanan_shape(24, 2304, 24, 1, 1, 32, 512)
    p = _params_per_gpu(2304, 24, 1, 1, NARAYANAN_VOCAB)
    exposed = estimate_step(small, A100, p).parts["DP reduce"]
    hidden = estimate_step(StepShape(**{**small.__dict__, "overlap_grad_reduce": True}), A100,
                           p).parts["DP reduce"]
    assert 0 < hidden < exposed


def test_recompute_costs_a_forward_and_tp_across_nodes_is_slower():
    shape = narayanan_shape(64, 8192, 48, 8, 2, 512, 1536)
    params = _params_per_gpu(8192, 48, 8, 2, NARAYANAN_VOCAB)
    full = estimate_step(shape, A100, params)
    none = estimate_step(StepShape(**{**shape.__dict__, "recompute": "none"}), A100, params)
    assert full.seconds / none.seconds == pytest.approx(1.3, abs=0.06)  # ~4/3: one more forward
    across = StepShape(**{**shape.__dict__, "tp": 16, "dp": shape.dp // 2, "heads": 64})
    assert estimate_step(across, A100, params / 2).parts["TP communication"] > \
        8 * full.parts["TP communication"] / 2


def test_each_dp_group_reduces_over_its_own_gpus_nics():
    """Every GPU of a DGX node has its own NIC: at TP 8 (one DP peer per node) the gradient
    all-reduce runs at one NIC's bus bandwidth, the node's other 7 groups beside it on theirs;
    at TP 2 a group's 4 peers in a node send a quarter of the bytes each."""
    shape = narayanan_shape(48, 6144, 40, 8, 1, 256, 1024)
    params = 2.3e9
    ring = 2 * 31 / 32 * params * shape.grad_bytes / bus_bandwidth(A100, inside_node=False)
    assert estimate_step(shape, A100, params).parts["DP reduce"] == pytest.approx(ring, rel=0.01)
    tp2 = StepShape(**{**shape.__dict__, "tp": 2, "pp": 4})
    assert estimate_step(tp2, A100, params).parts["DP reduce"] == pytest.approx(ring / 4, rel=0.01)


def test_unfused_scores_cost_more_through_torch_and_most_with_an_fp32_softmax():
    """The compiled scale-mask-softmax moves 16-bit scores once per step of the chain; torch's
    fallback makes mask and softmax separate passes, and an fp32 softmax casts both ways."""
    shape = narayanan_shape(48, 6144, 40, 8, 1, 256, 1024)
    times = [estimate_step(StepShape(**{**shape.__dict__, **switch}), A100, 2.3e9)
             .parts["attention"] for switch in ({}, {"fused_softmax": False},
                                                {"fused_softmax": False, "softmax_in_fp32": True})]
    assert times[0] < times[1] < times[2]


def test_an_estimate_takes_well_under_a_millisecond():
    import time

    shape = narayanan_shape(160, 25600, 128, 8, 64, 3072, 3072)
    start = time.perf_counter()
    for _ in range(100):
        estimate_step(shape, A100, 1e10)
    assert (time.perf_counter() - start) / 100 < 1e-3


def markdown_tables() -> str:
    """The validation tables of bench/notes/cost-model.md."""
    lines = []
    for title, rows in (("Narayanan et al. 2021, A100-80GB", narayanan_rows()),
                        ("Megatron-LM README, H100 (Megatron-Core 0.8)", megatron_h100_rows())):
        lines += [f"**{title}**", "", "| model | estimate s/iter | published s/iter | error |",
                  "| --- | ---: | ---: | ---: |"]
        for name, e, p in rows:
            lines.append(f"| {name} | {e.seconds:.2f} | {p:.2f} | {100 * _error(e, p):+.1f} % |")
        lines.append("")
    errors = [abs(_error(e, p)) for _, e, p in [*narayanan_rows(), *megatron_h100_rows()]]
    lines.append(f"Median |error| over the {len(errors)} published rows: "
                 f"{100 * statistics.median(errors):.1f} %; largest {100 * max(errors):.1f} %.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_tables())
    print()
    print("| shape | path | dropout | estimate ms | measured ms | error | estimate MiB | "
          "measured MiB | error |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape, path, dropout, ms, mib in H200_RUNS:
        plan = h200_plan(shape, path, dropout)
        est_ms = plan.run.step.seconds * 1e3
        est_mib = (plan.memory.total - plan.memory.reserve) / 2**20
        print(f"| {shape} | {path} | {dropout} | {est_ms:.1f} | {ms} "
              f"| {100 * (est_ms / ms - 1):+.1f} % | {est_mib:,.0f} | {mib:,} "
              f"| {100 * (est_mib / mib - 1):+.1f} % |")


def test_linears_kept_in_bf16_cost_bf16_time():
    """Under FP8, a linear the fast spec keeps in bf16 (too narrow to gain) is counted at the
    16-bit rate: the step estimate lies between all four linears in FP8 and none."""
    h200 = KNOWN_GPUS["H200"].spec
    shape = dict(hidden=2048, heads=16, query_groups=16, head_dim=128, ffn=8192, layers=24,
                 vocab=50304, seq=2048, glu=False, micro_batch=4, global_batch=4, tp=1, pp=1,
                 dp=1, precision="bf16", path="fast", attention_dropout=0.0,
                 hidden_dropout=0.0, grad_bytes=2)
    params = 1.3e9

    def seconds(**fp8):
        return estimate_step(StepShape(**shape, **fp8), h200, params).seconds

    bf16, all_four = seconds(), seconds(fp8=True)
    mlp_only = seconds(fp8=True, fp8_linears=(2, 3))
    assert all_four < mlp_only < bf16

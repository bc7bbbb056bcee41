"""The tables of bench/benchmarks.md: one ``Table`` per concern, its columns and its rows.

``TABLES`` (in the order of the document) says, for each ``table`` a record names
(``bench/records.py``): its title and introduction (what was measured and how it is
counted), its columns (each a header and a function of the record giving the cell), how rows
sort, the one-line form of an older record in the log, and the rows it expects (shown as not
measured, with their command, until a record has them). ``bench/tables.py`` renders them.
A new concern is a new ``Table`` here; a new row of a known concern needs nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

MIB_PER_GB = 1e9 / 2**20


# ---------------------------------------------------------------------------------------
# cells
# ---------------------------------------------------------------------------------------
def number(value, decimals: int = 1) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return f"{value:,.{decimals}f}"


def peak_memory(figures: dict) -> str:
    """megatron's "max allocated" in MiB; from the bench's GB (10^9 bytes) where only that
    was recorded (marked ≈)."""
    if figures.get("peak_mib") is not None:
        return f"{figures['peak_mib']:,.0f}"
    if figures.get("peak_gb") is not None:
        return f"≈{figures['peak_gb'] * MIB_PER_GB:,.0f}"
    return ""


def fig(key: str, decimals: int = 1) -> Callable[[dict], str]:
    return lambda r: number(r["figures"].get(key), decimals)


def rowval(key: str, names: dict | None = None) -> Callable[[dict], str]:
    def cell(r):
        value = r["row"].get(key, "")
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return (names or {}).get(value, str(value))
    return cell


def fig_row(key: str, decimals: int = 1) -> Callable[[dict], str]:
    return lambda r: number(r["row"].get(key), decimals)


def values_link(record: dict) -> str:
    """A link from bench/benchmarks.md to the record's per-iteration values, if it has them."""
    return f"[csv]({record['data'].removeprefix('bench/')})" if record.get("data") else ""


def code(text: str) -> str:
    return f"`{text}`" if text else ""


@dataclass(frozen=True)
class Table:
    name: str
    title: str
    intro: str
    columns: tuple[tuple[str, Callable[[dict], str]], ...]
    sort: Callable[[dict], tuple]
    summary: Callable[[dict], str]  # the log's one-line form of a record
    expected: tuple[tuple[dict, str], ...] = ()  # (row, command that measures it)
    text_columns: int = 3  # the leading columns that are text (left-aligned); the rest numbers


PATHS = {"local": "megatron's local spec", "fast": "fast path",
         "reference": "plain PyTorch"}
PATH_ORDER = {"local": 0, "fast": 1, "reference": 2}
TE_PATHS = {"fast": "the entry's default (fast spec)",
            "te": "TE's layers, full-iteration graph"}
APEX_PATHS = {"fast": "the entry's default (fast spec)",
              "nowrite": "default, --fast-disable grad-write (megatron's fusion kept on)",
              "distopt": "default, --use-distributed-optimizer",
              "megatron_optimizer": "default, --fast-disable optimizer (megatron's own step)",
              "local": "megatron's local spec",
              "nopersist": "local spec, --no-persist-layer-norm",
              "persist": "local spec, --persist-layer-norm",
              "nosoftmax": "local spec, --no-masked-softmax-fusion",
              "nofusion": "local spec, --no-gradient-accumulation-fusion"}
# the local spec's pieces: their own step of bench/gpu_record_apex.sh
APEX_LOCAL_PIECES = ("local", "nopersist", "persist", "nosoftmax", "nofusion")
APEX_INSTALLS = ("apex", "without apex", "apex beside TE", "TE without apex")
FP8_PATHS = {"te": "TE's layers, bf16", "tefp8": "TE's layers, FP8, delayed scaling",
             "tefp8cs": "TE's layers, FP8, current scaling", "fast": "fast path, bf16"}
FAST_FP8_PATHS = {"fast": "fast path, bf16", "fp8": "fast path, FP8, delayed scaling",
                  "fp8cs": "fast path, FP8, current scaling",
                  "fp8cast": "fast path, FP8, delayed scaling, weights cast in the forward",
                  "fp8write": "fast path, FP8, delayed scaling, weights written by the optimizer",
                  "fp8own": "fast path, FP8, delayed scaling on its own amaxes",
                  "tefp8": "TE's layers, FP8, delayed scaling",
                  "tefp8cs": "TE's layers, FP8, current scaling",
                  "referencefp8": "plain PyTorch + torchao FP8 (tensorwise)"}
SHAPE_ORDER = {"tiny": 0, "345M": 1, "1.3B": 2}
PREPROCESS_TOOLS = {"baseline": "upstream-style baseline", "megagpt": "megagpt"}
MULTI_GPU_PATHS = {"default": "single-GPU default (full-iteration graph)",
                   "several-GPU": "several-GPU path (per-layer graphs)",
                   "several-GPU eager": "several-GPU path, eager layers"}
MULTI_GPU_ORDER = {"default": 0, "several-GPU": 1, "several-GPU eager": 2}
GENERATION_ENGINES = {"transformers": "transformers' generate",
                      "megatron": "megatron.core.inference static engine",
                      "kv": "megagpt KV decoder (CUDA graph per step)",
                      "kv-compiled": "megagpt KV decoder, step compiled (`--compile`)"}
GENERATION_ORDER = {"transformers": 0, "megatron": 1, "kv": 2, "kv-compiled": 3}


def _percent(value) -> str:
    """A relative difference as a signed percentage."""
    return "" if value is None else f"{value * 100:+.2f} %"


def fig_percent(key: str) -> Callable[[dict], str]:
    """A figure that is a ratio less one, as a signed per cent (blank where absent)."""
    return lambda r: _percent(r["figures"].get(key))


def _loss_runs_table(name: str, title: str, text: str, *columns) -> "Table":
    """One of the "Loss references" tables: a row per run of one shape, ``columns`` between
    the shape and run and the values' link."""
    return Table(
        name, title, text,
        columns=(("shape", rowval("shape")), ("run", rowval("run")), *columns,
                 ("values", values_link)),
        sort=lambda r: (SHAPE_ORDER.get(r["shape"], 9), r["run"]),
        text_columns=2,
        summary=lambda r: f"{r['row']['shape']} {r['row']['run']}",
    )


def _train_summary(r: dict) -> str:
    f = r["figures"]
    return (f"{r['row']['shape']} {PATHS[r['row']['path']]}, dropout {rowval('dropout')(r)}: "
            f"{number(f.get('ms_per_iter'))} ms/iter, {number(f.get('tflops_per_gpu'))} "
            f"TFLOP/s/GPU" + (f", {peak_memory(f)} MiB" if peak_memory(f) else ""))


def _switch_text(r: dict) -> str:
    """The switch, and the path it was added to where that is not the default (its
    "default ms/iter" is then that path's)."""
    on = r["row"].get("on")
    return code(r["row"]["switch"]) + (f" on {code(on)}" if on else "")


def _switch_delta(r: dict) -> str:
    f = r["figures"]
    if f.get("default_ms") is None or f.get("switch_ms") is None:
        return ""
    return f"{f['switch_ms'] - f['default_ms']:+.1f}"


def _memory_delta(r: dict) -> str:
    f = r["figures"]
    if f.get("default_mib") is None or f.get("switch_mib") is None:
        return ""
    return f"{f['switch_mib'] - f['default_mib']:+,.0f}"


def _layout_cell(r: dict) -> str:
    f = r["figures"]
    if "not_run" in f:
        return f"not run: {f['not_run']}"
    if "failed" in f:
        return f"failed: {f['failed']}"
    return number(f.get("ms_per_iter"))


def throughput_command(shape: str, path: str, dropout: float) -> str:
    """The bench_throughput.py command that measures one row of the training table."""
    command = f"python bench/bench_throughput.py --shape {shape}"
    if path == "reference":
        command += " --paths reference" + ("" if dropout else " --reference-dropout 0")
    elif dropout:
        command += f" --paths {path}"
    else:
        command += ' --paths nodrop --variant "nodrop=--hidden-dropout 0 --attention-dropout 0"'
    return command + " --train-iters 30 --warmup-iters 10"


EXPECTED_TRAINING = tuple(
    (dict(shape=shape, path=path, dropout=dropout), throughput_command(shape, path, dropout))
    for shape in ("345M", "1.3B")
    for path, dropout in (("local", 0.1), ("fast", 0.1), ("fast", 0.0), ("reference", 0.1),
                          ("reference", 0.0)))
EXPECTED_LAYOUTS = (
    (dict(shape="345M", saved_under="tp2", resumed_under="pp2"),
     "bash bench/gpu_record_layouts.sh OUT (bench/layouts.py --resume-check tp2,pp2)"),)


TABLES = (
    Table(
        "train-1gpu", "Training throughput and memory, one GPU",
        "GPT pretraining through `pretrain_gpt.py` (megatron's local spec and the fast path, "
        "the default without Transformer Engine) and a plain-PyTorch GPT of the same shape "
        "(`bench/reference_gpt.py`: SDPA, fused AdamW, `torch.compile`). 345M: 24 layers × "
        "1024 hidden × 16 heads, sequence 1024, micro-batch 8; 1.3B: 24 × 2048 × 16, sequence "
        "2048, micro-batch 4; global batch = micro-batch, bf16, mock data. ms/iter is the "
        "median of megatron's logged intervals after the warm-up iterations; TFLOP/s is "
        "megatron's count (`num_floating_point_operations`, causal attention halved: 18.61 "
        "TFLOP per iteration at 345M, 69.39 at 1.3B); peak memory is "
        "`torch.cuda.max_memory_allocated` in MiB (megatron's \"max allocated\"). Dropout "
        "0.1 is megatron's default. The same code measured in two invocations differs by up to "
        "~1.5 %; what a change is worth is measured against the default in one invocation "
        "(the next table).",
        columns=(("shape", rowval("shape")), ("path", rowval("path", PATHS)),
                 ("dropout", rowval("dropout")), ("ms/iter", fig("ms_per_iter")),
                 ("tokens/s", fig("tokens_per_s", 0)), ("TFLOP/s/GPU", fig("tflops_per_gpu")),
                 ("peak MiB", lambda r: peak_memory(r["figures"]))),
        sort=lambda r: (SHAPE_ORDER.get(r["shape"], 9), PATH_ORDER.get(r["path"], 9),
                        -float(r["dropout"])),
        summary=_train_summary,
        expected=EXPECTED_TRAINING,
    ),
    Table(
        "switches", "The fast path's pieces, each against the default in one invocation",
        "What each switch of the fast path costs or saves: the default run and the run with "
        "the switch, one after the other in one invocation of `bench/bench_throughput.py` "
        "(Δ = with the switch − default; positive: the switch is slower or takes more "
        "memory). A switch \"on\" other flags is measured against a run with those flags "
        "alone, which is then its \"default\". Shapes and counting as in the table above. "
        "What each piece does: [notes/fast-path.md](notes/fast-path.md).",
        columns=(("shape", rowval("shape")), ("switch", _switch_text),
                 ("dropout", rowval("dropout")), ("default ms/iter", fig("default_ms")),
                 ("with switch", fig("switch_ms")), ("Δ ms", _switch_delta),
                 ("Δ peak MiB", _memory_delta)),
        sort=lambda r: (r["switch"], SHAPE_ORDER.get(r["shape"], 9)),
        summary=lambda r: (f"{r['row']['shape']} {_switch_text(r)}: "
                           f"{_switch_delta(r) or '?'} ms/iter against "
                           f"{'that path' if r['row'].get('on') else 'the default'}"),
    ),
    Table(
        "dropout", "What dropout costs",
        "megatron's dropout (0.1 by default: `--attention-dropout` on the attention "
        "probabilities inside the attention kernel, `--hidden-dropout` on both residual "
        "branches of every layer) against the same path without any dropout, in one "
        "invocation of `bench/bench_throughput.py`; cost = ms/iter ÷ ms/iter without "
        "dropout − 1. Shapes and counting as in the first table. Where the time goes: "
        "[notes/dropout.md](notes/dropout.md).",
        columns=(("shape", rowval("shape")), ("path", rowval("path", PATHS)),
                 ("attention dropout", rowval("attention_dropout")),
                 ("hidden dropout", rowval("hidden_dropout")), ("ms/iter", fig("ms_per_iter")),
                 ("TFLOP/s/GPU", fig("tflops_per_gpu")),
                 ("cost", lambda r: f"{100 * r['figures']['cost']:+.1f} %")),
        sort=lambda r: (SHAPE_ORDER.get(r["shape"], 9), PATH_ORDER.get(r["path"], 9),
                        float(r["attention_dropout"]) + float(r["hidden_dropout"]),
                        float(r["attention_dropout"])),
        text_columns=4,
        summary=lambda r: (f"{r['row']['shape']} {PATHS[r['row']['path']]}, attention "
                           f"{rowval('attention_dropout')(r)}, hidden "
                           f"{rowval('hidden_dropout')(r)}: "
                           f"{number(r['figures'].get('ms_per_iter'))} ms/iter, "
                           f"{100 * r['figures']['cost']:+.1f} %"),
        expected=tuple(
            (dict(shape=shape, path="fast", attention_dropout=attention, hidden_dropout=hidden),
             f"python bench/bench_throughput.py --shape {shape} --paths "
             "nodrop,attention-only,hidden-only,fast --variant \"nodrop=--hidden-dropout 0 "
             "--attention-dropout 0\" --variant \"attention-only=--hidden-dropout 0\" "
             "--variant \"hidden-only=--attention-dropout 0\" --baseline nodrop "
             "--train-iters 30 --warmup-iters 10")
            for shape in ("345M", "1.3B")
            for attention, hidden in ((0.0, 0.0), (0.1, 0.0), (0.0, 0.1), (0.1, 0.1))),
    ),
    Table(
        "transformer-engine", "With Transformer Engine installed",
        "The same launches with Transformer Engine 2.20.2 importable (installed) and hidden "
        "from the process (hidden), one after the other in one device call "
        "(`bench/gpu_record_te.sh OUT train`): bf16, mock data, dropout 0, no apex. The "
        "entry's default picks the fast spec on one GPU with or without TE "
        "(`megagpt/launch/layers.py`); TE's layers are measured beside it. vs = ms/iter of the "
        "default without TE ÷ this row's (above 1: faster). What TE changes and why: "
        "[notes/transformer-engine.md](notes/transformer-engine.md).",
        columns=(("shape", rowval("shape")), ("TE", rowval("te")),
                 ("path", rowval("path", TE_PATHS)), ("ms/iter", fig("ms_per_iter")),
                 ("TFLOP/s/GPU", fig("tflops_per_gpu")),
                 ("peak MiB", lambda r: peak_memory(r["figures"])),
                 ("vs default without TE", fig("vs_default_without_te", 3))),
        sort=lambda r: (SHAPE_ORDER.get(r["shape"], 9), r["te"] != "installed",
                        r["path"] != "fast"),
        summary=lambda r: (f"{r['row']['shape']}, TE {r['row']['te']}, "
                           f"{TE_PATHS.get(r['row']['path'], r['row']['path'])}: "
                           f"{number(r['figures'].get('tflops_per_gpu'))} TFLOP/s"),
    ),
    Table(
        "fp8-fast", "FP8 on the fast path, without Transformer Engine",
        "The fast spec's FP8 linears (`--fp8-format hybrid`: e4m3 inputs and weights, e5m2 "
        "gradients; megatron's default delayed scaling, or `--fp8-recipe tensorwise`) "
        "against the fast path in bf16, TE's FP8 layers (under the full-iteration graph, "
        "their fastest on one GPU) and plain PyTorch with torchao's FP8 "
        "(`bench/reference_gpt.py --fp8 tensorwise`). One call of `bench/gpu_fp8.sh` per "
        "column of ratios: the fast path's rows without TE importable, TE's rows with it, "
        "in one invocation of `bench/bench_throughput.py` each; mock data, dropout 0, 40 "
        "iterations, medians after iteration 10, TFLOP/s by megatron's count (FP8 matmuls "
        "counted as the same FLOPs). The ratios are against rows of the same call.",
        columns=(("shape", rowval("shape")), ("call", rowval("call")),
                 ("path", rowval("path", FAST_FP8_PATHS)),
                 ("ms/iter", fig("ms_per_iter")), ("TFLOP/s/GPU", fig("tflops_per_gpu")),
                 ("vs fast bf16", fig("vs_fast_bf16", 3)),
                 ("vs TE FP8 delayed", fig("vs_te_fp8", 3))),
        sort=lambda r: (SHAPE_ORDER.get(r["shape"], 9), r.get("call", ""),
                        list(FAST_FP8_PATHS).index(r["path"])
                        if r["path"] in FAST_FP8_PATHS else 9),
        text_columns=3,
        summary=lambda r: (f"{r['row']['shape']} "
                           f"{FAST_FP8_PATHS.get(r['row']['path'], r['row']['path'])}: "
                           f"{number(r['figures'].get('ms_per_iter'))} ms/iter"),
    ),
    Table(
        "fp8-losses", "FP8 losses on text, and checkpoints crossing precisions",
        "`bench/fp8_losses.py`: the embedded corpus with GPT-2 BPE, the 345M or 1.3B shape, 300 "
        "iterations, lr 3e-4 with 30 warm-up iterations and cosine decay to 3e-5, dropout 0, "
        "one launch per precision sharing the GPU (bf16: the fast path's default; FP8: the "
        "fast spec's, `--fp8-format hybrid`, delayed scaling; TE FP8: TE's layers with the "
        "same flags, where TE is importable). Then each run's checkpoint of iteration 150 "
        "resumed for 20 iterations under each precision, against the uninterrupted run of the "
        "precision that saved it. The ratios are of rows of the same call.",
        columns=(("shape", rowval("shape")), ("compared", rowval("compared")),
                 ("last 50 mean: bf16 / FP8 / TE FP8", lambda r: " / ".join(
                     number(r["figures"].get(k), 4) or "—" for k in (
                         "bf16_mean_last_50", "fp8_mean_last_50", "tefp8_mean_last_50"))
                  if "fp8_mean_last_50" in r["figures"] else ""),
                 ("FP8 vs bf16", lambda r: _percent(r["figures"].get("fp8_over_bf16"))),
                 ("FP8 vs TE FP8", lambda r: _percent(r["figures"].get("fp8_over_tefp8"))),
                 ("largest excursion over bf16", lambda r: (
                     f"{_percent(r['figures']['largest_excursion'])} (iteration "
                     f"{r['figures']['largest_excursion_iteration']})")
                  if "largest_excursion" in r["figures"] else ""),
                 ("NaN/Inf", fig("nonfinite", 0)),
                 ("first loss resumed / source", lambda r: (
                     f"{number(r['figures']['first_loss'], 4)} / "
                     f"{number(r['figures']['source_loss'], 4)}")
                  if r["figures"].get("first_loss") is not None else ""),
                 ("largest rel. diff vs source", lambda r: (
                     f"{r['figures']['max_rel_diff_vs_source']:.1e}"
                     if r["figures"].get("max_rel_diff_vs_source") is not None
                     else r["figures"].get("failed", ""))),
                 ("values", values_link)),
        sort=lambda r: (SHAPE_ORDER.get(r["shape"], 9), r["compared"].startswith("resume"),
                        r["compared"]),
        text_columns=2,
        summary=lambda r: f"{r['row']['shape']} {r['row']['compared']}",
    ),
    _loss_runs_table(
        "loss-references", "Loss references: which layers and which step",
        "The FP8 losses' call with references beside it (`bench/fp8_losses.py --precisions`): "
        "megatron's own local layers, loss, optimizer and step (no piece of the fast path), TE's "
        "layers in bf16, and the fast spec's layers on megatron's loss, optimizer and step; the "
        "same 345M launch on text, 300 iterations, seed 1234 (and 1235 where two seeds ran). "
        "Ratios are of the mean loss over the last 50 iterations, within the call.",
        ("seeds", fig("seeds", 0)), ("last 50 mean", fig("mean_last_50", 4)),
        ("per seed", lambda r: r["figures"].get("per_seed", "")),
        ("vs fast bf16", fig_percent("vs_fast_bf16")), ("vs TE FP8", fig_percent("vs_te_fp8")),
    ),
    _loss_runs_table(
        "loss-kernels", "Loss references: which kernels",
        "The same 345M launch on text as the loss references (300 iterations, seed 1234), in "
        "one call: the fast path in bf16 and FP8 with the attention kernel torch picks (cuDNN's "
        "on an H100 or H200), with torch's flash kernel (`--attention-backend flash`), and with "
        "its fused layer uncompiled (`--fast-compile off`), beside megatron's local layers, "
        "loss, optimizer and step. Ratios are of the mean loss over the last 50 iterations, "
        "within the call; iteration 3 is the first loss after two updates, where the runs on "
        "the fast spec's layers first part from megatron's.",
        ("iteration 3", fig("loss_3", 4)), ("iteration 10", fig("loss_10", 4)),
        ("last 50 mean", fig("mean_last_50", 4)),
        ("vs fast bf16", fig_percent("vs_fast_bf16")),
        ("vs megatron's local", fig_percent("vs_local")),
    ),
    _loss_runs_table(
        "loss-seeds", "Loss references: three seeds",
        "The same 345M launch on text as the loss references (300 iterations), each run with "
        "seeds 1234, 1235 and 1236 (TE's bf16 and delayed-scaling FP8 with the first two), on "
        "one machine type: megatron's local layers, loss, optimizer and step, the fast path in "
        "bf16 and FP8, its fused layer uncompiled (one seed), and TE's layers in bf16 and FP8; "
        "FP8 under delayed scaling (megatron's default recipe) and current scaling "
        "(`--fp8-recipe tensorwise`). Ratios are of the mean over the seeds of each run's mean "
        "loss over its last 50 iterations, taken over the seeds both runs have; \"vs TE FP8\" "
        "is against TE's delayed-scaling FP8, \"same recipe\" against TE's FP8 under the row's "
        "own recipe; iterations 3 and 10 are seed 1234's.",
        ("seeds", fig("seeds", 0)), ("per seed", lambda r: r["figures"]["per_seed"]),
        ("mean", fig("mean_last_50", 4)),
        ("iteration 3", fig("loss_3", 4)), ("iteration 10", fig("loss_10", 4)),
        ("vs megatron's local", fig_percent("vs_local")), ("vs TE FP8", fig_percent("vs_te_fp8")),
        ("vs TE FP8, same recipe", fig_percent("vs_te_same_recipe")),
    ),
    Table(
        "cluster-check", "megagpt-check against the dry run's figures",
        "`python -m megagpt.preflight.cluster_check` (the launch check before a big run) and its "
        "GPU "
        "test: the bf16 GEMM rate of each GPU (8192³ products for 0.2 s) against the dry "
        "run's constant for the GPU type (`megagpt/gpus.py`), which the check names a GPU "
        "below by more than its margin.",
        columns=(("GPUs", rowval("gpus")), ("what", rowval("what")),
                 ("measured", fig("measured_tflops")),
                 ("in the GPU test", fig("gpu_test_measured_tflops", 0)),
                 ("dry run's figure", fig("dry_run_tflops"))),
        sort=lambda r: (r["gpus"], r["what"]),
        text_columns=2,
        summary=lambda r: f"{r['row']['gpus']} GPU: {r['figures'].get('measured_tflops')}",
    ),
    Table(
        "apex", "With NVIDIA apex installed",
        "The same launches with NVIDIA apex (built from its source at a release tag for the "
        "GPU's architecture, `bench/gpu_apex_build.sh`) importable and hidden from the "
        "process, one after the other in one run on the GPU machine (`bench/gpu_record_apex.sh OUT "
        "speed`, `... pieces` and `... pieces_local`), alone and beside Transformer Engine: "
        "bf16, mock data, dropout 0. vs without apex = ms/iter of the same launch without apex ÷ this row's; "
        "vs the piece on = ms/iter of the same launch without this row's flag (the default, "
        "or megatron's local spec) ÷ this row's (above 1: faster). megatron's local spec took "
        "apex's persistent layer norm until 2026-12-07 (d893954, the rows of that date); the "
        "entry now leaves it, measured slower. What megatron takes from apex "
        "and why the fast path leaves most of it: "
        "[notes/apex.md](notes/apex.md).",
        columns=(("shape", rowval("shape")), ("install", rowval("install")),
                 ("path", rowval("path", APEX_PATHS)), ("ms/iter", fig("ms_per_iter")),
                 ("TFLOP/s/GPU", fig("tflops_per_gpu")),
                 ("peak MiB", lambda r: peak_memory(r["figures"])),
                 ("vs without apex", fig("vs_without_apex", 3)),
                 ("vs the piece on", fig("vs_piece_on", 3))),
        sort=lambda r: (SHAPE_ORDER.get(r["shape"], 9),
                        list(APEX_PATHS).index(r["path"]) if r["path"] in APEX_PATHS else 99,
                        APEX_INSTALLS.index(r["install"]) if r["install"] in APEX_INSTALLS
                        else 9),
        summary=lambda r: (f"{r['row']['shape']}, {r['row']['install']}, "
                           f"{APEX_PATHS.get(r['row']['path'], r['row']['path'])}: "
                           f"{number(r['figures'].get('ms_per_iter'))} ms/iter"),
        expected=tuple(
            (dict(shape=shape, install=install, path="fast"),
             "bash bench/gpu_record_apex.sh OUT speed")
            for shape in ("345M", "1.3B") for install in ("apex", "without apex"))
        + tuple((dict(shape="345M", install="apex", path=path),
                 "bash bench/gpu_record_apex.sh OUT "
                 + ("pieces_local" if path in APEX_LOCAL_PIECES else "pieces"))
                for path in APEX_PATHS if path != "fast"),
    ),
    Table(
        "fp8", "FP8 with Transformer Engine",
        "TE's layers in bf16 and in FP8 (`--fp8-format hybrid`: E4M3 forward, E5M2 "
        "gradients; delayed scaling, megatron's default recipe, or current scaling, "
        "`--fp8-recipe tensorwise`) against the fast path in bf16, one invocation of "
        "`bench/bench_throughput.py` (`bench/gpu_record_te.sh OUT fp8`): mock data, dropout "
        "0, 50 iterations, TFLOP/s by megatron's count (FP8 matmuls counted as the same "
        "FLOPs). The wide shape is 8 layers of hidden 4096, 32 heads, FFN 16384, sequence "
        "4096, micro-batch 1, where matmuls dominate the step. Losses every 5 iterations in "
        "the csv.",
        columns=(("shape", rowval("shape")), ("path", rowval("path", FP8_PATHS)),
                 ("ms/iter", fig("ms_per_iter")), ("TFLOP/s/GPU", fig("tflops_per_gpu")),
                 ("vs TE bf16", fig("vs_te_bf16", 3)), ("loss at 15", fig("loss_15", 3)),
                 ("loss at 50", fig("loss_50", 3)), ("values", values_link)),
        sort=lambda r: (r["shape"], ["te", "tefp8", "tefp8cs", "fast"].index(r["path"])
                        if r["path"] in FP8_PATHS else 9),
        text_columns=2,
        summary=lambda r: (f"{r['row']['shape']} {FP8_PATHS.get(r['row']['path'], '?')}: "
                           f"{number(r['figures'].get('ms_per_iter'))} ms/iter"),
    ),
    Table(
        "layouts", "Several GPUs: megatron's parallel layouts through the entry",
        "`bench/layouts.py`: the 345M shape at micro-batch 4 and a global batch of 16 "
        "(4 micro-batches of the one-GPU run), bf16, dropout 0, the embedded corpus (GPT-2 BPE "
        "text), one seed for every layout; ms/iter and TFLOP/s per GPU are megatron's logged "
        "figures, medians after iteration 10; the loss difference is the largest relative "
        "one against the one-GPU run over all iterations. These rows were measured before "
        "per-layer CUDA graphs (commit 56ab00c): the layers ran eagerly and the step was bound "
        "by the host; the next table measures the path with them on one GPU.",
        columns=(("shape", rowval("shape")), ("processes", rowval("processes")),
                 ("layout", rowval("layout")), ("ms/iter", _layout_cell),
                 ("TFLOP/s/GPU", fig("tflops_per_gpu")),
                 ("per GPU vs one", fig("per_gpu_vs_one", 2)),
                 ("max rel. Δloss", lambda r: number(
                     None if r["figures"].get("max_rel_loss_diff") is None
                     else 100 * r["figures"]["max_rel_loss_diff"], 2)
                  + (" %" if r["figures"].get("max_rel_loss_diff") is not None else "")),
                 ("dry-run estimate, ms/iter", lambda r: (
                     f"{number(r['figures']['estimated_ms'])} ({r['figures']['estimated_on']})"
                     if r["figures"].get("estimated_ms") else ""))),
        sort=lambda r: (SHAPE_ORDER.get(r["shape"], 9), r["processes"], r["layout"] != "one",
                        r["layout"]),
        summary=lambda r: (f"{r['row']['shape']} {r['row']['layout']} on "
                           f"{r['row']['processes']}: {_layout_cell(r)} ms/iter"
                           + (f", {number(r['figures'].get('tflops_per_gpu'))} TFLOP/s/GPU"
                              if r["figures"].get("tflops_per_gpu") else "")),
    ),
    Table(
        "against-commit", "Against an earlier commit, in one invocation",
        "The same path of an earlier commit and of the commit measured, one after the other "
        "in one invocation of `bench/bench_throughput.py` (the earlier one run from a "
        "checkout of its own: `git worktree add .bench-base COMMIT`, then `--entry-of "
        "base=.bench-base/pretrain_gpt.py`; `STEPS=10 BASE=.bench-base bash "
        "bench/gpu_record.sh OUT`): what a change to the code did to the step, free of the "
        "drift between calls. bf16, mock data, dropout 0.1, counting as in the first table; "
        "speed = earlier ms/iter ÷ ms/iter (above 1: faster now).",
        columns=(("shape", rowval("shape")), ("path", rowval("path")),
                 ("flags", lambda r: code(r["row"]["flags"])),
                 ("against", lambda r: code(r["row"]["against"])),
                 ("earlier ms/iter", fig("earlier_ms")), ("ms/iter", fig("ms")),
                 ("earlier TFLOP/s/GPU", fig("earlier_tflops")),
                 ("TFLOP/s/GPU", fig("tflops")), ("speed", fig("speed_vs_earlier", 3))),
        sort=lambda r: (r["against"], r["flags"], SHAPE_ORDER.get(r["shape"], 9)),
        summary=lambda r: (f"{r['row']['shape']} {r['row']['path']}: "
                           f"{number(r['figures'].get('speed_vs_earlier'), 3)}x of "
                           f"{r['row']['against']}"),
        text_columns=4,
    ),
    Table(
        "multi-gpu-path", "The several-GPU path on one GPU, against the single-GPU default",
        "A launch on several GPUs runs without the full-iteration CUDA graph (one GPU's "
        "default); the fast path then captures each layer as CUDA graphs holding the compiled "
        "fused layer (`--fast-cuda-graphs layers`, megatron's `--cuda-graph-impl local`). "
        "`--fast-multi-gpu-path` puts one GPU on that path (the defaults of two data-parallel "
        "ranks), with the distributed optimizer and the overlapped gradient reduce a "
        "data-parallel launch gives (`--use-distributed-optimizer --overlap-grad-reduce`), "
        "so it is timed beside the single-GPU default in one invocation "
        "(`bench/bench_throughput.py --baseline fast`; `STEPS=8 bash bench/gpu_record.sh "
        "OUT`). Shapes, bf16, mock data, dropout 0.1 and counting as in the first table; "
        "the batch is 8 micro-batches per step; \"vs default\" divides by the default "
        "measured in the same invocation. \"eager layers\" is the same path with "
        "`--fast-cuda-graphs none` (`--no-fast-layer-graphs` then), as every several-GPU "
        "launch ran before commit 019a8c9.",
        columns=(("shape", rowval("shape")),
                 ("micro-batches × size",
                  lambda r: f"{r['row']['micro_batches']} × {r['row']['micro_batch']}"),
                 ("path", rowval("path", MULTI_GPU_PATHS)), ("ms/iter", fig("ms_per_iter")),
                 ("TFLOP/s/GPU", fig("tflops_per_gpu")),
                 ("vs default", fig("vs_default", 3)),
                 ("peak MiB", lambda r: peak_memory(r["figures"]))),
        sort=lambda r: (SHAPE_ORDER.get(r["shape"], 9), -r["micro_batch"],
                        MULTI_GPU_ORDER.get(r["path"], 9)),
        summary=lambda r: (f"{r['row']['shape']} {r['row']['micro_batches']} × "
                           f"{r['row']['micro_batch']}, {MULTI_GPU_PATHS.get(r['row']['path'])}: "
                           f"{number(r['figures'].get('tflops_per_gpu'))} TFLOP/s/GPU, "
                           f"{number(r['figures'].get('vs_default'), 3)} of the default"),
        expected=tuple(
            (dict(shape=shape, micro_batch=mb, micro_batches=8, path=path),
             f'python bench/bench_throughput.py --shape {shape} --micro-batch {mb} '
             '--micro-batches 8 --paths fast,mgpu --variant "mgpu=--fast-multi-gpu-path '
             '--use-distributed-optimizer --overlap-grad-reduce" --baseline fast '
             '--train-iters 30 --warmup-iters 10')
            for shape, mb in (("345M", 8), ("345M", 4), ("1.3B", 4))
            for path in ("default", "several-GPU")),
    ),
    Table(
        "dry-run-estimate", "Several GPUs: what the dry run predicts (estimates, not measured)",
        "No GPU ran for these rows: they are the dry run's step-time model "
        "([notes/cost-model.md](notes/cost-model.md)) for the launch as the entry resolves it "
        "at that GPU count (`python pretrain_gpt.py "
        "--config configs/gpt2_345m.yaml --dry-run --dry-run-world-size N --gpu-type H200`; "
        "on several GPUs the fast path takes per-layer CUDA graphs in place of one GPU's "
        "full-iteration graph). Throughput on several GPUs has not been measured with this "
        "code; the one-GPU figures measured are in the first table. \"vs 1 GPU\" divides "
        "the estimated TFLOP/s per GPU by the one-GPU estimate.",
        columns=(("shape", rowval("shape")), ("GPUs", rowval("gpus")),
                 ("layout", rowval("layout")), ("ms/iter (estimate)", fig("ms_per_iter")),
                 ("TFLOP/s/GPU (estimate)", fig("tflops_per_gpu")),
                 ("vs 1 GPU", fig("vs_one_gpu", 3))),
        sort=lambda r: (SHAPE_ORDER.get(r["shape"], 9), r["gpus"]),
        summary=lambda r: (f"{r['row']['shape']} on {r['row']['gpus']} GPUs (estimate): "
                           f"{number(r['figures'].get('tflops_per_gpu'))} TFLOP/s/GPU"),
    ),
    Table(
        "generation", "Generation, one GPU",
        "`bench/bench_generate.py`: one megatron GPT of GPT-2 medium's shape (24 × 1024 × 16 "
        "heads, vocabulary 50257 padded to 50304, random weights, bf16), exported as "
        "`tools/export_hf.py` writes it and loaded back as `GPT2LMHeadModel`; the same random "
        "prompts of 128 tokens, 256 new tokens each (end-of-document ignored), greedy, through "
        "transformers' `generate` (KV cache), megatron-core's static inference engine and "
        "megagpt's KV decoder (one CUDA graph per step; compiled: its step through "
        "`torch.compile` first, `tools/generate.py --compile`), in one invocation; warmed up "
        "once each (the compile happens there), fastest of 2. New tokens per second = batch × "
        "new tokens / time; \"vs transformers\" divides by transformers' figure of the same "
        "invocation (its eager decoding is bound by the host: at batch 1 it gave 76.6, 93.9 "
        "and 50.7 new tokens/s in three invocations on the same kind of machine, so the notes "
        "also divide by its fastest recorded figure). The goal: 10× transformers at batch 1 "
        "and 5× at batch 16.",
        columns=(("batch", rowval("batch")), ("engine", rowval("engine", GENERATION_ENGINES)),
                 ("new tokens/s", fig("tokens_per_s", 0)),
                 ("vs transformers", fig("vs_transformers", 1))),
        sort=lambda r: (r["batch"], GENERATION_ORDER.get(r["engine"], 9)),
        text_columns=2,
        summary=lambda r: (f"batch {r['row']['batch']}, {r['row']['engine']}: "
                           f"{number(r['figures'].get('tokens_per_s'), 0)} new tokens/s"),
        expected=tuple(
            (dict(batch=batch, engine=engine), "python bench/bench_generate.py --out OUT")
            for batch in (1, 16) for engine in ("transformers", "megatron", "kv", "kv-compiled")),
    ),
    Table(
        "loss-agreement", "Losses against megatron's local spec",
        "The fast path and megatron's local spec on the same data and seed, every iteration "
        "logged (`bench/bench_throughput.py --compare-losses N`); bf16 runs whose rounding "
        "differs drift apart within noise, and after a loss spike (mock data at 1.3B) any two "
        "such runs part, the local spec against itself with exact GeLU included. The "
        "several-GPU path's per-layer graphs are compared with its eager layers the same way.",
        columns=(("shape", rowval("shape")), ("data", rowval("data")),
                 ("compared", rowval("compared")), ("flags", lambda r: code(r["row"]["flags"])),
                 ("iterations", fig("iterations", 0)), ("max \\|Δ\\|", fig("max_abs_diff", 3)),
                 ("max rel.", lambda r: number(100 * r["figures"]["max_rel_diff"], 2) + " %"
                  if r["figures"].get("max_rel_diff") is not None else ""),
                 ("mean \\|Δ\\|", fig("mean_abs_diff", 4)),
                 ("values", values_link)),
        sort=lambda r: (SHAPE_ORDER.get(r["shape"], 9), r["data"], r["compared"]),
        text_columns=4,
        summary=lambda r: (f"{r['row']['shape']} {r['row']['compared']}: max |Δ| "
                           f"{number(r['figures'].get('max_abs_diff'), 3)} over "
                           f"{r['figures'].get('iterations')} iterations"),
    ),
    Table(
        "resume", "Stopped and resumed: the same losses",
        "A run stopped half-way (`--save`, `--exit-interval`) and launched again with the "
        "same command against the same run uninterrupted: `bench/resume_fidelity.py` "
        "(deterministic mode, one process) and `bench/layouts.py --resume-check FROM,TO` "
        "(saved under one layout, resumed under another; megatron's torch_dist format "
        "reshards). What a user sees: [docs/resume.md](../docs/resume.md).",
        columns=(("shape", rowval("shape")), ("saved under", rowval("saved_under")),
                 ("resumed under", rowval("resumed_under")), ("saved at", fig("saved_at", 0)),
                 ("iterations compared", fig("iterations", 0)),
                 ("identical", fig("identical", 0)), ("max \\|Δloss\\|", fig("max_abs_diff", 4)),
                 ("values", values_link)),
        sort=lambda r: (SHAPE_ORDER.get(r["shape"], 9), r["saved_under"], r["resumed_under"]),
        expected=EXPECTED_LAYOUTS,
        summary=lambda r: (f"{r['row']['shape']} saved under {r['row']['saved_under']}, resumed "
                           f"under {r['row']['resumed_under']}: max |Δloss| "
                           f"{number(r['figures'].get('max_abs_diff'), 4)}"),
    ),
    Table(
        "preprocess", "Preprocessing throughput",
        "`tools/preprocess_data.py` against a baseline doing what upstream Megatron-LM's "
        "`tools/preprocess_data.py` does (`bench/bench_preprocess.py`: a `multiprocessing.Pool` "
        "whose initializer builds megatron's tokenizer in every worker, `imap(encode, lines, "
        "chunksize=32)`, one document at a time into megatron's `IndexedDatasetBuilder`). "
        "The embedded Shakespeare jsonl repeated to 20 MB (8,547 documents, 5,851,846 GPT-2 "
        "tokens with EOD), `--append-eod`; the two outputs are byte-identical. Best wall time "
        "of 3 runs in turn, tokenizer set-up included, Python imports (~5–8 s, mostly "
        "`megatron.core`) not; CPU time of all processes of that run, the figure to compare "
        "when the machine is shared.",
        columns=(("tool", rowval("tool", {"baseline": "upstream-style baseline",
                                          "megagpt": "megagpt"})),
                 ("workers", rowval("workers")), ("wall s", fig("wall_s", 2)),
                 ("documents/s", fig("documents_per_s", 0)),
                 ("tokens/s", lambda r: number(r["figures"]["tokens_per_s"] / 1e6, 2) + "M"),
                 ("MB/s", fig("mb_per_s", 2)), ("CPU s", fig("cpu_s", 2))),
        sort=lambda r: (r["tool"] != "baseline", r["workers"]),
        summary=lambda r: (f"{r['row']['tool']}, {r['row']['workers']} workers: "
                           f"{number(r['figures'].get('mb_per_s'), 2)} MB/s"),
    ),
    Table(
        "preprocess-end-to-end", "Preprocessing end to end: the command as a user waits for it",
        "Each tool as a fresh process, start-up and imports included: ours is "
        "`tools/preprocess_data.py` (GPT-2 BPE with OpenAI's files: no megatron, torch or "
        "transformers imported; tiktoken and megagpt's writer of megatron's format); the "
        "baseline is the pipeline of the table above, started the way upstream's tool starts "
        "(torch, megatron's tokenizer arguments and `indexed_dataset` imported at the top). "
        "Outputs byte-identical; run in turn, best wall time of each, CPU time of all processes "
        "of that run (`bench/bench_preprocess.py --end-to-end`).",
        columns=(("corpus MB", fig_row("corpus_mb")), ("tool", rowval("tool", PREPROCESS_TOOLS)),
                 ("documents", fig("documents", 0)), ("wall s", fig("wall_s", 2)),
                 ("CPU s", fig("cpu_s", 2)), ("speed-up (wall)", lambda r: (
                     number(r["figures"]["speedup"], 1) + "×")
                  if r["figures"].get("speedup") else "")),
        sort=lambda r: (r["corpus_mb"], r["tool"] != "baseline"),
        text_columns=2,
        summary=lambda r: (f"{r['row']['corpus_mb']} MB, {r['row']['tool']}: "
                           f"{number(r['figures'].get('wall_s'), 2)} s"),
    ),
    Table(
        "checkpoint-checksums", "What the checkpoint checksums cost",
        "`bench/checkpoint_checksums.py`: files of each size hashed as the entry hashes a "
        "checkpoint's files right after a save (a SHA-256 of the SHA-256s of 16 MiB blocks, on "
        "up to the given threads), against writing the same files; the sizes are the "
        "checkpoints of a bf16 run with Adam, 14 bytes per parameter. What a user sees: "
        "[docs/resume.md](../docs/resume.md#checksums).",
        columns=(("checkpoint", rowval("size")), ("threads", rowval("threads")),
                 ("GB", fig("gb", 2)), ("hashing s", fig("hash_s", 2)),
                 ("s per GB", fig("s_per_gb", 2)), ("writing s", fig("write_s", 2)),
                 ("hashing ÷ writing", fig("vs_write", 2))),
        sort=lambda r: (str(r["size"]), r["threads"]),
        text_columns=2,
        summary=lambda r: (f"{r['row']['size']}, {r['row']['threads']} threads: "
                           f"{number(r['figures'].get('hash_s'), 2)} s"),
    ),
    Table(
        "test-suite", "The test suite: make demo and make test",
        "`python bench/suite_time.py`: the two set-up commands timed one after the other in a "
        "fresh clone (so `make demo` includes `make venv`), in minutes, with pytest's counts. "
        "Caches warm: torch inductor's, the project's and Hugging Face's as earlier runs left "
        "them; empty: the first run on a machine (`CI=true bash .ci/run`, set-up and suite "
        "together). The machine is shared with other work, so the same code's minutes move "
        "between runs.",
        columns=(("caches", rowval("caches")), ("make demo, min", fig("demo_min")),
                 ("make test, min", fig("suite_min")),
                 ("set-up and suite, min", fig("setup_and_suite_min")),
                 ("passed", fig("passed", 0))),
        sort=lambda r: (r["caches"] != "warm",),
        text_columns=1,
        summary=lambda r: (f"caches {r['row']['caches']}: " + (
            f"make demo {number(r['figures'].get('demo_min'))} min, make test "
            f"{number(r['figures'].get('suite_min'))} min"
            if "suite_min" in r["figures"] else
            f"set-up and suite {number(r['figures'].get('setup_and_suite_min'))} min")
            + (f" ({r['figures']['passed']:,} passed)" if r["figures"].get("passed") else "")),
        expected=((dict(caches="warm"), "python bench/suite_time.py"),),
    ),
)

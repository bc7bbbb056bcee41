"""The flag matrix: upstream-style launches, one row each, and what each must do.

Rows are written from megatron's argument groups and the combinations its own GPT functional
tests launch: pipeline parallelism with and without interleaving, tensor and sequence
parallelism, the model options (SwiGLU, RoPE, RMSNorm, GQA, untied embeddings, no linear
bias, ...), per-token loss, full and selective recompute, the distributed optimizer with
overlapped reduce and gather, checkpointing (synchronous, asynchronous, legacy format), the
TensorBoard and logging flags, deterministic mode, the rerun modes, mixed precision.

Each row runs 3 iterations of a tiny GPT (2 layers, hidden 64, sequence 32) with its flags
as written, except for two things the device decides (``launch``):

* precision: on the CPU, ``--bf16`` / ``--fp16`` are left out (CPU mode trains in fp32);
* data: ``DATA`` stands for a small real dataset made by preprocessing (NullTokenizer ids),
  ``GPT2_DATA`` for the embedded GPT-2 corpus; other rows use megatron's mock data.

A row either trains (exit 0, losses logged for iterations 1-3, no traceback) or is refused by
design: exit 2, one ``error:`` line containing ``refused``, before any model is built. The
refusals are those of a plain install (no Transformer Engine, no apex), on any device; where
TE is installed the rows marked ``te_changes`` train (or meet the layout's refusal) instead,
and where apex is the rows marked ``apex_changes`` train.
``ci`` marks the selection ``make test`` runs; ``MEGAGPT_FLAG_MATRIX=all`` runs every row.
"""

from __future__ import annotations

from dataclasses import dataclass

# The tiny model every row starts from; a row's own flags come after and win.
BASE = (
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "1", "--eval-iters", "0",
    "--init-method-std", "0.02",
)
MOCK_DATA = ("--mock-data", "--vocab-size", "512")
# What a device without mixed precision leaves out (CPU mode trains in fp32).
PRECISION_FLAGS = frozenset({"--bf16", "--fp16"})
# Data placeholders, replaced by the paths of the datasets the test makes or fetches.
DATA_PLACEHOLDERS = ("DATA", "GPT2_DATA", "GPT2_VOCAB", "GPT2_MERGES")


@dataclass(frozen=True)
class Row:
    name: str
    flags: tuple[str, ...]
    nproc: int = 1
    ci: bool = False
    refused: str | None = None  # a text the one-line refusal contains; None: it trains
    # where Transformer Engine is installed the row expects ``refused_with_te`` instead
    # (None: it trains there)
    te_changes: bool = False
    refused_with_te: str | None = None
    # refused on the CPU alone: a GPU (one with FP8 tensor cores, for FP8) trains it
    refused_on_cpu_only: bool = False
    # where NVIDIA apex is installed the row trains (its norms take what torch's do not)
    apex_changes: bool = False

    def expected_refusal(self, te_installed: bool, apex_installed: bool = False,
                         device: str = "cpu") -> str | None:
        if self.refused_on_cpu_only and device != "cpu":
            return None
        if te_installed and self.te_changes:
            return self.refused_with_te
        return None if (apex_installed and self.apex_changes) else self.refused


def _f(text: str) -> tuple[str, ...]:
    return tuple(text.split())


ROWS: tuple[Row, ...] = (
    # --- parallel layouts -------------------------------------------------------------
    Row("tp2", _f("--tensor-model-parallel-size 2"), nproc=2),
    # not in make test's selection: test_parallel_layouts trains it against one process, twice
    Row("tp2_sp", _f("--tensor-model-parallel-size 2 --sequence-parallel"), nproc=2),
    Row("pp2", _f("--pipeline-model-parallel-size 2 --untie-embeddings-and-output-weights"),
        nproc=2),
    Row("pp2_interleaved", _f("--pipeline-model-parallel-size 2 --num-layers 4 "
                              "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 8"),
        nproc=2, ci=True),
    Row("pp2_uneven", _f("--pipeline-model-parallel-size 2 --num-layers 3 "
                         "--decoder-first-pipeline-num-layers 1"), nproc=2),
    Row("dp2_distributed_optimizer",
        _f("--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
           "--ddp-bucket-size 10000"), nproc=2, ci=True),
    Row("distributed_optimizer_one_rank",
        _f("--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather")),
    # refused while the arguments are parsed, before the layout is checked: one process
    # shows it as a user sees it (torchrun adds its own report of a failed worker)
    Row("cp2", _f("--context-parallel-size 2"),
        refused="--context-parallel-size 2 needs Transformer Engine", te_changes=True,
        refused_with_te="world size 1 is not divisible"),
    # --- model options ----------------------------------------------------------------
    Row("llama_like", _f("--swiglu --position-embedding-type rope --rotary-percent 1.0 "
                         "--normalization RMSNorm --disable-bias-linear "
                         "--untie-embeddings-and-output-weights --group-query-attention "
                         "--num-query-groups 2 --hidden-dropout 0 --attention-dropout 0"),
        ci=True),
    Row("rope_partial_qk_norm", _f("--position-embedding-type rope --rotary-percent 0.5 "
                                   "--qk-layernorm --squared-relu"), ci=True),
    Row("layernorm_1p", _f("--apply-layernorm-1p"),
        refused="--apply-layernorm-1p needs Transformer Engine or apex", te_changes=True,
        apex_changes=True),
    Row("moe", _f("--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 "
                  "--moe-token-dispatcher-type alltoall --disable-bias-linear"), ci=True),
    Row("moe_with_linear_bias", _f("--num-experts 4 --moe-router-topk 2"),
        refused="with linear biases needs Transformer Engine", te_changes=True,
        refused_with_te="with linear biases needs --moe-grouped-gemm"),
    Row("moe_grouped_with_linear_bias", _f("--num-experts 4 --moe-router-topk 2 "
                                           "--moe-grouped-gemm"),
        refused="with linear biases needs Transformer Engine", te_changes=True),
    Row("per_token_loss", _f("--calculate-per-token-loss"), ci=True),
    Row("spec_local_attention_local", _f("--spec local --attention-backend local")),
    Row("attention_backend_flash", _f("--bf16 --attention-backend flash --attention-dropout 0")),
    Row("hybrid_pattern", _f("--hybrid-override-pattern M*M*"),
        refused="describes a hybrid Mamba and attention stack"),
    Row("transformer_engine", _f("--transformer-impl transformer_engine"),
        refused="Transformer Engine is not installed", te_changes=True),
    # --- recompute --------------------------------------------------------------------
    Row("recompute_full_uniform", _f("--recompute-granularity full --recompute-method uniform "
                                     "--recompute-num-layers 1"), ci=True),
    Row("recompute_full_block", _f("--recompute-granularity full --recompute-method block "
                                   "--recompute-num-layers 1")),
    Row("recompute_selective", _f("--recompute-activations"), ci=True),
    # --- checkpoints ------------------------------------------------------------------
    Row("save_sync", _f("--save ckpt --save-interval 2 --ckpt-format torch_dist "
                        "--dist-ckpt-strictness log_all")),
    Row("save_async", _f("--save ckpt --save-interval 2 --async-save"), ci=True),
    Row("save_async_persistent_worker",
        _f("--save ckpt --save-interval 2 --async-save --use-persistent-ckpt-worker "
           "--ckpt-assume-constant-structure")),
    Row("save_legacy_format", _f("--save ckpt --save-interval 2 --ckpt-format torch")),
    Row("save_without_interval", _f("--save ckpt"), refused="needs --save-interval"),
    # --- logging ----------------------------------------------------------------------
    Row("tensorboard_and_logging",
        _f("--tensorboard-dir tb --tensorboard-log-interval 1 --log-timers-to-tensorboard "
           "--log-memory-to-tensorboard --log-validation-ppl-to-tensorboard "
           "--log-world-size-to-tensorboard --log-params-norm --log-num-zeros-in-grad "
           "--log-throughput --timing-log-level 2 --timing-log-option all "
           "--eval-interval 2 --eval-iters 1"), ci=True),
    # --- determinism and rerun modes --------------------------------------------------
    Row("deterministic", _f("--deterministic-mode --hidden-dropout 0 --attention-dropout 0"
                            " --seed 42")),
    Row("rerun_validate_results", _f("--rerun-mode validate_results --check-for-spiky-loss"),
        ci=True),
    Row("rerun_report_stats", _f("--rerun-mode report_stats")),
    Row("rerun_disabled", _f("--rerun-mode disabled --no-check-for-nan-in-loss-and-grad")),
    # --- precision --------------------------------------------------------------------
    Row("bf16", _f("--bf16 --attention-softmax-in-fp32 --accumulate-allreduce-grads-in-fp32")),
    Row("fp16", _f("--fp16 --initial-loss-scale 4096 --loss-scale-window 100 "
                   "--apply-query-key-layer-scaling"), ci=True),
    # the fast spec's FP8 linears (delayed scaling, megatron's default recipe), and current
    # scaling; on a GPU with FP8 tensor cores both train, TE installed or not (the matrix's
    # model is narrower than FP8 gains at: --fast-fp8-min-width 0 keeps its linears in FP8)
    Row("fp8", _f("--bf16 --fp8-format hybrid --fast-fp8-min-width 0"),
        refused="FP8 needs a GPU with FP8 tensor cores", refused_on_cpu_only=True),
    Row("fp8_tensorwise", _f("--bf16 --fp8-format e4m3 --fp8-recipe tensorwise "
                             "--fast-fp8-min-width 0"),
        refused="FP8 needs a GPU with FP8 tensor cores", refused_on_cpu_only=True),
    # --- data -------------------------------------------------------------------------
    Row("real_data_split", _f("--data-path DATA --split 90,5,5 --tokenizer-type NullTokenizer "
                              "--vocab-size 512 --num-workers 1 --eval-interval 2 "
                              "--eval-iters 1"), ci=True),
    # upstream's split on a few hundred documents: the 1/1000 test share holds none
    Row("real_data_split_without_test_documents",
        _f("--data-path DATA --split 949,50,1 --tokenizer-type NullTokenizer --vocab-size 512 "
           "--eval-iters 1"), refused="gives the test split none of its 300 documents"),
    Row("real_data_blend", _f("--data-path 0.7 DATA 0.3 DATA --split 98,2,0 "
                              "--tokenizer-type NullTokenizer --vocab-size 512 "
                              "--no-mmap-bin-files --data-cache-path cache")),
    Row("gpt2_data", _f("--data-path GPT2_DATA --split 98,1,1 --tokenizer-type GPT2BPETokenizer "
                        "--vocab-file GPT2_VOCAB --merge-file GPT2_MERGES"), ci=True),
    Row("data_made_with_another_tokenizer",
        _f("--data-path GPT2_DATA --split 98,1,1 --tokenizer-type NullTokenizer "
           "--vocab-size 512"), refused="was tokenized with GPT2BPETokenizer"),
    Row("odd_blend", _f("--data-path 0.5 DATA 0.5 --tokenizer-type NullTokenizer "
                        "--vocab-size 512"), refused="a blend is WEIGHT PREFIX pairs"),
)

BY_NAME = {row.name: row for row in ROWS}
assert len(BY_NAME) == len(ROWS), "row names must be unique"


def uses(row: Row, placeholder: str) -> bool:
    return placeholder in row.flags


def launch_flags(row: Row, device: str, data: dict[str, str]) -> list[str]:
    """The entry's command line for ``row`` on ``device`` ("cpu" or "gpu").

    ``data`` maps the placeholders the row uses to paths."""
    flags = [f for f in row.flags if not (device == "cpu" and f in PRECISION_FLAGS)]
    flags = [data.get(f, f) if f in DATA_PLACEHOLDERS else f for f in flags]
    real_data = any(f in ("--data-path", "--train-data-path") for f in flags)
    return ([*(["--cpu"] if device == "cpu" else []), *BASE,
             *(() if real_data else MOCK_DATA), *flags])

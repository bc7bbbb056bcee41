#!/usr/bin/env bash
# With Transformer Engine installed against without it, on one GPU: the runs behind
# bench/benchmarks.md's section "With Transformer Engine installed".
#
#   MCORE_SITE=DIR TE_SITE=DIR bash bench/gpu_record_te.sh OUT_DIR STEP [SECONDS]
#
# MCORE_SITE holds megatron-core and what the entry needs beside torch (and, for the tests,
# pytest-xdist and transformers where they are wanted); TE_SITE holds
# Transformer Engine (built against this machine's torch); bench/gpu_carry.sh makes what the
# first needs, and `source bench/gpu_site.sh` there sets both. A run "with TE" has both on
# PYTHONPATH, a run "without TE" only MCORE_SITE, so TE is importable for one and hidden
# from the other in the same call. Steps (one per call, each fits a 10-minute call):
#   tests   the TE GPU tests (pytest -m te_gpu, 6 at once with pytest-xdist; each failure is
#           written to OUT/te_failures.txt at once). More than one call's worth: split them
#           with TESTS_K, e.g. TESTS_K="config or example" in one call and
#           TESTS_K="not config and not example" in the next
#   matrix  the flag matrix's rows that TE changes (MATRIX_ROWS: other rows, in the order they
#           start, e.g. every row one GPU runs; MATRIX_PARALLEL rows at once, default 2); each
#           row's log stays in OUT/matrix_runs, so a call cut short keeps the rows it finished
#           (the two-GPU rows, on a two-GPU machine: MATRIX_ROWS=tp2,tp2_sp,pp2,
#           pp2_interleaved,pp2_uneven,dp2_distributed_optimizer)
#   train   throughput, bf16, mock data, dropout 0: 345M and 1.3B, each: the entry's default
#           with TE, TE's layers (--transformer-impl transformer_engine --fast-cuda-graphs iteration),
#           the default without TE
#   profile what importing TE changes for the fast path: the process's settings and mapped
#           libraries and torch's GEMM / AdamW times (bench/te_import_effects.py), with
#           PROFILE_ATTENTION=1 the attention kernels torch picks (bench_kernels.py: TE
#           imported as such, after megagpt as the entry does, no TE), then a kernel profile
#           of the 345M default with TE importable and hidden (bench/profile_entry.py;
#           kernels.tsv of each)
#   layouts on two GPUs: TE's layers (the default under TP and PP with TE) against the fast
#           spec's (--transformer-impl local) at TP=2 and PP=2, 345M and 1.3B (LAYOUT_SHAPES)
#   fp8     the wide shape (8 x 4096, seq 4096, micro-batch 1) and 1.3B (FP8_SHAPES picks): TE bf16, TE FP8
#           hybrid (delayed scaling), TE FP8 current scaling (--fp8-recipe tensorwise), the
#           entry's default; 50 iterations with their losses
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_record_te.sh OUT_DIR STEP [SECONDS]}
STEP=${2:?usage: gpu_record_te.sh OUT_DIR STEP [SECONDS]}
BUDGET=${3:-560}
START=$SECONDS
left() { echo $(( BUDGET - (SECONDS - START) )); }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
# NVLink multicast stays off for the rows that run on several GPUs (a shared host's GPUs can
# be left out of service by it)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WITH_TE="${MCORE_SITE:?}:${TE_SITE:?}"
WITHOUT_TE="${MCORE_SITE}"
PY=${PY:-python3}
NODROP="--hidden-dropout 0 --attention-dropout 0"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    PYTHONPATH=$WITH_TE $PY -c 'import torch, megatron.core as m, transformer_engine as t; print("torch", torch.__version__, "megatron-core", m.__version__, "transformer-engine", t.__version__)' 2>&1 | grep -v -i jax
} > "$OUT/versions.txt"
cat "$OUT/versions.txt"

bench() {  # NAME PYTHONPATH [bench_throughput args...]
    local name=$1 path=$2
    shift 2
    [ "$(left)" -gt 60 ] || { echo "== $name: skipped ($(left)s left)"; return; }
    echo "== $name ($(left)s left)"
    PYTHONPATH=$path timeout $(( $(left) - 10 )) $PY bench/bench_throughput.py "$@" \
        --out "$OUT/$name" > "$OUT/$name.txt" 2>&1
    grep -E "^(path|fast|te|local)|TFLOP|failed" "$OUT/$name.txt" | cut -c1-160 | head -12
    # which cuDNN each launch ran on (a second folder means torch's attention lost cuDNN)
    grep -h "installed:" "$OUT/$name"/entry_*.log 2>/dev/null | sort -u | cut -c1-240
}

case "$STEP" in
tests)
    # several tests at once where pytest-xdist is there (each test is its own processes);
    # TEST_WORKERS=1 runs them in this process, where -s shows the figures they print
    WORKERS=""
    if [ "${TEST_WORKERS:-6}" != 1 ]; then
        PYTHONPATH=$WITH_TE $PY -c "import xdist" 2>/dev/null && WORKERS="-n ${TEST_WORKERS:-6}"
    fi
    # each failure written as it happens: a run cut by the call's time limit keeps them
    MEGAGPT_FAILURE_LOG="$OUT/te_failures.txt" PYTHONPATH=$WITH_TE timeout $(( $(left) - 5 )) \
        $PY -m pytest -v -p no:cacheprovider -s -rA $WORKERS -m te_gpu \
        tests/test_transformer_engine_gpu.py ${TESTS_K:+-k "$TESTS_K"} > "$OUT/te_tests.txt" 2>&1
    grep -E "^(PASSED|FAILED|ERROR)|passed|failed|largest relative" "$OUT/te_tests.txt" | tail -20
    [ -s "$OUT/te_failures.txt" ] && grep -E "^(== |E  )" "$OUT/te_failures.txt" | head -40
    ;;
matrix)
    PYTHONPATH=$WITH_TE MEGAGPT_FLAG_MATRIX_DEVICE=gpu \
        MEGAGPT_FLAG_MATRIX=${MATRIX_ROWS:-cp2,layernorm_1p,moe_with_linear_bias,transformer_engine,fp8} \
        MEGAGPT_FLAG_MATRIX_PARALLEL=${MATRIX_PARALLEL:-2} \
        timeout $(( $(left) - 5 )) $PY -m pytest -q -rA -p no:cacheprovider --basetemp "$OUT/matrix_runs" \
        tests/test_flag_matrix.py -k row_trains > "$OUT/flag_matrix_te.txt" 2>&1
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/flag_matrix_te.txt" | cut -c1-200 | tail -40
    # rows that finished, by their logs (what a call cut short still shows)
    for log in "$OUT"/matrix_runs/flag_matrix0/*/entry.log; do
        [ -f "$log" ] || continue
        echo "$(basename "$(dirname "$log")"): $(grep -c ' iteration ' "$log") iteration lines," \
             "$(grep -c Traceback "$log") tracebacks; $(grep -m1 '^error:' "$log" | cut -c1-120)"
    done
    ;;
train)
    # TE_PATHS=fast: only the default with TE (against without), e.g. to check that
    # importing TE leaves the fast path's speed alone
    bench with_te_345m "$WITH_TE" --shape 345M --paths ${TE_PATHS:-fast,te} --baseline fast \
        --entry-args "$NODROP" --train-iters 30 --warmup-iters 10
    bench without_te_345m "$WITHOUT_TE" --shape 345M --paths fast --baseline fast \
        --entry-args "$NODROP" --train-iters 30 --warmup-iters 10
    bench with_te_1.3b "$WITH_TE" --shape 1.3B --paths ${TE_PATHS:-fast,te} \
        --baseline fast --entry-args "$NODROP" --train-iters 30 --warmup-iters 10
    bench without_te_1.3b "$WITHOUT_TE" --shape 1.3B --paths fast --baseline fast \
        --entry-args "$NODROP" --train-iters 30 --warmup-iters 10
    ;;
profile)
    # what importing TE changes in the process (environment, torch's settings, the libraries
    # it maps) and torch's GEMM / fused AdamW times with TE importable and hidden
    for side in with without; do
        path=$WITH_TE; [ $side = with ] || path=$WITHOUT_TE
        echo "== import effects, TE $side"
        PYTHONPATH=$path timeout 120 $PY bench/te_import_effects.py \
            --out "$OUT/effects_${side}_te.json" 2>&1 | grep -v -i jax | grep -E '"(environ|torch|libraries_added|modules_added)"|ms"|GB/s' | head -30
    done
    # the attention kernels torch picks, TE imported as such / as the entry imports it / no TE
    for side in ${PROFILE_ATTENTION:+as_such as_entry without}; do
        path=$WITH_TE; first="--import-first transformer_engine.pytorch"
        [ $side = as_entry ] && first="--import-first megagpt,transformer_engine.pytorch"
        [ $side = without ] && { path=$WITHOUT_TE; first=""; }
        echo "== attention, TE: $side"
        PYTHONPATH=$path timeout 120 $PY bench/bench_kernels.py --parts attention --no-flex \
            $first --out "$OUT/attention_te_${side}.json" 2>&1 | grep -v -i jax | tail -22
    done
    FLAGS=$($PY -c 'import sys, shlex; sys.path.insert(0, "bench")
from bench_throughput import shape_flags
print(shlex.join(shape_flags("345M", 25, 5, 1234)))')
    for side in with without; do
        path=$WITH_TE; [ $side = with ] || path=$WITHOUT_TE
        [ "$(left)" -gt 90 ] || { echo "== profile TE $side: skipped"; continue; }
        echo "== profile 345M, TE $side ($(left)s left)"
        PYTHONPATH=$path timeout $(( $(left) - 10 )) $PY bench/profile_entry.py --light \
            --start 20 --iters 3 --out "$OUT/profile_${side}_te" -- $FLAGS $NODROP \
            > "$OUT/profile_${side}_te.txt" 2>&1
        grep -E "iteration|busy|host|train_step|optimizer" "$OUT/profile_${side}_te.txt" | head -20
        cp "$OUT/profile_${side}_te/kernels.tsv" "$OUT/kernels_${side}_te.tsv" 2>/dev/null
        rm -f "$OUT"/profile_${side}_te/*.gz
    done
    ;;
fp8)
    TE="--transformer-impl transformer_engine --fast-cuda-graphs iteration"
    for shape in ${FP8_SHAPES:-wide 1.3B}; do
        bench fp8_$shape "$WITH_TE" --shape $shape --paths te,tefp8,tefp8cs,fast \
            --variant "tefp8=$TE --fp8-format hybrid" \
            --variant "tefp8cs=$TE --fp8-format hybrid --fp8-recipe tensorwise" \
            --baseline fast --entry-args "$NODROP" --train-iters 50 --warmup-iters 10 \
            --log-interval 5
    done
    ;;
layouts)
    # the layer choice under tensor and pipeline parallelism (megagpt/launch/layers.py), on two
    # GPUs with TE importable: TE's layers (the entry's default there) against the fast spec's
    # (--transformer-impl local), 345M and 1.3B, mock data, losses against one GPU
    for shape in ${LAYOUT_SHAPES:-345M 1.3B}; do
        [ "$(left)" -gt 90 ] || { echo "== layouts $shape: skipped ($(left)s left)"; continue; }
        echo "== layouts $shape ($(left)s left)"
        PYTHONPATH=$WITH_TE timeout $(( $(left) - 10 )) $PY bench/layouts.py --gpus 2 \
            --shape $shape --micro-batches 8 --iters 30 --timeout 200 \
            --layouts tp2,tp2local,pp2,pp2local --out "$OUT/layouts_$shape" \
            > "$OUT/layouts_$shape.txt" 2>&1
        tail -8 "$OUT/layouts_$shape.txt"
        grep -h "compat: layers" "$OUT/layouts_$shape"/*.log 2>/dev/null | sort | uniq -c | cut -c1-200
    done
    ;;
*) echo "unknown step $STEP"; exit 2 ;;
esac
echo "== done in $((SECONDS - START))s"

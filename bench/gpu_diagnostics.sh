#!/usr/bin/env bash
# The GPU half of the diagnostics (megagpt/diagnostics, megagpt/preflight/cluster_check.py) on one GPU, in
# about four minutes:
#   1. the GPU tests (pytest -m gpu): a launch too big for the GPU stops with the out-of-memory
#      line, with and without --record-memory-history (its snapshot file); megagpt-check's GEMM
#      rate on this GPU against the dry run's figure for it;
#   2. megagpt-check on this GPU, its measurements as JSON (OUT/cluster_check.json);
#   3. what the flight recorder and the straggler report cost: 345M, the default (both on)
#      against --no-flight-recorder --straggler-threshold 0, one invocation of
#      bench/bench_throughput.py (log interval 10: one timed step and one all-gather per 10);
#      `python bench/records.py add OUT/bench_345M.json` makes its row of bench/benchmarks.md.
#
#   source bench/gpu_site.sh && bash bench/gpu_diagnostics.sh OUT_DIR
#
# Needs: megatron-core (+ omegaconf) importable (bench/gpu_site.sh), one CUDA GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_diagnostics.sh OUT_DIR}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
$PY -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)' >> "$OUT/gpu.txt" 2>&1

echo "== 1. GPU tests: out of memory, the GEMM rate against the dry run's figure"
MEGAGPT_FAILURE_LOG="$OUT/gpu_test_failures.txt" timeout 240 $PY -m pytest -q -s -m gpu \
    -p no:cacheprovider tests/test_out_of_memory.py tests/test_cluster_check.py \
    > "$OUT/gpu_tests.txt" 2>&1
tail -3 "$OUT/gpu_tests.txt"; grep -h "GEMM\|^error: CUDA out of memory" "$OUT/gpu_tests.txt" | cut -c1-400

echo "== 2. megagpt-check on this GPU"
timeout 60 $PY -m megagpt.preflight.cluster_check --nproc-per-node 1 --json "$OUT/cluster_check.json" \
    > "$OUT/cluster_check.txt" 2>&1
grep -v "^W[0-9]" "$OUT/cluster_check.txt" | tail -5

echo "== 3. the recorder's and the straggler report's cost, 345M"
timeout 200 $PY bench/bench_throughput.py --shape 345M --paths fast,nodiag \
    --variant "nodiag=--no-flight-recorder --straggler-threshold 0" --baseline nodiag \
    --train-iters 60 --warmup-iters 10 --out "$OUT" > "$OUT/diagnostics_cost.txt" 2>&1
tail -6 "$OUT/diagnostics_cost.txt"

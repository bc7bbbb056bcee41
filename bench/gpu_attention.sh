#!/usr/bin/env bash
# megatron's --attention-backend on the fast spec, on one GPU: the runs behind
# bench/benchmarks.md's section "Attention backends on the fast spec".
#
#   source bench/gpu_site.sh && bash bench/gpu_attention.sh OUT_DIR [SECONDS]
#
# 1. train: throughput (bench_throughput.py, bf16, mock data, dropout 0) of the entry's
#    default (torch picks the SDPA kernel) against --attention-backend flash, fused (cuDNN)
#    and unfused (math), at 345M and 1.3B (SHAPES), each shape in one invocation;
# 2. launches: five iterations of a small model with attention dropout 0.1 for each backend,
#    with the fused layer (compiled, full-iteration graph) and without it (megagpt's
#    SDPADotProductAttention, grouped-query attention), and fp32 with flash, which the entry
#    refuses in one line. OUT/launches.txt has one line per launch: name, exit status, last
#    loss or the error line. LAUNCHES=0 leaves them out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_attention.sh OUT_DIR [SECONDS]}
BUDGET=${2:-560}
START=$SECONDS
left() { echo $(( BUDGET - (SECONDS - START) )); }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
PY=${PY:-python3}
SHAPES=${SHAPES:-345M 1.3B}
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    $PY -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__, "cudnn", torch.backends.cudnn.version())'
} > "$OUT/versions.txt"
cat "$OUT/versions.txt"

# 2 first: short, and what must work whatever the speeds
SMALL=(--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024
       --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 4
       --train-iters 5 --log-interval 1 --mock-data --lr 1e-4 --eval-iters 0
       --attention-dropout 0.1)
launch() {  # NAME FLAGS...
    local name=$1
    shift
    [ "$(left)" -gt 60 ] || { echo "$name skipped" >> "$OUT/launches.txt"; return; }
    timeout 120 $PY pretrain_gpt.py "${SMALL[@]}" "$@" > "$OUT/launch_$name.log" 2>&1
    local rc=$?
    local last
    last=$(grep -o "lm loss: [0-9.E+-]*" "$OUT/launch_$name.log" | tail -1)
    [ -n "$last" ] || last=$(grep -m1 -E "^error:|Error" "$OUT/launch_$name.log" | cut -c1-200)
    echo "$name rc=$rc $last" | tee -a "$OUT/launches.txt"
}
for backend in $([ "${LAUNCHES:-1}" = 0 ] || echo auto flash fused unfused); do
    launch "${backend}_fused_layer" --bf16 --attention-backend $backend
    launch "${backend}_sdpa_gqa" --bf16 --attention-backend $backend \
        --fast-disable fused-layer --group-query-attention --num-query-groups 2
done
[ "${LAUNCHES:-1}" = 0 ] || launch flash_fp32 --attention-backend flash

for shape in $SHAPES; do
    [ "$(left)" -gt 120 ] || { echo "== train $shape: skipped ($(left)s left)"; continue; }
    echo "== train $shape ($(left)s left)"
    timeout $(( $(left) - 10 )) $PY bench/bench_throughput.py --shape "$shape" \
        --paths fast,flash,fused,unfused \
        --variant 'flash=--attention-backend flash' --variant 'fused=--attention-backend fused' \
        --variant 'unfused=--attention-backend unfused' --baseline fast \
        --entry-args '--hidden-dropout 0 --attention-dropout 0' \
        --train-iters 40 --warmup-iters 10 --log-interval 5 \
        --out "$OUT/train_$shape" > "$OUT/train_$shape.txt" 2>&1
    grep -E "^(path|fast|flash|fused|unfused)|TFLOP|failed" "$OUT/train_$shape.txt" | cut -c1-160
done

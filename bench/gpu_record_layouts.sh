#!/usr/bin/env bash
# The recorded runs on one host with two GPUs (docs/benchmarks.md, several GPUs; the layouts'
# layouts.json becomes its rows through `python bench/records.py add`).
#
#   bash bench/gpu_record_layouts.sh OUT_DIR [SECONDS]
#
# In priority order, each with a time cap so the whole fits in SECONDS (default 560):
#   1. bench/layouts.py at 345M on real text: one GPU, then TP=2, TP=2 with sequence
#      parallelism, PP=2, interleaved PP=2, DP=2 (distributed optimizer, overlapped gradient
#      reduce: per-layer graphs by default), the same without per-layer graphs (dp2eager),
#      with the full-iteration graph (dp2graph, --fast-cuda-graph: the capture under its
#      deadline), TP=2 with per-layer graphs (tp2graphs), CP=2 (refused without TE), losses
#      against one GPU and TFLOP/s per GPU; and a checkpoint saved under TP=2 resumed under
#      PP=2 (the vocabulary padded alike);
#   2. a TP=2 profile: megatron's timers and torch.profiler over iterations 10-12 of rank 0
#      (OUT_DIR/profile_tp2/torch_profile/rank-0.json.gz), summarised by
#      bench/profile_entry.py --analyse (GPU busy share, kernel time by kind).
#
# Needs: megatron-core (+ omegaconf) importable, two CUDA GPUs, and the corpus: the embedded
# one (python -m megagpt.data.corpus builds it; on a machine without network, a copy of a
# built cache under MEGAGPT_CACHE_DIR) or DATA_PREFIX, VOCAB_FILE, MERGE_FILE.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_record_layouts.sh OUT_DIR [SECONDS]}
BUDGET=${2:-560}
mkdir -p "$OUT"
START=$SECONDS
left() { echo $(( BUDGET - (SECONDS - START) )); }
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
# NVLink multicast stays off (shared hosts; see the device notes)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
PREFIX=${DATA_PREFIX:-$($PY -m megagpt.data.corpus --get prefix)}
VOCAB=${VOCAB_FILE:-$($PY -m megagpt.data.corpus --get vocab_file)}
MERGES=${MERGE_FILE:-$($PY -m megagpt.data.corpus --get merge_file)}
DATA=(--data-path "$PREFIX" --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB"
      --merge-file "$MERGES")

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m
  $PY -c 'import torch, megatron.core as m; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "megatron-core", m.__version__, "gpus", torch.cuda.device_count())'
} > "$OUT/gpu.txt" 2>&1

echo "== 1. layouts ($(left)s left)"
timeout $(( $(left) - 100 )) $PY bench/layouts.py --gpus 2 --layouts "${LAYOUTS:-dp2,dp2eager,dp2graph,tp2,tp2graphs,tp2sp,pp2,vpp2,cp2}" \
    --iters 50 --resume-check tp2,pp2 --timeout 120 --out "$OUT/layouts" -- "${DATA[@]}" \
    > "$OUT/layouts.txt" 2>&1
tail -14 "$OUT/layouts.txt"
rm -rf "$OUT"/layouts/ckpt_*

echo "== 2. TP=2 profile ($(left)s left)"
if [ "$(left)" -gt 70 ]; then
    FLAGS=$(cd bench && $PY -c "from layouts import model_flags; print(' '.join(model_flags('345M', 1234, 16, False)))")
    timeout $(( $(left) - 5 )) $PY -m torch.distributed.run --standalone --nproc-per-node 2 pretrain_gpt.py \
        $FLAGS --tensor-model-parallel-size 2 "${DATA[@]}" --profile --use-pytorch-profiler \
        --profile-step-start 10 --profile-step-end 12 --profile-ranks 0 \
        --tensorboard-dir "$OUT/profile_tp2/tb" --timing-log-level 2 > "$OUT/profile_tp2.txt" 2>&1
    grep -E "^ +(forward|backward)-compute" "$OUT/profile_tp2.txt" | tail -2
    $PY bench/profile_entry.py --analyse "$OUT/profile_tp2/torch_profile/rank-0.json.gz" --iters 2 \
        > "$OUT/profile_tp2_report.txt" 2>&1
    head -1 "$OUT/profile_tp2_report.txt"
fi
date -u >> "$OUT/gpu.txt"
# the rows of docs/benchmarks.md these runs measured: copy OUT/records/*.json into
# docs/figures/runs/ and run `make tables`
for f in "$OUT"/layouts/layouts.json; do
    [ -f "$f" ] && $PY bench/records.py add "$f" --dir "$OUT/records"
done
echo "== done in $((SECONDS - START))s"

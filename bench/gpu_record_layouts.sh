#!/usr/bin/env bash
# The recorded runs on one host with several GPUs (bench/benchmarks.md, several GPUs; each
# set's layouts.json becomes its rows through `python bench/records.py add`).
#
#   [SETS="dp345 pp345 tp13 profile"] [GPUS=N] bash bench/gpu_record_layouts.sh OUT_DIR [SECONDS]
#
# GPUS: how many to use (default: all the host has). Each set runs bench/layouts.py on real
# text (bf16, the same seed, 50 iterations, losses against one GPU, TFLOP/s per GPU); a set
# fits in one call of about ten minutes:
#   dp345    345M, micro-batch 8, 8 micro-batches per GPU: DP=2 (4, 8 where there are the
#            GPUs) with the distributed optimizer and the overlapped gradient reduce
#            (per-layer graphs by default), DP=2 without per-layer graphs (dp2eager), and with
#            the full-iteration graph (dp2graph / dp4graph / dp8graph: the capture under its
#            deadline); the one-GPU run takes the same global batch;
#   pp345    345M, micro-batch 8, 16 micro-batches: PP=2, interleaved PP=2, and a checkpoint
#            saved under TP=2 resumed under PP=2 and under DP=2 with the distributed optimizer
#            (saved with it, in the format that reloads under another TP x PP);
#   tp13     1.3B, micro-batch 4, 8 micro-batches: TP=2, with sequence parallelism, with
#            per-layer graphs, CP=2 (refused without TE), and TP=2 x PP=2 x DP=2 on 8 GPUs;
#   profile  345M TP=2: megatron's timers and torch.profiler over iterations 10-12 of rank 0
#            (OUT_DIR/profile_tp2/torch_profile/rank-0.json.gz), summarised by
#            bench/profile_entry.py --analyse (GPU busy share, kernel time by kind).
#
# Needs: megatron-core (+ omegaconf) importable, two or more CUDA GPUs, and the corpus: the
# embedded one (python -m megagpt.data.corpus builds it; on a machine without network, a copy
# of a built cache under MEGAGPT_CACHE_DIR) or DATA_PREFIX, VOCAB_FILE, MERGE_FILE.
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

SETS=" ${SETS:-dp345 pp345 tp13 profile} "
want() { [[ "$SETS" == *" $1 "* ]]; }
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")}
layouts() {  # NAME FLAGS...: one set, its own folder and log
    local name=$1; shift
    echo "== $name ($(left)s left)"
    timeout $(( $(left) - 20 )) $PY bench/layouts.py --gpus "$GPUS" --iters 50 --timeout 240 \
        --out "$OUT/$name" "$@" -- "${DATA[@]}" > "$OUT/$name.txt" 2>&1
    tail -16 "$OUT/$name.txt"
    rm -rf "$OUT/$name"/ckpt_*
}
if want dp345; then
    DP=dp2,dp2eager,dp2graph
    [ "$GPUS" -ge 4 ] && DP=$DP,dp4,dp4graph
    [ "$GPUS" -ge 8 ] && DP=$DP,dp8,dp8graph
    WIDEST=$(( GPUS >= 8 ? 8 : GPUS >= 4 ? 4 : 2 ))
    layouts dp345 --shape 345M --micro-batch 8 --micro-batches $(( 8 * WIDEST )) --layouts "$DP"
fi
if want pp345; then
    layouts pp345 --shape 345M --micro-batch 8 --micro-batches 16 --layouts pp2,vpp2 \
        --resume-check tp2,pp2 --resume-check tp2,dp2
fi
if want tp13; then
    layouts tp13 --shape 1.3B --micro-batch 4 --micro-batches 8 \
        --layouts tp2,tp2sp,tp2graphs,cp2,tp2pp2dp2
fi

if want profile && [ "$(left)" -gt 70 ]; then
    echo "== profile: TP=2 ($(left)s left)"
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
# the rows of bench/benchmarks.md these runs measured: copy OUT/records/*.json into
# bench/figures/runs/ and run `make tables`
for f in "$OUT"/*/layouts.json; do
    [ -f "$f" ] && $PY bench/records.py add "$f" --dir "$OUT/records"
done
echo "== done in $((SECONDS - START))s"

#!/usr/bin/env bash
# GPT-2 medium (345M: 24 layers × 1024 × 16 heads, context 1024) on one node: 8 GPUs or 1.
#
#   examples/train_gpt345m.sh [GPUS_PER_NODE] [-- megatron flags]
#
#   8 GPUs: 512 sequences per step = micro-batch 8 × 8 micro-batches × DP 8
#   1 GPU:  the same 512 sequences  = micro-batch 8 × 64 micro-batches × DP 1
# (the global batch stays 524,288 tokens, so the loss curve does not depend on the GPU count).
#
# Environment:
#   GPUS_PER_NODE   8 (or the first argument)
#   DATA_PATH       preprocessed data prefix (with VOCAB_FILE, MERGE_FILE); unset: the embedded
#                   Shakespeare corpus (python -m megagpt.data.corpus, built once, GPT-2 BPE);
#                   "mock": random tokens
#   RUN_DIR         runs/gpt345m (checkpoints/, tensorboard/, train.log)
#   GPU_TYPE        what the dry run plans for (default: this machine's GPU, else A100-80GB)
#   DRY_RUN=1       only the dry run (no GPU needed); passing --dry-run after -- does the same
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
source "$REPO/scripts/project_python.sh" "$REPO"  # PYTHON: the project's, no activation needed

EXTRA_ARGS=()
if (($#)) && [[ $1 != "--" ]]; then GPUS_PER_NODE=$1; shift; fi
if (($#)) && [[ $1 == "--" ]]; then shift; EXTRA_ARGS=("$@"); fi
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RUN_DIR=${RUN_DIR:-runs/gpt345m}
DRY_RUN=${DRY_RUN:-0}
for arg in ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}; do [[ $arg == --dry-run ]] && DRY_RUN=1; done

# 24 × 1024 × 16 heads, seq 1024; batch 512, lr 3e-4 cosine, bf16: see the config's comments.
GPT_MODEL_ARGS=(
    --config "$REPO/configs/gpt2_345m.yaml"
)

if [[ ${DATA_PATH:-} == mock ]]; then
    DATA_ARGS=(--mock-data --vocab-size 50257)
else
    if [[ -z ${DATA_PATH:-} ]]; then
        corpus() { "$PYTHON" -m megagpt.data.corpus --get "$1"; }
        DATA_PATH=$(corpus prefix)  # builds it on first use (seconds), then cached
        VOCAB_FILE=$(corpus vocab_file)
        MERGE_FILE=$(corpus merge_file)
        echo "data: the embedded corpus at $DATA_PATH" >&2
    fi
    DATA_ARGS=(
        --data-path "$DATA_PATH"
        --tokenizer-type GPT2BPETokenizer
        --vocab-file "${VOCAB_FILE:?set VOCAB_FILE with DATA_PATH}"
        --merge-file "${MERGE_FILE:?set MERGE_FILE with DATA_PATH}"
        --split 98,1,1
    )
fi

CHECKPOINT_ARGS=(
    --save "$RUN_DIR/checkpoints"
    --load "$RUN_DIR/checkpoints"
    --save-interval 1000
)

LOGGING_ARGS=(
    --log-interval 10
    --log-throughput
    --eval-interval 500
    --eval-iters 10
    --tensorboard-dir "$RUN_DIR/tensorboard"
    --log-timers-to-tensorboard
)

ARGS=("${GPT_MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}"
      ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
DRY_RUN_ARGS=(--dry-run --dry-run-world-size "$GPUS_PER_NODE")
[[ -n ${GPU_TYPE:-} ]] && DRY_RUN_ARGS+=(--gpu-type "$GPU_TYPE")

if [[ $DRY_RUN == 1 ]]; then
    exec "$PYTHON" "$REPO/pretrain_gpt.py" "${ARGS[@]}" "${DRY_RUN_ARGS[@]}"
fi
mkdir -p "$RUN_DIR"
if ! PLAN=$("$PYTHON" "$REPO/pretrain_gpt.py" "${ARGS[@]}" "${DRY_RUN_ARGS[@]}" \
        --dry-run-yaml "$RUN_DIR/launch_config.yaml" 2>&1); then
    echo "$PLAN" | grep -v -i "warn" | tail -n 25 >&2
    echo "preflight failed: not starting torchrun" >&2
    exit 2
fi
echo "$PLAN" | sed -n '/^layout:/,$p'

"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$GPUS_PER_NODE" \
    "$REPO/pretrain_gpt.py" "${ARGS[@]}" 2>&1 | tee -i "$RUN_DIR/train.log"  # -i: tee outlives Ctrl-C while the trainer saves

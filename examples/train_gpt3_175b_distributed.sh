#!/usr/bin/env bash
# GPT-3 175B on 8-GPU A100 nodes: TP 8 × PP 16 = 128 GPUs per model replica, DP = GPUs / 128.
#
#   examples/train_gpt3_175b_distributed.sh [NNODES [NODE_RANK [MASTER_ADDR]]] [-- megatron flags]
#
# Run it once on every node (examples/train_gpt3_175b.sbatch does that under SLURM). Nodes, node
# rank and master address come from the arguments, else from SLURM (SLURM_NNODES, SLURM_NODEID,
# the first host of SLURM_JOB_NODELIST), else from NNODES / NODE_RANK / MASTER_ADDR, else one node.
#
#   16 nodes = 128 GPUs = TP 8 × PP 16 × DP 1:  1536 micro-batches of 1 per step
#  192 nodes = 1536 GPUs = TP 8 × PP 16 × DP 12:  128 micro-batches per step (the GPT-3 layout)
#
# Before torchrun starts, the dry run checks the layout at WORLD_SIZE = NNODES × 8 and the memory
# estimate against GPU_TYPE; a launch that cannot run stops here, on every node, with the numbers.
#
# Environment:
#   DATA_PATH, VOCAB_FILE, MERGE_FILE   preprocessed data prefix and GPT-2 BPE files
#                                       (DATA_PATH unset: --mock-data, random tokens)
#   CHECKPOINT_DIR  (default runs/gpt3_175b/checkpoints)   TENSORBOARD_DIR (runs/gpt3_175b/tensorboard)
#   GPU_TYPE        A100-80GB (default), A100-40GB, H100, H200: what the dry run plans for
#   MASTER_PORT     6000
#   PYTHON          the project's .venv unless set (scripts/project_python.sh: no activation needed)
#   DRY_RUN=1       only the dry run: print the plan and exit (no torchrun, no GPU needed);
#                   passing --dry-run after -- does the same
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
source "$REPO/scripts/project_python.sh" "$REPO"  # PYTHON: the project's, no activation needed
GPUS_PER_NODE=8

EXTRA_ARGS=()
POSITIONAL=()
while (($#)); do
    if [[ $1 == "--" ]]; then shift; EXTRA_ARGS=("$@"); break; fi
    POSITIONAL+=("$1"); shift
done
NNODES=${POSITIONAL[0]:-${SLURM_NNODES:-${NNODES:-1}}}
NODE_RANK=${POSITIONAL[1]:-${SLURM_NODEID:-${NODE_RANK:-0}}}
if [[ -n ${POSITIONAL[2]:-} ]]; then
    MASTER_ADDR=${POSITIONAL[2]}
elif [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
    if ! command -v scontrol >/dev/null; then
        echo "error: SLURM_JOB_NODELIST is set but scontrol is not on PATH: give the master" \
             "address (examples/train_gpt3_175b_distributed.sh NNODES NODE_RANK MASTER_ADDR)" >&2
        exit 2
    fi
    # sed reads the whole list: with head, scontrol could die of SIGPIPE and pipefail stop us
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
else
    MASTER_ADDR=${MASTER_ADDR:-localhost}
fi
MASTER_PORT=${MASTER_PORT:-6000}
WORLD_SIZE=$((NNODES * GPUS_PER_NODE))
GPU_TYPE=${GPU_TYPE:-A100-80GB}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-runs/gpt3_175b/checkpoints}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-runs/gpt3_175b/tensorboard}
DRY_RUN=${DRY_RUN:-0}
for arg in ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}; do [[ $arg == --dry-run ]] && DRY_RUN=1; done

# Model, layout (TP 8, PP 16, sequence parallel, distributed optimizer), batch 1536 × 2048
# tokens and the paper's schedule: see the arithmetic in the config's comments.
GPT_MODEL_ARGS=(
    --config "$REPO/configs/gpt3_175b.yaml"
)

if [[ -n ${DATA_PATH:-} ]]; then
    : "${VOCAB_FILE:?set VOCAB_FILE (GPT-2 vocab.json) with DATA_PATH}"
    : "${MERGE_FILE:?set MERGE_FILE (GPT-2 merges.txt) with DATA_PATH}"
    DATA_ARGS=(
        --data-path "$DATA_PATH"
        --tokenizer-type GPT2BPETokenizer
        --vocab-file "$VOCAB_FILE"
        --merge-file "$MERGE_FILE"
        --split 949,50,1
    )
else
    echo "DATA_PATH is not set: training on random tokens (--mock-data)" >&2
    DATA_ARGS=(--mock-data --vocab-size 50257)
fi

CHECKPOINT_ARGS=(
    --save "$CHECKPOINT_DIR"
    --load "$CHECKPOINT_DIR"
    --save-interval 1000
    --ckpt-format torch_dist
)

LOGGING_ARGS=(
    --log-interval 10
    --log-throughput
    --eval-interval 1000
    --eval-iters 10
    --tensorboard-dir "$TENSORBOARD_DIR"
    --log-timers-to-tensorboard
)

ARGS=("${GPT_MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}"
      ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})

echo "launch: $NNODES nodes × $GPUS_PER_NODE GPUs = $WORLD_SIZE GPUs; node rank $NODE_RANK;" \
     "master $MASTER_ADDR:$MASTER_PORT"

# Preflight: the layout arithmetic (TP 8 × PP 16 × DP = $WORLD_SIZE), batch divisibility and
# the memory estimate, on this node, before any GPU is touched.
DRY_RUN_ARGS=(--dry-run --dry-run-world-size "$WORLD_SIZE" --gpu-type "$GPU_TYPE")
if [[ $DRY_RUN == 1 ]]; then
    exec "$PYTHON" "$REPO/pretrain_gpt.py" "${ARGS[@]}" "${DRY_RUN_ARGS[@]}"
fi
mkdir -p "$CHECKPOINT_DIR"
RESOLVED=/dev/null
[[ $NODE_RANK == 0 ]] && RESOLVED="$CHECKPOINT_DIR/launch_config.yaml"
if ! PLAN=$("$PYTHON" "$REPO/pretrain_gpt.py" "${ARGS[@]}" "${DRY_RUN_ARGS[@]}" \
        --dry-run-yaml "$RESOLVED" 2>&1); then
    echo "$PLAN" | grep -v -i "warn" | tail -n 25 >&2
    echo "preflight failed: not starting torchrun" >&2
    exit 2
fi
echo "$PLAN" | sed -n '/^layout:/,$p'

export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP/SP communication ordered on one hardware queue
exec "$PYTHON" -m torch.distributed.run \
    --nproc-per-node "$GPUS_PER_NODE" \
    --nnodes "$NNODES" \
    --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" \
    --master-port "$MASTER_PORT" \
    "$REPO/pretrain_gpt.py" "${ARGS[@]}"

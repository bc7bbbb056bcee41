#!/usr/bin/env bash
# Stop a run and resume it from its checkpoint (by default the tiny model on the CPU, ~1 minute).
#
#   examples/resume.sh [RUN_DIR] [-- megatron flags for both runs]
#
# 1. train with --save and --exit-interval: megatron saves a checkpoint at STOP_AT and exits;
# 2. the same command with --load: megatron reads the checkpoint (weights, optimizer, scheduler,
#    RNG, consumed samples) and continues at STOP_AT + 1 up to TRAIN_ITERS.
# Then it draws both runs on one plot (RUN_DIR/resume.png): the resumed curve should continue
# the first one.
#
# Environment:
#   CONFIG       configs/tiny.yaml      TRAIN_ITERS  20     STOP_AT  10
#   DEVICE_ARGS  --cpu (set to "" on a GPU machine)
#   PYTHON       the project's .venv unless set (scripts/project_python.sh: no activation needed)
#   LAUNCHER     how pretrain_gpt.py is started, e.g. "torchrun --nproc-per-node 8" (default: python)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
source "$REPO/scripts/project_python.sh" "$REPO"  # PYTHON: the project's, no activation needed

RUN_DIR=runs/resume
if (($#)) && [[ $1 != "--" ]]; then RUN_DIR=$1; shift; fi
EXTRA_ARGS=()
if (($#)) && [[ $1 == "--" ]]; then shift; EXTRA_ARGS=("$@"); fi
CONFIG=${CONFIG:-$REPO/configs/tiny.yaml}
TRAIN_ITERS=${TRAIN_ITERS:-20}
STOP_AT=${STOP_AT:-10}
DEVICE_ARGS=${DEVICE_ARGS---cpu}
LAUNCHER=${LAUNCHER:-$PYTHON}
# A tiny model on the CPU: more intra-op threads cost more than they give (torchrun sets 1 too).
[[ " $DEVICE_ARGS " == *" --cpu "* ]] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# Identical for both runs: a resumed run must see the same model, data and schedule.
RUN_ARGS=(
    --config "$CONFIG"
    --train-iters "$TRAIN_ITERS"
    --save "$RUN_DIR/checkpoints"
    --save-interval "$STOP_AT"
    --tensorboard-dir "$RUN_DIR/tensorboard"
    --log-interval 1
    $DEVICE_ARGS
    ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
)

mkdir -p "$RUN_DIR"
rm -rf "$RUN_DIR/checkpoints" "$RUN_DIR/tensorboard"

echo "== 1. train, stop at iteration $STOP_AT (checkpoint in $RUN_DIR/checkpoints)"
$LAUNCHER "$REPO/pretrain_gpt.py" "${RUN_ARGS[@]}" --exit-interval "$STOP_AT" \
    > "$RUN_DIR/first.log" 2>&1 || { tail -n 30 "$RUN_DIR/first.log"; exit 1; }
grep -E "iteration +$STOP_AT/" "$RUN_DIR/first.log" | sed 's/^ *\[[^]]*\]//'
echo "checkpoint: iteration $(cat "$RUN_DIR/checkpoints/latest_checkpointed_iteration.txt")"

echo "== 2. resume with --load, iterations $((STOP_AT + 1))..$TRAIN_ITERS"
$LAUNCHER "$REPO/pretrain_gpt.py" "${RUN_ARGS[@]}" --load "$RUN_DIR/checkpoints" \
    > "$RUN_DIR/resumed.log" 2>&1 || { tail -n 30 "$RUN_DIR/resumed.log"; exit 1; }
grep -E "iteration +$((STOP_AT + 1))/|iteration +$TRAIN_ITERS/" "$RUN_DIR/resumed.log" \
    | sed 's/^ *\[[^]]*\]//'

echo "== 3. plot"
"$PYTHON" -m megagpt.run_log.plots "$RUN_DIR/first.log" "$RUN_DIR/resumed.log" \
    --labels "first run (stopped at $STOP_AT)" "resumed from checkpoint" \
    --title "resume at iteration $STOP_AT" --out "$RUN_DIR/resume.png"

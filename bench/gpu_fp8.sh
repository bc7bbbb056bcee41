#!/usr/bin/env bash
# The fast spec's FP8 linears on one GPU: its GPU tests, the fused layer's kernels in bf16 and
# FP8, and training throughput against bf16 (the runs behind bench/notes/fp8.md).
#
#   MCORE_SITE=DIR [TE_SITE=DIR] bash bench/gpu_fp8.sh OUT_DIR STEP [SECONDS]
#
# (`source bench/gpu_site.sh` sets MCORE_SITE, and TE_SITE where Transformer Engine was
# built.) Steps, each inside one 10-minute call:
#   tests   the FP8 GPU tests (tests/test_fp8.py and tests/test_fp8_weight_writes.py, -m gpu)
#   layer   the fused layer's forward + backward under a CUDA graph, bf16 against FP8 with
#           current and delayed scaling (bench/bench_layer.py), wide and 1.3B (LAYER_SHAPES),
#           with each setting's time by kind of kernel and the slowest kernels
#   train   throughput, mock data, dropout 0: the fast path in bf16 against its FP8 with
#           delayed and current scaling (TRAIN_PATHS: also fp8own, delayed scaling on each
#           tensor's own amax at first and for gradients; referencefp8, plain PyTorch with
#           torchao's FP8, from the wheels in .whl-ref; tefp8 and tefp8cs, TE's FP8 layers,
#           where TE_SITE holds Transformer Engine), at the wide shape and 1.3B (FP8_SHAPES)
#           (`python bench/fp8_records.py OUT/train_<shape>/bench_<shape>.json ...`, the
#           outputs of one call, makes bench/benchmarks.md's records)
#   te      per shape (FP8_SHAPES), one call each: train's fast,fp8,referencefp8 without TE,
#           then tefp8,tefp8cs with TE (TE_SITE), then fp8own (each skipped where the
#           call's time is short); about 480 s for the wide shape
#   weights per shape (FP8_SHAPES), one call each: the FP8 weights written by the optimizer
#           (fp8write: --fast-fp8-weight-writes) against the forward's own cast of them (fp8,
#           the default) and bf16 (fast), without TE, and whether fp8write's and fp8's
#           logged losses are the same (the copies are the
#           forward's own cast; flash attention's backward adds its query gradient in no
#           fixed order, so the last digits may part as between two runs of one path);
#           then TE's FP8 with delayed scaling under the full-iteration graph (tefp8);
#           WEIGHT_PATHS replaces fast,fp8,fp8write, and with BASE (another commit's files,
#           that commit named in BASE/COMMIT, as bench/gpu_record.sh's step 10 takes them)
#           its rows base (bf16) and basefp8 run that commit's entry in the same invocation
#   first   tests, train at the wide shape, layer
#   all     tests, layer (LAYER_SHAPES), train (FP8_SHAPES)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_fp8.sh OUT_DIR STEP [SECONDS]}
STEP=${2:?usage: gpu_fp8.sh OUT_DIR STEP [SECONDS]}
BUDGET=${3:-560}
START=$SECONDS
left() { echo $(( BUDGET - (SECONDS - START) )); }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=${MCORE_SITE:?}
PY=${PY:-python3}
# torchao for the plain-PyTorch FP8 row, kept apart from the entry's site
if ls .whl-ref/torchao-*.whl > /dev/null 2>&1 && [ ! -d /tmp/torchao/torchao ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/torchao \
        .whl-ref/torchao-*.whl 2>&1 | grep -v "^WARNING: Target" || true
fi
[ -d /tmp/torchao/torchao ] && export TORCHAO_SITE=/tmp/torchao
TE="--transformer-impl transformer_engine --fast-cuda-graphs iteration"
NODROP="--hidden-dropout 0 --attention-dropout 0"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    $PY -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__, "cuBLAS", torch.backends.cuda.preferred_blas_library())'
} > "$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"

tests() {
    echo "== tests ($(left)s left)"
    timeout $(( $(left) < 300 ? $(left) : 300 )) $PY -m pytest -q -p no:cacheprovider -m gpu \
        tests/test_fp8.py tests/test_fp8_weight_writes.py 2>&1 | tail -15 | tee "$OUT/tests.txt"
}

train() {  # SHAPE [PATHS [TAG]]: PATHS with TE's rows (tefp8, tefp8cs) only, run with TE
    local shape=$1 paths=${2:-${TRAIN_PATHS:-fast,fp8,fp8cs}} tag=${3:-}
    local name=train_${shape}${tag}
    [ "$(left)" -gt 120 ] || { echo "== $name: skipped ($(left)s left)"; return; }
    echo "== $name: $paths ($(left)s left)"
    # TE importable for TE's rows and hidden from the fast path's, in one call
    local path=$MCORE_SITE base=()
    case ",$paths," in *,te*) path="$MCORE_SITE:${TE_SITE:?TE rows need TE_SITE}" ;; esac
    if [ -n "${BASE:-}" ]; then  # another commit's entry, in the same invocation
        base=(--variant "base=" --entry-of "base=$BASE/pretrain_gpt.py"
              --variant "basefp8=--fp8-format hybrid" --entry-of "basefp8=$BASE/pretrain_gpt.py")
    fi
    PYTHONPATH=$path timeout $(( $(left) - 10 )) $PY bench/bench_throughput.py --shape "$shape" \
        --paths "$paths" "${base[@]}" --variant "fp8=--fp8-format hybrid" \
        --variant "fp8cs=--fp8-format hybrid --fp8-recipe tensorwise" \
        --variant "fp8write=--fp8-format hybrid --fast-fp8-weight-writes" \
        --variant "fp8own=--fp8-format hybrid --fast-fp8-first-scales amax --fast-fp8-grad-scaling current" \
        --variant "tefp8=$TE --fp8-format hybrid" \
        --variant "tefp8cs=$TE --fp8-format hybrid --fp8-recipe tensorwise" \
        --variant "te=$TE" --baseline "${paths%%,*}" \
        --entry-args "$NODROP" --reference-dropout 0 --train-iters ${TRAIN_ITERS:-40} \
        --warmup-iters 10 --log-interval 5 --out "$OUT/$name" > "$OUT/$name.txt" 2>&1
    grep -E "^(path|fast|fp8|te|ref|base)|TFLOP|failed|error" "$OUT/$name.txt" | cut -c1-200 | head -14
    grep -h "FP8 linears\|layers:\|flat AdamW step over" "$OUT/$name"/entry_*.log \
        2>/dev/null | sort -u | cut -c1-240 | head -6
}

same_losses() {  # SHAPE: fp8write's logged losses (weights written) against fp8's (cast)
    $PY - "$OUT/train_$1/bench_$1.json" <<'PY' 2>/dev/null | tee -a "$OUT/train_$1.txt"
import json, sys
runs = json.load(open(sys.argv[1]))["results"]
written, cast = (runs.get(p, {}).get("losses") for p in ("fp8write", "fp8"))
apart = list(zip(written or [], cast or []))
print("   fp8write (weights written) against fp8 (cast in the forward), the logged losses:",
      "the same" if written and written == cast else f"apart: {apart}")
PY
}

layer() {
    [ "$(left)" -gt 90 ] || { echo "== layer: skipped ($(left)s left)"; return; }
    echo "== layer ($(left)s left)"
    timeout $(( $(left) - 5 )) $PY bench/bench_layer.py --shapes "${LAYER_SHAPES:-wide,1.3B}" \
        --settings "${LAYER_SETTINGS:-default,fp8 tensorwise,fp8 delayed}" --out "$OUT/layer.json" \
        > "$OUT/layer.txt" 2>&1
    grep -E "^layer|not run|Error" "$OUT/layer.txt" | cut -c1-400
    $PY - "$OUT/layer.json" <<'PY' 2>/dev/null | tee "$OUT/layer_kernels.txt"
import json, sys
for shape, rows in json.load(open(sys.argv[1])).items():
    for name, row in rows.items():
        if "fp8" not in name:
            continue
        top = sorted(row["kernels"].items(), key=lambda kv: -kv[1])[:14]
        print(f"-- {shape} {name}: slowest kernels (ms per layer)")
        for kernel, ms in top:
            print(f"   {ms:7.3f}  {kernel[:150]}")
PY
}

case "$STEP" in
tests) tests ;;
layer) layer ;;
train) for shape in ${FP8_SHAPES:-wide 1.3B}; do train "$shape"; done ;;
a) tests; LAYER_SHAPES=wide LAYER_SETTINGS="default,fp8 delayed" layer
   train wide fast,fp8,fp8cs,referencefp8 ;;
te) for shape in ${FP8_SHAPES:-wide 1.3B}; do
        train "$shape" fast,fp8,referencefp8; train "$shape" tefp8,tefp8cs _te
        train "$shape" fp8own _own; done ;;
weights) for shape in ${FP8_SHAPES:-wide 1.3B}; do
        train "$shape" "${WEIGHT_PATHS:-fast,fp8,fp8write}"; same_losses "$shape"
        train "$shape" tefp8 _te
    done ;;
first) tests; train wide; layer ;;
all) tests; layer; for shape in ${FP8_SHAPES:-wide 1.3B}; do train "$shape"; done ;;
*) echo "unknown step $STEP"; exit 2 ;;
esac
echo "== done in $((SECONDS - START))s"

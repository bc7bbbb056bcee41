#!/usr/bin/env bash
# With NVIDIA apex installed against without it, alone and beside Transformer Engine, on one
# GPU: the runs behind bench/benchmarks.md's section "With NVIDIA apex installed".
#
#   source bench/gpu_site.sh && bash bench/gpu_record_apex.sh OUT_DIR STEP[,STEP...] [SECONDS]
#
# MCORE_SITE holds megatron-core and the entry's other wheels (bench/gpu_site.sh sets it, and
# TE_SITE where Transformer Engine was built into /tmp/site); APEX_SITE (default
# /tmp/apex-site) holds apex as bench/gpu_apex_build.sh builds it, which this script runs
# first when the folder is missing (.apex-built, or .apex to build, must then be there).
# Installs, each a PYTHONPATH of the same interpreter, so that one command measures them side by
# side: plain (MCORE_SITE), apex (+ APEX_SITE), te (+ TE_SITE), apex_te (both). Without
# TE_SITE the steps leave what needs TE out. Steps, each within 10 minutes on the GPU machine (SECONDS,
# default 560, bounds them all; what does not fit is skipped and said):
#   smoke        the shipped configs cut to one GPU and the layer choices
#                (tests/test_apex_gpu.py), and every one-GPU row of the flag matrix, apex
#                importable: no traceback, the apex line once per launch
#   smoke_te     the same beside TE (needs TE_SITE)
#   speed        throughput, bf16, mock data, dropout 0, 345M and 1.3B: the default with apex
#                importable, then hidden; then beside TE against TE alone if time is left
#                (SPEED_PAIRS="apex_te:te" measures only the latter; SPEED_SHAPES="1.3B"
#                one shape)
#   pieces       345M: each piece megatron takes from apex for the fast path (writing
#                gradients against megatron's fusion, its optimizers on apex's FusedAdam and
#                amp_C) switched off by its flag, and the same launches with apex hidden
#   pieces_local the same for megatron's local spec (apex's persistent layer norm taken by
#                --persist-layer-norm, its softmax and weight-gradient fusion switched off);
#                the two steps took 3 minutes each on an H100; LOCAL_PIECES=local,persist
#                times only the persistent layer norm, with apex (two launches of the four)
#   checkpoints  tests/test_apex_gpu.py's crossings (apex <-> plain <-> TE, the distributed
#                optimizer's layout too) and the generation and Hugging Face export of an
#                apex checkpoint under every install
# Each bench run's JSON lands in OUT_DIR/<step>/<install>_<shape>/; `python
# bench/apex_records.py OUT_DIR` turns them into records for bench/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_record_apex.sh OUT_DIR STEP[,STEP...] [SECONDS]}
STEPS=${2:?usage: gpu_record_apex.sh OUT_DIR STEP[,STEP...] [SECONDS]}
BUDGET=${3:-560}
START=$SECONDS
left() { echo $(( BUDGET - (SECONDS - START) )); }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
PY=${PY:-python3}
NODROP="--hidden-dropout 0 --attention-dropout 0"
APEX_SITE=${APEX_SITE:-/tmp/apex-site}
[ -n "${MCORE_SITE:-}" ] || { echo "error: MCORE_SITE is not set: source bench/gpu_site.sh first"; exit 2; }
for step in ${STEPS//,/ }; do
    case "$step" in smoke|smoke_te|speed|pieces|pieces_local|checkpoints) ;;
    *) echo "error: unknown step $step (smoke, smoke_te, speed, pieces, pieces_local," \
            "checkpoints)"; exit 2 ;;
    esac
done
if [ ! -f "$APEX_SITE/apex-build.json" ]; then
    # a check that fails is reported there; the runs go on with what was built
    APEX_SITE=$APEX_SITE bash bench/gpu_apex_build.sh "$OUT/apex"
    [ -f "$APEX_SITE/apex-build.json" ] || exit 2
fi
PLAIN=$MCORE_SITE
APEX=$MCORE_SITE:$APEX_SITE
TE=${TE_SITE:+$MCORE_SITE:$TE_SITE}
APEX_TE=${TE_SITE:+$MCORE_SITE:$APEX_SITE:$TE_SITE}
ALL=${APEX_TE:-$APEX}  # for the tests, which hide what each of their installs leaves out
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    PYTHONPATH=$ALL $PY - "$APEX_SITE/apex-build.json" <<'PY' 2> /dev/null
import importlib.metadata as md, json, sys
import torch, megatron.core as m
built = json.load(open(sys.argv[1]))
line = (f"torch {torch.__version__} megatron-core {m.__version__} apex "
        f"{built['source']['tag']} ({built['source']['commit'][:8]}, built for "
        f"{built['arch']} with {built['nvcc']})")
try:
    line += f" transformer-engine {md.version('transformer-engine')}"
except md.PackageNotFoundError:
    line += " transformer-engine not installed"
print(line)
PY
} > "$OUT/versions.txt"
cat "$OUT/versions.txt"

# the tests several at once where pytest-xdist is there (each test is its own processes)
WORKERS=""
PYTHONPATH=$ALL $PY -c "import xdist" 2>/dev/null && WORKERS="-n ${TEST_WORKERS:-6}"

apex_tests() {  # NAME PYTHONPATH -k EXPRESSION: tests/test_apex_gpu.py, its failures in OUT
    local name=$1 path=$2 expr=$3
    [ "$(left)" -gt 60 ] || { echo "== $name: skipped ($(left)s left)"; return; }
    echo "== $name ($(left)s left)"
    MEGAGPT_FAILURE_LOG="$OUT/${name}_failures.txt" PYTHONPATH=$path timeout $(( $(left) - 5 )) \
        $PY -m pytest -v -p no:cacheprovider -s -rA $WORKERS -m apex_gpu -k "$expr" \
        tests/test_apex_gpu.py > "$OUT/$name.txt" 2>&1
    # each test's outcome as pytest-xdist prints it when it ends ("[gw0] [ 25%] PASSED ..."),
    # so that a run the call's time cuts short still says which passed
    local outcome="(PASSED|FAILED|ERROR|SKIPPED) tests/[^ ]+.*|[0-9]+ (passed|failed).*"
    grep -oE "$outcome|[a-z_]+ -> [a-z_]+: largest relative.*" "$OUT/$name.txt" | sort -u \
        | cut -c1-200 | tail -40
}

matrix() {  # NAME PYTHONPATH: every one-GPU row of the flag matrix under that install
    local name=$1 path=$2
    [ "$(left)" -gt 60 ] || { echo "== $name: skipped ($(left)s left)"; return; }
    echo "== $name ($(left)s left)"
    PYTHONPATH=$path MEGAGPT_FLAG_MATRIX_DEVICE=gpu MEGAGPT_FLAG_MATRIX=${MATRIX_ROWS:-all} \
        MEGAGPT_FLAG_MATRIX_PARALLEL=${MATRIX_PARALLEL:-8} timeout $(( $(left) - 5 )) \
        $PY -m pytest -q -rA -p no:cacheprovider --basetemp "$OUT/$name" \
        tests/test_flag_matrix.py -k row_trains > "$OUT/$name.txt" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$name.txt" | cut -c1-200 | tail -20
    # rows that finished, by their logs (what a run cut short still shows)
    for log in "$OUT/$name"/flag_matrix0/*/entry.log; do
        [ -f "$log" ] || continue
        echo "$(basename "$(dirname "$log")"): $(grep -c ' iteration ' "$log") iteration lines," \
             "$(grep -c Traceback "$log") tracebacks, $(grep -c 'apex: what this launch' "$log")" \
             "apex lines; $(grep -m1 '^error:' "$log" | cut -c1-100)"
    done > "$OUT/$name.rows"
    grep -v " 0 tracebacks, 1 apex lines" "$OUT/$name.rows" | head -20
    echo "$(grep -c " 0 tracebacks, 1 apex lines" "$OUT/$name.rows") rows trained with the apex line once"
}

bench() {  # STEP INSTALL PYTHONPATH SHAPE [bench_throughput args...]
    local step=$1 install=$2 path=$3 shape=$4
    shift 4
    local dir="$OUT/$step/${install}_$shape"
    [ "$(left)" -gt 75 ] || { echo "== $step $install $shape: skipped ($(left)s left)"; return; }
    echo "== $step $install $shape ($(left)s left)"
    mkdir -p "$dir"
    PYTHONPATH=$path timeout $(( $(left) - 10 )) $PY bench/bench_throughput.py --shape "$shape" \
        --baseline fast --entry-args "$NODROP" --train-iters 30 --warmup-iters 10 \
        --out "$dir" "$@" > "$dir.txt" 2>&1
    grep -E "^(path|fast|local|[a-z_]+ +[0-9.]+ )|FAILED|failed" "$dir.txt" | cut -c1-120 | head -12
    grep -h "apex: what this launch" "$dir"/entry_*.log 2>/dev/null | sort -u | cut -c1-300
}

compare() {  # STEP SHAPE INSTALL BASE: ms/iter of each path under BASE / under INSTALL
    PY_OUT=$OUT $PY - "$@" <<'PY'
import json, os, sys
from pathlib import Path
step, shape, install, base = sys.argv[1:5]
def ms(name):
    f = Path(os.environ["PY_OUT"], step, f"{name}_{shape}", f"bench_{shape}.json")
    if not f.exists():
        return {}
    return {p: r.get("ms_per_iter") for p, r in json.loads(f.read_text())["results"].items()}
a, b = ms(install), ms(base)
for path in a:
    if a[path] and b.get(path):
        print(f"{step} {shape} {path}: {install} {a[path]:.1f} ms, {base} {b[path]:.1f} ms: "
              f"{install} at {b[path] / a[path]:.3f}x of {base}'s speed")
PY
}

LOCAL_FLAGS="--transformer-impl local --no-fast-spec --fast-disable optimizer,lm-loss"
for step in ${STEPS//,/ }; do
case "$step" in
smoke)
    # the configs and layer choices, and the matrix, side by side: nothing here is timed
    apex_tests smoke_tests "$APEX" "shipped_config or layer_choice" &
    matrix matrix_apex "$APEX" &
    wait
    ;;
smoke_te)
    [ -n "$APEX_TE" ] || { echo "== smoke_te: skipped (no TE_SITE)"; continue; }
    apex_tests smoke_te_tests "$APEX_TE" "(shipped_config or layer_choice) and apex_te" &
    matrix matrix_apex_te "$APEX_TE" &
    wait
    ;;
speed)
    # SPEED_PAIRS picks (default: apex against hidden, then beside TE against TE alone)
    for pair in ${SPEED_PAIRS:-apex:hidden apex_te:te}; do
        with=${pair%%:*} without=${pair##*:}
        [ "$with" = apex ] || [ -n "$APEX_TE" ] || { echo "== speed $pair: no TE_SITE"; continue; }
        for shape in ${SPEED_SHAPES:-345M 1.3B}; do
            if [ "$with" = apex ]; then
                bench speed apex "$APEX" $shape --paths fast
                bench speed hidden "$PLAIN" $shape --paths fast
            else
                bench speed apex_te "$APEX_TE" $shape --paths fast
                bench speed te "$TE" $shape --paths fast
            fi
            compare speed $shape "$with" "$without"
        done
    done
    ;;
pieces)
    # the fast path's pieces first: writing gradients against megatron's fusion kept on, and
    # megatron's own optimizer (apex's FusedAdam and amp_C) against the fast one
    bench pieces apex "$APEX" 345M --paths fast,nowrite,distopt,megatron_optimizer \
        --variant "nowrite=--fast-disable grad-write" \
        --variant "distopt=--use-distributed-optimizer" \
        --variant "megatron_optimizer=--fast-disable optimizer"
    bench pieces hidden "$PLAIN" 345M --paths fast,distopt,megatron_optimizer \
        --variant "distopt=--use-distributed-optimizer" \
        --variant "megatron_optimizer=--fast-disable optimizer"
    compare pieces 345M apex hidden
    ;;
pieces_local)
    # megatron's local spec, where apex's norms, softmax and weight-gradient fusion are taken
    # (its runs land beside the fast path's, in OUT/pieces); apex's persistent layer norm,
    # which the entry leaves (measured slower), taken by its flag
    bench pieces apex_local "$APEX" 345M --paths "${LOCAL_PIECES:-local,persist,nosoftmax,nofusion}" \
        --baseline local \
        --variant "persist=$LOCAL_FLAGS --persist-layer-norm" \
        --variant "nosoftmax=$LOCAL_FLAGS --no-masked-softmax-fusion" \
        --variant "nofusion=$LOCAL_FLAGS --no-gradient-accumulation-fusion"
    [ -n "${LOCAL_PIECES:-}" ] || bench pieces hidden_local "$PLAIN" 345M --paths local --baseline local
    compare pieces 345M apex_local hidden_local
    ;;
checkpoints)
    apex_tests checkpoint_tests "$ALL" "cross or generates"
    ;;
esac
done
echo "== done in $((SECONDS - START))s"

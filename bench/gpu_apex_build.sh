#!/usr/bin/env bash
# NVIDIA apex on the GPU machine, as NVIDIA's containers have it: built once, then reused. Run
# there from the project root:
#
#   bash bench/gpu_apex_build.sh OUT_DIR [BUDGET_S]
#
# Whichever of these the GPU machine has, in this order:
#   /tmp/apex-site already there (the machine stayed warm): only checked;
#   .apex-built/ (the apex-built.tar.gz, or its .partN files, that an earlier build left in its
#       OUT_DIR, copied here): unpacked into /tmp/apex-site, seconds;
#   .apex/ (bash bench/gpu_apex_carry.sh): the extensions megatron takes (megagpt.launch.apex_kernels)
#       built for this GPU's architecture only (bench/apex_build.py: all at once on every
#       core; what is not built within BUDGET_S, default 420, is left out), then packed into
#       OUT_DIR/apex-built.tar.gz, or parts of it under 16 MiB each (at most 6), for later
#       commands to bring along as .apex-built/.
# Then bench/apex_check.py: each part imports and its kernels agree with torch on this GPU
# (OUT_DIR/apex_check.json). Later commands: PYTHONPATH=/tmp/apex-site:... (or APEX_SITE);
# bench/gpu_record_apex.sh runs this itself when /tmp/apex-site is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_apex_build.sh OUT_DIR [BUDGET_S]}
BUDGET=${2:-420}
SITE=${APEX_SITE:-/tmp/apex-site}
PY=${PY:-python3}
PART_BYTES=$((15 * 1024 * 1024))
MAX_PARTS=6
mkdir -p "$OUT"
START=$SECONDS

torch_version() { $PY -c 'import torch; print(torch.__version__)'; }
built_for() { $PY -c "import json, sys; print(json.load(open(sys.argv[1]))['torch'])" "$1"; }

pack() {  # the site, whole, into OUT: one file, or parts that a later unpack joins
    local archive="$OUT/apex-built.tar.gz"
    rm -f "$archive" "$archive".part*
    tar -czf "$archive" -C "$SITE" . || return 1
    local size
    size=$(stat -c %s "$archive")
    if [ "$size" -ge "$PART_BYTES" ]; then
        split -b "$PART_BYTES" -d -a 1 "$archive" "$archive.part" && rm -f "$archive"
    fi
    local parts
    parts=$(ls "$archive"* | wc -l)
    if [ "$parts" -gt "$MAX_PARTS" ]; then
        echo "error: the built apex packs to $size bytes, more than $MAX_PARTS parts of 15 MiB"
        return 1
    fi
    echo "apex: packed $(du -ch "$archive"* | tail -1 | cut -f1) into $parts file(s):" \
         "copy OUT's apex-built.tar.gz* into .apex-built/ and bring .apex-built along next time"
}

if [ -f "$SITE/apex-build.json" ] && [ -d "$SITE/apex" ]; then
    echo "apex: $SITE is there already (built or unpacked earlier on this machine)"
elif ls .apex-built/apex-built.tar.gz* > /dev/null 2>&1; then
    rm -rf "$SITE" && mkdir -p "$SITE"
    if ! cat .apex-built/apex-built.tar.gz* | tar -xz -C "$SITE"; then
        rm -rf "$SITE"
        echo "error: .apex-built/ does not unpack (a part missing or cut short?): bring every" \
             "apex-built.tar.gz* file of the build's OUT"
        exit 2
    fi
    if [ "$(built_for "$SITE/apex-build.json")" != "$(torch_version)" ]; then
        echo "error: .apex-built/ was built against torch $(built_for "$SITE/apex-build.json")," \
             "this machine has $(torch_version): build again (bring .apex, not .apex-built)"
        rm -rf "$SITE"
        exit 2
    fi
    echo "apex: unpacked .apex-built/ into $SITE in $((SECONDS - START)) s"
elif [ -f .apex/setup.py ] && [ -d .apex/csrc ]; then
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
    echo "apex: building $(sed -n 's/^tag //p' .apex/SOURCE 2>/dev/null) for" \
         "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST on $(nproc) cores, torch $(torch_version)"
    $PY bench/apex_build.py --source .apex --site "$SITE" --budget "$BUDGET" --jobs "$(nproc)" \
        --build-root /tmp/apex-build 2>&1 | grep -E "^(apex build|error)"
    [ -f "$SITE/apex-build.json" ] || { echo "error: the build wrote no $SITE/apex-build.json"; exit 1; }
    cp "$SITE/apex-build.json" "$OUT/apex-build.json"
    # each extension's compiler output, for a build that failed
    mkdir -p "$OUT/apex-build-logs" && cp /tmp/apex-build/*.log "$OUT/apex-build-logs/" 2>/dev/null
    BUILT=1
else
    echo "error: no apex here: bring .apex-built (an earlier build's apex-built.tar.gz*) or" \
         ".apex (bash bench/gpu_apex_carry.sh makes it)"
    exit 2
fi

# the check's first import also writes apex's bytecode into the site, which the pack then keeps
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" $PY bench/apex_check.py --json "$OUT/apex_check.json" \
    2>&1 | grep -E "^apex check|^error|Error"
CHECK=${PIPESTATUS[0]}
if [ "${BUILT:-0}" = 1 ]; then
    pack || exit 1
fi
echo "apex: ready in $SITE ($((SECONDS - START)) s); check rc=$CHECK"
exit "$CHECK"

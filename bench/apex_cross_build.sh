#!/usr/bin/env bash
# NVIDIA apex's extensions for the GPU machine (H200, sm_90, torch 2.11.0+cu130), compiled here
# on a CPU-only machine, so that the GPU machine only unpacks them: building there takes about
# 7 minutes of its scarce time, here it costs none. Run in the project root, after
# bench/gpu_apex_carry.sh has made .apex/:
#
#   bash bench/apex_cross_build.sh [OUT_DIR] [BUDGET_S]     (default .apex-built, 5400)
#
# makes OUT_DIR/apex-built.tar.gz (or .partN files under 15 MiB, at most 6) exactly as
# bench/gpu_apex_build.sh's pack() does, which that script unpacks into /tmp/apex-site when
# .apex-built/ is brought along. Here (2 cores, gcc 12) the seven extensions took 8 min,
# from 26 s (fused_layer_norm_cuda) to 150 s (amp_C), and the venv 1 min more: the times
# are printed at the end and kept in OUT_DIR's apex-build.json.
#
# The compilers come from PyPI, into a throwaway venv (APEX_ENV, default /tmp/apexenv): torch
# 2.11.0, whose default Linux wheel is the CUDA 13.0 build (2.11.0+cu130, as the GPU machine
# has it; its requirement cuda-toolkit==13.0.2 brings cudart, cublas, cusparse, curand,
# cusolver), and the same cuda-toolkit's nvcc, crt, nvvm, cccl and profiler-api (the softmax
# kernels include cuda_profiler_api.h) wheels: nvcc 13.0.88. torch's nvcc version check then passes as it stands: nothing is bypassed.
# Those wheels put a CUDA tree in nvidia/cu13/ but without lib64/libcudart.so, which
# torch's link line (-L$CUDA_HOME/lib64 -lcudart) needs: APEX_ENV/cuda is that tree with it.
# The libraries link libcudart.so.13, libc10*.so and libtorch*.so by name, with no rpath:
# on the GPU machine `import torch` has loaded them already, as here.
#
# The extensions are built one after another (bench/apex_build.py --only, in its order, the
# persistent layer norm last): on 2 cores building them all at once takes no less time, and
# this way each one's time is its own and OUT_DIR is packed, usable, after each one.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.apex-built}
BUDGET=${2:-5400}
SRC=${APEX_SOURCE:-.apex}
ENV=${APEX_ENV:-/tmp/apexenv}
WORK=${APEX_WORK:-/tmp/apex-cross}  # the site being packed, ninja's build folders, logs
PYENV_PY=${PYENV_PY:-$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python}
TORCH=2.11.0
GPU_TORCH=2.11.0+cu130  # what the unpack compares apex-build.json's "torch" with
TOOLKIT=13.0.2          # the cuda-toolkit torch 2.11.0+cu130 requires
PART_BYTES=$((15 * 1024 * 1024))
MAX_PARTS=6
START=$SECONDS

[ -f "$SRC/setup.py" ] && [ -d "$SRC/csrc" ] \
    || { echo "error: no apex source at $SRC: run bash bench/gpu_apex_carry.sh first"; exit 2; }
EXCLUDE=$(git rev-parse --git-path info/exclude)
for folder in /.apex/ /.apex-built/; do
    grep -qx "$folder" "$EXCLUDE" 2>/dev/null || echo "$folder" >> "$EXCLUDE"
done

# 1. the build environment
PY=$ENV/bin/python
if [ "$($PY -c 'import torch; print(torch.__version__)' 2>/dev/null)" != "$GPU_TORCH" ] \
        || [ ! -x "$ENV/cuda/bin/nvcc" ]; then
    [ -x "$PYENV_PY" ] || { echo "error: no Python 3.12 at $PYENV_PY (set PYENV_PY)"; exit 2; }
    rm -rf "$ENV"
    "$PYENV_PY" -m venv "$ENV"
    # the toolkit's extras give the compiler; torch's own requirement gives the libraries
    "$ENV/bin/pip" install -q "torch==$TORCH" ninja numpy \
        "cuda-toolkit[nvcc,crt,nvvm,cccl,cudart,profiler]==$TOOLKIT" 2>&1 | grep -v '^WARNING' || true
    # cuobjdump, only to look at what was built: PyPI has none older than 13.2
    "$ENV/bin/pip" install -q --no-deps --target "$ENV/tools" nvidia-cuda-cuobjdump==13.2.51 \
        2>&1 | grep -v '^WARNING' || true
    CU13=$($PY -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13"))')
    mkdir -p "$ENV/cuda/lib64"
    for d in bin include lib nvvm; do ln -sfn "$CU13/$d" "$ENV/cuda/$d"; done
    ln -sf "$CU13"/lib/*.so* "$ENV/cuda/lib64/"
    ln -sf libcudart.so.13 "$ENV/cuda/lib64/libcudart.so"
fi
HAVE=$($PY -c 'import torch; print(torch.__version__, torch.version.cuda)')
[ "$HAVE" = "$GPU_TORCH 13.0" ] \
    || { echo "error: $ENV has torch $HAVE, not $GPU_TORCH (CUDA 13.0)"; exit 2; }
export CUDA_HOME=$ENV/cuda TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$(nproc)
"$CUDA_HOME/bin/nvcc" --version | grep -q 'release 13.0' \
    || { echo "error: $CUDA_HOME/bin/nvcc is not CUDA 13.0"; exit 2; }

pack() {  # as bench/gpu_apex_build.sh's pack(): the site, whole, into OUT
    local archive="$OUT/apex-built.tar.gz" size parts
    mkdir -p "$OUT"
    rm -f "$archive" "$archive".part*
    tar -czf "$archive" -C "$WORK/site" . || return 1
    size=$(stat -c %s "$archive")
    if [ "$size" -ge "$PART_BYTES" ]; then
        split -b "$PART_BYTES" -d -a 1 "$archive" "$archive.part" && rm -f "$archive"
    fi
    parts=$(ls "$archive"* | wc -l)
    if [ "$parts" -gt "$MAX_PARTS" ]; then
        echo "error: the built apex packs to $size bytes, more than $MAX_PARTS parts of 15 MiB"
        return 1
    fi
    cp "$WORK/site/apex-build.json" "$OUT/apex-build.json"
    echo "apex cross: packed $(du -ch "$archive"* | tail -1 | cut -f1) into $parts file(s) in $OUT"
}

record() {  # the site's apex-build.json: every extension's result so far, and how it was made
    $PY - "$WORK" "$GPU_TORCH" "$TOOLKIT" "$ENV" <<'EOF'
import json, os, platform, subprocess, sys
from importlib import metadata
from pathlib import Path
work, gpu_torch, toolkit, env = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
runs = [json.loads(p.read_text()) for p in sorted((work / "runs").glob("*.json"),
                                                   key=lambda p: p.stat().st_mtime)]
exts = {n: r for run in runs for n, r in run["extensions"].items()}
last = runs[-1]
wheel = metadata.distribution("torch").read_text("WHEEL")
tag = next(l.split(": ", 1)[1] for l in wheel.splitlines() if l.startswith("Tag:"))
gcc = subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
summary = dict(extensions=exts, total_s=round(sum(r["seconds"] for r in exts.values()), 1),
               arch=last["arch"], torch=gpu_torch, cuda=last["cuda"], nvcc=last["nvcc"],
               source=last["source"],
               cross_built=dict(
                   on=f"CPU only: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
                      "one extension at a time", host_compiler=gcc, glibc=platform.libc_ver()[1],
                   torch_wheel=f"torch-{metadata.version('torch')}-{tag}.whl (PyPI), "
                               f"torch.__version__ {last['torch']}",
                   toolkit=f"PyPI cuda-toolkit=={toolkit}: " + ", ".join(
                       f"{d}=={metadata.version(d)}" for d in (
                           "nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cuda-cccl",
                           "nvidia-cublas", "nvidia-cusparse")),
                   bypassed="nothing: the wheel is the CUDA 13.0 build, as nvcc is"))
(work / "site" / "apex-build.json").write_text(json.dumps(summary, indent=1))
EOF
}

# 2. the extensions, one at a time, each packed as soon as it is there
rm -rf "$WORK/site" "$WORK/runs" && mkdir -p "$WORK/runs"
NAMES=$($PY -c 'import sys; sys.path.insert(0, "bench"); import apex_build as b
print(" ".join(e.name for e in b.EXTENSIONS))')
for name in $NAMES; do
    left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -le 0 ]; then
        echo "apex cross: $name: not started, the $BUDGET s budget is spent"
        continue
    fi
    $PY bench/apex_build.py --source "$SRC" --site "$WORK/site" --build-root "$WORK/build" \
        --budget "$left" --jobs "$(nproc)" --only "$name" 2>&1 | grep -E "^apex build: $name|^error" \
        || true
    [ -f "$WORK/site/apex-build.json" ] || { echo "error: apex_build.py wrote no apex-build.json"; exit 1; }
    mv "$WORK/site/apex-build.json" "$WORK/runs/$name.json"
    record && pack
done

# 3. what can be checked without a GPU: the libraries' links and code, their imports
echo "apex cross: checking"
FAIL=0
CUOBJDUMP=$(find "$ENV/tools" -name cuobjdump -type f 2>/dev/null | head -1)
for so in "$WORK"/site/*.so; do
    needed=$(readelf -d "$so" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
    echo "apex cross: $(basename "$so"): NEEDED $needed"
    # only libraries the GPU machine has by name: torch's, CUDA 13's runtime, the system's
    for lib in $needed; do
        case $lib in
            libc10.so|libc10_cuda.so|libtorch*.so|libcudart.so.13|libstdc++.so.6|libgcc_s.so.1|\
            libc.so.6|libm.so.6|ld-linux-x86-64.so.2) ;;
            *) echo "error: $(basename "$so") needs $lib, which the GPU machine may lack"; FAIL=1 ;;
        esac
    done
    if readelf -d "$so" | grep -qE 'RPATH|RUNPATH'; then
        echo "error: $(basename "$so") has an rpath: $(readelf -d "$so" | grep -E 'RPATH|RUNPATH')"
        FAIL=1
    fi
    if [ -n "$CUOBJDUMP" ]; then
        elves=$("$CUOBJDUMP" --list-elf "$so" | grep -o 'sm_[0-9a-z]*' | sort | uniq -c | tr -s ' ')
        echo "apex cross: $(basename "$so"): cubins:$elves"
        [ "$(echo "$elves" | grep -vc 'sm_90$')" = 0 ] \
            || { echo "error: $(basename "$so") has code other than sm_90"; FAIL=1; }
    fi
done
# imports only, without CUDA (bench/apex_check.py); like the GPU build, its imports write
# apex's bytecode into the site before the last pack
PYTHONPATH="$WORK/site" $PY bench/apex_check.py 2>&1 | grep -E "^apex check|^error|Error" || FAIL=1
record && pack
$PY - "$OUT/apex-build.json" <<'EOF'
import json, sys
for n, r in json.load(open(sys.argv[1]))["extensions"].items():
    print(f"apex cross: {n}: " + (f"{r['seconds']:.0f} s, {r['mib']} MiB" if r["built"]
                                   else f"MISSING: {r['why']}"))
EOF
echo "apex cross: done in $((SECONDS - START)) s; bring $OUT along to the GPU machine" \
     "(bench/gpu_apex_build.sh unpacks it)"
exit "$FAIL"

#!/usr/bin/env bash
# What the GPU machine needs beside its own torch, for the runs of bench/gpu_record*.sh and
# the GPU tests: it cannot download, and a fresh one is bare. Run here, in the project root,
# after `make venv` (the corpus and tokenizer caches are made if missing):
#
#   bash bench/gpu_carry.sh
#
# fills two folders that git ignores, each named in a device call's carry:
#   .whl/        megatron-core as installed here, omegaconf (megatron's config container),
#                pytest-xdist, and transformers as the tests pin it
#   .gpu-cache/  the project's cache (the embedded corpus, GPT-2's vocabulary and merges)
# and prints what to run there: `source bench/gpu_site.sh` installs the wheels into
# /tmp/mcore and points MCORE_SITE, MEGAGPT_CACHE_DIR (and TE_SITE, where Transformer Engine
# was built into /tmp/site) at them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "error: no .venv here; run 'make venv' first" >&2; exit 2; }
for folder in /.whl/ /.gpu-cache/; do
    grep -qx "$folder" .git/info/exclude 2>/dev/null || echo "$folder" >> .git/info/exclude
done
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
PINNED_TRANSFORMERS=$(sed -n 's/.*"transformers==\([0-9.]*\)".*/\1/p' pyproject.toml)
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    "megatron-core==$(version megatron-core)" "omegaconf==$(version omegaconf)" \
    "pytest-xdist==$(version pytest-xdist)" "execnet==$(version execnet)" \
    "transformers==$PINNED_TRANSFORMERS"
# the caches the GPU tests and the text runs read (made here if this machine has not yet)
"$PY" -c "
from megagpt.data.corpus import ensure_embedded_dataset
from megagpt.data.gpt2_files import ensure_gpt2_files
ensure_gpt2_files(); ensure_embedded_dataset()" > /dev/null
CACHE=$("$PY" -c "from megagpt.data.cache import cache_root; print(cache_root())")
rm -rf .gpu-cache && cp -r "$CACHE" .gpu-cache
du -sh .whl .gpu-cache
echo "carry: .whl .gpu-cache (and .te/small .te/sha .te/core-name for Transformer Engine)"
echo "there: source bench/gpu_site.sh && bash bench/gpu_record_te.sh \$OUT tests"

#!/usr/bin/env bash
# NVIDIA apex's source for the GPU machine, which cannot download: run here, in the project
# root, with the apex repository mirrored (a git directory; APEX_GIT names another one):
#
#   bash bench/gpu_apex_carry.sh [TAG]          (default 25.09)
#
# fills .apex/ (ignored by git through .git/info/exclude) with what bench/apex_build.py
# compiles and imports: apex's setup.py (the flags each extension is built with), csrc/, and
# the apex Python package without its tests (apex/contrib/csrc/layer_norm holds the
# persistent layer norm's kernels), plus .apex/SOURCE (tag and commit, for the records).
#
# 25.09 is the newest release tag. Its setup.py adds sm_70 code to two extensions
# (fused_weight_gradient_mlp_cuda, fast_layer_norm), which CUDA 13's nvcc no longer
# compiles; bench/apex_build.py compiles the same sources with the same flags for the
# machine's one architecture instead, so that is no obstacle. Nothing the extensions
# megatron uses compile needs a torch newer than the GPU machine's (2.11); the one change
# after 25.09 for the C++20 that newer torch builds extensions with (std::lerp, in the
# distributed Adam kernels) is in an extension megatron does not use.
#
# Never `pip install apex`: the PyPI package of that name is an unrelated project.
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-25.09}
APEX_GIT=${APEX_GIT:-/work/.mirror/NVIDIA+apex/repo}
[ -d "$APEX_GIT" ] || { echo "error: no apex git directory at $APEX_GIT (set APEX_GIT)"; exit 2; }
git --git-dir "$APEX_GIT" rev-parse -q --verify "refs/tags/$TAG^{commit}" > /dev/null \
    || { echo "error: apex has no tag $TAG in $APEX_GIT"; exit 2; }
# a worktree's .git is a file: ask git where the exclude file is
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
for folder in /.apex/ /.apex-built/; do
    grep -qx "$folder" "$EXCLUDE" 2>/dev/null || echo "$folder" >> "$EXCLUDE"
done
rm -rf .apex && mkdir -p .apex
git --git-dir "$APEX_GIT" archive "$TAG" -- setup.py LICENSE csrc apex \
    ':(exclude)apex/contrib/test' ':(exclude)apex/contrib/examples' | tar -x -C .apex
COMMIT=$(git --git-dir "$APEX_GIT" rev-parse "refs/tags/$TAG^{commit}")
printf 'tag %s\ncommit %s\n' "$TAG" "$COMMIT" > .apex/SOURCE
du -sh .apex
echo "carry: .apex (and .whl .gpu-cache, bench/gpu_carry.sh)"
echo "there: bash bench/gpu_apex_build.sh \$OUT"

#!/usr/bin/env bash
# The machines before the run: megagpt-check on every node at once (examples/train_gpt3_175b.sbatch
# runs it as its first step; CLUSTER_CHECK=0 there skips it).
#
#   examples/cluster_check.sh [NNODES [NODE_RANK [MASTER_ADDR]]]
#
# On each node: every GPU's GEMM rate (16-bit, 8192²), the all-reduce bus bandwidth inside the
# node and, with several nodes, across them (one ring per local rank: each GPU's own NIC), each
# against the median of its kind and the dry run's figures for GPU_TYPE (megagpt/gpus.py). A
# GPU, node or rail more than MARGIN % below is named in one `error:` line (node 0's) and this
# script exits 1 on node 0, which stops the job before training. Takes seconds plus start-up.
#
# Environment: GPU_TYPE (A100-80GB), MARGIN (15), GPUS_PER_NODE (8), MASTER_PORT (6001),
# PYTHON (python), CHECK_ARGS (more megagpt-check flags, e.g. --cpu on a CPU).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
PYTHON=${PYTHON:-python}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${1:-${SLURM_NNODES:-${NNODES:-1}}}
NODE_RANK=${2:-${SLURM_NODEID:-${NODE_RANK:-0}}}
if [[ -n ${3:-} ]]; then
    MASTER_ADDR=$3
elif [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
else
    MASTER_ADDR=${MASTER_ADDR:-localhost}
fi
# another port than training's (6000): the check's rendezvous may still be closing
MASTER_PORT=${MASTER_PORT:-6001}
STATUS=$(mktemp)
trap 'rm -f "$STATUS"' EXIT

cd "$REPO"
"$PYTHON" -m torch.distributed.run \
    --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m megagpt.preflight.cluster_check --gpu-type "${GPU_TYPE:-A100-80GB}" --margin "${MARGIN:-15}" \
    --status-file "$STATUS" ${CHECK_ARGS:-}
if [[ $NODE_RANK == 0 && $(cat "$STATUS") != ok ]]; then
    echo "cluster check failed: not starting the run (CLUSTER_CHECK=0 skips the check)" >&2
    exit 1
fi

#!/usr/bin/env bash
# Multi-node lp_runner with torchrun's static rendezvous. Run on every node; lp_runner's own flags follow.
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to a host every node can reach}"
: "${NNODES:?set NNODES}"
: "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}"
exec torchrun \
  --nnodes="${NNODES}" --node-rank="${NODE_RANK}" \
  --nproc-per-node="${NPROC_PER_NODE:-1}" \
  --master-addr="${MASTER_ADDR}" --master-port="${MASTER_PORT:-29500}" \
  -m lp_runner "$@"

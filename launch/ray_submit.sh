#!/usr/bin/env bash
# Submit an lp_runner job to a Ray cluster. The repo is the job's working_dir, so the workers import this
# lp_runner without installing it (torch, transformers etc. must be installed on the nodes); lp_runner's own
# flags follow. The job's driver runs on the head node: --output is written there.
#
#   RAY_ADDRESS=http://head:8265 WORKERS=4 launch/ray_submit.sh --prompts prompts.jsonl --output /shared/out.jsonl
#
# RAY_ADDRESS  the cluster's dashboard (job submission) address, e.g. http://127.0.0.1:8265
# CONFIG       lp_runner config (default configs/ray.yaml); WORKERS: parallel.workers (default: the config's)
# SUBMIT_FLAGS extra `ray job submit` flags, e.g. "--no-wait" or "--submission-id=lp-001"
set -euo pipefail
: "${RAY_ADDRESS:?set RAY_ADDRESS to the dashboard address of the cluster, e.g. http://head-node:8265}"
cd "$(dirname "$0")/.."
args=(--config "${CONFIG:-configs/ray.yaml}" --set parallel.backend=ray)
if [[ -n "${WORKERS:-}" ]]; then
  args+=(--set "parallel.workers=${WORKERS}")
fi
# shellcheck disable=SC2086  # SUBMIT_FLAGS is a list of flags
exec ray job submit --address "${RAY_ADDRESS}" --working-dir . ${SUBMIT_FLAGS:-} -- \
  python -m lp_runner "${args[@]}" "$@"

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
#
# Token authentication: a cluster that `ray start` started (Ray 2.5x and later) takes only submissions that
# carry its token, and Ray sends one only with RAY_AUTH_MODE=token. Ray reads the token from $RAY_AUTH_TOKEN,
# else the file $RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token (where `ray start` wrote it on the head node: on
# another machine, copy that file or set one of the two). Where one of them is there and RAY_AUTH_MODE is not
# set, this script sets RAY_AUTH_MODE=token; where none is and the cluster asks for a token, it says so in one
# line. RAY_AUTH_MODE=disabled (or token) set by the caller is left as it is.
set -euo pipefail

fail() {
  echo "error: $*" >&2
  exit 2
}

[[ -n "${RAY_ADDRESS:-}" ]] || fail "set RAY_ADDRESS to the dashboard address of the cluster, e.g. http://head-node:8265"

# The token Ray would send, as "where it is" (empty: none found).
token_source() {
  if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
    echo "RAY_AUTH_TOKEN"
  elif [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
    [[ -r "${RAY_AUTH_TOKEN_PATH}" && -s "${RAY_AUTH_TOKEN_PATH}" ]] ||
      fail "RAY_AUTH_TOKEN_PATH=${RAY_AUTH_TOKEN_PATH} is not a readable, non-empty token file"
    echo "${RAY_AUTH_TOKEN_PATH}"
  elif [[ -r "${HOME}/.ray/auth_token" && -s "${HOME}/.ray/auth_token" ]]; then
    echo "${HOME}/.ray/auth_token"
  fi
}

# Whether the dashboard at RAY_ADDRESS says it takes token-authenticated requests only (its public
# /api/authentication_mode); unreachable, an older Ray or anything else: no (`ray job submit` then reports what
# is wrong itself).
asks_for_token() {
  curl --silent --max-time 10 "${RAY_ADDRESS%/}/api/authentication_mode" 2>/dev/null | grep -q '"token"'
}

source=$(token_source)
if [[ -z "${RAY_AUTH_MODE:-}" ]]; then
  if [[ -n "${source}" ]]; then
    export RAY_AUTH_MODE=token
  elif command -v curl >/dev/null && asks_for_token; then
    fail "the Ray cluster at ${RAY_ADDRESS} asks for its authentication token: copy the head node's" \
      "~/.ray/auth_token to this machine's ~/.ray/auth_token, or set RAY_AUTH_TOKEN=<token> or" \
      "RAY_AUTH_TOKEN_PATH=<file> (\`ray get-auth-token\` on the head node prints it)"
  fi
elif [[ "${RAY_AUTH_MODE}" == token && -z "${source}" ]]; then
  fail "RAY_AUTH_MODE=token but no token: set RAY_AUTH_TOKEN=<token> or RAY_AUTH_TOKEN_PATH=<file>, or copy" \
    "the head node's ~/.ray/auth_token here (\`ray get-auth-token\` on the head node prints it)"
fi

cd "$(dirname "$0")/.."
args=(--config "${CONFIG:-configs/ray.yaml}" --set parallel.backend=ray)
if [[ -n "${WORKERS:-}" ]]; then
  args+=(--set "parallel.workers=${WORKERS}")
fi
# shellcheck disable=SC2086  # SUBMIT_FLAGS is a list of flags
exec ray job submit --address "${RAY_ADDRESS}" --working-dir . ${SUBMIT_FLAGS:-} -- \
  python -m lp_runner "${args[@]}" "$@"

#!/usr/bin/env bash
# Prepared check for a lent GPU machine (one GPU, no network, preinstalled torch + transformers).
#
#   bash benchmarks/gpu_check.sh                          # on the GPU machine, from the repo root (< 9 min)
#   GPU_CHECK_SMOKE=1 bash benchmarks/gpu_check.sh        # CPU smoke test of the same steps (tiny shapes, minutes)
#
# Writes everything under ${OUT:-benchmarks/results/gpu}: gpu_check_summary.md (all tables), env.json,
# nvidia-smi.txt, rounds_*.json, forward_cost.{json,md,png}, nccl_probe.json, cli_*.jsonl, steps.tsv, logs/*.log.
# Steps:
#   1. versions + nvidia-smi; stop early (one line) if torch/transformers are missing or too old, or no CUDA
#   2. forward cost vs packed rows Q for a random-weight ~1.2B Llama (bf16, prefixes 512 and 2048), each point's
#      distance to the machine's limit; 2b. the same forward compiled (model.compile: on), compile time included
#   3. torch.distributed process group (NCCL) + TorchCommunicator.all_gather timing, torchrun with one rank
#   4. the real CLI under torchrun (one rank) on a saved random-weight Llama: configs/default.yaml (the auto
#      preset: its summary block and records hold the device's measured curve, the padding and the chosen setting),
#      configs/lookahead.yaml and a plain-greedy reference (no candidates, no padding); 4b. two ranks sharing
#      the one GPU over gloo (model.device=cuda:0), with each rank's peak host memory at load
#   5. benchmarks/compare.py, only where the embedded model exists and compare.py takes --device
#   6. (run right after 1) rounds (benchmarks/gpu_rounds.py; the embedded model where it exists, else random
#      weights in its shape):
#      6a. rounds-buckets: eager vs captured (CUDA graph) rounds per row bucket, wall ms, device ms (CUDA events)
#      and host us per round (wall minus device), capture seconds, argmax agreement (bf16); a job of two prompts,
#      the second needing a larger K/V arena than the first, after a warm-up at the longer one: the arena must be
#      allocated once (arena_allocations 1 before and after); the peak device memory of an 8k-token prefill
#      (chunks of 512 rows), eager and captured; torch's counts: one compilation and no CUDA-graph skip (exit 1
#      otherwise); 6a'. rounds-8b: the same on random weights in Llama-3-8B's shape cut to 4 layers (bf16);
#      6b. tokens/s of HF greedy, HF prompt lookup, the engine alone eager / captured and the default job eager /
#      captured, each output compared with HF greedy's (bf16); 6c. HF-greedy identity in fp32, eager and captured
#      (exit 1 on any difference); 6b and 6c check torch's counts too. GPU_CHECK_ONLY=rounds runs steps 1 and 6
#      alone (one lent run fits them), GPU_CHECK_ONLY=rest steps 1 to 5.
# Every step runs under `timeout` inside one overall budget (GPU_CHECK_BUDGET_S, default 540 s, 25 s of it kept for
# the summary): each step's limit is its own maximum (T_* below) or what is left, whichever is less, its kill
# grace included. Steps 1 and 6 add up to ROUNDS_PLAN_S (480 + 6 x 5 = 510 s) so GPU_CHECK_ONLY=rounds runs each
# to its maximum; steps 2 to 5 get what is left. A step stopped by its timeout keeps its log, its line in
# steps.tsv (status timeout) and, for step 6, its JSON as far as it got (complete: false). A failed step is
# logged and the next one runs; the exit status is 1 if any step failed.
# Knobs: PYTHON (interpreter; default: the first of python3/python that imports torch), GPU_CHECK_BUDGET_S,
# GPU_CHECK_MIN_TRANSFORMERS (default 5.17), GPU_CHECK_KEEP_MODEL=1 (keep the saved random model folder),
# GPU_CHECK_ONLY=rounds | rest (steps 1 and 6 | 1 to 5), GPU_CHECK_PROMPTS (prompts JSONL for step 6 with the embedded model).

set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT/logs" || exit 2
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export MPLBACKEND=Agg

SMOKE=${GPU_CHECK_SMOKE:-0}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
RESERVE=25    # seconds kept back for the summary (its own timeout)
KILL_GRACE=5  # a step's SIGKILL comes this long after its SIGTERM, inside the budget too
START=$SECONDS

# Each step's most seconds (capped further by what is left of the budget). Steps 1 and 6, what
# GPU_CHECK_ONLY=rounds runs, add up to ROUNDS_PLAN_S (printed at start): within 540 - RESERVE, so that no rounds
# step is cut short by an earlier one. The rest take what is left. The CPU smoke run compiles on a CPU (minutes,
# not seconds) and gets three times as long per step; its total is bounded by the same budget.
T_SMI=15 T_ENV=45 T_BUCKETS=140 T_8B=95 T_SPEED=105 T_IDENTITY=80
ROUNDS_PLAN_S=$((T_SMI + T_ENV + T_BUCKETS + T_8B + T_SPEED + T_IDENTITY + 6 * KILL_GRACE))
SCALE=1

ONLY=${GPU_CHECK_ONLY:-all}
EMBEDDED="${LP_RUNNER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lp_runner}/models/SmolLM2-135M-Instruct"
if [[ $SMOKE == 1 ]]; then
    SIZE=tiny DEVICE=cpu ONE_DEVICE=cpu DTYPE=bfloat16 DIST=gloo THREADS=1 REPS=3 MAX_NEW=16 SCALE=3
    ROWS="1 4 16" PREFIX="32" COMPILED_ROWS="1 4"
    SMALL=(--device cpu --limit 1 --new 12 --prefix 32 --rows 2 4 --warm-rows 2 --reps 3)
    ROUNDS=("${SMALL[@]}" --shape tiny)
    ROUNDS_8B=("${SMALL[@]}" --shape llama8b-tiny)
    LONG=(--job-tokens 40 600 --prefill-tokens 520) # a second prompt that outgrows the first's arena; 2 chunks
else
    SIZE=1b DEVICE=cuda ONE_DEVICE=cuda:0 DTYPE=bfloat16 DIST=nccl THREADS=4 REPS=21 MAX_NEW=128
    ROWS="1 2 4 8 16 32 64 128 256 512" PREFIX="512 2048" COMPILED_ROWS="1 8 64"
    ROUNDS=(--device cuda --limit 4 --new 128 --prefix 512 --reps 21)
    ROUNDS_8B=("${ROUNDS[@]}" --shape llama8b)
    LONG=(--job-tokens 64 1200 --prefill-tokens 8192)
    if [[ -f $EMBEDDED/lp_runner_model.json ]]; then # real weights and real prompts where the model exists
        ROUNDS+=(--model-dir "$EMBEDDED" --prompts "${GPU_CHECK_PROMPTS:-benchmarks/results/calibration8.jsonl}")
    fi
fi

exec > >(tee -a "$OUT/gpu_check.log") 2>&1
echo "gpu_check: $(date -Is)  smoke=$SMOKE  out=$OUT  budget=${BUDGET}s  host=$(uname -n)"
echo "rounds plan (GPU): steps 1 and 6 take at most ${ROUNDS_PLAN_S}s of $((BUDGET - RESERVE))s"
((ROUNDS_PLAN_S <= BUDGET - RESERVE)) || echo "note: GPU_CHECK_BUDGET_S=$BUDGET may cut the last rounds steps short"
printf 'step\tstatus\texit\tseconds\ttimeout_s\n' >"$OUT/steps.tsv"
FAILED=0

record() { # NAME STATUS RC SECONDS TIMEOUT
    printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$OUT/steps.tsv"
    [[ $2 == ok || $2 == skipped ]] || FAILED=1
}

left_s() { # seconds of the budget left for steps (the summary's reserve kept back)
    echo $((BUDGET - (SECONDS - START) - RESERVE))
}

# step NAME MAX_SECONDS CMD...: run CMD under timeout (MAX_SECONDS x SCALE, capped so that the kill grace too ends
# inside the budget), its output in logs/NAME.log, followed on the terminal; record the outcome and never stop the
# script. The command writes the log itself and the terminal follows it (tail --pid) rather than a pipe: a child
# that outlives the kill (a torchrun worker runs in a session of its own) cannot hold a pipe open and stall the
# script, and a step killed by its timeout keeps its log (and whatever its JSON holds) and its line in steps.tsv.
step() {
    local name=$1 max=$(($2 * SCALE))
    shift 2
    local left
    left=$(($(left_s) - KILL_GRACE))
    local limit=$((max < left ? max : left))
    if ((limit < 10)); then
        echo "== $name: not run, the time budget is spent"
        record "$name" no-time - 0 "$limit"
        return 1
    fi
    echo
    echo "== [$(date +%T)] $name (timeout ${limit}s): $*"
    local t0=$SECONDS rc status log="$OUT/logs/$name.log" pid follower
    : >"$log"
    timeout -k "$KILL_GRACE" "$limit" "$@" >"$log" 2>&1 </dev/null &
    pid=$!
    tail -n +1 -f --pid="$pid" "$log" 2>/dev/null &
    follower=$!
    wait "$pid"
    rc=$?
    wait "$follower"
    case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
    esac
    echo "== $name: $status (exit $rc, $((SECONDS - t0))s)"
    record "$name" "$status" "$rc" "$((SECONDS - t0))" "$limit"
    return "$rc"
}

skip() { # NAME REASON
    echo "== $1: skipped ($2)"
    record "$1" skipped - 0 -
}

# ---- 1. environment -----------------------------------------------------------------------------------------
PY=""
for cand in "${PYTHON:-}" python3 python; do # each probe bounded: a missing torch must not eat the budget
    if [[ -n $cand ]] && command -v "$cand" >/dev/null && timeout 60 "$cand" -c "import torch" 2>/dev/null; then
        PY=$cand
        break
    fi
done
if [[ -z $PY ]]; then
    echo "error: no python with torch found (tried \$PYTHON, python3, python); set PYTHON=/path/to/python"
    record python failed - 0 -
    PY=$(command -v python3 || command -v python || echo python3)
fi
echo "python: $PY ($(command -v "$PY" 2>/dev/null))"

if command -v nvidia-smi >/dev/null; then
    step nvidia-smi "$T_SMI" bash -c "nvidia-smi; echo; nvidia-smi --query-gpu=name,driver_version,memory.total,\
memory.used,clocks.max.sm,power.limit,mig.mode.current --format=csv" && cp "$OUT/logs/nvidia-smi.log" "$OUT/nvidia-smi.txt"
elif [[ $SMOKE == 1 ]]; then
    skip nvidia-smi "not installed (smoke test)"
else
    echo "error: nvidia-smi not found"
    record nvidia-smi failed - 0 -
fi

ENV_ARGS=(--out "$OUT/env.json")
[[ $SMOKE == 1 ]] || ENV_ARGS+=(--require-cuda)
ENV_OK=1
step env "$T_ENV" "$PY" benchmarks/gpu_check.py env "${ENV_ARGS[@]}" || ENV_OK=0

run_py() { # NAME MAX_SECONDS ARGS...: a Python step, skipped when the environment check failed
    if ((ENV_OK)); then
        step "$@"
    else
        echo "== $1: not run, the environment check failed"
        record "$1" not-run - 0 -
        return 1
    fi
}

# ---- 6. rounds on the device (first: the issue's targets; GPU_CHECK_ONLY=rounds runs these alone) ------------
# the three steps' compilations share one on-disk cache, outside OUT (thousands of files nobody reads)
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/gpu_check_inductor}"
if [[ $ONLY == rest ]]; then
    for name in rounds-buckets rounds-8b rounds-speed rounds-identity; do skip "$name" "GPU_CHECK_ONLY=rest"; done
else
run_py rounds-buckets "$T_BUCKETS" "$PY" benchmarks/gpu_rounds.py buckets "${ROUNDS[@]}" "${LONG[@]}" \
    --cache-dir "$OUT/cache" --dtype "$DTYPE" --out "$OUT/rounds_buckets.json"
run_py rounds-8b "$T_8B" "$PY" benchmarks/gpu_rounds.py buckets "${ROUNDS_8B[@]}" "${LONG[@]}" \
    --cache-dir "$OUT/cache" --dtype "$DTYPE" --out "$OUT/rounds_buckets_8b.json"
run_py rounds-speed "$T_SPEED" "$PY" benchmarks/gpu_rounds.py speed "${ROUNDS[@]}" --cache-dir "$OUT/cache" \
    --dtype "$DTYPE" --out "$OUT/rounds_speed.json"
run_py rounds-identity "$T_IDENTITY" "$PY" benchmarks/gpu_rounds.py identity "${ROUNDS[@]}" --cache-dir "$OUT/cache" \
    --out "$OUT/rounds_identity.json"
fi

if [[ $ONLY == rounds ]]; then
    for name in forward-cost forward-cost-compiled nccl-probe make-model cli-default cli-lookahead cli-greedy \
        cli-two-ranks compare; do
        skip "$name" "GPU_CHECK_ONLY=rounds"
    done
else
# ---- 2. forward cost vs packed rows -------------------------------------------------------------------------
# shellcheck disable=SC2086 # ROWS and PREFIX are word lists
run_py forward-cost 240 "$PY" benchmarks/forward_cost.py --random-llama "$SIZE" --device "$DEVICE" \
    --dtype "$DTYPE" --threads "$THREADS" --prefix $PREFIX --rows $ROWS --reps "$REPS" --out "$OUT/forward_cost"
# 2b. the same forward compiled (model.compile: on; static-shape rounds), fewer points: compile on vs off
# shellcheck disable=SC2086
run_py forward-cost-compiled 180 "$PY" benchmarks/forward_cost.py --random-llama "$SIZE" --device "$DEVICE" \
    --dtype "$DTYPE" --threads "$THREADS" --prefix ${PREFIX%% *} --rows $COMPILED_ROWS --reps "$REPS" --compile \
    --out "$OUT/forward_cost_compiled"

# ---- 3. process group probe under torchrun (one rank) -------------------------------------------------------
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node=1)
run_py nccl-probe 120 "${TORCHRUN[@]}" benchmarks/gpu_check.py nccl-probe --backend "$DIST" --device "$DEVICE" \
    --out "$OUT/nccl_probe.json"

# ---- 4. the CLI on a saved random-weight model --------------------------------------------------------------
MODEL_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_model.XXXXXX")
[[ ${GPU_CHECK_KEEP_MODEL:-0} == 1 ]] || trap 'rm -rf "$MODEL_DIR"' EXIT
MODEL_OK=0
run_py make-model 180 "$PY" benchmarks/gpu_check.py make-model --size "$SIZE" --device "$DEVICE" --dtype "$DTYPE" \
    --out "$MODEL_DIR" --prompts "$OUT/prompts.jsonl" && MODEL_OK=1

cli() { # NAME CONFIG EXTRA_SETS...
    local name=$1 config=$2
    shift 2
    if ((!MODEL_OK)); then
        echo "== cli-$name: not run, no model folder"
        record "cli-$name" not-run - 0 -
        return 1
    fi
    run_py "cli-$name" 150 "${TORCHRUN[@]}" -m lp_runner --config "$config" --prompts "$OUT/prompts.jsonl" \
        --output "$OUT/cli_$name.jsonl" --overwrite --set model.path="$MODEL_DIR" --set model.device="$DEVICE" \
        --set model.dtype="$DTYPE" --set parallel.workers=1 --set parallel.dist_backend="$DIST" \
        --set generation.max_new_tokens="$MAX_NEW" --set advanced.stop_on_eos=false --set advanced.progress=false "$@"
}
cli default configs/default.yaml
cli lookahead configs/lookahead.yaml
cli greedy configs/default.yaml --set lookahead.verification_set_size=0 --set advanced.lookahead_branch=false \
    --set advanced.context_lookup=false --set lookahead.preset=off --set advanced.pad_rows=false

# 4b. two ranks sharing the one device over gloo (model.device names it): every rank binds it, loads onto it and
# exchanges through the host, through the real CLI. The records carry each rank's peak host memory at load.
if ((MODEL_OK)); then
    run_py cli-two-ranks 180 "$PY" -m torch.distributed.run --standalone --nproc-per-node=2 -m lp_runner \
        --config configs/default.yaml --prompts "$OUT/prompts.jsonl" --output "$OUT/cli_two-ranks.jsonl" --overwrite \
        --set model.path="$MODEL_DIR" --set model.device="$ONE_DEVICE" --set model.dtype="$DTYPE" \
        --set parallel.workers=2 --set parallel.dist_backend=gloo --set generation.max_new_tokens="$MAX_NEW" \
        --set advanced.stop_on_eos=false --set advanced.progress=false
else
    echo "== cli-two-ranks: not run, no model folder"
    record cli-two-ranks not-run - 0 -
fi

# ---- 5. compare.py on the embedded model (only where it exists and compare.py can use the GPU) ---------------
if [[ ! -f $EMBEDDED/lp_runner_model.json ]]; then
    skip compare "no embedded model at $EMBEDDED (fetching needs network)"
elif ((!ENV_OK)); then
    skip compare "the environment check failed"
elif (($(left_s) < 40)); then
    echo "== compare: not run, the time budget is spent"
    record compare no-time - 0 -
elif ! timeout 30 "$PY" benchmarks/compare.py --help 2>/dev/null | grep -q -- "--device"; then
    skip compare "benchmarks/compare.py has no --device option; it would measure the CPU"
else
    step compare 180 "$PY" benchmarks/compare.py --configs lean-g2,ctx-7-5-7,la-7-5-7 --limit 2 \
        --device "$DEVICE" --out "$OUT/compare"
fi
fi # GPU_CHECK_ONLY

# ---- summary ------------------------------------------------------------------------------------------------
SUM_ARGS=(--out "$OUT")
[[ $SMOKE == 1 ]] && SUM_ARGS+=(--smoke)
echo
echo "== [$(date +%T)] summary (total so far $((SECONDS - START))s)"
timeout -k 5 $((RESERVE - 5)) "$PY" benchmarks/gpu_check.py summarize "${SUM_ARGS[@]}" || {
    echo "error: the summary step failed"
    FAILED=1
}
echo "gpu_check: finished in $((SECONDS - START))s; $( ((FAILED)) && echo 'SOME STEPS FAILED' || echo 'all steps ok')"
echo "results: $OUT"
exit "$FAILED"

#!/usr/bin/env bash
# Prepared check for one lease of a GPU machine (one GPU, no network, preinstalled torch + transformers, a return
# folder that brings back at most 8 files of 16 MiB, 2 folders deep).
#
#   OUT=/return/folder bash benchmarks/gpu_check.sh      # on the GPU machine, from the repo root (< 9 min)
#   GPU_CHECK_SMOKE=1 bash benchmarks/gpu_check.sh       # CPU smoke run of the same steps (tiny shapes, minutes)
#
# Everything is written in a scratch folder (mktemp: logs, JSON, the random model, the inductor and Triton caches,
# the calibration cache), so nothing of an earlier or killed run is read back. OUT receives two files only:
# gpu_check_summary.md and gpu_check.tar.gz (the scratch folder's results: every step's JSON, logs cut to their
# last MiB, steps.tsv, the summary). The decisive steps come first:
#   env          versions; stops early (one line) if torch/transformers are missing or too old, or no CUDA
#   core         one process (gpu_rounds.py core), on Llama-3-8B's per-layer shape cut to 4 layers:
#                probe.json (TF32 flags after device.bind, a float32 compile), identity.json (fp32, TF32 off: HF
#                greedy vs the engine eager and captured, at the auto preset's setting and at W 7, N 5, G 7),
#                buckets.json (bf16: per bucket eager vs captured wall / device / host time, capture seconds,
#                logit error, CUDA graphs recorded before and after a two-prompt job and an 8k prefill, the
#                prefill's peak memory beside HF generate's, a capacity sweep)
#   make-model   a random-weight model folder for the CLI (make_model.json)
#   cli-compiled the CLI's default job with model.compile: on (cli_compiled.jsonl, cli_compiled.json: host us and
#                forward ms per round)
#   nccl-probe   a process group through lp_runner's own init and TorchCommunicator.all_gather (nccl_probe.json)
#   buckets-8b-full  the buckets measurements on a whole 32-layer random Llama-3-8B (buckets_8b_full.json)
#   speed        tokens/s against HF greedy (speed.json)
#   cli-two-ranks two ranks sharing the one device over gloo through the CLI (cli_two-ranks.json)
# Each step runs under `timeout` within one budget (GPU_CHECK_BUDGET_S, default 540 s; RESERVE of it kept for the
# summary and the tarball): its limit is its own maximum (T_* below, or GPU_CHECK_LIMIT_<STEP>, e.g.
# GPU_CHECK_LIMIT_CORE=20) or what is left, whichever is less, the kill grace included. Every step's JSON exists
# afterwards: a Python step rewrites its own as it goes (complete: false and its stage until it ends); where a step
# was cut before writing one, or never ran, a stub says so (status, complete: false). A failed step is logged and
# the next one runs; the exit status is 1 if any step failed or was cut.
# Knobs: PYTHON (default: the first of python3/python that imports torch), GPU_CHECK_BUDGET_S,
# GPU_CHECK_LIMIT_<STEP>, GPU_CHECK_MIN_TRANSFORMERS (default 5.17), GPU_CHECK_KEEP=1 (keep the scratch folder).

set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
SMOKE=${GPU_CHECK_SMOKE:-0}
if [[ -z ${OUT:-} ]]; then # the smoke run's results belong nowhere in the repository
    if [[ $SMOKE == 1 ]]; then OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_out.XXXXXX"); else OUT=benchmarks/results/gpu; fi
fi
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2
[[ ${GPU_CHECK_KEEP:-0} == 1 ]] || trap 'rm -rf "$SCRATCH"' EXIT
RES=$SCRATCH/gpu_check # what the tarball holds
mkdir -p "$RES/logs" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 MPLBACKEND=Agg
# compile caches private to this run: a killed run's truncated artifact cannot break the next one. TMPDIR too:
# inductor keeps its precompiled headers under it whatever TORCHINDUCTOR_CACHE_DIR says, torchrun its logs
mkdir -p "$SCRATCH/tmp" || exit 2
export TORCHINDUCTOR_CACHE_DIR=$SCRATCH/inductor TRITON_CACHE_DIR=$SCRATCH/triton TMPDIR=$SCRATCH/tmp
CACHE=$SCRATCH/cache # calibration and compile records

BUDGET=${GPU_CHECK_BUDGET_S:-540}
RESERVE=20    # seconds kept back for the summary and the tarball
KILL_GRACE=5  # a step's SIGKILL comes this long after its SIGTERM, inside the budget too
START=$SECONDS

# each step's most seconds on a GPU; the decisive ones (up to the compiled CLI job) fit the budget at their longest
T_SMI=10 T_ENV=30 T_CORE=260 T_MODEL=40 T_CLI=120 T_NCCL=40 T_FULL=200 T_SPEED=100 T_TWO=90
DECISIVE_PLAN_S=$((T_SMI + T_ENV + T_CORE + T_MODEL + T_CLI + 5 * KILL_GRACE))
if [[ $SMOKE == 1 ]]; then # a CPU compiles for tens of seconds where a GPU takes seconds
    T_SMI=10 T_ENV=60 T_CORE=330 T_MODEL=60 T_CLI=150 T_NCCL=60 T_FULL=150 T_SPEED=150 T_TWO=150
    DEVICE=cpu ONE_DEVICE=cpu DTYPE=bfloat16 DIST=gloo SIZE=tiny MAX_NEW=16
    SMALL=(--device cpu --limit 1 --new 12 --prefix 32 --rows 2 4 --warm-rows 2 --reps 3)
    CORE=("${SMALL[@]}" --shape llama8b-tiny --job-tokens 40 600 --prefill-tokens 520)
    FULL=("${SMALL[@]}" --shape llama8b-tiny --job-tokens 40 600 --prefill-tokens 0)
    SPEED=("${SMALL[@]}" --shape tiny)
else
    DEVICE=cuda ONE_DEVICE=cuda:0 DTYPE=bfloat16 DIST=nccl SIZE=1b MAX_NEW=128
    CORE=(--device cuda --limit 2 --new 64 --prefix 512 --reps 21 --shape llama8b --job-tokens 64 1200
        --prefill-tokens 8192 --warm-rows 128)
    FULL=(--device cuda --limit 1 --new 32 --prefix 512 --reps 11 --shape llama8b-full --job-tokens 64 1200
        --prefill-tokens 0 --warm-rows 128)
    SPEED=(--device cuda --limit 4 --new 128 --prefix 512 --reps 5 --shape embedded --warm-rows 128)
fi

exec > >(tee -a "$RES/gpu_check.log") 2>&1
echo "gpu_check: $(date -Is)  smoke=$SMOKE  out=$OUT  scratch=$SCRATCH  budget=${BUDGET}s  host=$(uname -n)"
echo "decisive plan (GPU): env to cli-compiled take at most ${DECISIVE_PLAN_S}s of $((540 - RESERVE))s"
printf 'step\tstatus\texit\tseconds\ttimeout_s\n' >"$RES/steps.tsv"
FAILED=0

record() { # NAME STATUS RC SECONDS TIMEOUT
    printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$RES/steps.tsv"
    [[ $2 == ok || $2 == skipped ]] || FAILED=1
}

left_s() { # seconds of the budget left for steps (the reserve kept back)
    echo $((BUDGET - (SECONDS - START) - RESERVE))
}

stub() { # STEP STATUS FILE...: a JSON for each FILE the step did not write, saying why
    local name=$1 status=$2 file
    shift 2
    for file in "$@"; do
        [[ -s $RES/$file ]] || printf '{"step": "%s", "status": "%s", "complete": false, "note": "%s"}\n' \
            "$name" "$status" "the step wrote no JSON here (see steps.tsv and logs/$name.log)" >"$RES/$file"
    done
}

# step NAME MAX_SECONDS "JSON FILES" CMD...: CMD under timeout (MAX_SECONDS, or GPU_CHECK_LIMIT_<NAME>, capped so
# that the kill grace too ends inside the budget), its output in logs/NAME.log, followed on the terminal; the
# outcome recorded, a stub for each JSON it did not write; never stops the script. The command writes the log
# itself and the terminal follows it (tail --pid) rather than a pipe: a child that outlives the kill (a torchrun
# worker runs in a session of its own) cannot hold a pipe open and stall the script.
STATUS=""
step() {
    local name=$1 max=$2 files=$3
    shift 3
    local knob="GPU_CHECK_LIMIT_${name^^}"
    knob=${knob//-/_}
    max=${!knob:-$max}
    local left
    left=$(($(left_s) - KILL_GRACE))
    local limit=$((max < left ? max : left))
    if ((limit < 10)); then
        echo "== $name: not run, the time budget is spent"
        record "$name" no-time - 0 "$limit"
        # shellcheck disable=SC2086 # a word list
        stub "$name" no-time $files
        STATUS=no-time
        return 1
    fi
    echo
    echo "== [$(date +%T)] $name (timeout ${limit}s): $*"
    local t0=$SECONDS rc log="$RES/logs/$name.log" pid follower
    : >"$log"
    timeout -k "$KILL_GRACE" "$limit" "$@" >"$log" 2>&1 </dev/null &
    pid=$!
    tail -n +1 -f --pid="$pid" "$log" 2>/dev/null &
    follower=$!
    wait "$pid"
    rc=$?
    wait "$follower"
    case $rc in
    0) STATUS=ok ;;
    124 | 137) STATUS=timeout ;;
    *) STATUS=failed ;;
    esac
    echo "== $name: $STATUS (exit $rc, $((SECONDS - t0))s)"
    record "$name" "$STATUS" "$rc" "$((SECONDS - t0))" "$limit"
    # shellcheck disable=SC2086
    stub "$name" "$STATUS" $files
    [[ $STATUS == ok ]]
}

not_run() { # NAME WHY "JSON FILES"
    echo "== $1: not run, $2"
    STATUS=not-run
    record "$1" not-run - 0 -
    # shellcheck disable=SC2086
    stub "$1" not-run $3
}

# ---- environment ---------------------------------------------------------------------------------------------
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
    step nvidia-smi "$T_SMI" "" bash -c "nvidia-smi; echo; nvidia-smi --query-gpu=name,driver_version,memory.total,\
memory.used,clocks.max.sm,power.limit,mig.mode.current --format=csv"
elif [[ $SMOKE == 1 ]]; then
    echo "== nvidia-smi: skipped (not installed; smoke run)"
    record nvidia-smi skipped - 0 -
else
    echo "error: nvidia-smi not found"
    record nvidia-smi failed - 0 -
fi

ENV_ARGS=(--out "$RES/env.json")
[[ $SMOKE == 1 ]] || ENV_ARGS+=(--require-cuda)
ENV_OK=1
step env "$T_ENV" "env.json" "$PY" benchmarks/gpu_check.py env "${ENV_ARGS[@]}" || ENV_OK=0

run_py() { # NAME MAX_SECONDS "JSON FILES" CMD...: a Python step, not run when the environment check failed
    if ((ENV_OK)); then
        step "$@"
    else
        not_run "$1" "the environment check failed" "$3"
        return 1
    fi
}

# ---- the decisive parts, one process: probe, fp32 identity, bf16 buckets ---------------------------------------
run_py core "$T_CORE" "probe.json identity.json buckets.json" "$PY" benchmarks/gpu_rounds.py core "${CORE[@]}" \
    --dtype "$DTYPE" --cache-dir "$CACHE" --out-dir "$RES"

# ---- the CLI's job, compiled ---------------------------------------------------------------------------------
MODEL_DIR=$SCRATCH/model
MODEL_OK=0
run_py make-model "$T_MODEL" "make_model.json" "$PY" benchmarks/gpu_check.py make-model --size "$SIZE" \
    --device "$DEVICE" --dtype "$DTYPE" --out "$MODEL_DIR" --prompts "$RES/prompts.jsonl" \
    --json "$RES/make_model.json" && MODEL_OK=1

cli() { # NAME MAX_SECONDS WORKERS DEVICE DIST EXTRA_SETS...: the CLI under torchrun, then its records' figures
    local name=$1 max=$2 workers=$3 device=$4 dist=$5
    shift 5
    if ((!MODEL_OK)); then
        not_run "cli-$name" "no model folder" "cli_$name.json"
        return 1
    fi
    run_py "cli-$name" "$max" "" "$PY" -m torch.distributed.run --standalone --nproc-per-node="$workers" \
        -m lp_runner --config configs/default.yaml --prompts "$RES/prompts.jsonl" --output "$RES/cli_$name.jsonl" \
        --overwrite --set model.path="$MODEL_DIR" --set model.device="$device" --set model.dtype="$DTYPE" \
        --set advanced.cache_dir="$CACHE" --set parallel.workers="$workers" --set parallel.dist_backend="$dist" \
        --set generation.max_new_tokens="$MAX_NEW" --set advanced.stop_on_eos=false --set advanced.progress=false "$@"
    local status=$STATUS # the figures of what the records hold, even of a cut run
    timeout 20 "$PY" benchmarks/gpu_check.py cli-json --records "$RES/cli_$name.jsonl" --status "$status" \
        --out "$RES/cli_$name.json" || stub "cli-$name" "$status" "cli_$name.json"
}
cli compiled "$T_CLI" 1 "$DEVICE" "$DIST" --set model.compile=on

# ---- the process group ---------------------------------------------------------------------------------------
run_py nccl-probe "$T_NCCL" "nccl_probe.json" "$PY" -m torch.distributed.run --standalone --nproc-per-node=1 \
    benchmarks/gpu_check.py nccl-probe --backend "$DIST" --device "$DEVICE" --out "$RES/nccl_probe.json"

# ---- if time is left: the whole 8B, tokens/s, two ranks --------------------------------------------------------
run_py buckets-8b-full "$T_FULL" "buckets_8b_full.json" "$PY" benchmarks/gpu_rounds.py buckets "${FULL[@]}" \
    --dtype "$DTYPE" --cache-dir "$CACHE" --out "$RES/buckets_8b_full.json"
run_py speed "$T_SPEED" "speed.json" "$PY" benchmarks/gpu_rounds.py speed "${SPEED[@]}" --dtype "$DTYPE" \
    --cache-dir "$CACHE" --out "$RES/speed.json"
cli two-ranks "$T_TWO" 2 "$ONE_DEVICE" gloo

# ---- summary and tarball -------------------------------------------------------------------------------------
SUM_ARGS=(--res "$RES")
[[ $SMOKE == 1 ]] && SUM_ARGS+=(--smoke)
echo
echo "== [$(date +%T)] summary (total so far $((SECONDS - START))s)"
timeout -k 2 $((RESERVE / 2)) "$PY" benchmarks/gpu_check.py summarize "${SUM_ARGS[@]}" >/dev/null || {
    echo "error: the summary step failed"
    printf '# GPU check\n\nThe summary step failed; steps.tsv and the logs are in gpu_check.tar.gz.\n' \
        >"$RES/gpu_check_summary.md"
    FAILED=1
}
cp "$RES/gpu_check_summary.md" "$OUT/gpu_check_summary.md"
echo "gpu_check: finished in $((SECONDS - START))s; $( ((FAILED)) && echo 'SOME STEPS FAILED OR WERE CUT' || echo 'all steps ok')"
for log in "$RES"/logs/*.log "$RES/gpu_check.log"; do # a log's last MiB: compile logs can run to hundreds
    [[ -f $log ]] && (($(stat -c %s "$log") > 1048576)) && tail -c 1048576 "$log" >"$log.tail" && mv "$log.tail" "$log"
done
rm -f "$OUT/gpu_check.tar.gz"
tar -czf "$OUT/gpu_check.tar.gz" -C "$SCRATCH" gpu_check
if (($(stat -c %s "$OUT/gpu_check.tar.gz") > 16 * 1048576)); then # the return folder's limit: JSON kept, logs cut
    tar -czf "$OUT/gpu_check.tar.gz" -C "$SCRATCH" --exclude=gpu_check/logs gpu_check
fi
echo "results: $OUT/gpu_check_summary.md and $OUT/gpu_check.tar.gz"
exit "$FAILED"

"""Job throughput with D LP groups: bench16 as ONE job through the real CLI, three ways to use 2 cores.

    python benchmarks/groups.py --out results/groups               # bench16, 128 tokens, configs/default.yaml
    python benchmarks/groups.py --limit 2 --max-new-tokens 8       # a check that it runs (no timing meaning)
    python benchmarks/groups.py --only D1P1,D2P1,D2P1_unshared --repeat 3 --out results/groups_shared

Setups (the CPU stand-in for one device per rank is one core per rank):
    D=1 x P=1, 2 threads  |  D=2 x P=1, 1 thread each (with and without advanced.share_cores: a group with
    no more work gives its thread to the other)  |  D=1 x P=2 (LP), 1 thread per rank
Each is one ``python -m lp_runner`` run (D x P > 1 starts torchrun itself). Reported per setup: the job's wall
time and tokens/s from its summary line (``report.job_line``: generation only, model loading excluded), the
per-prompt latency p50/p90, per-group utilisation, the process's whole wall time, and the ratio of job
tokens/s to D=1 x P=1 of the same round (``--repeat``: the setups run back to back that many times, and the
table ends with each setup's ratios and their median: a two-core machine's speed drifts between minutes, and one
job's tail depends on which prompt lands last); outputs are compared token by token with the first run. Records
the CPU (``machine_limits.cpu_description``: lscpu's model name, family/model, vector ISA). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SETUPS = (  # (label, groups D, workers P, threads per rank, extra --set, output file tag)
    ("D=1 x P=1, 2 threads", 1, 1, 2, (), "D1P1"),
    ("D=2 x P=1, 1 thread each", 2, 1, 1, (), "D2P1"),
    ("D=2 x P=1, 1 thread each, share_cores=false", 2, 1, 1, ("advanced.share_cores=false",), "D2P1_unshared"),
    ("D=1 x P=2, 1 thread per rank", 1, 2, 1, (), "D1P2"),
)
JOB_LINE = re.compile(
    r"job (?P<wall>[\d.]+) s  (?P<tps>[\d.]+) tokens/s  latency p50 (?P<p50>[\d.]+) s  p90 (?P<p90>[\d.]+) s"
    r"(?:  groups \d+: busy (?P<busy>[\d% ]+))?"
)


def run_setup(prompts: Path, out: Path, groups: int, workers: int, threads: int, extra: tuple, args) -> dict:
    sets = [*(arg for item in extra for arg in ("--set", item)),
        "--set", f"parallel.groups={groups}", "--set", f"parallel.workers={workers}",
        "--set", f"model.threads={threads}", "--set", f"generation.max_new_tokens={args.max_new_tokens}",
        "--set", "advanced.progress=false",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "lp_runner", "--config", str(args.config), "--prompts", str(prompts)]
    cmd += ["--output", str(out), "--overwrite", *sets]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads))
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    process_s = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"setup D={groups} x P={workers} failed (exit {proc.returncode})")
    match = JOB_LINE.search(proc.stderr)
    if match is None:
        raise SystemExit(f"no job summary line in the output of D={groups} x P={workers}")
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {
        "groups": groups,
        "workers": workers,
        "threads_per_rank": threads,
        "job_s": float(match["wall"]),
        "job_tokens_per_s": float(match["tps"]),
        "latency_p50_s": float(match["p50"]),
        "latency_p90_s": float(match["p90"]),
        "group_busy": match["busy"].split() if match["busy"] else [],
        "process_s": round(process_s, 2),
        "tokens": sum(r.get("new_tokens", 0) for r in records),
        "outputs": {r["id"]: r.get("output_ids") for r in records},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/groups"), help="OUT.json / OUT.md prefix")
    ap.add_argument("--config", default=str(REPO / "configs/default.yaml"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--only", default="", help="comma-separated setup tags (D1P1 first), e.g. D1P1,D2P1,D2P1_unshared")
    ap.add_argument("--repeat", type=int, default=1, help="run the setups this many times, back to back")
    ap.add_argument("--limit", type=int, default=0, help="first N prompts of bench16 only (0: all 16)")
    args = ap.parse_args()

    from benchmarks.machine_limits import cpu_description
    from benchmarks.prompt_sets import bench16

    prompts = bench16()
    if args.limit:
        prompts = prompts[: args.limit]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompt_file = out.with_name(out.name + "_prompts.jsonl")
    prompt_file.write_text("".join(json.dumps({k: v for k, v in p.items() if k != "set"}) + "\n" for p in prompts))

    chosen = [s for s in SETUPS if not args.only or s[5] in args.only.split(",")]
    if not chosen or chosen[0][5] != "D1P1":
        raise SystemExit("--only must start with D1P1: every ratio is to it")
    rounds = []  # one list of results per repeat: the setups back to back, so each ratio is of one stretch of time
    for rep in range(args.repeat):
        results = []
        for label, groups, workers, threads, extra, tag in chosen:
            print(f"round {rep + 1}/{args.repeat}: running {label} ...", file=sys.stderr, flush=True)
            jsonl = out.with_name(f"{out.name}_{tag}.jsonl")
            res = run_setup(prompt_file, jsonl, groups, workers, threads, extra, args)
            results.append({"setup": label, **res})
        base = results[0]
        for res in results:
            res["throughput_vs_D1P1"] = round(res["job_tokens_per_s"] / max(base["job_tokens_per_s"], 1e-9), 3)
            res["latency_p50_vs_D1P1"] = round(res["latency_p50_s"] / max(base["latency_p50_s"], 1e-9), 3)
            res["identical_to_D1P1"] = res["outputs"] == (rounds[0][0] if rounds else base)["outputs"]
        rounds.append(results)
    summary = {
        "date": date.today().isoformat(),
        "cpu": cpu_description(),  # lscpu: name, family/model, vector ISA
        "cores": len(os.sched_getaffinity(0)),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "config": str(args.config),
        "repeat": args.repeat,
        "setups": [{k: v for k, v in r.items() if k != "outputs"} for r in rounds[0]],
        "rounds": [[{k: v for k, v in r.items() if k != "outputs"} for r in results] for results in rounds],
    }
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    rows = [
        "| round | setup | job s | job tokens/s | x D1P1 | latency p50 s | p90 s | group busy | same output |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rep, results in enumerate(rounds, 1):
        for r in results:
            rows.append(
                f"| {rep} | {r['setup']} | {r['job_s']:.2f} | {r['job_tokens_per_s']:.2f} | "
                f"{r['throughput_vs_D1P1']:.2f}x | {r['latency_p50_s']:.2f} | {r['latency_p90_s']:.2f} | "
                f"{' '.join(r['group_busy']) or '-'} | {'yes' if r['identical_to_D1P1'] else 'NO'} |"
            )
    if len(rounds) > 1:
        rows += ["", "| setup | x D1P1 per round | median |", "|---|---|---|"]
        for k, (label, *_rest) in enumerate(chosen):
            ratios = [results[k]["throughput_vs_D1P1"] for results in rounds]
            rows.append(f"| {label} | {' '.join(f'{x:.2f}x' for x in ratios)} | {statistics.median(ratios):.2f}x |")
    table = "\n".join(rows)
    head = f"{summary['cpu']}, {summary['cores']} cores, {len(prompts)} prompts x {args.max_new_tokens} tokens, one job"
    out.with_suffix(".md").write_text(f"{head}\n\n{table}\n")
    print(head)
    print(table)


if __name__ == "__main__":
    main()

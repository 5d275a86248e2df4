"""Job throughput with D LP groups (issue 15): bench16 as ONE job through the real CLI, three ways to use 2 cores.

    python benchmarks/groups.py --out results/groups               # bench16, 128 tokens, configs/default.yaml
    python benchmarks/groups.py --limit 2 --max-new-tokens 8       # a check that it runs (no timing meaning)

Setups (the CPU stand-in for one device per rank is one core per rank):
    D=1 x P=1, 2 threads  |  D=2 x P=1, 1 thread each  |  D=1 x P=2 (LP), 1 thread per rank
Each is one ``python -m lp_runner`` run (D x P > 1 starts torchrun itself). Reported per setup: the job's wall
time and tokens/s from its summary line (``report.job_line``: generation only, model loading excluded), the
per-prompt latency p50/p90, per-group utilisation, the process's whole wall time, and the ratio of job
tokens/s to D=1 x P=1; outputs are compared token by token with the first setup. Records the CPU model
(lscpu's model name). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SETUPS = (  # (label, groups D, workers P, threads per rank)
    ("D=1 x P=1, 2 threads", 1, 1, 2),
    ("D=2 x P=1, 1 thread each", 2, 1, 1),
    ("D=1 x P=2, 1 thread per rank", 1, 2, 1),
)
JOB_LINE = re.compile(
    r"job (?P<wall>[\d.]+) s  (?P<tps>[\d.]+) tokens/s  latency p50 (?P<p50>[\d.]+) s  p90 (?P<p90>[\d.]+) s"
    r"(?:  groups \d+: busy (?P<busy>[\d% ]+))?"
)


def run_setup(prompts: Path, out: Path, groups: int, workers: int, threads: int, args) -> dict:
    sets = [
        "--set", f"parallel.groups={groups}", "--set", f"parallel.workers={workers}",
        "--set", f"model.threads={threads}", "--set", f"generation.max_new_tokens={args.max_new_tokens}",
        "--set", "run.progress=false",
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
    ap.add_argument("--limit", type=int, default=0, help="first N prompts of bench16 only (0: all 16)")
    args = ap.parse_args()

    import torch

    from benchmarks.prompt_sets import bench16
    from lp_runner.calibrate import device_name

    prompts = bench16()
    if args.limit:
        prompts = prompts[: args.limit]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompt_file = out.with_name(out.name + "_prompts.jsonl")
    prompt_file.write_text("".join(json.dumps({k: v for k, v in p.items() if k != "set"}) + "\n" for p in prompts))

    results = []
    for label, groups, workers, threads in SETUPS:
        print(f"running {label} ...", file=sys.stderr, flush=True)
        res = run_setup(
            prompt_file, out.with_name(f"{out.name}_D{groups}P{workers}.jsonl"), groups, workers, threads, args
        )
        results.append({"setup": label, **res})
    base = results[0]
    for res in results:
        res["throughput_vs_D1P1"] = round(res["job_tokens_per_s"] / max(base["job_tokens_per_s"], 1e-9), 3)
        res["latency_p50_vs_D1P1"] = round(res["latency_p50_s"] / max(base["latency_p50_s"], 1e-9), 3)
        res["identical_to_D1P1"] = res["outputs"] == base["outputs"]
    summary = {
        "date": date.today().isoformat(),
        "cpu": device_name(torch.device("cpu")),  # lscpu's model name: figures travel with the CPU they ran on
        "cores": len(os.sched_getaffinity(0)),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "config": str(args.config),
        "setups": [{k: v for k, v in r.items() if k != "outputs"} for r in results],
    }
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    rows = [
        "| setup | job s | job tokens/s | x D1P1 | latency p50 s | p90 s | group busy | same output |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r['setup']} | {r['job_s']:.2f} | {r['job_tokens_per_s']:.2f} | {r['throughput_vs_D1P1']:.2f}x | "
            f"{r['latency_p50_s']:.2f} | {r['latency_p90_s']:.2f} | {' '.join(r['group_busy']) or '-'} | "
            f"{'yes' if r['identical_to_D1P1'] else 'NO'} |"
        )
    table = "\n".join(rows)
    head = f"{summary['cpu']}, {summary['cores']} cores, {len(prompts)} prompts x {args.max_new_tokens} tokens, one job"
    out.with_suffix(".md").write_text(f"{head}\n\n{table}\n")
    print(head)
    print(table)


if __name__ == "__main__":
    main()

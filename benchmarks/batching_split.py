"""Where a batched job's time goes: rounds that carry a joining prompt's prefill against decode rounds.

    python benchmarks/batching.py --out benchmarks/results/batching          # writes batching_prompts.jsonl
    python benchmarks/batching_split.py --out benchmarks/results/batching_split --batches 1,4,8

Each setup is the real CLI job (``configs/default.yaml``, ``run.batch`` = B) run in this process, with every
round of ``scheduler.RoundLoop`` timed and classed by whether a generation in it is at its first round (its
prompt's prefill). Reported per setup: the rounds and seconds of each class, the prefill rounds' excess over the
mean decode round (what the joining prompts cost every generation in flight), the decode rounds' mean time,
generations and tokens per round; and from them the bound this split puts on batching's latency: a generation
lives through about B joins, so its latency carries about B prefill excesses besides its own decode rounds.
Records the CPU (``machine_limits.cpu_description``). Writes OUT.json and OUT.md. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def run_setup(prompts: Path, out: Path, batch: int, config: Path, max_new_tokens: int) -> dict:
    from lp_runner.cli.main import main
    from lp_runner.decoding import scheduler

    rounds: list[tuple[int, int, float]] = []  # (prefilling generations, generations, seconds)
    original, original_run = scheduler.RoundLoop._round, scheduler.RoundLoop.run
    loop_s = []  # the round loop's wall time: the job's generation, model loading and calibration left out

    def timed(self, gens):
        prefilling = sum(g.state.past_len == 0 for g in gens)
        start = time.perf_counter()
        original(self, gens)
        rounds.append((prefilling, len(gens), time.perf_counter() - start))

    def timed_run(self, *a, **k):
        start = time.perf_counter()
        try:
            return original_run(self, *a, **k)
        finally:
            loop_s.append(time.perf_counter() - start)

    scheduler.RoundLoop._round, scheduler.RoundLoop.run = timed, timed_run
    try:
        argv = ["--config", str(config), "--prompts", str(prompts), "--output", str(out), "--overwrite"]
        argv += ["--set", f"run.batch={batch}", "--set", "advanced.progress=false"]
        argv += ["--set", f"generation.max_new_tokens={max_new_tokens}"]
        if main(argv) != 0:
            raise SystemExit(f"run.batch={batch} failed")
        job_s = sum(loop_s)
    finally:
        scheduler.RoundLoop._round, scheduler.RoundLoop.run = original, original_run
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    tokens = sum(r["new_tokens"] for r in records)
    latencies = sorted(r["seconds"] for r in records)
    prefill = [r for r in rounds if r[0]]
    decode = [r for r in rounds if not r[0]]
    decode_s = sum(r[2] for r in decode)
    mean_decode = decode_s / max(len(decode), 1)
    prefill_s = sum(r[2] for r in prefill)
    gens = sum(r[1] for r in decode) / max(len(decode), 1)
    decode_rounds_per_gen = sum(r["stats"]["rounds"] - 1 for r in records) / max(len(records), 1)
    return {
        "batch": batch,
        "job_s": round(job_s, 2),
        "tokens": tokens,
        "latency_p50_s": round(latencies[len(latencies) // 2], 3),
        "rounds": len(rounds),
        "prefill_rounds": len(prefill),
        "prefill_rows": sum(len(r["prompt_ids"]) for r in records),
        "prefill_s": round(prefill_s, 2),
        "prefill_excess_s": round(prefill_s - mean_decode * len(prefill), 2),
        "decode_rounds": len(decode),
        "decode_s": round(decode_s, 2),
        "decode_round_ms": round(1e3 * mean_decode, 1),
        "generations_per_decode_round": round(gens, 2),
        "decode_rounds_per_generation": round(decode_rounds_per_gen, 1),
        "tokens_per_forward_per_generation": round(tokens / max(sum(r["stats"]["rounds"] for r in records), 1), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/batching_split"), help="OUT.json / OUT.md prefix")
    ap.add_argument("--prompts", default=str(REPO / "benchmarks/results/batching_prompts.jsonl"))
    ap.add_argument("--config", default=str(REPO / "configs/default.yaml"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,4,8", help="comma-separated run.batch values, 1 first")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if batches[0] != 1:
        raise SystemExit("--batches must start with 1: the bound is relative to one prompt at a time")
    from benchmarks.machine_limits import cpu_description

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for batch in batches:
        print(f"run.batch={batch} ...", file=sys.stderr, flush=True)
        results.append(
            run_setup(
                Path(args.prompts),
                out.with_name(f"{out.name}_b{batch}.jsonl"),
                batch,
                Path(args.config),
                args.max_new_tokens,
            )
        )
    base = results[0]
    prompts = base["prefill_rounds"]
    excess_per_join = base["prefill_excess_s"] / max(prompts, 1)
    for r in results:
        # a generation's latency: its decode rounds, its own prefill, and the B - 1 others' joins it lives through
        decode_latency = r["decode_rounds_per_generation"] * r["decode_round_ms"] / 1e3
        r["latency_model_s"] = round(decode_latency + r["batch"] * excess_per_join, 3)
        r["throughput_vs_b1"] = round(base["job_s"] / r["job_s"] * r["tokens"] / max(base["tokens"], 1), 3)
        r["latency_p50_vs_b1"] = round(r["latency_p50_s"] / base["latency_p50_s"], 3)
    summary = {
        "date": date.today().isoformat(),
        "cpu": cpu_description(),
        "cores": len(os.sched_getaffinity(0)),
        "prompts": prompts,
        "max_new_tokens": args.max_new_tokens,
        "prefill_excess_per_join_s": round(excess_per_join, 3),
        "results": results,
    }
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    rows = [
        "| run.batch | job s | x batch 1 (throughput) | p50 latency s | x batch 1 | prefill rounds: s, excess s | "
        "decode rounds | mean decode round ms | generations / round | tokens / forward / generation | "
        "latency model s (decode + B joins) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r['batch']} | {r['job_s']:.1f} | {r['throughput_vs_b1']:.2f}x | {r['latency_p50_s']:.2f} | "
            f"{r['latency_p50_vs_b1']:.2f}x | {r['prefill_rounds']}: {r['prefill_s']:.1f}, "
            f"{r['prefill_excess_s']:.1f} | "
            f"{r['decode_rounds']} | {r['decode_round_ms']:.1f} | {r['generations_per_decode_round']:.2f} | "
            f"{r['tokens_per_forward_per_generation']:.2f} | {r['latency_model_s']:.2f} |"
        )
    head = (
        f"{summary['cpu']}, {summary['cores']} cores, {prompts} prompts ({base['prefill_rows']} prompt tokens) x "
        f"{args.max_new_tokens} tokens, one job; a join's prefill excess {excess_per_join * 1e3:.0f} ms"
    )
    out.with_suffix(".md").write_text(f"{head}\n\n" + "\n".join(rows) + "\n")
    print(head)
    print("\n".join(rows))


if __name__ == "__main__":
    main()

"""Many prompts per forward: one job of bench16 + heldout24 (40 prompts) through the real CLI, one prompt at a time
(the default before batching) against ``run.batch`` = 2, 4, 8, 16, side by side.

    python benchmarks/batching.py --out benchmarks/results/batching            # 40 prompts, 128 tokens
    python benchmarks/batching.py --repeat 2 --out benchmarks/results/batching # the setups back to back, twice
    python benchmarks/batching.py --limit 6 --max-new-tokens 16 --batches 1,4  # a check that it runs

Each setup is one ``python -m lp_runner`` run of the whole job with ``configs/default.yaml`` (the auto preset
chooses each batch's setting from the device's curve, ``costmodel.batched_curve``). Reported per setup, from the
run's summary: job tokens/s (generation only, model loading excluded), per-prompt latency p50/p90 (each
record's ``seconds``: from its prompt joining to its last token), rows and generations per forward, tokens per
forward per generation, the setting the preset chose, and the ratios of throughput and latency to batch 1 of the
same round (``--repeat``: the setups back to back that many times; the table ends with each batch's ratios and
their median, since a shared machine's speed drifts between minutes). Every output is compared token by token
with HF greedy ``generate`` on the stock model (fp32). Records the CPU (``machine_limits.cpu_description``).
Writes OUT.json and OUT.md.
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

JOB_LINE = re.compile(
    r"job (?P<wall>[\d.]+) s  (?P<tps>[\d.]+) tokens/s  latency p50 (?P<p50>[\d.]+) s  p90 (?P<p90>[\d.]+) s"
)
BATCH_LINE = re.compile(
    r"batch (?P<batch>\d+): (?P<forwards>\d+) forwards of (?P<gens>[\d.]+) generations and (?P<rows>[\d.]+) rows, "
    r"(?P<tpf>[\d.]+) tokens per forward \((?P<per_gen>[\d.]+) per generation\)"
)
PLAIN_LINE = re.compile(r"forwards (?P<forwards>\d+)  tokens/forward (?P<tpf>[\d.]+)")
ROWS_LINE = re.compile(r"mean packed rows (?P<rows>[\d.]+)")
SETTING_LINE = re.compile(r"lp_runner  (?P<setting>.+?)  workers=")


def run_setup(prompts: Path, out: Path, batch: int, args) -> dict:
    cmd = [sys.executable, "-m", "lp_runner", "--config", str(args.config), "--prompts", str(prompts)]
    cmd += ["--output", str(out), "--overwrite", "--set", f"run.batch={batch}", "--set", "advanced.progress=false"]
    cmd += ["--set", f"generation.max_new_tokens={args.max_new_tokens}"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    process_s = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"run.batch={batch} failed (exit {proc.returncode})")
    job = JOB_LINE.search(proc.stderr)
    if job is None:
        raise SystemExit(f"no job summary line in the output of run.batch={batch}")
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    rounds = sum(r["stats"]["rounds"] for r in records)
    tokens = sum(r["new_tokens"] for r in records)
    batched = BATCH_LINE.search(proc.stderr)
    if batched is not None:
        forwards, rows, gens = int(batched["forwards"]), float(batched["rows"]), float(batched["gens"])
    else:  # one prompt at a time: a forward per round
        forwards, rows, gens = rounds, float(ROWS_LINE.search(proc.stderr)["rows"]), 1.0
    setting = SETTING_LINE.search(proc.stderr)
    return {
        "batch": batch,
        "job_s": float(job["wall"]),
        "job_tokens_per_s": float(job["tps"]),
        "latency_p50_s": float(job["p50"]),
        "latency_p90_s": float(job["p90"]),
        "forwards": forwards,
        "rows_per_forward": rows,
        "generations_per_forward": gens,
        "tokens_per_forward_per_generation": round(tokens / rounds, 3) if rounds else 0.0,
        "setting": setting["setting"] if setting else "?",
        "process_s": round(process_s, 2),
        "tokens": tokens,
        "outputs": {r["id"]: (r["prompt_ids"], r.get("output_ids")) for r in records},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/batching"), help="OUT.json / OUT.md prefix")
    ap.add_argument("--config", default=str(REPO / "configs/default.yaml"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,2,4,8,16", help="comma-separated run.batch values, 1 first")
    ap.add_argument("--repeat", type=int, default=1, help="run the setups this many times, back to back")
    ap.add_argument("--limit", type=int, default=0, help="first N prompts of the 40 only (0: all)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if batches[0] != 1:
        raise SystemExit("--batches must start with 1: every ratio is to one prompt at a time")

    import torch

    from benchmarks.compare import _answer, hf_generate
    from benchmarks.machine_limits import cpu_description
    from benchmarks.prompt_sets import bench16, heldout24
    from lp_runner.models.loading import embedded_model_dir, fetch_embedded_model, load_model_and_tokenizer

    fetch_embedded_model()
    model, tok, _ = load_model_and_tokenizer(embedded_model_dir(), dtype=torch.float32)
    prompts = bench16() + heldout24(lambda messages: _answer(model, tok, messages, args.max_new_tokens))
    if args.limit:
        prompts = prompts[: args.limit]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompt_file = out.with_name(out.name + "_prompts.jsonl")
    prompt_file.write_text("".join(json.dumps({k: v for k, v in p.items() if k != "set"}) + "\n" for p in prompts))

    rounds = []  # one list of results per repeat: the setups back to back, so each ratio is of one stretch of time
    for rep in range(args.repeat):
        results = []
        for batch in batches:
            print(f"round {rep + 1}/{args.repeat}: run.batch={batch} ...", file=sys.stderr, flush=True)
            res = run_setup(prompt_file, out.with_name(f"{out.name}_b{batch}.jsonl"), batch, args)
            results.append(res)
        base = results[0]
        for res in results:
            res["throughput_vs_b1"] = round(res["job_tokens_per_s"] / max(base["job_tokens_per_s"], 1e-9), 3)
            res["latency_p50_vs_b1"] = round(res["latency_p50_s"] / max(base["latency_p50_s"], 1e-9), 3)
        rounds.append(results)

    print("HF greedy on every prompt (the oracle) ...", file=sys.stderr, flush=True)
    eos = tok.eos_token_id
    oracle = {
        pid: hf_generate(model, ids, args.max_new_tokens, eos) for pid, (ids, _) in rounds[0][0]["outputs"].items()
    }
    for results in rounds:
        for res in results:
            res["exact"] = all(out_ids == oracle[pid] for pid, (_, out_ids) in res.pop("outputs").items())
    summary = {
        "date": date.today().isoformat(),
        "cpu": cpu_description(),  # lscpu: name, family/model, vector ISA
        "cores": len(os.sched_getaffinity(0)),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "config": str(args.config),
        "repeat": args.repeat,
        "rounds": rounds,
    }
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    rows = [
        "| round | run.batch | job tokens/s | x batch 1 | latency p50 s | x batch 1 | p90 s | rows/forward | "
        "generations/forward | tokens/forward/generation | setting (auto preset) | = HF greedy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rep, results in enumerate(rounds, 1):
        for r in results:
            rows.append(
                f"| {rep} | {r['batch']} | {r['job_tokens_per_s']:.2f} | {r['throughput_vs_b1']:.2f}x | "
                f"{r['latency_p50_s']:.2f} | {r['latency_p50_vs_b1']:.2f}x | {r['latency_p90_s']:.2f} | "
                f"{r['rows_per_forward']:.1f} | {r['generations_per_forward']:.1f} | "
                f"{r['tokens_per_forward_per_generation']:.2f} | {r['setting']} | {'yes' if r['exact'] else 'NO'} |"
            )
    if len(rounds) > 1:
        rows += ["", "| run.batch | throughput x batch 1 per round | median | p50 latency x batch 1 | median |"]
        rows.append("|---|---|---|---|---|")
        for k, batch in enumerate(batches):
            tput = [results[k]["throughput_vs_b1"] for results in rounds]
            lat = [results[k]["latency_p50_vs_b1"] for results in rounds]
            rows.append(
                f"| {batch} | {' '.join(f'{x:.2f}x' for x in tput)} | {statistics.median(tput):.2f}x | "
                f"{' '.join(f'{x:.2f}x' for x in lat)} | {statistics.median(lat):.2f}x |"
            )
    table = "\n".join(rows)
    head = f"{summary['cpu']}, {summary['cores']} cores, {len(prompts)} prompts x {args.max_new_tokens} tokens, one job"
    out.with_suffix(".md").write_text(f"{head}\n\n{table}\n")
    print(head)
    print(table)


if __name__ == "__main__":
    main()

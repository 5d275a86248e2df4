"""Strong scaling on this machine: the same job through the real CLI at P = 1 and P = 2.

    python benchmarks/scaling.py --out results/scaling          # (15,5,15), 8 HumanEval + 8 MT-bench, 128 tokens

Setups (the CPU stand-in for one device per worker is one core per rank):
    P=1, 1 thread  |  P=1, 2 threads  |  P=2 (torchrun, gloo), 1 thread per rank
Reports per-round and per-token latency, tokens/s, packed rows per rank, the time split forward / host /
communication (communication as the engine sees it: the all_gather including any wait for the slower rank), and
the pure cost of one round's all_gather measured alone (``--collective-bench``, run under torchrun).
Outputs of every setup are compared token by token.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def collective_bench(iters: int, length: int) -> None:
    """Run under torchrun: time the round's all_gather alone (after a barrier), print µs per call on rank 0."""
    import torch
    import torch.distributed as dist

    from lp_runner.parallel.comm import TorchCommunicator, init_process_group

    init_process_group("gloo", 60)
    comm = TorchCommunicator(torch.device("cpu"))
    payload = torch.zeros(length, dtype=torch.long)
    for _ in range(20):
        comm.all_gather(payload)
    dist.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        comm.all_gather(payload)
    us = 1e6 * (time.perf_counter() - t) / iters
    if dist.get_rank() == 0:
        print(json.dumps({"all_gather_us": round(us, 1), "payload_int64": length, "world": dist.get_world_size()}))
    dist.destroy_process_group()


def run_cli(prompts: Path, out: Path, workers: int, threads: int, wng: tuple[int, int, int], extra: list[str]) -> dict:
    w, n, g = wng
    sets = [
        "--set", f"model.threads={threads}", "--set", f"lookahead.window_size={w}",
        "--set", f"lookahead.ngram_size={n}", "--set", f"lookahead.verification_set_size={g}",
        "--set", "run.progress=false", *extra,
    ]  # fmt: skip
    args = ["--config", str(REPO / "configs/default.yaml"), "--prompts", str(prompts), "--output", str(out), *sets]
    if workers == 1:
        cmd = [sys.executable, "-m", "lp_runner", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}"]
        cmd += ["-m", "lp_runner", *args]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads))
    subprocess.run(cmd, check=True, env=env)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    tot = {k: sum(r["stats"][k] for r in records) for k in ("rounds", "rows", "forward_s", "host_s", "comm_s")}
    tokens = sum(r["new_tokens"] for r in records)
    secs = sum(r["seconds"] for r in records)
    return {
        "workers": workers,
        "threads_per_worker": threads,
        "tokens": tokens,
        "seconds": round(secs, 3),
        "tokens_per_s": round(tokens / secs, 3),
        "tokens_per_forward": round(tokens / tot["rounds"], 3),
        "round_ms": round(1000 * secs / tot["rounds"], 2),
        "token_ms": round(1000 * secs / tokens, 2),
        "rows_per_rank": round(tot["rows"] / tot["rounds"], 1),
        "forward_share": round(tot["forward_s"] / secs, 4),
        "host_share": round(tot["host_s"] / secs, 4),
        "comm_share": round(tot["comm_s"] / secs, 4),
        "comm_us_per_round": round(1e6 * tot["comm_s"] / tot["rounds"], 1),
        "outputs": [r["output_ids"] for r in records],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/scaling")
    ap.add_argument("--wng", default="15,5,15")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--context-lookup", default="false", help="lookahead.context_lookup for every setup")
    ap.add_argument("--collective-bench", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--length", type=int, default=40)
    args = ap.parse_args()
    if args.collective_bench:
        collective_bench(args.iters, args.length)
        return

    from benchmarks.prompt_sets import bench16

    wng = tuple(int(x) for x in args.wng.split(","))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts = bench16()
    if args.limit:
        prompts = [p for s in ("humaneval", "mtbench") for p in [q for q in prompts if q["set"] == s][: args.limit]]
    pfile = out.with_suffix(".prompts.jsonl")
    pfile.write_text("".join(json.dumps({k: v for k, v in p.items() if k != "set"}) + "\n" for p in prompts))
    extra = [
        "--set", f"lookahead.context_lookup={args.context_lookup}", "--set", "lookahead.pool_from_prompt=false",
        "--set", "lookahead.lookahead_branch=true",
    ]  # fmt: skip
    setups = {"P1-1thread": (1, 1), "P1-2threads": (1, 2), "P2-1thread-each": (2, 1)}
    results = {}
    for name, (workers, threads) in setups.items():
        results[name] = run_cli(pfile, out.with_suffix(f".{name}.jsonl"), workers, threads, wng, extra)
        print(name, {k: v for k, v in results[name].items() if k != "outputs"}, file=sys.stderr, flush=True)
    bench = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
         "--collective-bench", "--length", str(4 + wng[1] + wng[0])],  # header + emitted (N) + columns (W)
        check=True, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    collective = json.loads(bench.stdout.strip().splitlines()[-1])
    base = results["P1-1thread"]
    identical = all(r["outputs"] == base["outputs"] for r in results.values())
    report = {
        "date": date.today().isoformat(),
        "wng": wng,
        "prompts": len(prompts),
        "identical_outputs": identical,
        "collective": collective,
        "setups": {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in results.items()},
        "p2_token_latency_vs_p1_1thread": round(results["P2-1thread-each"]["token_ms"] / base["token_ms"], 3),
        "p2_token_latency_vs_p1_2threads": round(
            results["P2-1thread-each"]["token_ms"] / results["P1-2threads"]["token_ms"], 3
        ),
    }
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    md = [
        f"{report['date']}, W,N,G = {wng}, {len(prompts)} prompts, outputs identical across setups: {identical}; "
        f"one round's all_gather alone: {collective['all_gather_us']} us (gloo, 2 ranks)",
        "",
        "| setup | tok/s | round ms | token ms | tokens/forward | rows (rank 0) | forward | host | comm (incl. wait) "
        "| comm us/round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["setups"].items():
        md.append(
            f"| {name} | {r['tokens_per_s']:.2f} | {r['round_ms']:.1f} | {r['token_ms']:.1f} | "
            f"{r['tokens_per_forward']:.2f} | {r['rows_per_rank']:.1f} | {100 * r['forward_share']:.1f}% | "
            f"{100 * r['host_share']:.1f}% | {100 * r['comm_share']:.1f}% | {r['comm_us_per_round']:.0f} |"
        )
    md.append("")
    md.append(
        f"P=2 per-token latency: {report['p2_token_latency_vs_p1_1thread']}x of P=1 (1 thread), "
        f"{report['p2_token_latency_vs_p1_2threads']}x of P=1 (2 threads)."
    )
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()

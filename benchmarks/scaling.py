"""Strong scaling on this machine: the same job through the real CLI at P = 1 and P = 2.

    python benchmarks/scaling.py --out results/scaling          # (15,5,15), 8 HumanEval + 8 MT-bench, 128 tokens
    python benchmarks/scaling.py --simulate --skip-measured     # predicted P = 1..8 from the cost model only

Setups (the CPU stand-in for one device per worker is one core per rank):
    P=1, 1 thread  |  P=1, 2 threads  |  P=2 (torchrun, gloo), 1 thread per rank
Reports per-round and per-token latency, tokens/s, packed rows per rank, the time split forward / host /
communication (communication as the engine sees it: the all_gather including any wait for the slower rank), and
the pure cost of one round's all_gather measured alone (``--collective-bench``, run under torchrun).
Outputs of every setup are compared token by token. ``--simulate`` adds predictions for P = 1..8 from the cost
model (``lp_runner/costmodel.py``), each labelled simulated with its inputs; writes .json, .md and .png.
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
    args.append("--overwrite")  # a rerun replaces the previous run's records
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


def simulate(prompts: list[dict], wng: tuple[int, int, int], extra_la: dict, args, measured: dict) -> dict:
    """Predicted per-token latency for P = 1..max_workers from measured inputs (see ``lp_runner/costmodel.py``):
    the forward-cost curve at one thread (one core = this CPU's stand-in for one device), the round shapes of a
    real P = 1 run of the same job (greedy rounds do not depend on P), its host time per round, and the measured
    2-rank all_gather. Every figure it returns is labelled simulated."""
    import torch

    from lp_runner.config import GenerationConfig, LookaheadConfig
    from lp_runner.costmodel import measure_curve, predict
    from lp_runner.layout import max_round_rows
    from lp_runner.loading import embedded_model_dir, fetch_embedded_model, load_model_and_tokenizer
    from lp_runner.model import ModelAdapter
    from lp_runner.prompts import encode, spec_from_obj
    from lp_runner.tune import calibrate_setting

    torch.set_num_threads(1)
    fetch_embedded_model()
    model, tok, _ = load_model_and_tokenizer(embedded_model_dir())
    adapter = ModelAdapter(model)
    w, n, g = wng
    la = LookaheadConfig(w, n, g, **extra_la)
    encoded = [encode(tok, spec_from_obj({k: v for k, v in p.items() if k != "set"}, p["id"])) for p in prompts]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    cal = calibrate_setting(adapter, encoded, la, gen, [tok.eos_token_id])  # the tuner's own P=1 run
    shapes = cal.shapes
    top = max_round_rows(la) + 1
    rows = [q for q in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128) if q < top] + [top]
    kv = sorted({min(len(e) for e in encoded), max(len(e) for e in encoded) + args.max_new_tokens})
    curve = measure_curve(adapter, kv, rows, reps=args.reps)
    allgather = measured.get("all_gather_us", 0.0) * 1e-6
    p1 = [predict(sh, curve, 1) for sh in shapes]
    p1_forward_per_round = sum(x.forward_s for x in p1) / sum(x.rounds for x in p1)
    out = []
    for p in range(1, args.max_workers + 1):
        preds = [predict(s, curve, p, allgather, cal.host_s_per_round) for s in shapes]
        secs, toks = sum(x.seconds for x in preds), sum(x.tokens for x in preds)
        r = sum(x.rounds for x in preds)
        out.append(
            {
                "workers": p,
                "simulated": True,
                "token_ms": round(1e3 * secs / toks, 2),
                "round_ms": round(1e3 * secs / r, 2),
                "rows_max_rank": round(sum(x.mean_rows_max_rank * x.rounds for x in preds) / r, 1),
                "forward_ms_per_round": round(1e3 * sum(x.forward_s for x in preds) / r, 2),
                "comm_ms_per_round": round(1e3 * sum(x.comm_s for x in preds) / r, 3),
            }
        )
    return {
        "simulated": True,
        "inputs": {
            "curve": curve.to_dict(),
            "curve_threads": 1,
            "host_us_per_round": round(1e6 * cal.host_s_per_round, 1),
            "allgather_2_rank_us": measured.get("all_gather_us"),
            "comm_assumption": "ring all_gather: (P - 1) x the measured 2-rank latency",
            "shapes_from": f"a real P=1 run of the same job, {len(prompts)} prompts (greedy rounds do not depend on P)",
            "excluded": "prefill rounds (the same for every P)",
        },
        "validation": {
            "p1_forward_ms_per_round_measured": round(1e3 * cal.forward_s_per_round, 2),
            "p1_forward_ms_per_round_predicted": round(1e3 * p1_forward_per_round, 2),
            "what": "the same P=1 run's own forward time (1 thread) against the model's prediction for its rounds",
        },
        "x_label": "workers P",
        "y_label": "per-token latency (ms)",
        "points": out,
    }


def plot(report: dict, path: Path) -> None:
    """Per-token latency vs P: measured setups as markers, the simulation as a labelled line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    sim = report.get("simulation")
    if sim:
        pts = sim["points"]
        ax.plot([p["workers"] for p in pts], [p["token_ms"] for p in pts], "--o", label="simulated (cost model)")
    for name, r in report.get("setups", {}).items():
        if r["threads_per_worker"] == 1:
            ax.plot([r["workers"]], [r["token_ms"]], "s", markersize=9, label=f"measured {name}")
    ax.set_xlabel(sim["x_label"] if sim else "workers P")
    ax.set_ylabel(sim["y_label"] if sim else "per-token latency (ms)")
    ax.set_title(f"strong scaling, W,N,G = {tuple(report['wng'])}, one core per worker")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/scaling")
    ap.add_argument("--wng", default="15,5,15")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--context-lookup", default="false", help="lookahead.context_lookup for every setup")
    ap.add_argument("--collective-bench", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--length", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--simulate", action="store_true", help="also predict P = 1..--max-workers with the cost model")
    ap.add_argument("--max-workers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions per cost-curve point")
    ap.add_argument("--skip-measured", action="store_true", help="only the collective bench and the simulation")
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
    context = args.context_lookup.lower() == "true"
    extra = [
        "--set", f"lookahead.context_lookup={context}", "--set", "lookahead.pool_from_prompt=false",
        "--set", "lookahead.lookahead_branch=true", "--set", f"generation.max_new_tokens={args.max_new_tokens}",
        "--set", "lookahead.max_verify_rows=0",  # the full window and candidate set, whatever the default caps
    ]  # fmt: skip
    setups = {} if args.skip_measured else {"P1-1thread": (1, 1), "P1-2threads": (1, 2), "P2-1thread-each": (2, 1)}
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
    report = {
        "date": date.today().isoformat(),
        "wng": wng,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "collective": collective,
        "setups": {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in results.items()},
    }
    if results:
        base = results["P1-1thread"]
        report["identical_outputs"] = all(r["outputs"] == base["outputs"] for r in results.values())
        report["p2_token_latency_vs_p1_1thread"] = round(results["P2-1thread-each"]["token_ms"] / base["token_ms"], 3)
        report["p2_token_latency_vs_p1_2threads"] = round(
            results["P2-1thread-each"]["token_ms"] / results["P1-2threads"]["token_ms"], 3
        )
    if args.simulate:
        la = dict(context_lookup=context, pool_from_prompt=False, lookahead_branch=True)
        report["simulation"] = simulate(prompts, wng, la, args, collective)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    md = markdown(report)
    out.with_suffix(".md").write_text(md)
    plot(report, out.with_suffix(".png"))
    print(md)


def markdown(report: dict) -> str:
    wng, collective = tuple(report["wng"]), report["collective"]
    md = [
        f"{report['date']}, W,N,G = {wng}, {report['prompts']} prompts, {report['max_new_tokens']} new tokens; "
        f"one round's all_gather alone: {collective['all_gather_us']} us (gloo, 2 ranks)",
    ]
    if report["setups"]:
        md += [
            f"Measured; outputs identical across setups: {report['identical_outputs']}",
            "",
            "| setup | tok/s | round ms | token ms | tokens/forward | rows (rank 0) | forward | host | "
            "comm (incl. wait) | comm us/round |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in report["setups"].items():
            md.append(
                f"| {name} | {r['tokens_per_s']:.2f} | {r['round_ms']:.1f} | {r['token_ms']:.1f} | "
                f"{r['tokens_per_forward']:.2f} | {r['rows_per_rank']:.1f} | {100 * r['forward_share']:.1f}% | "
                f"{100 * r['host_share']:.1f}% | {100 * r['comm_share']:.1f}% | {r['comm_us_per_round']:.0f} |"
            )
        md += [
            "",
            f"P=2 per-token latency: {report['p2_token_latency_vs_p1_1thread']}x of P=1 (1 thread), "
            f"{report['p2_token_latency_vs_p1_2threads']}x of P=1 (2 threads).",
        ]
    sim = report.get("simulation")
    if sim:
        inp = sim["inputs"]
        md += [
            "",
            f"**Simulated** (cost model; inputs: forward-cost curve at {inp['curve_threads']} thread, round shapes of "
            f"a real P=1 run, host {inp['host_us_per_round']} us/round, all_gather {inp['allgather_2_rank_us']} us "
            f"at 2 ranks, {inp['comm_assumption']}; prefill excluded):",
            "",
            f"Check at P=1 (same run, same moment): forward {sim['validation']['p1_forward_ms_per_round_measured']} "
            f"ms/round measured, {sim['validation']['p1_forward_ms_per_round_predicted']} predicted.",
            "",
            "| P (simulated) | token ms | vs P=1 | round ms | rows on the busiest rank | comm ms/round |",
            "|---|---|---|---|---|---|",
        ]
        p1 = sim["points"][0]["token_ms"]
        for pt in sim["points"]:
            md.append(
                f"| {pt['workers']} | {pt['token_ms']:.1f} | {pt['token_ms'] / p1:.2f}x | {pt['round_ms']:.1f} | "
                f"{pt['rows_max_rank']:.1f} | {pt['comm_ms_per_round']:.3f} |"
            )
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()

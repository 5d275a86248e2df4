"""Strong scaling on this machine: the same job through the real CLI at P = 1 and P = 2.

    python benchmarks/scaling.py --out results/scaling          # (15,5,15), 8 HumanEval + 8 MT-bench, 128 tokens
    python benchmarks/scaling.py --simulate --skip-measured     # predicted P = 1..8 from the cost model only
    python benchmarks/scaling.py --from results/scaling.json    # re-render a stored report (adds the throughput view)
    python benchmarks/scaling.py --simulate --skip-measured --curve gpu:benchmarks/results/gpu/buckets.json
    python benchmarks/scaling.py --simulate --skip-measured --curve roofline:H100-SXM

Setups (the CPU stand-in for one device per worker is one core per rank):
    D=1 x P=1, 1 thread  |  D=1 x P=1, 2 threads  |  D=1 x P=2 (torchrun, gloo), 1 thread per rank  |
    D=2 x P=1 (two groups, one job), 1 thread per rank
Reports per-round and per-token latency, tokens/s, packed rows per rank, the time split forward / host /
communication (communication as the engine sees it: the all_gather including any wait for the slower rank), and
the pure cost of one round's all_gather measured alone (``--collective-bench``, run under torchrun).
Outputs of every setup are compared token by token. ``--simulate`` adds predictions for P = 1..8 from the cost
model (``lp_runner/tuning/costmodel.py``), each labelled simulated with its inputs; writes .json, .md and .png.

Throughput view: job tokens/s against the devices D x P. Measured points are the setups above (the
job's tokens/s from its summary line; a stored report without one gives, for one group, its tokens over the sum
of its prompts' seconds, which is the same job rate without model loading); ``--groups-json`` adds the points of
``benchmarks/groups.py`` (another setting: table only). Simulated points are every split D x P <= --max-workers
from the simulated per-token latency at P (``lp_runner.tuning.split.split_table``: D x one group's tokens/s, each device
running its own forward at the 1-thread curve). Every point says which it is.

On a GPU curve (``--curve``): the simulation prices the same rounds with a GPU's forward instead of this CPU's,
from the GPU check's measured rounds (``gpu:`` ``buckets.json`` of ``benchmarks/gpu_rounds.py``: the
embedded model's shape, captured rounds per bucket) when one exists, else from the roofline of a named GPU
(``roofline:NAME``, ``GPUS``: its memory bandwidth and dense bf16 FLOP/s, stated in the report; no launch or host
cost, so a lower bound on the forward). Round shapes and host time still come from the real P=1 run here (the
window's acceptance is the model's, not the device's; host time is this CPU's, labelled), at this run's fixed
W, N, G. The report puts the Lookahead paper's reported LP figures beside it, as reported, not measured here.

For a GPU, ``python -m lp_runner study --simulate`` is the model to use: it lets the window grow with P (LP's
lever), prices the all_gather from a named interconnect and host time from a stated figure. This script stays the
CPU measurement (its four setups on one 2-core machine) and its throughput view.
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

# The named GPUs, their roofline and the GPU check's measured rounds live with the strong-scaling simulation
# (``lp_runner/studies/hardware.py``); the paper's reported figures too (``lp_runner/studies/simulate.py``).
from lp_runner.studies.hardware import GPUS, roofline_curve  # noqa: E402
from lp_runner.studies.hardware import gpu_rounds_curve as _gpu_rounds_curve  # noqa: E402
from lp_runner.studies.simulate import PAPER_LP  # noqa: E402


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


def run_cli(
    prompts: Path, out: Path, workers: int, threads: int, wng: tuple[int, int, int], extra: list[str], groups: int = 1
) -> dict:
    from benchmarks.groups import JOB_LINE

    w, n, g = wng
    sets = [
        "--set", f"model.threads={threads}", "--set", f"parallel.groups={groups}",
        "--set", f"lookahead.window_size={w}", "--set", f"lookahead.ngram_size={n}",
        "--set", f"lookahead.verification_set_size={g}",
        "--set", "advanced.progress=false", *extra,
    ]  # fmt: skip
    args = ["--config", str(REPO / "configs/default.yaml"), "--prompts", str(prompts), "--output", str(out), *sets]
    args.append("--overwrite")  # a rerun replaces the previous run's records
    if workers == 1:
        cmd = [sys.executable, "-m", "lp_runner", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}"]
        cmd += ["-m", "lp_runner", *args]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)  # D > 1: lp_runner starts torchrun itself
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"setup D={groups} x P={workers} failed (exit {proc.returncode})")
    job = JOB_LINE.search(proc.stderr)
    if job is None:
        raise SystemExit(f"no job summary line in the output of D={groups} x P={workers}")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    tot = {k: sum(r["stats"][k] for r in records) for k in ("rounds", "rows", "forward_s", "host_s", "comm_s")}
    tokens = sum(r["new_tokens"] for r in records)
    secs = sum(r["seconds"] for r in records)
    return {
        "groups": groups,
        "workers": workers,
        "threads_per_worker": threads,
        "job_s": float(job["wall"]),
        "job_tokens_per_s": float(job["tps"]),
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
        "outputs": {r["id"]: r["output_ids"] for r in records},  # D > 1 writes records as they finish
    }


def gpu_curve(path: Path) -> tuple:
    """(CostCurve, label) from ``benchmarks/gpu_rounds.py buckets``' JSON (``studies.hardware.gpu_rounds_curve``)."""
    return _gpu_rounds_curve(json.loads(Path(path).read_text()))


def curve_for(source: str, shape: dict, kv_lens: list[int]) -> tuple | None:
    """``--curve``: None for this CPU's measured curve, else ``gpu:PATH`` or ``roofline:NAME``'s (curve, label)."""
    if source == "cpu":
        return None
    kind, _, arg = source.partition(":")
    if kind == "gpu":
        return gpu_curve(Path(arg))
    if kind == "roofline" and arg in GPUS:
        return roofline_curve(arg, shape, kv_lens)
    raise SystemExit(f"error: --curve {source!r}: use cpu, gpu:PATH (buckets.json) or roofline:NAME ({GPUS})")


def simulate(prompts: list[dict], wng: tuple[int, int, int], extra_la: dict, args, measured: dict) -> dict:
    """Predicted per-token latency for P = 1..max_workers from measured inputs (see ``lp_runner/tuning/costmodel.py``):
    the forward-cost curve at one thread (one core = this CPU's stand-in for one device), the round shapes of a
    real P = 1 run of the same job (greedy rounds do not depend on P), its host time per round, and the measured
    2-rank all_gather. Every figure it returns is labelled simulated."""
    import torch

    from lp_runner.backends.adapter import ModelAdapter
    from lp_runner.config import GenerationConfig, LookaheadConfig
    from lp_runner.decoding.layout import max_round_rows
    from lp_runner.jobs.prompts import encode, spec_from_obj
    from lp_runner.models.loading import embedded_model_dir, fetch_embedded_model, load_model_and_tokenizer
    from lp_runner.tuning.costmodel import measure_curve, predict
    from lp_runner.tuning.search import calibrate_setting

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
    other = curve_for(args.curve, model.config.to_dict(), kv)
    curve, curve_label = other if other else (measure_curve(adapter, kv, rows, reps=args.reps), "")
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
            "curve_source": curve_label or "this CPU, measured (1 thread)",
            "host_us_per_round": round(1e6 * cal.host_s_per_round, 1),
            "allgather_2_rank_us": measured.get("all_gather_us"),
            "comm_assumption": "ring all_gather: (P - 1) x the measured 2-rank latency",
            "shapes_from": f"a real P=1 run of the same job, {len(prompts)} prompts (greedy rounds do not depend on P)",
            "host_from": "this CPU's P=1 run" + (" (a GPU's host may differ)" if curve_label else ""),
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


def _rel(path: str) -> str:
    """A path inside the repository as a relative path (results travel between checkouts)."""
    p = Path(path)
    return str(p.relative_to(REPO)) if p.is_absolute() and p.is_relative_to(REPO) else path


def setup_label(groups: int, workers: int) -> str:
    return f"D={groups} x P={workers}"


def throughput(report: dict, groups_report: dict | None = None) -> dict:
    """The throughput view: job tokens/s against the devices D x P, every point labelled measured or simulated.

    Measured: each setup of ``report`` (its job summary line; a stored report from before the job line gives, for
    one group, tokens over the sum of its prompts' seconds: the same job rate, generation only). Threads per rank
    are kept with each point, since "D=1 x P=1, 2 threads" uses two cores as one device. ``groups_report``
    (``benchmarks/groups.py``'s JSON) adds its points, marked with their own setting. Simulated: every split
    D x P <= the largest simulated P, from the simulated per-token latency at P (``split.split_table``)."""
    from lp_runner.tuning.split import ASSUMPTION, highest_throughput, lowest_latency, split_table

    setting = f"W,N,G = {tuple(report['wng'])}"
    points = []
    for name, r in report.get("setups", {}).items():
        groups = r.get("groups", 1)
        if "job_tokens_per_s" in r:
            tps, how = r["job_tokens_per_s"], "job summary line"
        elif groups == 1:
            tps, how = r["tokens_per_s"], "tokens / sum of per-prompt seconds (one group)"
        else:
            continue  # D > 1 without a job line: no job rate to report
        points.append(
            {
                "label": "measured", "setup": name, "setting": setting, "groups": groups, "workers": r["workers"],
                "devices": groups * r["workers"], "threads_per_rank": r["threads_per_worker"],
                "tokens_per_s": tps, "ms_per_token": r.get("token_ms"), "how": how,
            }
        )  # fmt: skip
    if groups_report:
        for r in groups_report["setups"]:
            points.append(
                {
                    "label": "measured", "setup": r["setup"], "setting": f"{_rel(groups_report['config'])} (groups.py)",
                    "groups": r["groups"], "workers": r["workers"], "devices": r["groups"] * r["workers"],
                    "threads_per_rank": r["threads_per_rank"], "tokens_per_s": r["job_tokens_per_s"],
                    "ms_per_token": None, "how": f"benchmarks/groups.py job summary line, {groups_report['date']}",
                }
            )  # fmt: skip
    sources = [f"measured: this report's setups ({report['date']}, {report['prompts']} prompts)"]
    if groups_report:
        sources.append(
            f"measured: benchmarks/groups.py ({groups_report['date']}, {groups_report['prompts']} prompts, "
            f"{_rel(groups_report['config'])})"
        )
    best = []
    sim = report.get("simulation")
    if sim:
        sources.append(f"simulated: this report's simulation ({report['date']})")
        token_ms = {pt["workers"]: pt["token_ms"] for pt in sim["points"]}
        for n in range(1, max(token_ms) + 1):
            table = split_table(n, lambda d, p: token_ms[p])
            for sp in table:
                points.append({"label": "simulated", "setting": setting, **sp.to_dict()})
            fast, wide = lowest_latency(table), highest_throughput(table)
            best.append({"devices": n, "lowest_latency": fast.to_dict(), "highest_throughput": wide.to_dict()})
    return {
        "x_label": "devices D x P",
        "y_label": "job tokens/s",
        "simulated_assumption": ASSUMPTION + "; " + _curve_assumption(report) + ", prefill excluded",
        "sources": sources,
        "points": points,
        "best_simulated": best,
    }


def _curve_assumption(report: dict) -> str:
    """The simulated forward's source, for the throughput view: this CPU's 1-thread curve or the GPU curve."""
    source = report.get("simulation", {}).get("inputs", {}).get("curve_source", "")
    if source and not source.startswith("this CPU"):
        return f"each device's forward: {source}"
    return "1-thread curve (one core = one device)"


def plot(report: dict, path: Path) -> None:
    """Left: per-token latency vs P (measured setups as markers, the simulation as a labelled line). Right, when
    the report has a throughput view: job tokens/s vs devices D x P, one simulated line per P, measured markers
    (points measured at another setting are left to the table)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    view = report.get("throughput")
    fig, axes = plt.subplots(1, 2 if view else 1, figsize=(12 if view else 6, 4), squeeze=False)
    ax = axes[0][0]
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
    if view:
        ax = axes[0][1]
        setting = f"W,N,G = {tuple(report['wng'])}"
        sim_pts = [p for p in view["points"] if p["label"] == "simulated"]
        for p_ in sorted({p["workers"] for p in sim_pts}):
            line = [p for p in sim_pts if p["workers"] == p_]
            ax.plot([p["devices"] for p in line], [p["tokens_per_s"] for p in line], "--o", label=f"simulated P={p_}")
        for p in view["points"]:
            if p["label"] == "measured" and p["setting"] == setting:
                name = f"measured {setup_label(p['groups'], p['workers'])}, {p['threads_per_rank']} thr/rank"
                ax.plot([p["devices"] * p["threads_per_rank"]], [p["tokens_per_s"]], "s", markersize=9, label=name)
        ax.set_xlabel(view["x_label"] + " (measured: cores used)")
        ax.set_ylabel(view["y_label"])
        ax.set_title("job throughput (simulated: each device its own forward)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/scaling")
    ap.add_argument("--wng", default="15,5,15")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--context-lookup", default="false", help="advanced.context_lookup for every setup")
    ap.add_argument("--collective-bench", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--length", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--simulate", action="store_true", help="also predict P = 1..--max-workers with the cost model")
    ap.add_argument("--max-workers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions per cost-curve point")
    ap.add_argument("--skip-measured", action="store_true", help="only the collective bench and the simulation")
    ap.add_argument(
        "--curve", default="cpu", help="the simulation's forward: cpu (measured here), gpu:ROUNDS_BUCKETS_JSON or "
        f"roofline:NAME ({', '.join(GPUS)})"
    )  # fmt: skip
    ap.add_argument(
        "--groups-json", help="add benchmarks/groups.py's measured points (its JSON) to the throughput view"
    )
    ap.add_argument(
        "--from", dest="from_report", help="re-render this stored report JSON (no runs): adds the throughput view, "
        "rewrites its .json, .md and .png"
    )  # fmt: skip
    args = ap.parse_args()
    if args.collective_bench:
        collective_bench(args.iters, args.length)
        return
    groups_report = json.loads(Path(args.groups_json).read_text()) if args.groups_json else None
    if args.from_report:
        report = json.loads(Path(args.from_report).read_text())
        report["throughput"] = throughput(report, groups_report)
        write(report, Path(args.from_report).with_suffix(""))
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
        "--set", f"advanced.context_lookup={context}", "--set", "advanced.pool_from_prompt=false",
        "--set", "advanced.lookahead_branch=true", "--set", f"generation.max_new_tokens={args.max_new_tokens}",
        "--set", "advanced.max_verify_rows=0",  # the full window and candidate set, whatever the default caps
    ]  # fmt: skip
    setups = {  # name: (workers P, threads per rank, groups D)
        "P1-1thread": (1, 1, 1), "P1-2threads": (1, 2, 1), "P2-1thread-each": (2, 1, 1), "D2P1-1thread-each": (1, 1, 2),
    }  # fmt: skip
    results = {}
    for name, (workers, threads, groups) in ({} if args.skip_measured else setups).items():
        results[name] = run_cli(pfile, out.with_suffix(f".{name}.jsonl"), workers, threads, wng, extra, groups)
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
    report["throughput"] = throughput(report, groups_report)
    write(report, out)


def write(report: dict, out: Path) -> None:
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
        source = inp.get("curve_source", f"this CPU, measured ({inp['curve_threads']} thread)")
        md += [
            "",
            f"**Simulated** (cost model; inputs: forward-cost curve: {source}; round shapes of a real P=1 run, host "
            f"{inp['host_us_per_round']} us/round ({inp.get('host_from', 'measured')}), all_gather "
            f"{inp['allgather_2_rank_us']} us at 2 ranks, {inp['comm_assumption']}; prefill excluded):",
            "",
        ]
        check = sim.get("validation")  # reports from before the check have none
        if check:
            md += [
                f"Check at P=1 (same run, same moment): forward {check['p1_forward_ms_per_round_measured']} "
                f"ms/round measured, {check['p1_forward_ms_per_round_predicted']} predicted.",
                "",
            ]
        md += [
            "| P (simulated) | token ms | vs P=1 | round ms | rows on the busiest rank | comm ms/round |",
            "|---|---|---|---|---|---|",
        ]
        p1 = sim["points"][0]["token_ms"]
        for pt in sim["points"]:
            md.append(
                f"| {pt['workers']} | {pt['token_ms']:.1f} | {pt['token_ms'] / p1:.2f}x | {pt['round_ms']:.1f} | "
                f"{pt['rows_max_rank']:.1f} | {pt['comm_ms_per_round']:.3f} |"
            )
        if "curve_source" in inp and not inp["curve_source"].startswith("this CPU"):  # a GPU's curve: the paper's
            md += ["", "Beside it, as the Lookahead paper reports them (not measured here):", ""]
            md += [f"- {line}" for line in PAPER_LP]
    if report.get("throughput"):
        md += throughput_markdown(report["throughput"])
    return "\n".join(md) + "\n"


def throughput_markdown(view: dict) -> list[str]:
    """The throughput view as a table (measured rows first, each against the one-thread D=1 x P=1 of its own kind
    and setting) and the simulated winners per number of devices."""

    def base_of(p: dict) -> float | None:  # D=1 x P=1 of the same kind and setting, with the fewest threads
        ones = [q for q in view["points"] if (q["label"], q["setting"], q["devices"]) == (p["label"], p["setting"], 1)]
        return min(ones, key=lambda q: q.get("threads_per_rank", 1))["tokens_per_s"] if ones else None

    md = [
        "",
        f"**Throughput view**: {view['y_label']} vs {view['x_label']}; each row measured or simulated (simulated: "
        f"{view['simulated_assumption']}). Sources: {'; '.join(view.get('sources', []))}.",
        "",
        "| split | devices | threads/rank | job tokens/s | vs D=1 x P=1 (same kind, setting) | per-token ms | kind "
        "| setting |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(view["points"], key=lambda p: (p["label"] != "measured", p["setting"], p["devices"], p["workers"]))
    for p in order:
        base = base_of(p)
        ratio = f"{p['tokens_per_s'] / base:.2f}x" if base else "-"
        ms = f"{p['ms_per_token']:.1f}" if p.get("ms_per_token") else "-"
        md.append(
            f"| {setup_label(p['groups'], p['workers'])} | {p['devices']} | {p.get('threads_per_rank', 1)} | "
            f"{p['tokens_per_s']:.2f} | {ratio} | {ms} | {p['label']} | {p['setting']} |"
        )
    if view["best_simulated"]:
        md += ["", "| devices | lowest latency (simulated) | highest throughput (simulated) |", "|---|---|---|"]
        for b in view["best_simulated"]:
            fast, wide = b["lowest_latency"], b["highest_throughput"]
            fast_label, wide_label = (
                setup_label(fast["groups"], fast["workers"]),
                setup_label(wide["groups"], wide["workers"]),
            )
            md.append(
                f"| {b['devices']} | {fast_label}, {fast['ms_per_token']:.1f} ms/token "
                f"| {wide_label}, {wide['tokens_per_s']:.2f} tokens/s |"
            )
    return md


if __name__ == "__main__":
    main()

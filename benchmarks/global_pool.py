"""The job-level store (``lookahead.pool_scope``): tokens per forward with ``prompt`` vs ``job`` over one job.

Greedy output does not depend on the setting, and with the window off a round's plan depends only on the
committed tokens, so tokens per forward is a deterministic function of the prompts and the model's greedy
outputs: ``preset.simulate`` replays the real Coordinator on them (``tests/tuning/test_preset.py`` checks it against
real runs). This script therefore needs the model only once, to write the HF greedy outputs (cached in
``--outputs``); every comparison after that is a simulation, unaffected by a busy machine. ``--engine N`` also
runs the real engine on the first N prompts of each set, as one job per scope, and checks that its outputs
equal HF greedy and its tokens per forward equal the simulation's; ``--wall`` adds wall clock (a quiet machine).

The job: MT-bench first turns (``--chat``, up to 80: ten per category, category order interleaved as in the
question file) then HumanEval (``--code`` problems), in a fixed order. Also measured: the gain as a function of
the number of prompts already seen, the effect of a store from a disjoint earlier job (``--pool-in``'s use), and
the lookup cost of a store holding a million tokens (a micro-benchmark of the lookup alone).

    python benchmarks/global_pool.py --chat 80 --code 40 --out benchmarks/results/global_pool
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine_limits import cpu_description  # noqa: E402
from benchmarks.prompt_sets import humaneval, mtbench  # noqa: E402
from lp_runner.backends.adapter import ModelAdapter  # noqa: E402
from lp_runner.backends.cpu.prepack import apply_prepack, linear_kernels  # noqa: E402
from lp_runner.config import GenerationConfig, LookaheadConfig  # noqa: E402
from lp_runner.decoding.coordinator import Coordinator, RoundPlan  # noqa: E402
from lp_runner.decoding.engine import LookaheadEngine  # noqa: E402
from lp_runner.decoding.job_store import JobPool  # noqa: E402
from lp_runner.decoding.sources import merge_candidates  # noqa: E402
from lp_runner.jobs.prompts import encode, spec_from_obj  # noqa: E402
from lp_runner.models.loading import embedded_model_dir, fetch_embedded_model, load_model_and_tokenizer  # noqa: E402
from lp_runner.tuning import preset  # noqa: E402
from lp_runner.tuning.acceptance import Sample  # noqa: E402
from lp_runner.tuning.preset import simulate  # noqa: E402

# Window-off settings (the only ones a simulation can replay): the auto preset's choice on a 2-core CPU (G=1,
# context 1-3 / 10 tokens) and wider budgets, as a GPU's flatter cost curve would pick.
SETTINGS: dict[str, LookaheadConfig] = {
    "G1": LookaheadConfig(lookahead_branch=False, verification_set_size=1, pool_scope="prompt"),
    "G2": LookaheadConfig(lookahead_branch=False, verification_set_size=2, pool_scope="prompt"),
    "G4": LookaheadConfig(lookahead_branch=False, verification_set_size=4, pool_scope="prompt"),
    "G4-ctx16": LookaheadConfig(
        lookahead_branch=False, verification_set_size=4, context_tokens=16, pool_scope="prompt"
    ),
    "G16": LookaheadConfig(lookahead_branch=False, verification_set_size=16, pool_scope="prompt"),
}


def job_prompts(chat: int, code: int) -> list[dict]:
    """MT-bench first turns in question-file order (categories interleaved by 10s), then HumanEval."""
    qs = mtbench(per_category=10)[:chat]
    return qs + humaneval(code)


def write_outputs(path: Path, chat: int, code: int, max_new: int, threads: int) -> None:
    """HF greedy outputs of every prompt, one JSON line each; resumes a partial file."""
    done = {json.loads(line)["id"] for line in path.read_text().splitlines()} if path.is_file() else set()
    if all(p["id"] in done for p in job_prompts(chat, code)):
        return
    torch.set_num_threads(threads)
    fetch_embedded_model()
    model, tok, _ = load_model_and_tokenizer(embedded_model_dir())
    eos = tok.eos_token_id
    with path.open("a", encoding="utf-8") as f:
        for p in job_prompts(chat, code):
            if p["id"] in done:
                continue
            ids = encode(tok, spec_from_obj({k: v for k, v in p.items() if k != "set"}, p["id"]))
            x = torch.tensor([ids])
            with torch.no_grad():
                out = model.generate(
                    x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                    eos_token_id=eos, pad_token_id=eos,
                )  # fmt: skip
            row = {"id": p["id"], "set": p["set"], "prompt_ids": ids, "output_ids": out[0, len(ids) :].tolist()}
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(f"{p['id']}: {len(row['output_ids'])} tokens", flush=True)


def load_rows(path: Path, order: list[str]) -> list[dict]:
    """The cached outputs of the prompts in ``order``, in that order (a resumed cache file is not in job order)."""
    rows = {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}
    return [rows[i] for i in order if i in rows]


class JobFirstCoordinator(Coordinator):
    """Measurement only: the job source ahead of the context source (the shipped order puts it after)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        job = [s for s in self.sources if s.name == "job"]
        self.sources = job + [s for s in self.sources if s.name != "job"]


class FirstOfEachCoordinator(Coordinator):
    """Measurement only, the bound of a one-candidate round: every source's first proposal verified side by side
    (the simulation keeps the one with the most hits), i.e. a perfect choice among them. What G=1 could reach
    with these sources if the choice between them were never wrong."""

    def plan(self, history, depth):
        firsts = [p for src in self.sources for p in src.propose(history, 1)[:1]]
        kept = merge_candidates(firsts, len(firsts))
        return RoundPlan(history[-1], tuple(kept), ((0, 0),), (tuple(range(len(kept))),))


def simulate_job(
    la: LookaheadConfig,
    rows: list[dict],
    store: JobPool | None = None,
    job_first: bool = False,
    coordinator: type[Coordinator] | None = None,
) -> list[tuple[int, int]]:
    """(tokens, forwards) per prompt of one job, run in order; ``store`` carried across prompts (None: prompt
    scope); ``coordinator`` replaces the shipped one (a measurement variant)."""
    out = []
    original = preset.Coordinator
    preset.Coordinator = coordinator or (JobFirstCoordinator if job_first else Coordinator)
    try:
        for r in rows:
            shapes = simulate(la, Sample(tuple(r["prompt_ids"]), tuple(r["output_ids"])), store)
            out.append((sum(s.emitted for s in shapes), len(shapes)))
    finally:
        preset.Coordinator = original
    return out


def tpf(pairs: list[tuple[int, int]]) -> float:
    tokens, forwards = sum(t for t, _ in pairs), sum(f for _, f in pairs)
    return round(tokens / forwards, 4) if forwards else 0.0


def by_set(rows: list[dict], pairs: list[tuple[int, int]]) -> dict[str, float]:
    sets = sorted({r["set"] for r in rows})
    return {s: tpf([p for r, p in zip(rows, pairs, strict=True) if r["set"] == s]) for s in sets}


def compare_scopes(rows: list[dict], max_tokens: int) -> dict:
    """Per setting: tokens per forward by set, prompt vs job scope (and the variants the defaults were chosen
    from: prompts stored too, the job source ahead of the context source)."""
    out = {}
    for name, la in SETTINGS.items():
        job = dataclasses.replace(la, pool_scope="job", pool_max_tokens=max_tokens)
        runs = {
            "prompt": simulate_job(la, rows),
            "job": simulate_job(job, rows, JobPool(max_tokens)),
            "job+prompts": simulate_job(job, rows, JobPool(max_tokens, store_prompts=True)),
            "job-first": simulate_job(job, rows, JobPool(max_tokens), job_first=True),
        }
        res = {k: by_set(rows, v) for k, v in runs.items()}
        res["gain_job_vs_prompt"] = {s: round(res["job"][s] / res["prompt"][s] - 1, 4) for s in res["prompt"]}
        res["per_prompt"] = {k: runs[k] for k in ("prompt", "job")}
        out[name] = res
    return out


def choice_bound(rows: list[dict], max_tokens: int) -> dict:
    """At G=1 (the auto preset's CPU choice): tokens per forward by set, each scope as shipped and with a perfect
    choice among the sources' first proposals (``FirstOfEachCoordinator``). If the job scope's gain stays short
    of a target even with perfect choices, no ranking between the sources closes it: the store's content does
    not hold the continuations."""
    la = SETTINGS["G1"]
    job = dataclasses.replace(la, pool_scope="job", pool_max_tokens=max_tokens)
    runs = {
        "prompt": simulate_job(la, rows),
        "job": simulate_job(job, rows, JobPool(max_tokens)),
        "prompt_perfect_choice": simulate_job(la, rows, coordinator=FirstOfEachCoordinator),
        "job_perfect_choice": simulate_job(job, rows, JobPool(max_tokens), coordinator=FirstOfEachCoordinator),
    }
    res = {k: by_set(rows, v) for k, v in runs.items()}
    res["gain_perfect_choice"] = {
        s: round(res["job_perfect_choice"][s] / res["prompt_perfect_choice"][s] - 1, 4) for s in res["prompt"]
    }
    return res


def growth(rows: list[dict], setting: str, result: dict, step: int = 10) -> list[dict]:
    """Chat tokens per forward of the job scope over the prompt scope, by prompts already seen (buckets)."""
    per = result[setting]["per_prompt"]
    chat = [i for i, r in enumerate(rows) if r["set"] == "mtbench"]
    out = []
    for lo in range(0, len(chat), step):
        idx = chat[lo : lo + step]
        p, j = tpf([per["prompt"][i] for i in idx]), tpf([per["job"][i] for i in idx])
        out.append({"seen": lo, "prompt": p, "job": j, "gain": round(j / p - 1, 4)})
    return out


def pool_in_effect(rows: list[dict], setting: str, max_tokens: int) -> dict:
    """``--pool-in``: chat prompts split in two disjoint halves A, B; B as its own job, cold (prompt and job
    scope) and with the store A left behind (what ``--pool-out`` then ``--pool-in`` carry)."""
    chat = [r for r in rows if r["set"] == "mtbench"]
    a, b = chat[: len(chat) // 2], chat[len(chat) // 2 :]
    la = SETTINGS[setting]
    job = dataclasses.replace(la, pool_scope="job", pool_max_tokens=max_tokens)
    warm = JobPool(max_tokens)
    simulate_job(job, a, warm)
    return {
        "prompts_a": len(a),
        "prompts_b": len(b),
        "b_prompt_scope": tpf(simulate_job(la, b)),
        "b_job_cold": tpf(simulate_job(job, b, JobPool(max_tokens))),
        "b_job_pool_in_a": tpf(simulate_job(job, b, warm)),
    }


def lookup_cost(rows: list[dict], target: int = 1_000_000, lookups: int = 2000) -> dict:
    """Micro-benchmark of the store alone at ``target`` tokens: build time, one lookup (``JobPoolSource.propose``
    via the coordinator's source), peak memory. Outputs are repeated with a shifting token offset so that the
    store holds many distinct n-grams as well as long position lists."""
    import resource
    import statistics

    from lp_runner.decoding.job_store import JobPoolSource

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    store = JobPool(target)
    t0 = time.perf_counter()
    rep = 0
    while store.num_tokens < target - 200:
        for r in rows:
            store.add((), [t + (rep % 7) for t in r["output_ids"]])
            if store.num_tokens >= target - 200:
                break
        rep += 1
    build_s = time.perf_counter() - t0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    src = JobPoolSource(store, num_tokens=16)
    histories = [r["prompt_ids"] + r["output_ids"][: 1 + i % 100] for i, r in enumerate(rows * 20)][:lookups]
    times = []
    for h in histories:  # best of 3: on a shared machine a single timing catches the scheduler's time slices
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            src.propose(h, 4)
            best = min(best, time.perf_counter() - t)
        times.append(best)
    import gc

    gc.collect()  # the first full collection untracks the index's int tuples; the next one is what a run pays
    t = time.perf_counter()
    gc.collect()
    gc_ms = 1e3 * (time.perf_counter() - t)
    t = time.perf_counter()
    store.add((), rows[0]["output_ids"])
    add_s = time.perf_counter() - t
    return {
        "stored_tokens": store.num_tokens,
        "build_s": round(build_s, 2),
        "lookup_us_median": round(1e6 * statistics.median(times), 1),
        "lookup_us_p99": round(1e6 * sorted(times)[int(0.99 * len(times))], 1),
        "lookup_share_of_60ms_round_p99": round(sorted(times)[int(0.99 * len(times))] / 0.060, 5),
        "add_one_generation_ms": round(1e3 * add_s, 2),
        "peak_rss_growth_mb": round((rss1 - rss0) / 1024, 1),
        "full_gc_ms": round(gc_ms, 1),
    }


def engine_check(rows: list[dict], n: int, setting: str, threads: int, wall: bool, prepack: str = "auto") -> dict:
    """The real engine on the first ``n`` prompts of each set, as one job per scope: outputs must equal HF
    greedy (the cached outputs) and tokens per forward the simulation's. ``prepack``: the linear layers as
    ``model.backend`` runs them (the runner's default, auto)."""
    torch.set_num_threads(threads)
    model, tok, _ = load_model_and_tokenizer(embedded_model_dir())
    apply_prepack(model, prepack)  # the HF greedy outputs it is checked against came from the stock model
    picked = [r for s in ("mtbench", "humaneval") for r in [q for q in rows if q["set"] == s][:n]]
    la = SETTINGS[setting]
    scopes = ("prompt", "job")
    max_new = max(len(r["output_ids"]) for r in picked)
    engines = {
        scope: LookaheadEngine(
            ModelAdapter(model),
            dataclasses.replace(la, pool_scope=scope),
            GenerationConfig(max_new_tokens=max_new),
            [tok.eos_token_id],
        )
        for scope in scopes
    }
    pairs = {scope: [] for scope in scopes}
    exact = dict.fromkeys(scopes, True)
    seconds = {scope: {"mtbench": 0.0, "humaneval": 0.0} for scope in scopes}
    for r in picked:  # the scopes interleaved prompt by prompt: a drifting machine slows both alike
        for scope, engine in engines.items():
            engine.gen = GenerationConfig(max_new_tokens=len(r["output_ids"]))  # HF's budget or its EOS
            res = engine.generate(r["prompt_ids"])
            exact[scope] &= res.output_ids == r["output_ids"]
            pairs[scope].append((len(res.output_ids), res.stats.forwards))
            seconds[scope][r["set"]] += res.stats.seconds
    out = {}
    for scope, engine in engines.items():
        store = JobPool(engine.la.pool_max_tokens) if scope == "job" else None
        simulated = simulate_job(engine.la, picked, store)
        wall_s = {k: round(v, 2) for k, v in seconds[scope].items()}
        out[scope] = {
            "tokens_per_forward": tpf(pairs[scope]),
            "simulated_tokens_per_forward": tpf(simulated),
            "forwards_match_simulation": pairs[scope] == simulated,
            "exact": exact[scope],
            **({"seconds": round(sum(wall_s.values()), 2), "seconds_by_set": wall_s} if wall else {}),
        }
    out["prompts"] = [r["id"] for r in picked]
    out["linear"] = linear_kernels(model)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outputs", default="/tmp/global_pool_outputs.jsonl", help="HF greedy outputs (cache)")
    ap.add_argument("--out", default="benchmarks/results/global_pool")
    ap.add_argument("--chat", type=int, default=80)
    ap.add_argument("--code", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only-outputs", action="store_true", help="write the HF greedy outputs and stop")
    ap.add_argument("--max-tokens", type=int, default=1_000_000, help="advanced.pool_max_tokens")
    ap.add_argument("--engine", type=int, default=0, help="confirm on the first N prompts of each set")
    ap.add_argument("--engine-setting", default="G1")
    ap.add_argument("--wall", action="store_true", help="also report the engine's wall clock (quiet machine)")
    ap.add_argument("--no-lookup-cost", action="store_true")
    ap.add_argument("--prepack", default="auto", choices=("auto", "off"), help="--engine's linear layers")
    ap.add_argument("--engine-from", help="an engine_check JSON from an earlier call (instead of --engine)")
    args = ap.parse_args()
    path = Path(args.outputs)
    start = time.perf_counter()
    write_outputs(path, args.chat, args.code, args.max_new_tokens, args.threads)
    print(f"outputs ready in {time.perf_counter() - start:.0f} s", flush=True)
    if args.only_outputs:
        return
    rows = load_rows(path, [p["id"] for p in job_prompts(args.chat, args.code)])
    scopes = compare_scopes(rows, args.max_tokens)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_description(),
        "model": "SmolLM2-135M-Instruct (embedded), fp32, HF greedy outputs",
        "max_new_tokens": args.max_new_tokens,
        "prompts": {s: sum(r["set"] == s for r in rows) for s in ("mtbench", "humaneval")},
        "order": "MT-bench first turns in question-file order, then HumanEval in file order, one job",
        "method": "tokens per forward from preset.simulate (the real Coordinator replayed on the outputs)",
        "settings": {k: preset.describe(v) for k, v in SETTINGS.items()},
        "tokens_per_forward": {k: {kk: vv for kk, vv in v.items() if kk != "per_prompt"} for k, v in scopes.items()},
        "choice_bound_G1": choice_bound(rows, args.max_tokens),
        "growth_G1": growth(rows, "G1", scopes),
        "growth_G4": growth(rows, "G4", scopes),
        "pool_in_G1": pool_in_effect(rows, "G1", args.max_tokens),
        "pool_in_G4": pool_in_effect(rows, "G4", args.max_tokens),
    }
    if not args.no_lookup_cost:
        report["lookup_cost"] = lookup_cost(rows)
    if args.engine:
        report["engine_check"] = engine_check(
            rows, args.engine, args.engine_setting, args.threads, args.wall, args.prepack
        )
    elif args.engine_from:
        report["engine_check"] = json.loads(Path(args.engine_from).read_text())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    plot(report, out.with_suffix(".png"))
    print(markdown(report))


def plot(r: dict, path: Path) -> None:
    """Chat gain of the job scope by prompts already seen, per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key in ("growth_G1", "growth_G4"):
        xs = [g["seen"] for g in r[key]]
        ax.plot(xs, [100 * g["gain"] for g in r[key]], marker="o", label=key[7:])
    ax.axhline(15, color="grey", linestyle=":", label="target +15%")
    ax.set_xlabel("MT-bench prompts already seen (bucket start)")
    ax.set_ylabel("tokens per forward, job vs prompt (%)")
    ax.set_title("Job store: chat gain by prompts seen")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def markdown(r: dict) -> str:
    lines = [
        f"# Job store (lookahead.pool_scope): prompt vs job, {r['date']}",
        "",
        f"{r['model']}; {r['prompts']['mtbench']} MT-bench first turns + {r['prompts']['humaneval']} HumanEval, "
        f"{r['max_new_tokens']} new tokens; {r['order']}. {r['method']}: deterministic, independent of machine "
        f"load. CPU: {r['cpu']}.",
        "",
        "| setting | set | prompt | job | gain | job + prompts stored | job source first |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, res in r["tokens_per_forward"].items():
        for s in res["prompt"]:
            lines.append(
                f"| {name}: {r['settings'][name]} | {s} | {res['prompt'][s]:.3f} | {res['job'][s]:.3f} | "
                f"{100 * res['gain_job_vs_prompt'][s]:+.1f}% | {res['job+prompts'][s]:.3f} | "
                f"{res['job-first'][s]:.3f} |"
            )
    if "choice_bound_G1" in r:
        b = r["choice_bound_G1"]
        lines += [
            "",
            "G1 with a perfect choice among the sources' first proposals (each verified, the best kept: a bound "
            "no ranking between sources can pass):",
            "",
            "| set | prompt | job | gain | prompt, perfect choice | job, perfect choice | gain |",
            "|---|---|---|---|---|---|---|",
        ]
        for s in b["prompt"]:
            lines.append(
                f"| {s} | {b['prompt'][s]:.3f} | {b['job'][s]:.3f} | {100 * (b['job'][s] / b['prompt'][s] - 1):+.1f}%"
                f" | {b['prompt_perfect_choice'][s]:.3f} | {b['job_perfect_choice'][s]:.3f} | "
                f"{100 * b['gain_perfect_choice'][s]:+.1f}% |"
            )
    for key in ("growth_G1", "growth_G4"):
        lines += ["", f"Chat gain by prompts already seen ({key[7:]}):", "", "| seen | prompt | job | gain |"]
        lines.append("|---|---|---|---|")
        lines += [f"| {g['seen']}+ | {g['prompt']:.3f} | {g['job']:.3f} | {100 * g['gain']:+.1f}% |" for g in r[key]]
    for key in ("pool_in_G1", "pool_in_G4"):
        p = r[key]
        lines += [
            "",
            f"--pool-in ({key[8:]}): chat half B ({p['prompts_b']} prompts) after half A ({p['prompts_a']}): "
            f"prompt scope {p['b_prompt_scope']:.3f}, job scope cold {p['b_job_cold']:.3f}, "
            f"job scope with A's store {p['b_job_pool_in_a']:.3f} tokens per forward.",
        ]
    if "lookup_cost" in r:
        c = r["lookup_cost"]
        lines += [
            "",
            f"Lookup cost at {c['stored_tokens']} stored tokens (micro-benchmark, best of 3 per lookup): median "
            f"{c['lookup_us_median']} us, p99 {c['lookup_us_p99']} us "
            f"({100 * c['lookup_share_of_60ms_round_p99']:.2f}% of a 60 ms round); "
            f"adding a generation {c['add_one_generation_ms']} ms; build {c['build_s']} s; "
            f"peak RSS growth {c['peak_rss_growth_mb']} MB; a full garbage collection {c['full_gc_ms']} ms.",
        ]
    if "engine_check" in r:
        e = r["engine_check"]
        kernels = f", linear layers {e['linear']}" if "linear" in e else ""
        lines += [
            "",
            f"Real engine on {', '.join(e['prompts'])} (one job per scope, interleaved per prompt{kernels}):",
            "",
        ]
        for scope in ("prompt", "job"):
            x = e[scope]
            by_set = x.get("seconds_by_set", {})
            wall = f", {x['seconds']} s" if "seconds" in x else ""
            wall += f" (MT-bench {by_set['mtbench']} s, HumanEval {by_set['humaneval']} s)" if by_set else ""
            lines.append(
                f"- {scope}: {x['tokens_per_forward']:.3f} tokens per forward (simulation "
                f"{x['simulated_tokens_per_forward']:.3f}, forwards equal: {x['forwards_match_simulation']}), "
                f"exact vs HF greedy: {x['exact']}{wall}"
            )
        if all("seconds_by_set" in e[s] for s in ("prompt", "job")):
            ratio = {
                k: e["prompt"]["seconds_by_set"][k] / e["job"]["seconds_by_set"][k] for k in ("mtbench", "humaneval")
            }
            lines.append(
                f"- wall clock, prompt / job: MT-bench {ratio['mtbench']:.3f}x, HumanEval {ratio['humaneval']:.3f}x "
                "(above 1: the job store is faster)"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

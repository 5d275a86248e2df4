"""Side by side in one process: HF greedy generate, HF prompt lookup, and lp_runner configurations.

Same model, prompts and threads for every method; each method runs every prompt once after one warm-up
generation, and every lp_runner output is checked against HF greedy (a mismatch is reported, not hidden).

    python benchmarks/compare.py --out results/compare            # 8 HumanEval + 8 MT-bench, 128 new tokens
    python benchmarks/compare.py --configs lean,default --limit 4   # a quicker look

Writes ``<out>.json`` (every figure) and ``<out>.md`` (the table in the README).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.prompt_sets import bench16  # noqa: E402
from lp_runner.config import (
    GenerationConfig,  # noqa: E402
    LookaheadConfig,  # noqa: E402
)
from lp_runner.engine import LookaheadEngine  # noqa: E402
from lp_runner.loading import embedded_model_dir, fetch_embedded_model, load_model_and_tokenizer  # noqa: E402
from lp_runner.model import ModelAdapter  # noqa: E402
from lp_runner.prompts import encode, spec_from_obj  # noqa: E402

PLAIN = dict(context_lookup=False)  # Lookahead Decoding alone: Jacobi pool (+ its repair by committed text)
CONFIGS: dict[str, LookaheadConfig] = {
    "la-4-3-4": LookaheadConfig(4, 3, 4, False, **PLAIN),
    "la-4-3-4+prompt": LookaheadConfig(4, 3, 4, True, **PLAIN),
    "la-7-5-7": LookaheadConfig(7, 5, 7, False, **PLAIN),
    "la-7-5-7+prompt": LookaheadConfig(7, 5, 7, True, **PLAIN),
    "la-15-5-15": LookaheadConfig(15, 5, 15, False, **PLAIN),
    "la-15-5-15+prompt": LookaheadConfig(15, 5, 15, True, **PLAIN),
    # the Jacobi pool alone, without repair by the committed text (the published algorithm's pool)
    "la-7-5-7-pure": LookaheadConfig(7, 5, 7, False, pool_from_output=False, context_lookup=False),
    # context lookup + Jacobi pool under one budget (configs/lookahead.yaml)
    "ctx-7-5-7": LookaheadConfig(7, 5, 7, False),
    "ctx-2-3-2": LookaheadConfig(2, 3, 2, False),
    # context lookup + prompt/output pool, no window rows (configs/default.yaml: the CPU default)
    "lean-g1": LookaheadConfig(7, 5, 1, True, lookahead_branch=False),
    "lean-g2": LookaheadConfig(7, 5, 2, True, lookahead_branch=False),
}


def hf_generate(model, ids: list[int], max_new: int, eos: int, **kw) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
        pad_token_id=eos, **kw,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/compare")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names from CONFIGS")
    ap.add_argument("--baselines", default="greedy,prompt_lookup")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts of each set")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    fetch_embedded_model()
    model, tok, folder = load_model_and_tokenizer(embedded_model_dir())
    eos = tok.eos_token_id
    prompts = bench16()
    if args.limit:
        prompts = [p for s in ("humaneval", "mtbench") for p in [q for q in prompts if q["set"] == s][: args.limit]]
    encoded = [
        (p["set"], encode(tok, spec_from_obj({k: v for k, v in p.items() if k != "set"}, p["id"]))) for p in prompts
    ]
    adapter = ModelAdapter(model)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)

    def run_hf(**kw):
        hf_generate(model, encoded[0][1], 8, eos, **kw)  # warm-up
        rows = []
        for set_name, ids in encoded:
            t = time.perf_counter()
            out = hf_generate(model, ids, args.max_new_tokens, eos, **kw)
            rows.append({"set": set_name, "tokens": len(out), "seconds": time.perf_counter() - t, "out": out})
        return rows

    methods: dict[str, list[dict]] = {}
    reference = None
    for name in args.baselines.split(","):
        if name == "greedy":
            methods["hf-greedy"] = run_hf()
            reference = [r["out"] for r in methods["hf-greedy"]]
            for r in methods["hf-greedy"]:
                r["forwards"] = r["tokens"]  # one forward per new token
        elif name == "prompt_lookup":
            methods["hf-prompt-lookup"] = run_hf(prompt_lookup_num_tokens=10)
        print(f"{name} done", file=sys.stderr, flush=True)

    for name in args.configs.split(","):
        la = CONFIGS[name]
        engine = LookaheadEngine(adapter, la, gen, eos_ids=[eos])
        engine.generate(encoded[0][1][:16])  # warm-up
        rows = []
        for i, (set_name, ids) in enumerate(encoded):
            res = engine.generate(ids)
            s = res.stats
            rows.append(
                {
                    "set": set_name, "tokens": len(res.output_ids), "seconds": s.seconds, "forwards": s.forwards,
                    "rows": s.rows, "rounds": s.rounds, "host_s": s.host_s, "forward_s": s.forward_s,
                    "sources": s.sources, "exact": reference is None or res.output_ids == reference[i],
                }
            )  # fmt: skip
        methods[name] = rows
        print(f"{name} done", file=sys.stderr, flush=True)

    report = summarize(methods, args, folder)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def _agg(rows: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    d = {"tokens": tokens, "seconds": round(secs, 3), "tokens_per_s": round(tokens / secs, 3)}
    if all("forwards" in r for r in rows):
        d["tokens_per_forward"] = round(tokens / sum(r["forwards"] for r in rows), 3)
    if all("rows" in r for r in rows):
        d["mean_rows"] = round(sum(r["rows"] for r in rows) / sum(r["rounds"] for r in rows), 1)
        d["host_share"] = round(sum(r["host_s"] for r in rows) / secs, 4)
        d["exact"] = all(r["exact"] for r in rows)
    return d


def summarize(methods: dict[str, list[dict]], args, folder) -> dict:
    report = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads".strip(),
        "model": str(folder),
        "max_new_tokens": args.max_new_tokens,
        "torch": torch.__version__,
        "methods": {},
    }
    greedy = {s: _agg([r for r in methods["hf-greedy"] if s in (r["set"], "all")]) for s in ("humaneval", "mtbench")}
    greedy["all"] = _agg(methods["hf-greedy"])
    for name, rows in methods.items():
        entry = {"all": _agg(rows)}
        for s in ("humaneval", "mtbench"):
            entry[s] = _agg([r for r in rows if r["set"] == s])
        for key in ("all", "humaneval", "mtbench"):
            entry[key]["speedup"] = round(entry[key]["tokens_per_s"] / greedy[key]["tokens_per_s"], 3)
        srcs: dict[str, dict[str, int]] = {}
        for r in rows:
            for k, v in r.get("sources", {}).items():
                d = srcs.setdefault(k, {})
                for kk, vv in v.items():
                    d[kk] = d.get(kk, 0) + vv
        if srcs:
            entry["sources"] = srcs
        report["methods"][name] = entry
    return report


def markdown(report: dict) -> str:
    lines = [
        f"{report['date']}, {report['machine']}, fp32, {report['max_new_tokens']} new tokens, "
        "8 HumanEval + 8 MT-bench prompts",
        "",
        "| method | tok/s | speedup vs HF greedy | HumanEval speedup | MT-bench speedup | tokens/forward "
        "(HE / MT) | mean rows | host share | exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, e in report["methods"].items():
        a, he, mt = e["all"], e["humaneval"], e["mtbench"]
        tpf = (
            f"{a['tokens_per_forward']:.2f} ({he['tokens_per_forward']:.2f} / {mt['tokens_per_forward']:.2f})"
            if "tokens_per_forward" in a
            else "-"
        )
        host = f"{100 * a['host_share']:.1f}%" if "host_share" in a else "-"
        lines.append(
            f"| {name} | {a['tokens_per_s']:.2f} | {a['speedup']:.2f}x | {he['speedup']:.2f}x | {mt['speedup']:.2f}x "
            f"| {tpf} | {a.get('mean_rows', '-')} | {host} | {a.get('exact', '-')} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

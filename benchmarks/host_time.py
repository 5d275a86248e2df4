"""Host time per round on the critical path: what a round spends outside its forward and its collective.

    python benchmarks/host_time.py --out benchmarks/results/host_time                      # this checkout
    python benchmarks/host_time.py --baseline ../old-checkout --out benchmarks/results/host_time   # side by side

Each setup is the real CLI job (``python -m lp_runner``) on the first ``--prompts`` prompts of bench16, 128 new
tokens, at P = 1 and P = 2 (two gloo ranks started by the CLI, one core each), at the default
(``configs/default.yaml``: the auto preset's shape) and at fixed shapes W,N,G (``--shapes``, preset off, no
padding). A round's host time is its wall time less its forward (the read-back included) and its collective, as
every record's ``stats`` splits it (``scheduler.RoundLoop._round``): planning, layout, verification, publication
(K/V moves included), the pool and the round's record. On a CPU the forward blocks, so all of it is on the critical
path; on a GPU the part after the next launch would overlap the forward.

``--baseline DIR`` runs another checkout's code (``PYTHONPATH=DIR``) on the same jobs, each setup's two runs back
to back in alternating order, so the ratio is measured in one run; ``--repeat R`` runs each setup R times per
checkout, alternating, and reports each checkout's median run (a job's host time moves by a tenth or more between
runs on a shared machine). Records the CPU (``lscpu``'s model name).
Writes OUT.json and OUT.md. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def run_job(code: Path, prompts: Path, workers: int, shape: str, max_new_tokens: int, work: Path) -> dict:
    """One CLI job on ``code``'s lp_runner; the rounds' host, forward and collective seconds from its records."""
    out = work / f"out_{abs(hash((str(code), workers, shape)))}.jsonl"
    args = [sys.executable, "-m", "lp_runner", "--config", str(REPO / "configs/default.yaml"), "--prompts",
            str(prompts), "--output", str(out), "--overwrite", "--set", f"generation.max_new_tokens={max_new_tokens}",
            "--set", "advanced.progress=false", "--set", f"parallel.workers={workers}"]  # fmt: skip
    if shape != "default":
        w, n, g = shape.split(",")
        args += ["--set", "lookahead.preset=off", "--set", "advanced.pad_rows=false",
                 "--set", f"lookahead.window_size={w}", "--set", f"lookahead.ngram_size={n}",
                 "--set", f"lookahead.verification_set_size={g}"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(code))
    proc = subprocess.run(args, env=env, capture_output=True, text=True, cwd=code)
    if proc.returncode != 0:
        raise SystemExit(f"{code} {shape} P={workers} failed:\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    stats = [r["stats"] for r in records]
    rounds = sum(s["rounds"] for s in stats)
    return {
        "rounds": rounds,
        "host_us_per_round": 1e6 * sum(s["host_s"] for s in stats) / rounds,
        "forward_ms_per_round": 1e3 * sum(s["forward_s"] for s in stats) / rounds,
        "comm_us_per_round": 1e6 * sum(s["comm_s"] for s in stats) / rounds,
        "rows_per_round": sum(s["rows"] for s in stats) / rounds,
        "padded_rows_per_round": sum(s["padded_rows"] for s in stats) / rounds,
        "tokens_per_forward": sum(s["new_tokens"] for s in stats) / sum(s["forwards"] for s in stats),
        "tokens_per_s": sum(s["new_tokens"] for s in stats) / sum(s["seconds"] for s in stats),
        "outputs": [r["output_ids"] for r in records],
        "setting": records[0].get("policy", {}).get("lookahead"),
    }


def median_run(runs: list[dict]) -> dict:
    """The run whose host time is the median of ``runs`` (the lower middle one for an even count): one whole run's
    figures, so its host time, forward and tokens/s stay one measurement's."""
    return sorted(runs, key=lambda r: r["host_us_per_round"])[(len(runs) - 1) // 2]


def main() -> None:
    from prompt_sets import bench16

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--baseline", type=Path, help="another checkout, run side by side")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--shapes", default="default,7,5,7,15,5,15", help="'default' and W,N,G triples")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each setup per checkout (the median is reported)")
    args = ap.parse_args()
    parts = args.shapes.split(",")
    shapes, i = [], 0
    while i < len(parts):
        if parts[i] == "default":
            shapes.append("default")
            i += 1
        else:
            shapes.append(",".join(parts[i : i + 3]))
            i += 3
    codes = {"this": REPO} if args.baseline is None else {"baseline": args.baseline.resolve(), "this": REPO}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prompts = work / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(p) + "\n" for p in bench16()[: args.prompts]))
        flip = False
        for workers in (int(w) for w in args.workers.split(",")):
            for shape in shapes:
                runs: dict[str, list[dict]] = {name: [] for name in codes}
                for _ in range(args.repeat):
                    order = list(codes.items())[:: -1 if flip else 1]
                    flip = not flip
                    for name, code in order:
                        runs[name].append(run_job(code, prompts, workers, shape, args.max_new_tokens, work))
                got = {name: median_run(rs) for name, rs in runs.items()}
                row = {"workers": workers, "shape": shape, "repeat": args.repeat}
                for name, res in got.items():
                    row[name] = {k: v for k, v in res.items() if k != "outputs"}
                    row[name]["host_us_per_round_runs"] = [r["host_us_per_round"] for r in runs[name]]
                if "baseline" in got:
                    row["identical"] = got["baseline"]["outputs"] == got["this"]["outputs"]
                    row["host_ratio"] = got["this"]["host_us_per_round"] / got["baseline"]["host_us_per_round"]
                    row["speed_ratio"] = got["this"]["tokens_per_s"] / got["baseline"]["tokens_per_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    baseline = str(args.baseline) if args.baseline else None
    meta = {"date": str(date.today()), "cpu": cpu_model(), "prompts": f"bench16[:{args.prompts}]",
            "max_new_tokens": args.max_new_tokens, "baseline": baseline, "repeat": args.repeat}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"{meta['date']}, {meta['cpu']}, {meta['prompts']}, {args.max_new_tokens} new tokens, median of "
             f"{args.repeat} run(s) per setup and checkout", ""]  # fmt: skip
    names = list(codes)
    head = "| P | shape | " + " | ".join(f"{n} host us/round | {n} rows/round | {n} forward ms" for n in names)
    lines += [head + (" | host this / baseline | tokens/s this / baseline | identical |" if len(names) > 1 else " |")]
    lines += ["|" + "---|" * (2 + 3 * len(names) + (3 if len(names) > 1 else 0))]
    for row in rows:
        cells = [str(row["workers"]), row["shape"]]
        for n in names:
            r = row[n]
            cells += [f"{r['host_us_per_round']:.0f}", f"{r['rows_per_round']:.1f}", f"{r['forward_ms_per_round']:.1f}"]
        if len(names) > 1:
            cells += [f"{row['host_ratio']:.2f}x", f"{row['speed_ratio']:.2f}x", "yes" if row["identical"] else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

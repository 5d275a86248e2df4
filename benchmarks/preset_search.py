"""Time of the auto preset's searches, this code against a baseline revision, side by side.

    python benchmarks/preset_search.py --baseline f821f22 --pairs 5 --out benchmarks/results/preset_search

The auto preset searches once at a job's start (cached for the next job with the same inputs) and again from
the job's own outputs when they first reach 256, 1024 and 4096 tokens (never cached: the samples are the
job's). Each pair runs one child process per variant, in alternating order: this checkout's ``lp_runner`` and
the baseline's (exported with ``git archive``). A child loads the embedded model (a job's heap, which Python's
garbage collector walks), then, per curve, times ``AutoPreset``'s start-up search over the shipped samples and
its re-choices, the shipped samples replayed six times as the job's outputs. Curves: this machine's newest
calibration curve (when the cache holds one) and a synthetic curve where 2-3 rows cost more than 8
(``tests/helpers.py``).

Reported per search: each variant's median seconds and the median of the pairs' ratios (baseline / this); a
two-core machine's speed drifts between minutes, so only ratios taken side by side count. Both variants must
choose the same settings (checked: the searches are meant to differ in speed only). Records the CPU model.
Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import date
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# a synthetic curve (tests/helpers.py): ms per forward at K/V 300; 2-3 rows cost more than 8
ISSUE13_MS = {1: 60.0, 2: 114.0, 3: 114.0, 4: 81.0, 8: 81.0, 16: 120.0, 32: 200.0}
REPLAYS = 6  # the shipped samples, replayed this many times as one job's outputs (past the last re-choice)


def child(root: str, curves_file: str) -> None:
    """One variant's timings, printed as one JSON line (runs in its own process, ``root``'s lp_runner)."""
    sys.path.insert(0, root)
    from lp_runner.config import load_config
    from lp_runner.models.loading import load_model_and_tokenizer, resolve_model_path
    from lp_runner.tuning.acceptance import shipped_prior
    from lp_runner.tuning.costmodel import CostCurve, RowPlan
    from lp_runner.tuning.preset import AutoPreset, describe

    model = load_model_and_tokenizer(resolve_model_path("embedded"), dtype="float32")  # noqa: F841 (the heap)
    cfg = load_config(REPO / "configs" / "default.yaml")
    la = cfg.lookahead
    samples = list(shipped_prior().samples) * REPLAYS
    out: dict = {}
    for name, d in json.loads(Path(curves_file).read_text()).items():
        curve = CostCurve.from_dict(d)
        plan = RowPlan.from_curve(curve) if la.pad_rows else RowPlan.identity()
        start = time.perf_counter()
        auto = AutoPreset(la, cfg.pinned_lookahead(), curve, plan, prior=shipped_prior())
        times = {"start-up": time.perf_counter() - start}
        tokens = 0
        for s in samples:
            before = len(auto.history)
            start = time.perf_counter()
            auto.observe(s.prompt_ids, s.output_ids)
            elapsed = time.perf_counter() - start
            tokens += len(s.output_ids)
            if len(auto.history) > before:
                times[f"re-choice at {tokens} tokens"] = elapsed
        out[name] = {"seconds": times, "choices": [describe(c.lookahead) for c in auto.history]}
    print(json.dumps(out))


def run_child(root: Path, curves_file: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", str(root), str(curves_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{root}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def export(rev: str, into: Path) -> Path:
    """The baseline's lp_runner package (sources and data), exported from git into ``into``."""
    blob = subprocess.run(["git", "archive", rev, "lp_runner"], cwd=REPO, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    return into


def curves() -> dict[str, dict]:
    out = {}
    cached = sorted(
        (Path.home() / ".cache" / "lp_runner" / "calibration").glob("curve-*.json"), key=lambda p: p.stat().st_mtime
    )
    if cached:
        out["this machine's calibration"] = json.loads(cached[-1].read_text())["curve"]
    points = [{"kv_len": 300, "rows": q, "body_s": ms / 1e3, "all_s": ms / 1e3} for q, ms in ISSUE13_MS.items()]
    out["synthetic"] = {"points": points}
    return out


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3])
    # imported here, not at the top: a child must import its own revision's lp_runner, which machine_limits
    # would otherwise have imported from this checkout first
    sys.path.insert(0, str(REPO))
    from benchmarks.machine_limits import cpu_description

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="git revision to compare against")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--out", default="", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base_root = export(args.baseline, Path(tmp) / "baseline")
        curves_file = Path(tmp) / "curves.json"
        curves_file.write_text(json.dumps(curves()))
        runs: dict[str, list[dict]] = {"this": [], "baseline": []}
        for pair in range(args.pairs):
            order = [("this", REPO), ("baseline", base_root)]
            for name, root in order if pair % 2 == 0 else order[::-1]:
                runs[name].append(run_child(root, curves_file))
            print(f"pair {pair + 1}/{args.pairs} done", flush=True)
    rows, same = [], True
    for curve in runs["this"][0]:
        for search in runs["this"][0][curve]["seconds"]:
            this = [r[curve]["seconds"][search] for r in runs["this"]]
            base = [r[curve]["seconds"][search] for r in runs["baseline"]]
            ratios = [b / t for b, t in zip(base, this, strict=True)]
            rows.append(
                {
                    "curve": curve,
                    "search": search,
                    "baseline_s": round(statistics.median(base), 3),
                    "this_s": round(statistics.median(this), 3),
                    "ratio": round(statistics.median(ratios), 2),
                    "ratio_range": [round(min(ratios), 2), round(max(ratios), 2)],
                }
            )
        choices = {json.dumps(r[curve]["choices"]) for r in runs["this"] + runs["baseline"]}
        same = same and len(choices) == 1
    report = {
        "date": date.today().isoformat(),
        "cpu": cpu_description(),
        "baseline": args.baseline,
        "pairs": args.pairs,
        "same_choices": same,
        "choices": {c: runs["this"][0][c]["choices"] for c in runs["this"][0]},
        "rows": rows,
    }
    lines = [
        f"# Auto preset searches: this code vs {args.baseline} ({report['date']}, CPU {report['cpu']}, "
        f"{args.pairs} alternating pairs)",
        "",
        "| curve | search | baseline s (median) | this s (median) | baseline / this (median of pairs) | range |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["ratio_range"]
        lines.append(
            f"| {r['curve']} | {r['search']} | {r['baseline_s']:.3f} | {r['this_s']:.3f} | **{r['ratio']:.2f}x** "
            f"| {lo:.2f}-{hi:.2f}x |"
        )
    lines += ["", f"Same choices in every run of both variants: {'yes' if same else 'NO'}."]
    for c, ch in report["choices"].items():
        lines.append(f"- {c}: " + " -> ".join(ch))
    print("\n".join(lines))
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    if not same:
        sys.exit("the variants chose different settings")


if __name__ == "__main__":
    main()

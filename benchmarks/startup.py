"""Start-up time of one job: the auto preset's start-up search, computed or read back from the cache.

    python benchmarks/startup.py --out results/startup            # the embedded model, one prompt, 16 tokens
    python benchmarks/startup.py --model /path/to/folder --pairs 3

Each pair runs ``python -m lp_runner`` twice on one cache dir whose calibration curve is already measured: once
with the start-up choice removed from the cache (the search runs, as on a job's first start with these inputs)
and once with it kept (read back), in alternating order. Reported: each variant's whole-process wall time
(min/median/max) and the ratio of the pair's two times, with its median (a two-core machine's speed drifts
between minutes, so only ratios taken side by side count). Both runs print the same setting (checked). Records
the CPU (``machine_limits.cpu_description``: lscpu's model name, family/model, vector ISA). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


from benchmarks.machine_limits import cpu_description  # noqa: E402

PRESET_LINE = re.compile(r"preset auto \((?P<how>[^)]*)\): (?P<rest>.*)")


def run_once(cache: Path, prompts: Path, out: Path, args, searched: bool) -> tuple[float, str]:
    if searched:
        shutil.rmtree(cache / "preset", ignore_errors=True)
    cmd = [sys.executable, "-m", "lp_runner", "--prompts", str(prompts), "--output", str(out), "--overwrite"]
    cmd += ["--set", f"model.path={args.model}", "--set", f"generation.max_new_tokens={args.max_new_tokens}"]
    cmd += ["--set", "advanced.progress=false"]
    env = dict(os.environ, PYTHONPATH=str(REPO), LP_RUNNER_CACHE=str(cache))
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    line = next((m for m in map(PRESET_LINE.search, proc.stderr.splitlines()) if m), None)
    if line is None or ("read from the cache" in line["how"]) == searched:
        sys.exit(f"unexpected preset line (searched={searched}):\n{proc.stderr[-2000:]}")
    return wall, line["rest"]


def spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None, help="OUT: writes OUT.json and OUT.md")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lp_startup-"))
    cache = work / "cache"
    source = Path(os.environ.get("LP_RUNNER_CACHE", Path.home() / ".cache" / "lp_runner"))
    if (source / "models").is_dir():  # the embedded model without a second fetch
        cache.mkdir(parents=True)
        (cache / "models").symlink_to(source / "models")
    prompts = work / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "def quicksort(arr):"}) + "\n")
    run_once(cache, prompts, work / "warm.jsonl", args, searched=True)  # measures the curve once, warms files
    times: dict[str, list[float]] = {"searched": [], "cached": []}
    settings, ratios = set(), []
    for i in range(args.pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        pair = {}
        for searched in order:
            wall, setting = run_once(cache, prompts, work / "o.jsonl", args, searched)
            pair["searched" if searched else "cached"] = wall
            settings.add(setting)
        for k, v in pair.items():
            times[k].append(v)
        ratios.append(pair["searched"] / pair["cached"])
    if len(settings) != 1:
        sys.exit(f"the two variants chose differently: {settings}")
    cpu = cpu_description()
    rows = [
        f"# Start-up: the auto preset's search computed vs read from the cache ({date.today()}, {cpu})",
        "",
        f"`python benchmarks/startup.py --model {args.model} --pairs {args.pairs}`: `python -m lp_runner`, one prompt,"
        f" {args.max_new_tokens} new tokens, calibration curve cached; alternating pairs.",
        "",
        "| variant | whole process s (min / median / max) |",
        "|---|---|",
        f"| search computed | {spread(times['searched'])} |",
        f"| search read from the cache | {spread(times['cached'])} |",
        "",
        f"Ratio computed / cached per pair: {', '.join(f'{r:.2f}' for r in ratios)}; median "
        f"**{statistics.median(ratios):.2f}x**. Setting: {settings.pop()}",
    ]
    print("\n".join(rows))
    if args.out is not None:
        out = args.out if args.out.is_absolute() else Path(__file__).resolve().parent / args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text("\n".join(rows) + "\n")
        data = {"cpu": cpu, "date": str(date.today()), "args": {k: str(v) for k, v in vars(args).items()}}
        out.with_suffix(".json").write_text(json.dumps({**data, "times": times, "ratios": ratios}, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""The native forward with its packed weights in transparent huge pages against the same weights in 4 KB pages.

``advanced.huge_pages: true`` packs a native model's weights into one allocation asked for 2 MB pages
(``lp_runner/backends/cpu/arena.py``; the default packs into the same allocation in 4 KB pages). This loads the embedded
model twice in one process, once each way, reports what packing took each way (the start-up cost: faulting the pages
in), and times their forwards interleaved (row counts and layouts alternating within every repetition), logits compared
bit for bit.

Where a model is loaded in the process matters by itself on this project's VM: of two identical models in 4 KB
pages, the one loaded second ran up to 1.2x faster in a scratch run. So each comparison runs twice, in a
fresh process per load order (huge first, then plain first), and the table keeps both: a layout's gain is what
holds in both orders.

    python benchmarks/weight_pages.py --rows 1 8 --out benchmarks/results/weight_pages
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.forward_timing import prefilled_caches  # noqa: E402
from benchmarks.machine_limits import cpu_description  # noqa: E402
from lp_runner.backends.adapter import ModelAdapter, causal  # noqa: E402
from lp_runner.backends.cpu.prepack import NATIVE_KERNEL, native_unavailable_reason, prepack_linears  # noqa: E402
from lp_runner.backends.staging import Rows  # noqa: E402
from lp_runner.models.fetch import fetch_embedded_model  # noqa: E402
from lp_runner.models.loading import default_cache_dir, embedded_model_dir, load_model_and_tokenizer  # noqa: E402

LAYOUTS = {"huge": True, "plain": False}  # name -> prepack_linears(huge_pages=...)


def huge_mb() -> float:
    """This process's anonymous memory in transparent huge pages, MB (0 where /proc has no such line)."""
    for line in (
        Path("/proc/self/smaps_rollup").read_text().splitlines() if Path("/proc/self/smaps_rollup").exists() else []
    ):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 1024
    return 0.0


def one_order(order: list[str], rows: list[int], reps: int, prefix: int) -> dict:
    """Load the model once per layout in ``order``, then time every (layout, rows) forward, interleaved."""
    adapters, grew, pack_s = {}, {}, {}
    for name in order:
        model, _, _ = load_model_and_tokenizer(embedded_model_dir(), dtype="float32")
        if reason := native_unavailable_reason(model, default_cache_dir()):
            raise SystemExit(f"the native kernel is unavailable here: {reason}")
        before, start = huge_mb(), time.perf_counter()
        prepack_linears(model, kernel=NATIVE_KERNEL, huge_pages=LAYOUTS[name])
        pack_s[name] = round(time.perf_counter() - start, 2)
        grew[name] = round(huge_mb() - before, 1)
        adapters[name] = ModelAdapter(model)
    gen = torch.Generator().manual_seed(1)
    caches = prefilled_caches(adapters, prefix, prefix + max(rows) + 1, gen)
    ids = {r: torch.randint(0, adapters[order[0]].vocab_size, (r,), generator=gen) for r in rows}
    times: dict[tuple[str, int], list[float]] = {(n, r): [] for n in order for r in rows}
    logits = {}
    with torch.inference_mode():
        for rep in range(reps + 1):  # the first pass warms every shape, untimed
            for r in rows[rep % len(rows) :] + rows[: rep % len(rows)]:
                for name in order[rep % 2 :] + order[: rep % 2]:
                    start = time.perf_counter()
                    logits[name, r] = adapters[name].run(
                        [Rows.of(ids[r], torch.arange(prefix, prefix + r), causal(r), torch.arange(r))], [caches[name]]
                    )
                    elapsed = time.perf_counter() - start
                    caches[name].crop(prefix)
                    if rep:
                        times[name, r].append(elapsed)
    ms = {f"{n} {r}": round(1e3 * statistics.median(t), 2) for (n, r), t in times.items()}
    equal = all(torch.equal(logits["huge", r], logits["plain", r]) for r in rows)
    return {"order": order, "ms": ms, "huge_pages_mb": grew, "prepack_s": pack_s, "bits_equal": equal}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prefix", type=int, default=256, help="cached K/V positions before each forward")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--order", help=argparse.SUPPRESS)  # a child process: this load order only, JSON on stdout
    ap.add_argument("--out", default="", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = sorted({1, *args.rows})
    if args.order:
        print(json.dumps(one_order(args.order.split(","), rows, args.reps, args.prefix)))
        return
    fetch_embedded_model()
    runs = []
    for order in ("huge,plain", "plain,huge"):
        cmd = [sys.executable, __file__, "--order", order, "--reps", str(args.reps), "--prefix", str(args.prefix)]
        cmd += ["--threads", str(args.threads), "--rows", *map(str, rows)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    report = {"date": str(date.today()), "cpu": cpu_description(), "threads": args.threads, "prefix": args.prefix}
    report |= {"reps": args.reps, "runs": runs}
    md = [
        f"{report['date']}, CPU {report['cpu']}, {args.threads} threads, the embedded model (float32, native "
        f"layers), K/V {args.prefix}, median of {args.reps} interleaved forwards per cell; one process per load order.",
        "",
        "| loaded first | rows | huge pages ms | 4 KB pages ms | 4 KB / huge | huge pages granted (MB) | bits equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for r in rows:
            huge, plain = run["ms"][f"huge {r}"], run["ms"][f"plain {r}"]
            md.append(
                f"| {run['order'][0]} | {r} | {huge} | {plain} | **{plain / huge:.2f}x** "
                f"| {run['huge_pages_mb']['huge']} (4 KB layout: {run['huge_pages_mb']['plain']}) "
                f"| {run['bits_equal']} |"
            )
    md.append("")
    for run in runs:
        line = f"{run['order'][0]} first: packing took {run['prepack_s']['huge']} s in huge pages, "
        line += f"{run['prepack_s']['plain']} s in 4 KB pages"
        if 8 in rows:
            line += f"; 8 rows x one row: huge {run['ms']['huge 8'] / run['ms']['huge 1']:.2f}x, "
            line += f"4 KB {run['ms']['plain 8'] / run['ms']['plain 1']:.2f}x"
        md.append(f"- {line}")
    print("\n".join(md))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        out.with_suffix(".md").write_text("# Packed weights: huge pages against 4 KB pages\n\n" + "\n".join(md) + "\n")


if __name__ == "__main__":
    main()

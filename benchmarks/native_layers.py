"""Native decoder layers (``advanced.native_layers``) against transformers' layers on the same native products,
eager, and against the compiled forward (``model.compile: on``), side by side on the embedded model.

Three adapters share one model (native products): eager with ``native_layers=False`` (transformers' layer code,
static cache), eager with native layers (the default), and compiled (its graph traces transformers' layers). For
every row count they alternate forward by forward on a cached prefix (order rotated each repetition; each forward
cropped back), so the printed medians are measured together; the logits' largest difference from the first
adapter and whether every argmax agrees are printed too.

    python benchmarks/native_layers.py --out benchmarks/results/native_layers
    python benchmarks/native_layers.py --prefill 32 150 600 --out benchmarks/results/native_layers_prefill

``--prefill``: prompts of those lengths prefilled from an empty cache instead (a fresh cache per forward, its
buffer sized as the engine sizes it for 128 new tokens), the eager adapters only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.forward_timing import native_embedded_model, scratch_region, time_row_counts  # noqa: E402
from benchmarks.machine_limits import cpu_description  # noqa: E402
from benchmarks.tables import write_results  # noqa: E402
from lp_runner.backends import detect_backend  # noqa: E402
from lp_runner.backends.adapter import ModelAdapter, causal  # noqa: E402
from lp_runner.backends.staging import Rows  # noqa: E402


def time_prefills(adapters: dict[str, ModelAdapter], lengths: list[int], reps: int) -> list[dict]:
    """Per prompt length, ``reps`` prefills per adapter from an empty cache (order rotated each repetition, one
    warm-up pass): the median ms per adapter, the first adapter's over each other's, the last row's logits'
    largest difference and whether their argmax agrees."""
    names, first = list(adapters), next(iter(adapters))
    results = []
    for n in lengths:
        ids = torch.randint(0, adapters[first].vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        times: dict[str, list[float]] = {name: [] for name in names}
        logits = {}
        for rep in range(reps + 1):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                cache = scratch_region(adapters[name], n + 128 + 16)
                start = time.perf_counter()
                logits[name] = adapters[name].run(
                    [Rows.of(ids, torch.arange(n), causal(n), torch.tensor([n - 1]))], [cache]
                )
                if rep:
                    times[name].append(time.perf_counter() - start)
        row = {"prompt tokens": n, **{f"ms {name}": round(1e3 * statistics.median(times[name]), 1) for name in names}}
        for name in names[1:]:
            row[f"{first} / {name}"] = round(row[f"ms {first}"] / row[f"ms {name}"], 2)
        row[f"max |logit - {first}|"] = max(float((v - logits[first]).abs().max()) for v in logits.values())
        row["argmax agree"] = all(torch.equal(v.argmax(-1), logits[first].argmax(-1)) for v in logits.values())
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=300)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--no-compile", action="store_true", help="leave out the compiled adapter")
    ap.add_argument("--prefill", type=int, nargs="+", default=[], help="time prefills of these prompt lengths")
    ap.add_argument("--out", default="", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    model = native_embedded_model(args.threads)
    capacity = args.prefix + max(args.rows) + 64
    layered = detect_backend(model)
    adapters = {
        "eager, transformers' layers": ModelAdapter(model, backend=layered.transformers_layers()),
        "eager, native layers": ModelAdapter(model),
    }
    if not adapters["eager, native layers"].backend.whole_layers:
        raise SystemExit("the embedded model's layers did not take the native path")
    compile_s = None
    if args.prefill:
        results = time_prefills(adapters, args.prefill, args.reps)
        if args.out:
            cpu = cpu_description()
            caption = f"{cpu}, {args.threads} threads, float32, native products, prefills, median of {args.reps}"
            meta = {"cpu": cpu, "threads": args.threads, "reps": args.reps, "prefill": args.prefill}
            write_results(Path(args.out), meta, caption, results)
        return
    if not args.no_compile:
        adapters["compiled"] = ModelAdapter(model)
        compile_s = round(adapters["compiled"].compile([capacity]), 1)
        print(f"compiled in {compile_s} s", flush=True)
    results = time_row_counts(adapters, args.prefix, capacity, args.rows, args.reps)
    if args.out:
        cpu = cpu_description()
        caption = (
            f"{cpu}, {args.threads} threads, float32, native products, K/V {args.prefix}, median of {args.reps} "
            f"forwards, interleaved" + (f"; compiled in {compile_s} s" if compile_s is not None else "")
        )
        meta = {"cpu": cpu, "threads": args.threads, "prefix": args.prefix, "reps": args.reps, "compile_s": compile_s}
        write_results(Path(args.out), meta, caption, results)


if __name__ == "__main__":
    main()

"""The native attention loop against torch's sdpa, call by call, at the packed row counts a round gives them.

Why: ``attention.NATIVE_MAX_ROWS`` is where the native loop stops and sdpa takes over; this sweep is the evidence
for it. The embedded model's attention shape (3 K/V heads of 64 floats; packed rows = 3 query heads per K/V head x
round rows) over a static buffer of ``keys`` + 100 slots: the cached keys and a causal block of the round's rows
visible, the spare slots hidden. Both kernels get the same inputs as in a forward (``native.attention`` on the
packed rows, sdpa on the same rows with the mask tiled per query head) and alternate call by call; the lower
quartile of each is printed, with the largest difference between their outputs.

    python benchmarks/attention_kernels.py --out benchmarks/results/attention_kernels
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine_limits import cpu_description  # noqa: E402
from benchmarks.tables import write_results  # noqa: E402
from lp_runner import native  # noqa: E402
from lp_runner.loading import default_cache_dir  # noqa: E402


def _time_kernels(query, key, value, mask, groups: int, scale: float, calls: int) -> tuple[dict[str, float], float]:
    """Lower-quartile seconds of each kernel over ``calls`` interleaved calls, and their outputs' largest difference."""
    tiled = mask.repeat(groups, 1)[None, None]  # packed row r reads round row r % Q, as packed_gqa_sdpa tiles it
    kernels = {
        "native": lambda: native.attention(query, key, value, mask, scale),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
            query[None], key[None], value[None], attn_mask=tiled, scale=scale
        )[0],
    }
    times: dict[str, list[float]] = {name: [] for name in kernels}
    outputs = {}
    with torch.inference_mode():
        for call in range(calls + 10):
            for name, kernel in kernels.items():
                start = time.perf_counter()
                outputs[name] = kernel()
                elapsed = time.perf_counter() - start
                if call >= 10:  # the first calls warm caches and allocators
                    times[name].append(elapsed)
    quartile = {name: sorted(t)[len(t) // 4] for name, t in times.items()}
    return quartile, float((outputs["native"] - outputs["sdpa"]).abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keys", type=int, nargs="+", default=[300, 1000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="round rows (x 3 packed)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default="", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native.load(default_cache_dir())
    heads, groups, dim, hidden = 3, 3, 64, torch.finfo(torch.float32).min
    gen = torch.Generator().manual_seed(0)
    results = []
    for keys in args.keys:
        capacity = keys + 100
        key, value = (torch.randn(1, heads, capacity, dim, generator=gen)[0] for _ in range(2))
        for rows in args.rows:
            query = torch.randn(heads, groups * rows, dim, generator=gen)
            mask = torch.full((rows, capacity), hidden)
            mask[:, :keys] = 0.0
            causal = torch.ones(rows, rows, dtype=torch.bool).tril()
            mask[:, keys : keys + rows] = torch.where(causal, 0.0, hidden)
            quartile, diff = _time_kernels(query, key, value, mask, groups, dim**-0.5, args.calls)
            row = {
                "keys": keys,
                "round rows": rows,
                "packed rows": groups * rows,
                "us native": round(1e6 * quartile["native"], 1),
                "us sdpa": round(1e6 * quartile["sdpa"], 1),
                "native / sdpa": round(quartile["native"] / quartile["sdpa"], 2),
                "max |diff|": diff,
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        cpu = cpu_description()
        caption = f"{cpu}, {args.threads} threads, lower quartile of {args.calls} calls each, interleaved"
        write_results(Path(args.out), {"cpu": cpu, "threads": args.threads, "calls": args.calls}, caption, results)


if __name__ == "__main__":
    main()

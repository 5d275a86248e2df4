"""The native attention loop against torch's sdpa, call by call, at the packed row counts a round gives them.

Why: ``attention.NATIVE_MAX_ROWS`` is where the native loop stops and sdpa takes over; this sweep is the evidence
for it. The embedded model's attention shape (3 K/V heads of 64 floats; packed rows = 3 query heads per K/V head x
round rows) over a static buffer of ``keys`` + 100 slots: the cached keys and a causal block of the round's rows
visible, the spare slots hidden. Both kernels get the same inputs as in a forward (``native.attention`` on the
packed rows, sdpa on the same rows with the mask tiled per query head) and alternate call by call; the lower
quartile of each is printed, with the largest difference between their outputs.

    python benchmarks/attention_kernels.py --out benchmarks/results/attention_kernels
    git archive REV lp_runner/backends/cpu/csrc | tar -x -C /tmp/old
    python benchmarks/attention_kernels.py --baseline /tmp/old/lp_runner/backends/cpu/csrc --out ...   # "native@base"
    # (a revision before the kernels were split by file: git show REV:lp_runner/backends/cpu/native_gemm.c > /tmp/old.c)
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
from benchmarks.native_isa import compile_source  # noqa: E402
from benchmarks.tables import write_results  # noqa: E402
from lp_runner.backends.cpu import native  # noqa: E402
from lp_runner.models.loading import default_cache_dir  # noqa: E402


def _time_kernels(
    query, key, value, mask, groups: int, scale: float, calls: int, libs: dict
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Lower-quartile seconds of each kernel over ``calls`` interleaved calls, and each kernel's last output.

    ``libs``: the native builds by name ("native", and "native@base" with ``--baseline``), each routed in before
    its calls are timed. The order rotates call by call, so that no kernel always runs in the caches another left."""
    tiled = mask.repeat(groups, 1)[None, None]  # packed row r reads round row r % Q, as round_mask tiles it
    kernels = {name: (lib, lambda: native.attention(query, key, value, mask, scale)) for name, lib in libs.items()}
    kernels["sdpa"] = (
        None,
        lambda: torch.nn.functional.scaled_dot_product_attention(
            query[None], key[None], value[None], attn_mask=tiled, scale=scale
        )[0],
    )
    times: dict[str, list[float]] = {name: [] for name in kernels}
    outputs = {}
    with torch.inference_mode():
        names = list(kernels)
        for call in range(calls + 10):
            for name in names[call % len(names) :] + names[: call % len(names)]:  # rotating: none always follows sdpa
                lib, kernel = kernels[name]
                if lib is not None:
                    native.route(lib)
                start = time.perf_counter()
                outputs[name] = kernel()
                elapsed = time.perf_counter() - start
                if call >= 10:  # the first calls warm caches and allocators
                    times[name].append(elapsed)
    native.route(libs["native"])
    quartile = {name: sorted(t)[len(t) // 4] for name, t in times.items()}
    return quartile, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keys", type=int, nargs="+", default=[300, 1000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="round rows (x 3 packed)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument(
        "--baseline", default="", help="another version of the kernels (csrc or native_gemm.c), as native@base"
    )
    ap.add_argument("--out", default="", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    libs = {"native": native.library(str(default_cache_dir()), native.extra_flags())}
    if args.baseline:
        libs["native@base"] = compile_source(Path(args.baseline), native.extra_flags())
    native.route(libs["native"])
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
            quartile, outputs = _time_kernels(query, key, value, mask, groups, dim**-0.5, args.calls, libs)
            row = {
                "keys": keys,
                "round rows": rows,
                "packed rows": groups * rows,
                "us native": round(1e6 * quartile["native"], 1),
                "us sdpa": round(1e6 * quartile["sdpa"], 1),
                "native / sdpa": round(quartile["native"] / quartile["sdpa"], 2),
                "max |diff|": float((outputs["native"] - outputs["sdpa"]).abs().max()),
            }
            if args.baseline:
                row["us native@base"] = round(1e6 * quartile["native@base"], 1)
                row["base / native"] = round(quartile["native@base"] / quartile["native"], 2)
                row["bits = base"] = bool(torch.equal(outputs["native"], outputs["native@base"]))
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        cpu = cpu_description()
        caption = f"{cpu}, {args.threads} threads, lower quartile of {args.calls} calls each, interleaved"
        write_results(Path(args.out), {"cpu": cpu, "threads": args.threads, "calls": args.calls}, caption, results)


if __name__ == "__main__":
    main()

"""The native forward on float32 weights against the same forward on bfloat16-stored weights, side by side.

``model.backend=native-bf16`` stores the linear weights as bfloat16 and multiplies in float32 (the model with
its linear weights rounded, exactly). A one-row forward is bound by streaming the weights, so half the bytes
should make it up to about twice as fast; a forward of many rows is bound by arithmetic, which is unchanged,
plus one integer op per weight vector to widen. This measures both, per row count, in one process: the two
forwards alternate at every repetition (a drifting host moves both alike), and each forward is also paired
with a memory copy timed right before it (``machine_limits.paired_ratios``), against the bytes that
forward must read (the bfloat16 one: its linear weights at 2 bytes).

    python benchmarks/weight_storage.py --rows 1 2 4 8 16 --out benchmarks/results/weight_storage
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.forward_timing import prefilled_caches  # noqa: E402
from benchmarks.machine_limits import cpu_description, forward_bytes, paired_ratios  # noqa: E402
from lp_runner.backends.adapter import ModelAdapter  # noqa: E402
from lp_runner.backends.cpu import native  # noqa: E402
from lp_runner.backends.cpu.prepack import KERNELS, native_unavailable_reason, prepack_linears  # noqa: E402
from lp_runner.backends.staging import Rows  # noqa: E402
from lp_runner.models.fetch import fetch_embedded_model  # noqa: E402
from lp_runner.models.loading import default_cache_dir, embedded_model_dir, load_model_and_tokenizer  # noqa: E402

STORAGES = {"float32": ("native", 0), "bfloat16": ("native-bf16", 2)}  # name -> (kernel key, weight bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--prefix", type=int, default=300, help="cached K/V positions before each forward")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fetch_embedded_model()
    stock, _, _ = load_model_and_tokenizer(embedded_model_dir())
    for storage in (torch.float32, torch.bfloat16):  # builds and loads the kernel
        if reason := native_unavailable_reason(stock, default_cache_dir(), storage):
            raise SystemExit(f"native product on {storage} weights unavailable: {reason}")
    adapters = {}
    for name, (kernel, _) in STORAGES.items():
        model = copy.deepcopy(stock)
        prepack_linears(model, kernel=KERNELS[kernel])
        adapters[name] = ModelAdapter(model)
        print(f"{name}: {adapters[name].backend.kernels}", file=sys.stderr, flush=True)
    rows = sorted({1, *args.rows})
    kv = args.prefix
    caches = prefilled_caches(adapters, kv, kv + max(rows), torch.Generator().manual_seed(0))

    def forward(name: str, q: int) -> None:
        vis = torch.ones(q, q, dtype=torch.bool).tril()
        adapters[name].run(
            [Rows.of(torch.arange(q), torch.arange(kv, kv + q), vis, torch.tensor([q - 1]))], [caches[name]]
        )
        caches[name].crop(kv)

    times: dict[tuple[str, int], list[float]] = {(n, q): [] for n in adapters for q in rows}
    with torch.inference_mode():
        for q in rows:  # warm every shape
            for name in adapters:
                forward(name, q)
        for _ in range(args.reps):  # alternate storages and row counts within every repetition
            for q in rows:
                for name in adapters:
                    start = time.perf_counter()
                    forward(name, q)
                    times[(name, q)].append(time.perf_counter() - start)
        paired = {
            (name, q): statistics.median(
                r.memory
                for r in paired_ratios(
                    lambda name=name, q=q: forward(name, q),
                    forward_bytes(stock, kv, STORAGES[name][1]),
                    adapters[name].device,
                    reps=max(5, args.reps // 2),
                )
            )
            for q in rows
            for name in adapters
        }
    ms = {key: 1e3 * statistics.median(v) for key, v in times.items()}
    table = []
    for q in rows:
        f32, bf16 = ms[("float32", q)], ms[("bfloat16", q)]
        table.append(
            {
                "rows": q,
                "float32_ms": round(f32, 2),
                "bfloat16_ms": round(bf16, 2),
                "float32_over_bfloat16": round(f32 / bf16, 2),
                "float32_x_one_row": round(f32 / ms[("float32", 1)], 2),
                "bfloat16_x_one_row": round(bf16 / ms[("bfloat16", 1)], 2),
                "float32_x_memory_limit_paired": round(paired[("float32", q)], 2),
                "bfloat16_x_memory_limit_paired": round(paired[("bfloat16", q)], 2),
            }
        )
    report = {
        "date": str(date.today()),
        "cpu": cpu_description(),
        "threads": args.threads,
        "prefix": kv,
        "reps": args.reps,
        "weights_mb": {name: round(forward_bytes(stock, 0, size) / 1e6, 1) for name, (_, size) in STORAGES.items()},
        "kernels": {name: adapter.backend.kernels for name, adapter in adapters.items()},
        "native_build": native.build_id(),  # the library's hashed name (source, compiler, CPU, flags)
        "native_flags": " ".join(native.extra_flags()),  # $LP_RUNNER_NATIVE_CFLAGS: another ISA's tile
        "rows": table,
    }
    md = [
        f"{report['date']}, CPU {report['cpu']}, {args.threads} threads, embedded model, K/V {kv}, median of "
        f"{args.reps} alternating forwards (head on the last row), native build {report['native_build']}"
        + (f" (extra flags {report['native_flags']})" if report["native_flags"] else "")
        + "; weights read per forward: "
        f"{report['weights_mb']['float32']} MB float32, {report['weights_mb']['bfloat16']} MB bfloat16-stored.",
        "",
        "| rows | float32 ms | bf16 weights ms | float32 / bf16 | float32 x one row | bf16 x one row "
        "| float32 x memory limit (paired) | bf16 x memory limit (paired) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        md.append(
            f"| {r['rows']} | {r['float32_ms']} | {r['bfloat16_ms']} | **{r['float32_over_bfloat16']}x** "
            f"| {r['float32_x_one_row']}x | {r['bfloat16_x_one_row']}x | {r['float32_x_memory_limit_paired']} "
            f"| {r['bfloat16_x_memory_limit_paired']} |"
        )
    print("\n".join(md))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        out.with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()

"""The model's linear layers alone: torch's ``linear`` against oneDNN-prepacked products (``model.backend``).

Every ``nn.Linear`` of the model, in forward order (weights far larger than the caches, as in a real forward),
run at each row count with torch's ``linear`` on the original weights and with ``PackedLinear`` on a prepacked
copy, interleaved pass by pass; the median pass in ms and the weights' bytes over it in GB/s (the memory-bound
floor of a forward is those bytes over the machine's bandwidth: ``benchmarks/machine_limits.py``).

    python benchmarks/linear_kernels.py --out benchmarks/results/linear_kernels
    python benchmarks/linear_kernels.py --native --rows 1 2 3 4 6 8 --out benchmarks/results/linear_kernels_native

``--native`` adds a third kernel, lp_runner's native product (``lp_runner/backends/cpu/csrc/gemm.c``, ``model.backend:
native``), on its own packed copy.
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

from benchmarks.machine_limits import cpu_description  # noqa: E402
from lp_runner.backends.cpu.prepack import NATIVE_KERNEL, PackedLinear, native_unavailable_reason, prepack_linears  # noqa: E402
from lp_runner.models.loading import default_cache_dir, load_model_and_tokenizer, resolve_model_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--native", action="store_true", help="also benchmarks/native_gemv.c (rows <= 8, float32)")
    ap.add_argument("--out", default="", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _, folder = load_model_and_tokenizer(resolve_model_path(args.model), dtype=args.dtype)
    stock = [m for m in model.modules() if type(m) is torch.nn.Linear]
    packed_model = copy.deepcopy(model)
    prepack_linears(packed_model, fuse=False)  # layer by layer, as torch runs them (fusing: forward_paths.py)
    packed = [m for m in packed_model.modules() if isinstance(m, PackedLinear)]  # oneDNN (the default kernel)
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in stock)
    kernels = {
        "torch": lambda xs: [torch.nn.functional.linear(xs[m.in_features], m.weight, m.bias) for m in stock],
        "prepacked": lambda xs: [m(xs[m.in_features]) for m in packed],
    }
    if args.native:
        reason = native_unavailable_reason(model, default_cache_dir())
        if reason is not None:
            raise SystemExit(f"--native: {reason}")
        native_model = copy.deepcopy(model)
        prepack_linears(native_model, fuse=False, kernel=NATIVE_KERNEL)
        native_layers = [m for m in native_model.modules() if isinstance(m, PackedLinear)]
        kernels["native"] = lambda xs: [m(xs[m.in_features]) for m in native_layers]
    results = []
    with torch.inference_mode():
        for rows in args.rows:
            xs = {m.in_features: torch.randn(rows, m.in_features, dtype=model.dtype) for m in stock}
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for rep in range(args.reps + 1):
                names = list(kernels)
                for name in names[rep % len(names) :] + names[: rep % len(names)]:  # rotate who goes first
                    start = time.perf_counter()
                    kernels[name](xs)
                    if rep:  # the first pass warms allocators and kernels
                        times[name].append(time.perf_counter() - start)
            ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            row = {"rows": rows, **{f"ms_{n}": round(v, 2) for n, v in ms.items()}}
            row |= {f"gb_s_{n}": round(weight_bytes / (v / 1e3) / 1e9, 1) for n, v in ms.items()}
            row["prepacked_over_torch"] = round(ms["prepacked"] / ms["torch"], 3)
            if "native" in ms:
                row["native_over_prepacked"] = round(ms["native"] / ms["prepacked"], 3)
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        cpu = cpu_description()
        meta = {
            "date": date.today().isoformat(),
            "model": str(folder),
            "cpu": cpu,
            "dtype": args.dtype,
            "threads": args.threads,
            "linear_layers": len(stock),
            "weights_mb": round(weight_bytes / 1e6, 1),
            "reps": args.reps,
            "results": results,
        }
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(meta, indent=2))
        md = [
            f"{meta['date']}, {cpu}, {args.threads} threads, {args.dtype}: the model's {len(stock)} linear layers "
            f"({meta['weights_mb']} MB), median pass of {args.reps}, kernels interleaved",
            "",
            "| rows | ms torch linear | ms prepacked | prepacked / torch | GB/s torch | GB/s prepacked |"
            + (" ms native | native / prepacked | GB/s native |" if args.native else ""),
            "|---|---|---|---|---|---|" + ("---|---|---|" if args.native else ""),
        ]
        md += [
            f"| {r['rows']} | {r['ms_torch']} | {r['ms_prepacked']} | {r['prepacked_over_torch']} "
            f"| {r['gb_s_torch']} | {r['gb_s_prepacked']} |"
            + (f" {r['ms_native']} | {r['native_over_prepacked']} | {r['gb_s_native']} |" if args.native else "")
            for r in results
        ]
        out.with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()

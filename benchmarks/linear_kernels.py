"""The model's linear layers alone: torch's ``linear`` against oneDNN-prepacked products (``model.prepack``).

Every ``nn.Linear`` of the model, in forward order (weights far larger than the caches, as in a real forward),
run at each row count with torch's ``linear`` on the original weights and with ``PackedLinear`` on a prepacked
copy, interleaved pass by pass; the median pass in ms and the weights' bytes over it in GB/s (the memory-bound
floor of a forward is those bytes over the machine's bandwidth: ``benchmarks/machine_limits.py``).

    python benchmarks/linear_kernels.py --out benchmarks/results/linear_kernels
    python benchmarks/linear_kernels.py --native --rows 1 2 3 4 6 8 --out benchmarks/results/linear_kernels_native

``--native`` adds a third kernel, ``benchmarks/native_gemv.c`` (a plain C GEMV for up to 8 rows, on the
original weights), compiled here with gcc: a measurement of how far from the memory-bound limit the products
of a few-row forward could get on this CPU, not a kernel lp_runner uses.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lp_runner.calibrate import device_name  # noqa: E402
from lp_runner.loading import load_model_and_tokenizer, resolve_model_path  # noqa: E402
from lp_runner.prepack import PackedLinear, prepack_linears  # noqa: E402


def native_gemv(threads: int):
    """``benchmarks/native_gemv.c`` compiled (gcc -O3 -march=native -fopenmp) and loaded: a function of (x, linear)
    -> x @ linear.weight.T (+ bias), for 1-8 rows of float32."""
    source = Path(__file__).with_name("native_gemv.c")
    lib_path = Path(tempfile.mkdtemp(prefix="lp_gemv_")) / "native_gemv.so"
    cmd = ["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(source), "-o", str(lib_path)]
    subprocess.run(cmd, check=True)
    fn = ctypes.CDLL(str(lib_path)).lp_gemv_f32
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4

    def product(x: torch.Tensor, m: torch.nn.Linear) -> torch.Tensor:
        y = torch.empty(x.shape[0], m.out_features, dtype=x.dtype)
        bias = None if m.bias is None else m.bias.data_ptr()
        if fn(
            x.data_ptr(), m.weight.data_ptr(), bias, y.data_ptr(), x.shape[0], m.out_features, m.in_features, threads
        ):
            raise ValueError(f"native_gemv takes 1-8 rows, not {x.shape[0]}")
        return y

    return product


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
    packed = [m for m in packed_model.modules() if isinstance(m, PackedLinear)]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in stock)
    kernels = {
        "torch": lambda xs: [torch.nn.functional.linear(xs[m.in_features], m.weight, m.bias) for m in stock],
        "prepacked": lambda xs: [m(xs[m.in_features]) for m in packed],
    }
    if args.native:
        native = native_gemv(args.threads)
        kernels["native"] = lambda xs: [native(xs[m.in_features], m) for m in stock]
        with torch.inference_mode():  # the same products as torch's, up to summation order
            for m in stock[:7]:
                x = torch.randn(3, m.in_features, dtype=model.dtype)
                torch.testing.assert_close(
                    native(x, m), torch.nn.functional.linear(x, m.weight, m.bias), atol=1e-4, rtol=1e-4
                )
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
        cpu = device_name(torch.device("cpu"))
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

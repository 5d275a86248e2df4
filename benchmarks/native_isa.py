"""The native kernels built for other instruction sets, on this CPU, side by side: does the speed travel?

``lp_runner/backends/cpu/csrc/`` picks its register tile by instruction set (AVX-512, AVX2, 4-float vectors). An
AVX-512 machine can build and run the other two (``-mno-avx512f``; ``-march=x86-64``: SSE2, no FMA), so the
tiles every user's CPU gets are measured here, against the build this CPU takes by default, in one process:
each build's library is loaded next to the others and swapped in round by round (rotating order).

- products: every linear of the embedded model (random weights of its shapes, packed), one pass in forward
  order, at each row count: the median ms, and the weights' bytes over it in GB/s;
- forwards: the embedded model's whole eager round (native decoder layers, the model loop) after a cached
  prefix, at each row count: the median ms and, where 1 is among the row counts, each build's price of a row
  count in its own one-row forwards (row counts interleaved too); the logits compared with the default build's
  (bit for bit for the builds with FMA).

    python benchmarks/native_isa.py --out benchmarks/results/native_isa
    git archive REV lp_runner/backends/cpu/csrc | tar -x -C /tmp/old   # a revision before the split:
    #   git show REV:lp_runner/backends/cpu/native_gemm.c > /tmp/old.c, and --baseline /tmp/old.c
    python benchmarks/native_isa.py --baseline /tmp/old/lp_runner/backends/cpu/csrc --out ...   # "NAME@base" builds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the builds the ISA tests cover

from helpers import stand_in_builds  # noqa: E402

from benchmarks.forward_timing import native_embedded_model, prefilled_caches  # noqa: E402
from benchmarks.machine_limits import cpu_description  # noqa: E402
from lp_runner.backends.adapter import ModelAdapter, causal  # noqa: E402
from lp_runner.backends.cpu import native  # noqa: E402
from lp_runner.backends.staging import Rows  # noqa: E402
from lp_runner.models.loading import default_cache_dir  # noqa: E402


def compile_source(source: Path, flags: tuple[str, ...]):
    """Another version of the kernels' sources (``--baseline``: a ``csrc`` folder, or the single C file of a revision
    before the split), built as lp_runner builds its own, loaded."""
    root = Path(tempfile.mkdtemp(prefix="lp_isa_"))
    return native.open_library(native.build(root, flags, native.sources_at(source)))


def time_products(libs: dict, shapes: list[tuple[int, int]], rows: list[int], reps: int, threads: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    packed = [(native.pack(torch.randn(o, i, generator=gen)), o, i) for o, i in shapes]
    weight_bytes = sum(p.numel() * 4 for p, _, _ in packed)
    table = []
    for r in rows:
        xs = {i: torch.randn(r, i, generator=gen) for i in {i for _, i in shapes}}
        outs = {o: torch.empty(r, o) for o in {o for o, _ in shapes}}
        times: dict[str, list[float]] = {name: [] for name in libs}
        names = list(libs)
        for rep in range(reps + 1):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                fn = libs[name].lp_native_gemm_f32
                start = time.perf_counter()
                for p, o, i in packed:
                    fn(xs[i].data_ptr(), p.data_ptr(), None, outs[o].data_ptr(), r, o, i, threads)
                if rep:
                    times[name].append(time.perf_counter() - start)
        row = {"rows": r}
        for name, t in times.items():
            ms = 1e3 * statistics.median(t)
            row[f"ms {name}"] = round(ms, 2)
            row[f"GB/s {name}"] = round(weight_bytes / ms / 1e6, 1)
        table.append(row)
        print(json.dumps(row), flush=True)
    return table


def time_forwards(libs: dict, model: torch.nn.Module, rows: list[int], reps: int, prefix: int) -> list[dict]:
    """Each build's whole forward at each row count: row counts and builds both interleaved within every pass
    (rotating orders), so the ratios between builds and between row counts are each measured side by side. The
    first build is the reference the others are compared with (the default build where it is among them)."""
    gen = torch.Generator().manual_seed(1)
    adapter = ModelAdapter(model)
    names = list(libs)
    ref = names[0]
    native.route(libs[ref])
    cache = prefilled_caches({"a": adapter}, prefix, prefix + max(rows) + 1, gen)["a"]
    ids = {r: torch.randint(0, adapter.vocab_size, (r,), generator=gen) for r in rows}
    times: dict[tuple[str, int], list[float]] = {(name, r): [] for name in names for r in rows}
    logits = {}
    for rep in range(reps + 1):
        for r in rows[rep % len(rows) :] + rows[: rep % len(rows)]:
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                native.route(libs[name])
                start = time.perf_counter()
                last = torch.arange(r) if prefix else torch.tensor([r - 1])  # a prefill: its last row's logits
                logits[name, r] = adapter.run(
                    [Rows.of(ids[r], torch.arange(prefix, prefix + r), causal(r), last)], [cache]
                )
                elapsed = time.perf_counter() - start
                cache.crop(prefix)
                if rep:
                    times[name, r].append(elapsed)
    native.route(libs[ref])
    table = []
    for r in rows:
        row = {"rows": r, **{f"ms {n}": round(1e3 * statistics.median(times[n, r]), 2) for n in names}}
        if 1 in rows:
            for n in names:  # the row count's price in that build's own one-row forwards
                row[f"{n} x one row"] = round(statistics.median(times[n, r]) / statistics.median(times[n, 1]), 2)
        for name in names[1:]:
            row[f"ms {name} / {ref}"] = round(row[f"ms {name}"] / row[f"ms {ref}"], 2)
            row[f"{name} bits equal"] = torch.equal(logits[name, r], logits[ref, r])
            row[f"max |logit {name} - {ref}|"] = float((logits[name, r] - logits[ref, r]).abs().max())
        table.append(row)
        print(json.dumps(row), flush=True)
    return table


def same(row: dict, name: str, ref: str) -> str:
    """'bits' where build ``name``'s logits equal the reference build's, else their largest difference."""
    if row[f"{name} bits equal"]:
        return "bits"
    return f"{row[f'max |logit {name} - {ref}|']:.1e}"


def markdown(result: dict) -> str:
    lines = [
        f"# Native kernels per instruction set, {result['date']}",
        "",
        f"{result['device']}, {result['threads']} threads, fp32, the embedded model. Builds: "
        + ", ".join(f"`{n}` ({' '.join(f) or '-march=native'})" for n, f in result["builds"].items())
        + f". Median of {result['reps']} passes, builds interleaved."
        + (f" `@base`: the same builds of `{result['baseline']}`." if result["baseline"] else ""),
        "",
        "## Products (every linear of the model, one pass)",
        "",
    ]
    names = list(result["builds"])
    ref = names[0]
    lines += ["| rows | " + " | ".join(f"{n} ms (GB/s)" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for row in result["products"]:
        cells = [f"{row[f'ms {n}']} ({row[f'GB/s {n}']})" for n in names]
        lines.append(f"| {row['rows']} | " + " | ".join(cells) + " |")
    lines += ["", "## Forwards (native decoder layers, the model loop)", ""]
    per_row = f"{names[0]} x one row" in result["forwards"][0]
    lines += [
        "| rows | "
        + " | ".join(f"{n} ms" for n in names)
        + "".join(f" | {n} x one row" for n in names if per_row)
        + "".join(f" | {n} / {ref}" for n in names[1:])
        + f" | logits equal to {ref} |",
        "|---" * ((3 if per_row else 2) * len(names) + 1) + "|",
    ]
    for row in result["forwards"]:
        equal = ", ".join(f"{n}: {same(row, n, ref)}" for n in names[1:])
        lines.append(
            f"| {row['rows']} | "
            + " | ".join(str(row[f"ms {n}"]) for n in names)
            + "".join(f" | {row[f'{n} x one row']}x" for n in names if per_row)
            + "".join(f" | {row[f'ms {n} / {ref}']}x" for n in names[1:])
            + f" | {equal} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prefix", type=int, default=256, help="cached tokens before each round (0: prefills)")
    ap.add_argument("--builds", nargs="+", help="a subset of default, avx2, x86-64 (default: those this CPU can run)")
    ap.add_argument(
        "--baseline",
        type=Path,
        help="another version of the kernels (a csrc folder or an old native_gemm.c), NAME@base",
    )
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    model = native_embedded_model(args.threads)
    builds = {"default": ()} | {name: flags for name, (flags, _) in stand_in_builds().items()}
    if args.builds:
        builds = {n: builds[n] for n in args.builds}
    root = str(default_cache_dir())
    libs = {name: native.library(root, flags) for name, flags in builds.items()}
    if args.baseline:
        for name, flags in list(builds.items()):
            libs[f"{name}@base"] = compile_source(args.baseline, flags)
            builds[f"{name}@base"] = flags
    cfg = model.config  # the products of a layer (q/k/v and gate/up stacked, as packed) and the output layer
    e, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * d
    shapes = [(e + 2 * kv, e), (e, e), (2 * i, e), (e, i)] * cfg.num_hidden_layers + [(cfg.vocab_size, e)]
    result = {
        "date": str(date.today()),
        "device": cpu_description(),
        "threads": args.threads,
        "reps": args.reps,
        "builds": {n: list(f) for n, f in builds.items()},
        "baseline": str(args.baseline or ""),
        "products": time_products(libs, shapes, args.rows, args.reps, args.threads),
        "forwards": time_forwards(libs, model, args.rows, args.reps, args.prefix),
    }
    text = markdown(result)
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
        Path(args.out + ".md").write_text(text)


if __name__ == "__main__":
    main()

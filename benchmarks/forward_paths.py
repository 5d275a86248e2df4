"""One target forward through the adapter on transformers' own paths versus lp_runner's two replacements.

Variants of ``ModelAdapter`` on one model, each with its own cache holding the same prefix:

* ``transformers``: ``DynamicCache`` (concatenates every layer's whole K/V on each forward) and transformers'
  sdpa attention (repeats every cached K/V head per query head when a mask and several rows are given);
* ``append``: the append-buffer cache (``lp_runner.backends.adapter.AppendBufferLayer``), transformers' sdpa;
* ``append+packed``: the append buffer and packed GQA attention (``lp_runner.backends.attention``);
* ``prepacked-unfused``: that, with every linear layer prepacked for oneDNN on its own (``backends.cpu.prepack``,
  a copy of the model);
* ``prepacked``: that, with sibling projections (q/k/v, gate/up) fused into one product each (another copy):
  oneDNN's products, as ``apply_prepack(model, "onednn")`` packs them;
* ``native``: the same fused layers on lp_runner's native product (``lp_runner.backends.cpu.native``; another copy), as
  ``model.backend: native`` runs them (``auto`` takes whichever of the two it measures faster);
* ``prepacked compiled`` and ``native compiled`` (with ``--compiled``): those forwards through ``model.compile:
  on`` (torch.compile with dynamic shapes on a static cache; compiled once before timing, the compile time
  printed).

For every (prefix, rows) the variants alternate forward by forward (order rotated each repetition), so the
printed ratios are measured side by side; each forward is cropped back to the prefix, as a rejected round is.

    python benchmarks/forward_paths.py --out benchmarks/results/forward_paths    # embedded model, 2 threads
    python benchmarks/forward_paths.py --prefix 100 300 600 --rows 1 2 3 8 --reps 40
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine_limits import cpu_description  # noqa: E402
from lp_runner.backends.adapter import ModelAdapter, crop  # noqa: E402
from lp_runner.backends.cpu.prepack import NATIVE_KERNEL, native_unavailable_reason, prepack_linears  # noqa: E402
from lp_runner.models.loading import default_cache_dir, load_model_and_tokenizer, resolve_model_path  # noqa: E402

VARIANTS = {
    "transformers": dict(append_buffer=False, packed_gqa=False),
    "append": dict(append_buffer=True, packed_gqa=False),
    "append+packed": dict(append_buffer=True, packed_gqa=True),
    "prepacked-unfused": dict(append_buffer=True, packed_gqa=True),  # on the unfused prepacked copy
    "prepacked": dict(append_buffer=True, packed_gqa=True),  # on the prepacked copy, siblings fused
    "native": dict(append_buffer=True, packed_gqa=True),  # on the native copy, siblings fused
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, nargs="+", default=[100, 300, 600])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="", help="write OUT.json and OUT.md")
    ap.add_argument("--compiled", action="store_true", help="add the prepacked forward compiled (model.compile)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _, folder = load_model_and_tokenizer(resolve_model_path(args.model), dtype="float32")
    copies = {name: copy.deepcopy(model) for name in ("prepacked-unfused", "prepacked", "native")}
    prepack_linears(copies["prepacked-unfused"], fuse=False)
    prepack_linears(copies["prepacked"])
    reason = native_unavailable_reason(model, default_cache_dir())
    if reason is not None:
        raise SystemExit(f"the native product is unavailable here: {reason}")
    prepack_linears(copies["native"], kernel=NATIVE_KERNEL)
    variants = dict(VARIANTS)
    if args.compiled:
        for name in ("prepacked", "native"):  # the same packed weights, compiled
            variants[f"{name} compiled"] = dict(compile=True)
            copies[f"{name} compiled"] = copies[name]
    adapters = {name: ModelAdapter(copies.get(name, model), **kw) for name, kw in variants.items()}
    capacity = max(args.prefix) + max(args.rows) + 64
    for name, adapter in adapters.items():
        if adapter.compiled:
            print(f"{name}: compiled in {adapter.warm_up(capacity):.1f} s", flush=True)
    gen = torch.Generator().manual_seed(0)
    results = []
    for prefix in args.prefix:
        tokens = torch.randint(0, model.config.vocab_size, (prefix,), generator=gen)
        tril = torch.ones(prefix, prefix, dtype=torch.bool).tril()
        caches = {name: a.new_cache(capacity) for name, a in adapters.items()}
        for name, a in adapters.items():
            a.forward(tokens, torch.arange(prefix), tril, caches[name], torch.tensor([prefix - 1]))
        for q in args.rows:
            ids = torch.randint(0, model.config.vocab_size, (q,), generator=gen)
            vis = torch.ones(q, q, dtype=torch.bool).tril()
            times: dict[str, list[float]] = {name: [] for name in adapters}
            names = list(adapters)
            for rep in range(args.reps + 1):
                k = rep % len(names)
                for name in names[k:] + names[:k]:
                    start = time.perf_counter()
                    adapters[name].forward(ids, torch.arange(prefix, prefix + q), vis, caches[name], torch.arange(q))
                    elapsed = time.perf_counter() - start
                    crop(caches[name], prefix)
                    if rep:  # the first repetition warms allocators and kernels
                        times[name].append(elapsed)
            ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            base = ms["transformers"]
            row = {"prefix": prefix, "rows": q, **{f"ms_{n}": round(v, 2) for n, v in ms.items()}}
            row |= {f"ratio_{n}": round(v / base, 3) for n, v in ms.items() if n != "transformers"}
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        cpu = cpu_description()
        meta = {"model": str(folder), "cpu": cpu, "threads": args.threads, "reps": args.reps, "results": results}
        out.with_suffix(".json").write_text(json.dumps(meta, indent=2))
        others = [n for n in adapters if n != "transformers"]
        md = [
            f"{cpu}, {args.threads} threads, median of {args.reps} forwards per cell, variants interleaved",
            "",
            "| prefix | rows | ms transformers | "
            + " | ".join(f"ms {n}" for n in others)
            + " | "
            + " | ".join(f"{n} / transformers" for n in others)
            + " |",
            "|---|---|---|" + "---|" * (2 * len(others)),
        ]
        md += [
            f"| {r['prefix']} | {r['rows']} | {r['ms_transformers']} | "
            + " | ".join(str(r[f"ms_{n}"]) for n in others)
            + " | "
            + " | ".join(str(r[f"ratio_{n}"]) for n in others)
            + " |"
            for r in results
        ]
        out.with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()

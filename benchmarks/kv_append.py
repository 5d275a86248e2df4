"""One target forward with the adapter's append-buffer K/V cache versus transformers' DynamicCache.

``DynamicCache`` concatenates every layer's whole K/V on each forward; ``lp_runner.model.AppendBufferLayer``
writes only the new rows into spare capacity. Both caches hold the same prefix, and forwards of Q rows through
the same adapter alternate between them (order swapped every repetition), so the printed ratio is measured side
by side. Each forward is cropped back to the prefix, as a rejected round is.

    python benchmarks/kv_append.py                                   # embedded model, 2 threads
    python benchmarks/kv_append.py --prefix 100 300 600 --rows 1 3 8 --out results/kv_append
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

from lp_runner.loading import load_model_and_tokenizer, resolve_model_path  # noqa: E402
from lp_runner.model import ModelAdapter, crop  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, nargs="+", default=[100, 300, 600])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import DynamicCache

    model, _, folder = load_model_and_tokenizer(resolve_model_path(args.model), dtype="float32")
    adapter = ModelAdapter(model)
    gen = torch.Generator().manual_seed(0)
    results = []
    for prefix in args.prefix:
        tokens = torch.randint(0, adapter.vocab_size, (prefix,), generator=gen)
        caches = {"dynamic": DynamicCache(config=model.config), "append": adapter.new_cache()}
        for cache in caches.values():
            tril = torch.ones(prefix, prefix, dtype=torch.bool).tril()
            adapter.forward(tokens, torch.arange(prefix), tril, cache, torch.tensor([prefix - 1]))
        for q in args.rows:
            ids = torch.randint(0, adapter.vocab_size, (q,), generator=gen)
            vis = torch.ones(q, q, dtype=torch.bool).tril()
            times: dict[str, list[float]] = {name: [] for name in caches}
            for rep in range(args.reps + 1):
                order = list(caches) if rep % 2 else list(reversed(caches))
                for name in order:
                    start = time.perf_counter()
                    adapter.forward(ids, torch.arange(prefix, prefix + q), vis, caches[name], torch.arange(q))
                    elapsed = time.perf_counter() - start
                    crop(caches[name], prefix)
                    if rep:  # the first repetition warms allocators and kernels
                        times[name].append(elapsed)
            dyn, app = (statistics.median(times[n]) for n in ("dynamic", "append"))
            row = {
                "prefix": prefix,
                "rows": q,
                "ms_dynamic": round(1e3 * dyn, 2),
                "ms_append": round(1e3 * app, 2),
                "append_over_dynamic": round(app / dyn, 3),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"model": str(folder), "threads": args.threads, "reps": args.reps, "results": results}
        out.with_suffix(".json").write_text(json.dumps(meta, indent=2))
        md = ["| prefix | rows | ms DynamicCache | ms append buffer | ratio |", "|---|---|---|---|---|"]
        md += [
            f"| {r['prefix']} | {r['rows']} | {r['ms_dynamic']} | {r['ms_append']} | {r['append_over_dynamic']} |"
            for r in results
        ]
        out.with_suffix(".md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()

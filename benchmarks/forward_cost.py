"""Cost of one target forward versus packed rows Q (and K/V length), through lp_runner's own adapter.

This is the curve that decides whether lookahead can win on a device: a round of Q rows must buy more tokens
than Q rows cost relative to one. Timings are medians of repeated forwards on a fixed cached prefix, with the
LM head computed for one row (``head=last``) or all rows (``head=all``), as a lookahead round computes it only
for the rows whose logits are used.

    python benchmarks/forward_cost.py --out results/forward_cost            # embedded model, 2 threads
    python benchmarks/forward_cost.py --model /path/to/folder --prefix 300 1000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lp_runner.loading import load_model_and_tokenizer, resolve_model_path  # noqa: E402
from lp_runner.model import ModelAdapter, crop  # noqa: E402

DEFAULT_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 56, 64, 96, 120)


def measure(adapter: ModelAdapter, prefix: int, rows: int, head_rows: int, reps: int) -> float:
    """Median seconds of a forward of ``rows`` new rows after a cached prefix of ``prefix`` tokens."""
    gen = torch.Generator().manual_seed(0)
    vocab = adapter.vocab_size
    cache = adapter.new_cache()
    pre = torch.randint(0, vocab, (prefix,), generator=gen)
    adapter.forward(pre, torch.arange(prefix), torch.ones(prefix, prefix, dtype=torch.bool).tril(), cache, pre[:1] * 0)
    ids = torch.randint(0, vocab, (rows,), generator=gen)
    pos = torch.arange(prefix, prefix + rows)
    vis = torch.ones(rows, rows, dtype=torch.bool).tril()  # [Q, Q]
    logit_rows = torch.arange(rows - head_rows, rows)  # [R]
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        logits = adapter.forward(ids, pos, vis, cache, logit_rows)
        logits[0, 0].item()  # synchronise (CUDA); a no-op on CPU
        times.append(time.perf_counter() - start)
        crop(cache, prefix)
    times = sorted(times[1:])  # drop the first (allocator warm-up)
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, nargs="+", default=[300])
    ap.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="results/forward_cost")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _, folder = load_model_and_tokenizer(resolve_model_path(args.model), dtype=args.dtype, device=args.device)
    adapter = ModelAdapter(model)
    curves = []
    for prefix in args.prefix:
        base = measure(adapter, prefix, 1, 1, args.reps)
        for q in args.rows:
            last = measure(adapter, prefix, q, 1, args.reps)
            full = measure(adapter, prefix, q, q, args.reps)
            row = {
                "prefix": prefix,
                "rows": q,
                "ms_head_last": round(1e3 * last, 2),
                "ms_head_all": round(1e3 * full, 2),
            }
            row["ratio_head_all"] = round(full / base, 3)
            curves.append(row)
            print(json.dumps(row), flush=True)
    report = {
        "date": date.today().isoformat(),
        "model": str(folder),
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "x_label": "packed rows Q",
        "y_label": "forward ms",
        "curves": curves,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    md = ["| prefix | rows Q | ms (head on 1 row) | ms (head on all rows) | ratio to Q=1 |", "|---|---|---|---|---|"]
    md += [
        f"| {c['prefix']} | {c['rows']} | {c['ms_head_last']} | {c['ms_head_all']} | {c['ratio_head_all']} |"
        for c in curves
    ]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for prefix in args.prefix:
            pts = [c for c in curves if c["prefix"] == prefix]
            ax.plot([c["rows"] for c in pts], [c["ms_head_all"] for c in pts], marker="o", label=f"prefix {prefix}")
        ax.set_xlabel(report["x_label"])
        ax.set_ylabel(report["y_label"])
        ax.set_title(f"forward cost, {args.dtype}, {args.device}, {args.threads} threads")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()

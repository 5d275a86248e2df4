"""Attention of a packed round: torch's sdpa (``packed_gqa_sdpa``) against lp_runner's native loop
(``native_gqa_attention``), eager and compiled, on the embedded model with native products, side by side.

Four adapters share one model (native products): eager and compiled (``model.compile``), each with either
attention; a fifth runs the compiled native forward with dynamo's guards checked on every round
(``skip_guards=False``: the same graph, no compilation of its own), so the cost of the checks the adapter skips
after a cache's first forward is in the same table. For every row count they alternate forward by forward on a
cached prefix (order rotated each repetition; each forward cropped back), so the printed medians are measured
together; the logits' largest difference from eager sdpa and whether every argmax agrees are printed too.

    python benchmarks/attention_paths.py --out benchmarks/results/attention_paths
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

from benchmarks.tables import write_results  # noqa: E402
from lp_runner.attention import NATIVE_GQA, PACKED_GQA  # noqa: E402
from lp_runner.calibrate import device_name  # noqa: E402
from lp_runner.loading import default_cache_dir, load_model_and_tokenizer, resolve_model_path  # noqa: E402
from lp_runner.model import ModelAdapter, crop  # noqa: E402
from lp_runner.prepack import NATIVE_KERNEL, native_unavailable_reason, prepack_linears  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=300)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _, _ = load_model_and_tokenizer(resolve_model_path("embedded"), dtype="float32")
    reason = native_unavailable_reason(model, default_cache_dir())
    if reason is not None:
        raise SystemExit(f"the native kernel is unavailable here: {reason}")
    prepack_linears(model, kernel=NATIVE_KERNEL)
    capacity = args.prefix + max(args.rows) + 64
    adapters = {}
    for compiled in (False, True):
        for attention in (PACKED_GQA, NATIVE_GQA):
            adapter = ModelAdapter(model, compile=compiled)
            adapter.attention = attention
            name = f"{'compiled' if compiled else 'eager'} {'native' if attention == NATIVE_GQA else 'sdpa'}"
            if compiled:
                print(f"{name}: compiled in {adapter.warm_up(capacity):.1f} s", flush=True)
            adapters[name] = adapter
    checked = ModelAdapter(model, compile=True, skip_guards=False)  # the compiled native graph, guards checked
    print(f"compiled native, guards checked: warm in {checked.warm_up(capacity):.1f} s", flush=True)
    adapters["compiled native guards checked"] = checked
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (args.prefix,), generator=gen)
    tril = torch.ones(args.prefix, args.prefix, dtype=torch.bool).tril()
    caches = {name: a.new_cache(capacity) for name, a in adapters.items()}
    for name, a in adapters.items():
        a.forward(tokens, torch.arange(args.prefix), tril, caches[name], torch.tensor([args.prefix - 1]))
    results = []
    for q in args.rows:
        ids = torch.randint(0, model.config.vocab_size, (q,), generator=gen)
        vis = torch.ones(q, q, dtype=torch.bool).tril()
        positions = torch.arange(args.prefix, args.prefix + q)
        times: dict[str, list[float]] = {name: [] for name in adapters}
        names, logits = list(adapters), {}
        for rep in range(args.reps + 1):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                start = time.perf_counter()
                logits[name] = adapters[name].forward(ids, positions, vis, caches[name], torch.arange(q))
                elapsed = time.perf_counter() - start
                crop(caches[name], args.prefix)
                if rep:
                    times[name].append(elapsed)
        ref = logits["eager sdpa"]
        row = {"rows": q, **{f"ms {n}": round(1e3 * statistics.median(t), 2) for n, t in times.items()}}
        row["max |logit - eager sdpa|"] = max(float((v - ref).abs().max()) for v in logits.values())
        row["argmax agree"] = all(torch.equal(v.argmax(-1), ref.argmax(-1)) for v in logits.values())
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        cpu = device_name(torch.device("cpu"))
        caption = f"{cpu}, {args.threads} threads, K/V {args.prefix}, median of {args.reps} forwards, interleaved"
        meta = {"cpu": cpu, "threads": args.threads, "prefix": args.prefix, "reps": args.reps}
        write_results(Path(args.out), meta, caption, results)


if __name__ == "__main__":
    main()

"""Native decoder layers (``model.native_layers``) against transformers' layers on the same native products,
eager, and against the compiled forward (``model.compile: on``), side by side on the embedded model.

Three adapters share one model (native products): eager with ``native_layers=False`` (transformers' layer code,
static cache), eager with native layers (the default), and compiled (its graph traces transformers' layers). For
every row count they alternate forward by forward on a cached prefix (order rotated each repetition; each forward
cropped back), so the printed medians are measured together; the logits' largest difference from the first
adapter and whether every argmax agrees are printed too.

    python benchmarks/native_layers.py --out benchmarks/results/native_layers
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
from lp_runner.calibrate import device_name  # noqa: E402
from lp_runner.loading import default_cache_dir, load_model_and_tokenizer, resolve_model_path  # noqa: E402
from lp_runner.model import ModelAdapter, causal, crop  # noqa: E402
from lp_runner.prepack import NATIVE_KERNEL, native_unavailable_reason, prepack_linears  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=300)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--no-compile", action="store_true", help="leave out the compiled adapter")
    ap.add_argument("--out", default="", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _, _ = load_model_and_tokenizer(resolve_model_path("embedded"), dtype="float32")
    reason = native_unavailable_reason(model, default_cache_dir())
    if reason is not None:
        raise SystemExit(f"the native kernel is unavailable here: {reason}")
    prepack_linears(model, kernel=NATIVE_KERNEL)
    capacity = args.prefix + max(args.rows) + 64
    adapters = {
        "eager, transformers' layers": ModelAdapter(model, native_layers=False, static_cache=True),
        "eager, native layers": ModelAdapter(model),
    }
    compile_s = None
    if not args.no_compile:
        adapters["compiled"] = ModelAdapter(model, compile=True)
        compile_s = round(adapters["compiled"].warm_up(capacity), 1)
        print(f"compiled in {compile_s} s", flush=True)
    if not adapters["eager, native layers"].native_layers:
        raise SystemExit("the embedded model's layers did not take the native path")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (args.prefix,), generator=gen)
    caches = {name: a.new_cache(capacity) for name, a in adapters.items()}
    for name, a in adapters.items():
        a.forward(tokens, torch.arange(args.prefix), causal(args.prefix), caches[name], torch.tensor([args.prefix - 1]))
    names, first = list(adapters), next(iter(adapters))
    results = []
    for q in args.rows:
        ids = torch.randint(0, model.config.vocab_size, (q,), generator=gen)
        positions = torch.arange(args.prefix, args.prefix + q)
        times: dict[str, list[float]] = {name: [] for name in names}
        logits = {}
        for rep in range(args.reps + 1):  # the first repetition warms every adapter at this row count
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                start = time.perf_counter()
                logits[name] = adapters[name].forward(ids, positions, causal(q), caches[name], torch.arange(q))
                elapsed = time.perf_counter() - start
                crop(caches[name], args.prefix)
                if rep:
                    times[name].append(elapsed)
        row = {"rows": q, **{f"ms {n}": round(1e3 * statistics.median(t), 2) for n, t in times.items()}}
        row[f"max |logit - {first}|"] = max(float((v - logits[first]).abs().max()) for v in logits.values())
        row["argmax agree"] = all(torch.equal(v.argmax(-1), logits[first].argmax(-1)) for v in logits.values())
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        cpu = device_name(torch.device("cpu"))
        caption = (
            f"{cpu}, {args.threads} threads, float32, native products, K/V {args.prefix}, median of {args.reps} "
            f"forwards, interleaved" + (f"; compiled in {compile_s} s" if compile_s is not None else "")
        )
        meta = {"cpu": cpu, "threads": args.threads, "prefix": args.prefix, "reps": args.reps, "compile_s": compile_s}
        write_results(Path(args.out), meta, caption, results)


if __name__ == "__main__":
    main()

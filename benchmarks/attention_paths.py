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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.forward_timing import native_embedded_model, time_row_counts  # noqa: E402
from benchmarks.machine_limits import cpu_description  # noqa: E402
from benchmarks.tables import write_results  # noqa: E402
from lp_runner.backends import detect_backend  # noqa: E402
from lp_runner.backends.adapter import ModelAdapter  # noqa: E402
from lp_runner.backends.attention import PACKED_GQA  # noqa: E402
from lp_runner.backends.cpu.attention import NATIVE_GQA  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=300)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    model = native_embedded_model(args.threads)
    capacity = args.prefix + max(args.rows) + 64
    adapters = {}
    for compiled in (False, True):
        for attention in (PACKED_GQA, NATIVE_GQA):
            # eager: transformers' layers (a native decoder layer always attends with the native loop)
            adapter = ModelAdapter(model, compile=compiled, backend=detect_backend(model).transformers_layers())
            adapter.attention = attention
            name = f"{'compiled' if compiled else 'eager'} {'native' if attention == NATIVE_GQA else 'sdpa'}"
            if compiled:
                print(f"{name}: compiled in {adapter.warm_up(capacity):.1f} s", flush=True)
            adapters[name] = adapter
    checked = ModelAdapter(model, compile=True, skip_guards=False)  # the compiled native graph, guards checked
    print(f"compiled native, guards checked: warm in {checked.warm_up(capacity):.1f} s", flush=True)
    adapters["compiled native guards checked"] = checked
    results = time_row_counts(adapters, args.prefix, capacity, args.rows, args.reps)
    if args.out:
        cpu = cpu_description()
        caption = f"{cpu}, {args.threads} threads, K/V {args.prefix}, median of {args.reps} forwards, interleaved"
        meta = {"cpu": cpu, "threads": args.threads, "prefix": args.prefix, "reps": args.reps}
        write_results(Path(args.out), meta, caption, results)


if __name__ == "__main__":
    main()

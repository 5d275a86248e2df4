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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.forward_timing import native_embedded_model, time_row_counts  # noqa: E402
from benchmarks.machine_limits import cpu_description  # noqa: E402
from benchmarks.tables import write_results  # noqa: E402
from lp_runner.model import ModelAdapter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=300)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--no-compile", action="store_true", help="leave out the compiled adapter")
    ap.add_argument("--out", default="", help="write OUT.json and OUT.md")
    args = ap.parse_args()
    model = native_embedded_model(args.threads)
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
    results = time_row_counts(adapters, args.prefix, capacity, args.rows, args.reps)
    if args.out:
        cpu = cpu_description()
        caption = (
            f"{cpu}, {args.threads} threads, float32, native products, K/V {args.prefix}, median of {args.reps} "
            f"forwards, interleaved" + (f"; compiled in {compile_s} s" if compile_s is not None else "")
        )
        meta = {"cpu": cpu, "threads": args.threads, "prefix": args.prefix, "reps": args.reps, "compile_s": compile_s}
        write_results(Path(args.out), meta, caption, results)


if __name__ == "__main__":
    main()

"""``lp_runner.generate`` at its defaults against HF ``generate`` on the same model and prompt, in one process.

The first API call on a model measures the device's forward-cost curve once (cached on disk for later processes)
and chooses the setting from it and the model's own acceptance table; this times that first call apart, then
alternates API and HF calls (``--trials``) and reports each one's median seconds, their ratio and whether every
output is HF greedy's.

    python benchmarks/api_default.py --out benchmarks/results/api_default     # embedded model, 64 new tokens
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

import lp_runner  # noqa: E402
from benchmarks.machine_limits import cpu_description  # noqa: E402
from lp_runner.models.loading import embedded_model_dir, fetch_embedded_model, load_model_and_tokenizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="def quicksort(arr):")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fetch_embedded_model()
    model, tok, _ = load_model_and_tokenizer(embedded_model_dir(), dtype=torch.float32)
    ids = tok(args.prompt, return_tensors="pt").input_ids  # [1, T]
    model.generate(ids, max_new_tokens=8, do_sample=False)  # HF's warm-up
    start = time.perf_counter()
    first = lp_runner.generate(model, ids, max_new_tokens=args.max_new_tokens)
    first_s = time.perf_counter() - start
    api_s, hf_s, exact = [], [], True
    for _ in range(args.trials):
        start = time.perf_counter()
        out = lp_runner.generate(model, ids, max_new_tokens=args.max_new_tokens)
        api_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        ref = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        hf_s.append(time.perf_counter() - start)
        exact &= torch.equal(out, ref) and torch.equal(first, ref)
    report = {
        "cpu": cpu_description(),
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "first_call_s": round(first_s, 3),
        "api_median_s": round(statistics.median(api_s), 3),
        "hf_median_s": round(statistics.median(hf_s), 3),
        "api_speed_vs_hf": round(statistics.median(hf_s) / statistics.median(api_s), 3),
        "exact": exact,
    }
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

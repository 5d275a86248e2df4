"""Make ``lp_runner/tuning/data/acceptance.json``: the auto preset's shipped statistics (``tuning/preset.py``).

On the calibration prompts (``benchmarks/results/calibration8.jsonl``: HumanEval 8-11 and four MT-bench second
questions, apart from every benchmark prompt), with the embedded SmolLM2-135M-Instruct in fp32:

* ``samples``: each prompt's token ids and the model's greedy output (128 new tokens). The window-off settings
  are simulated on these at start-up.
* ``recorded``: the round shapes of a few Jacobi-window settings, from real runs (window rounds depend on the
  model's own guesses and cannot be simulated). Timing plays no part: shapes depend only on the tokens.

    python benchmarks/record_acceptance.py            # rewrites lp_runner/tuning/data/acceptance.json (a few minutes)
    python benchmarks/record_acceptance.py --add      # keeps the file's samples and settings, records the missing
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lp_runner.backends.adapter import ModelAdapter  # noqa: E402
from lp_runner.config import GenerationConfig, LookaheadConfig  # noqa: E402
from lp_runner.decoding.engine import LookaheadEngine  # noqa: E402
from lp_runner.jobs.prompts import encode, read_prompts  # noqa: E402
from lp_runner.models.loading import load_model_and_tokenizer, resolve_model_path  # noqa: E402
from lp_runner.tuning.costmodel import shapes_from_records  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WINDOW_SETTINGS = {  # name -> (W, N, G); context lookup on, no row cap, pool from prompt and output
    "window-4-4-4": (4, 4, 4),
    "window-7-5-7": (7, 5, 7),
    "window-15-5-15": (15, 5, 15),
    "window-15-7-15": (15, 7, 15),
    # larger windows: what one rank of several could afford on a device whose forward is flat up to a knee
    # (the strong-scaling simulation, ``lp_runner/studies/simulate.py``, reads tokens per forward from these)
    "window-23-6-23": (23, 6, 23),
    "window-31-7-31": (31, 7, 31),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=str(ROOT / "benchmarks/results/calibration8.jsonl"))
    ap.add_argument("--out", default=str(ROOT / "lp_runner/tuning/data/acceptance.json"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--add", action="store_true", help="keep --out's samples and settings; record only the missing")
    args = ap.parse_args()
    kept = json.loads(Path(args.out).read_text()) if args.add else None

    model, tokenizer, _ = load_model_and_tokenizer(resolve_model_path("embedded"), dtype=torch.float32)
    adapter = ModelAdapter(model)
    eos = [tokenizer.eos_token_id]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    specs = read_prompts(args.prompts)
    prompts = [encode(tokenizer, s) for s in specs]

    fast = LookaheadConfig(preset="off", lookahead_branch=False, verification_set_size=1, max_verify_rows=2)
    samples = kept["samples"] if kept else []
    engine = LookaheadEngine(adapter, fast, gen, eos)
    for spec, ids in zip(specs, prompts, strict=True):
        if kept:
            break
        out = engine.generate(ids).output_ids
        samples.append({"id": spec.id, "prompt_ids": ids, "output_ids": out})
        print(f"sample {spec.id}: {len(out)} tokens", file=sys.stderr)

    recorded = kept["recorded"] if kept else []
    for name, (w, n, g) in WINDOW_SETTINGS.items():
        if any(r["name"] == name for r in recorded):
            continue
        la = LookaheadConfig(preset="off", window_size=w, ngram_size=n, verification_set_size=g)
        engine = LookaheadEngine(adapter, la, gen, eos)
        start, shapes = time.perf_counter(), []
        for s, ids in zip(samples, prompts, strict=True):
            res = engine.generate(ids)
            if res.output_ids != s["output_ids"]:
                raise SystemExit(f"{name}: output differs from the greedy sample on {s['id']} (not exact?)")
            shapes.append([list(_row(x)) for x in shapes_from_records(res.stats.records, w)])
        tpf = sum(len(s["output_ids"]) for s in samples) / sum(len(p) for p in shapes)
        print(f"{name}: {tpf:.2f} tokens/forward ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
        recorded.append({"name": name, "lookahead": _lookahead_dict(la), "shapes": shapes})

    data = {
        "format": 1,
        "model": "SmolLM2-135M-Instruct (embedded), fp32, greedy",
        "prompts": Path(args.prompts).name,
        "max_new_tokens": args.max_new_tokens,
        "samples": samples,
        "recorded": recorded,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)


def _row(shape) -> tuple:
    """A RoundShape as the positional list ``preset.prior_from_dict`` reads back."""
    return (
        shape.kv_len,
        shape.ordinary,
        shape.window_size,
        shape.depth,
        list(shape.candidates),
        shape.winner,
        shape.emitted,
    )


def _lookahead_dict(la: LookaheadConfig) -> dict:
    import dataclasses

    return dataclasses.asdict(la)


if __name__ == "__main__":
    main()

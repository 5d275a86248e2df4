"""Record a model's acceptance at LP's windows (``lp_runner.tuning.acceptance``) and write its table.

Counts only: tokens per forward and rows per round do not depend on the machine's speed, so this runs for hours in
the background (``nice``, one thread) and resumes where it stopped (one record per prompt and window in
``OUT/records.jsonl``). Every window's output is checked equal to the prompt's greedy output.

    python benchmarks/record_acceptance.py --model embedded --out benchmarks/results/acceptance/embedded
    python benchmarks/record_acceptance.py --model qwen-coder --out benchmarks/results/acceptance/qwen-coder
    python benchmarks/record_acceptance.py ... --table lp_runner/tuning/data/acceptance/NAME.json   # table only

``--model qwen-coder`` is Qwen2.5-Coder-0.5B-Instruct (``benchmarks/real_model.py`` fetches it); the prompts are
bench16 (HumanEval 0-7 as code, the first MT-bench question of each category as chat) unless ``--prompts`` names
a JSONL file.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lp_runner.tuning.acceptance import (  # noqa: E402
    DEFAULT_WINDOWS,
    PromptToRecord,
    read_records,
    record,
    table,
    threads_of,
)

MODELS = {"embedded": "SmolLM2-135M-Instruct (embedded)", "qwen-coder": "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded", help="embedded, qwen-coder, or a model.path")
    ap.add_argument("--prompts", default="bench16", help="bench16 or a JSONL file ('HumanEval' ids are code)")
    ap.add_argument("--out", required=True, type=Path, help="folder of records.jsonl and table.json")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--windows", default="", help="W-N-G,W-N-G,... (default: the module's grid)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--table", type=Path, default=None, help="also write the table here")
    ap.add_argument("--table-only", action="store_true", help="write the table from the records, record nothing")
    ap.add_argument("--preset", action="store_true", help="a table for the auto preset (calibration prompts only)")
    args = ap.parse_args()
    windows = [tuple(map(int, w.split("-"))) for w in args.windows.split(",")] if args.windows else DEFAULT_WINDOWS
    name = MODELS.get(args.model, args.model)
    records_file = args.out / "records.jsonl"
    if not args.table_only:
        rec = _recorder(args.model, args.max_new_tokens, args.threads)
        args.out.mkdir(parents=True, exist_ok=True)
        model_json = json.dumps({"model": name, "weights": rec.weights}) + "\n"
        (args.out / "model.json").write_text(model_json, encoding="utf-8")
        prompts = _prompts(args.prompts, rec.tokenizer)
        start = time.time()
        log = functools.partial(print, file=sys.stderr, flush=True)
        record(rec.run, prompts, windows, records_file, log=log, threads=rec.threads)
        print(f"recorded in {time.time() - start:.0f} s", file=sys.stderr)
    weights = json.loads((args.out / "model.json").read_text(encoding="utf-8"))["weights"]
    prompts = Path(args.prompts).name
    records = read_records(records_file)
    data = table(records, f"{name}, fp32, greedy", prompts, args.max_new_tokens, weights, args.preset)
    data["threads"] = threads_of(records)  # what the records ran on (counts: any)
    text = json.dumps(data, separators=(",", ":")) + "\n"
    for path in [args.out / "table.json", *([args.table] if args.table else [])]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)


def _recorder(model_name: str, max_new_tokens: int, threads: int):
    """The model loaded as ``lp_runner study --record-acceptance`` loads it (``cli.acceptance.load_recorder``)."""
    from lp_runner.cli.acceptance import load_recorder
    from lp_runner.config import load_config

    spec = model_name
    if model_name == "qwen-coder":
        from benchmarks.real_model import qwen_coder_gguf

        spec = str(qwen_coder_gguf())
    sets = [f"model.path={spec}", f"generation.max_new_tokens={max_new_tokens}", f"model.threads={threads}"]
    return load_recorder(load_config(None, sets))


def _prompts(source: str, tokenizer) -> list[PromptToRecord]:
    from lp_runner.jobs.prompts import PromptSpec, encode, read_prompts

    if source == "bench16":
        from benchmarks.prompt_sets import bench16

        specs = [
            PromptSpec(p["id"], p.get("prompt"), tuple(p["messages"]) if "messages" in p else None) for p in bench16()
        ]
    else:
        specs = read_prompts(source)
    return [
        PromptToRecord(s.id, "code" if "humaneval" in s.id.lower() else "chat", tuple(encode(tokenizer, s)))
        for s in specs
    ]


if __name__ == "__main__":
    main()

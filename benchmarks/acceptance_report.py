"""Tokens per forward against window, from acceptance recordings (``benchmarks/record_acceptance.py``): the tables
of docs/results.md.

Per model: each window recorded on every prompt, its rows a round at P = 1, tokens per forward over the decode
rounds (all prompts, code, chat) with a 95% bootstrap interval over prompts, the paired difference from the window
before it (fewer rows) with its interval, the fitted slope per doubling of rows with its interval, and the
recording's wall time.

    python benchmarks/acceptance_report.py benchmarks/results/acceptance/{qwen-coder,embedded} \
        --out benchmarks/results/acceptance/report.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lp_runner.tuning.acceptance import (  # noqa: E402
    GREEDY,
    bootstrap,
    decode_tpf,
    mean_rows,
    paired_difference,
    read_records,
    slope_interval,
    threads_of,
    window_label,
)


def by_window(records: list[dict]) -> tuple[list[str], dict[tuple, list[dict]]]:
    """(prompt ids, {window: its records in prompt order}) for the windows recorded on every prompt."""
    ids = [r["prompt"] for r in records if tuple(r["window"]) == GREEDY]
    per: dict[tuple, dict[str, dict]] = {}
    for r in records:
        per.setdefault(tuple(r["window"]), {})[r["prompt"]] = r
    whole = {w: [p[i] for i in ids] for w, p in per.items() if all(i in p for i in ids)}
    return ids, dict(sorted(whole.items(), key=lambda kv: mean_rows(kv[1]) if kv[0] != GREEDY else 0))


def _interval(recs: list[dict]) -> str:
    if not recs:
        return "-"
    lo, hi = bootstrap(recs, decode_tpf)
    return f"{decode_tpf(recs):.2f} [{lo:.2f}, {hi:.2f}]"


def _threads(records: list[dict]) -> str:
    """The threads the records ran on, as the report states them (records before the field: one thread)."""
    counts = threads_of(records)
    if len(counts) == 1:
        return f"{counts[0]} thread" + ("s" if counts[0] > 1 else "")
    return f"{counts[0]} to {counts[-1]} threads"


def model_section(folder: Path) -> list[str]:
    records = read_records(folder / "records.jsonl")
    meta = json.loads((folder / "model.json").read_text("utf-8")) if (folder / "model.json").is_file() else {}
    ids, windows = by_window(records)
    kinds = {r["prompt"]: r["kind"] for r in records if tuple(r["window"]) == GREEDY}
    tokens = sum(len(r["output_ids"]) for r in records if tuple(r["window"]) == GREEDY)
    seconds = sum(r["seconds"] for r in records)
    lines = [
        f"### {meta.get('model', folder.name)}: {folder.name}",
        "",
        f"{len(ids)} prompts ({sum(k == 'code' for k in kinds.values())} code, "
        f"{sum(k == 'chat' for k in kinds.values())} chat), {tokens} greedy output tokens; recorded in "
        f"{seconds / 3600:.1f} h of generation ({_threads(records)}, niced, beside other work: counts do not depend "
        "on speed).",
        "",
        "| window W-N-G | rows a round | tokens/forward (all) | code | chat | minus the row above |",
        "|---|---|---|---|---|---|",
    ]
    prev = None
    for w, recs in windows.items():
        code = [r for r in recs if kinds[r["prompt"]] == "code"]
        chat = [r for r in recs if kinds[r["prompt"]] != "code"]
        diff = "-"
        if prev is not None:
            d, lo, hi = paired_difference(prev, recs)
            diff = f"{d:+.2f} [{lo:+.2f}, {hi:+.2f}]"
        name = "no window, G=1" if w == GREEDY else window_label(w)
        lines.append(
            f"| {name} | {mean_rows(recs):.1f} | {_interval(recs)} | {_interval(code)} | {_interval(chat)} | {diff} |"
        )
        prev = recs
    lookahead = {w: r for w, r in windows.items() if w != GREEDY}
    if len(lookahead) >= 2:
        s, lo, hi = slope_interval(lookahead)
        lines += [
            "",
            f"Slope over the {len(lookahead)} windows: **{s:+.3f} tokens per forward per doubling of rows** "
            f"(95% interval {lo:+.3f} to {hi:+.3f}, prompts resampled, windows paired by prompt).",
        ]
    return [*lines, ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    lines = ["## Acceptance at LP's windows", ""]
    for folder in args.folders:
        lines += model_section(folder)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

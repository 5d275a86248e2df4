"""The measured strong-scaling study: the user's job through the real CLI at each P, compared token by token.

Each P runs ``python -m lp_runner --config C --prompts F --output DIR/P<p>.jsonl --set parallel.workers=P``: the
CLI starts the P ranks itself (gloo on a CPU, one rank per GPU on a machine with GPUs, as ``cli/launch.py`` places
them), so the study measures what a user's run is. The window at each P is the auto preset's choice at that P,
or the W, N, G the study pins (``--wng``). Each P's records file is its own, so an interrupted study resumes:
a P whose file holds every prompt is skipped, a partial one is run again with the job's own ``--resume``.

Per prompt it keeps what the job's records already carry: latency, tokens/s, tokens per forward, packed rows of
rank 0 per round, and the time split forward / host / communication (``stats``; communication includes any wait
for a slower rank), and whether the output equals P = 1's (it must: LP is exact).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from lp_runner.errors import InputError, LPError


class StudyInterrupted(LPError):
    """A P's run ended on Ctrl-C or SIGTERM: its finished records are kept for the next study."""


class RunFailed(LPError):
    """A P's run failed; ``code`` is its exit code (2: bad input, 3: a failed peer, ...)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def records_path(out: Path, workers: int) -> Path:
    return out / f"P{workers}.jsonl"


def read_records(path: Path) -> dict[str, dict]:
    """The records of one P's output by prompt id (the file's header line and any torn last line left out)."""
    found: dict[str, dict] = {}
    if not path.exists():
        return found
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "id" in rec and "output_ids" in rec:
            found[rec["id"]] = rec
    return found


def pin_sets(wng: tuple[int, int, int] | None) -> list[str]:
    """``--set`` overrides that pin a window at every P (None: the auto preset chooses at each P)."""
    if wng is None:
        return []
    w, n, g = wng
    keys = {
        "lookahead.window_size": w,
        "lookahead.ngram_size": n,
        "lookahead.verification_set_size": g,
        "advanced.lookahead_branch": "true",
    }
    return [x for k, v in keys.items() for x in ("--set", f"{k}={v}")]


def command(config: str | None, prompts: str, out: Path, workers: int, sets: Sequence[str], resume: bool) -> list[str]:
    """The CLI command of one P's run (the study's own interpreter)."""
    cmd = [sys.executable, "-m", "lp_runner", "--prompts", prompts, "--output", str(records_path(out, workers))]
    cmd += ["--config", config] if config else []
    cmd += [*sets, "--set", f"parallel.workers={workers}", "--set", "advanced.progress=false"]
    cmd += ["--resume"] if resume else []
    return cmd


def run_study(
    config: str | None,
    prompts: str,
    ids: Sequence[str],
    workers: Sequence[int],
    out: Path,
    sets: Sequence[str],
    say: Callable[[str], None],
) -> None:
    """Run the job at each P in ``workers`` (skipping every P whose records are complete). A failed run raises
    ``LPError`` naming its P and exit code; Ctrl-C or SIGTERM stops the running P (its records stay) and raises
    ``StudyInterrupted``."""
    out.mkdir(parents=True, exist_ok=True)
    for p in workers:
        path = records_path(out, p)
        have = read_records(path)
        if all(i in have for i in ids):
            say(f"P={p}: every prompt recorded in {path}, skipped")
            continue
        say(f"P={p}: running {len(ids) - len(have)} of {len(ids)} prompts -> {path}")
        code, stopped = _run_child(command(config, prompts, out, p, sets, resume=path.exists()))
        if stopped or code == 130:
            raise StudyInterrupted(f"interrupted at P={p}; its finished records are in {path}: run again to resume")
        if code != 0:
            raise RunFailed(f"the run at P={p} failed (exit {code}, message above); records so far in {path}", code)


def _run_child(cmd: list[str]) -> tuple[int, bool]:
    """Run one P's CLI to its end: (its exit code, whether the study was stopped meanwhile). On Ctrl-C (which
    reaches the child too) or SIGTERM (passed on to it) the child stops its own ranks and keeps its records; we
    wait for it to do so."""
    child = subprocess.Popen(cmd, env=dict(os.environ))
    stopped = False

    def forward(signum: int, frame: object) -> None:
        nonlocal stopped
        stopped = True
        child.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            try:
                return child.wait(), stopped
            except KeyboardInterrupt:
                stopped = True  # the child got the same Ctrl-C: wait for it to write its records and leave
    finally:
        signal.signal(signal.SIGTERM, previous)


def _percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return 0.0
    k = min(int(round(q * (len(s) - 1))), len(s) - 1)
    return s[k]


def summarize(out: Path, ids: Sequence[str], workers: Sequence[int]) -> dict:
    """Per P and per prompt: latency, tokens/s, tokens per forward, rows per rank, the time split and whether the
    output equals the lowest P's; per P the latency p50 / p90 and the window that ran. A prompt without an output
    at some P (an error record) is an ``InputError`` naming the P: nothing to compare."""
    base_p = min(workers)
    base = read_records(records_path(out, base_p))
    rows = []
    for p in sorted(workers):
        recs = read_records(records_path(out, p))
        missing = [i for i in ids if i not in recs]
        if missing:
            raise InputError(f"P={p}: no record for {len(missing)} prompt(s) in {records_path(out, p)}")
        prompts = []
        for i in ids:
            r = recs[i]
            st = r.get("stats", {})
            rounds = max(st.get("rounds", 0), 1)
            secs = r["seconds"] or 0.0
            prompts.append(
                {
                    "id": i,
                    "latency_s": secs,
                    "new_tokens": r["new_tokens"],
                    "tokens_per_s": r["new_tokens"] / secs if secs else 0.0,
                    "tokens_per_forward": r["tokens_per_forward"],
                    "rows_per_rank": st.get("rows", 0) / rounds,
                    "forward_s": st.get("forward_s", 0.0),
                    "host_s": st.get("host_s", 0.0),
                    "comm_s": st.get("comm_s", 0.0),
                    "identical_to_base": r["output_ids"] == base[i]["output_ids"],
                    "window": {"W": r["window_size"], "N": r["ngram_size"], "G": r["verification_set_size"]},
                    "setting": r.get("policy", {}).get("setting"),
                }
            )
        lat = [x["latency_s"] for x in prompts]
        tokens = sum(x["new_tokens"] for x in prompts)
        total = sum(lat) or 1.0
        rows.append(
            {
                "workers": p,
                "measured": True,
                "latency_p50_s": round(_percentile(lat, 0.5), 4),
                "latency_p90_s": round(_percentile(lat, 0.9), 4),
                "tokens_per_s": round(tokens / total, 3),
                "ms_per_token": round(1e3 * total / tokens, 3) if tokens else None,
                "tokens_per_forward": round(sum(x["tokens_per_forward"] for x in prompts) / len(prompts), 3),
                "rows_per_rank": round(sum(x["rows_per_rank"] for x in prompts) / len(prompts), 2),
                "forward_share": round(sum(x["forward_s"] for x in prompts) / total, 4),
                "host_share": round(sum(x["host_s"] for x in prompts) / total, 4),
                "comm_share": round(sum(x["comm_s"] for x in prompts) / total, 4),
                "identical_to_base": all(x["identical_to_base"] for x in prompts),
                "windows": sorted({json.dumps(x["window"], sort_keys=True) for x in prompts}),
                "settings": sorted({x["setting"] for x in prompts if x["setting"]}),
                "prompts": prompts,
            }
        )
    p1 = rows[0]["ms_per_token"]
    for r in rows:
        r["speedup_vs_p1"] = round(p1 / r["ms_per_token"], 3) if p1 and r["ms_per_token"] else None
    return {
        "base_workers": base_p,
        "identical_outputs": all(r["identical_to_base"] for r in rows),
        "points": rows,
    }

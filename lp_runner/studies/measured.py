"""The measured strong-scaling study: the user's job through the real CLI at each P, compared token by token.

Each run is ``python -m lp_runner --config C --prompts F --output DIR/P<p>-r<rep>.jsonl --set parallel.workers=P``:
the CLI starts the P ranks itself (gloo on a CPU, one rank per GPU on a machine with GPUs, as ``cli/launch.py``
places them), so the study measures what a user's run is. The window at each P is the auto preset's choice at
that P, or the W, N, G the study pins (``--wng``).

Why the schedule (``schedule``) is what it is: a shared machine's speed moves by 10% and more within minutes, so
one run per P, in order, measures the machine's drift as much as P. So every run starts with a warm-up prompt
(a copy of the first, left out of every figure: the first generation pays for allocators and kernels), the P
values are interleaved over at least 3 repetitions (each repetition's order rotated), and each P's figure is the
median over repetitions with its spread ((slowest - fastest) / median) printed beside it. Every rank runs the same
threads at every P (``threads_per_rank``: the cores over the largest P), so P, not the threads, is what changes;
a P = 1 run with every core is added as its own labelled row. A warning is printed when the load average exceeds
the cores or a spread exceeds ``SPREAD_WARNING``.

Each run's records file is its own, so an interrupted study resumes: a run whose file holds every prompt is
skipped (a torn last line from a kill dropped), a partial one is run again with the job's own ``--resume``.

Per prompt it keeps what the job's records carry: latency, tokens/s, tokens per forward, the busiest rank's
packed rows per round (``busiest_rank_rows``: under LP a round costs its busiest rank's forward, and the record
carries every rank's rows, gathered once per generation), the time split forward / host / communication (``stats``;
communication includes any wait for a slower rank), and whether the output equals P = 1's (it must: LP is exact;
a difference fails the study, ``NotExact``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from lp_runner.errors import InputError, LPError


class StudyInterrupted(LPError):
    """A P's run ended on Ctrl-C or SIGTERM: its finished records are kept for the next study."""


class NotExact(LPError):
    """A P's output differs from P = 1's: LP is exact, so the study fails (exit ``code``) once its report is
    written."""

    code = 1


class RunFailed(LPError):
    """A P's run failed; ``code`` is its exit code (2: bad input, 3: a failed peer, ...)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


SPREAD_WARNING = 0.10  # a P's repetitions further apart than this (relative) are too noisy to compare
WARMUP_ID = "study-warmup"


@dataclass(frozen=True)
class Run:
    """One run of the job: P ranks of ``threads`` threads each, repetition ``rep``."""

    workers: int
    threads: int
    rep: int
    all_cores: bool = False  # the P = 1 run with every core (its own row)

    @property
    def key(self) -> str:
        return f"P{self.workers}-all" if self.all_cores else f"P{self.workers}"

    def label(self, cores: int) -> str:
        return f"P={self.workers} (all {cores} cores)" if self.all_cores else f"P={self.workers}"


def records_path(out: Path, run: Run) -> Path:
    return out / f"{run.key}-r{run.rep}.jsonl"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_rank(configured: int, top: int, cores: int | None = None) -> int:
    """The threads every rank runs at every P: ``model.threads`` where set, else the cores over the largest P
    (at least 1), so the largest P's ranks do not share cores and the smaller P's run no more threads a rank."""
    if configured > 0:
        return configured
    return max((cores or available_cores()) // max(top, 1), 1)


def schedule(workers: Sequence[int], repeat: int, threads: int, cores: int) -> list[Run]:
    """The runs in the order they run: ``repeat`` repetitions, each every P once (the order rotated by one each
    repetition, so no P always runs first or last), plus a P = 1 run with every core per repetition where the
    per-rank threads leave cores idle at P = 1. Example: P = 1, 2, repeat 3, 1 thread on 2 cores ->
    [1, 1-all, 2], [1-all, 2, 1], [2, 1, 1-all]."""
    kinds = [Run(p, threads, 0) for p in sorted(set(workers))]
    if 1 in workers and threads < cores:
        kinds.insert(1, Run(1, cores, 0, all_cores=True))
    out = []
    for rep in range(repeat):
        k = rep % len(kinds)
        out += [replace(r, rep=rep) for r in kinds[k:] + kinds[:k]]
    return out


def warmup_prompts(prompts: str, ids: Sequence[str], out: Path) -> Path:
    """``out``/prompts-with-warmup.jsonl: a copy of the first prompt (id ``WARMUP_ID``) and then every prompt."""
    from lp_runner.outfiles import write_file

    text = Path(prompts).read_text(encoding="utf-8")
    first = json.loads(next(line for line in text.splitlines() if line.strip()))
    wid = WARMUP_ID
    while wid in ids:
        wid += "-"
    first["id"] = wid
    path = out / "prompts-with-warmup.jsonl"
    write_file(path, (json.dumps(first) + "\n" + text + ("" if text.endswith("\n") else "\n")).encode("utf-8"))
    return path


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


def command(
    config: str | None, prompts: str, output: Path, workers: int, sets: Sequence[str], resume: bool
) -> list[str]:
    """The CLI command of one run (the study's own interpreter)."""
    cmd = [sys.executable, "-m", "lp_runner", "--prompts", prompts, "--output", str(output)]
    cmd += ["--config", config] if config else []
    cmd += [*sets, "--set", f"parallel.workers={workers}", "--set", "advanced.progress=false"]
    cmd += ["--resume"] if resume else []
    return cmd


def drop_torn_lines(path: Path) -> bool:
    """Rewrite ``path`` without its lines that are not whole JSON (a kill mid-write), atomically; True if any."""
    from lp_runner.outfiles import write_file

    if not path.is_file():
        return False
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    whole = []
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            continue
        whole.append(line if line.endswith("\n") else line + "\n")
    if len(whole) == len(lines) and all(line.endswith("\n") for line in lines):
        return False
    write_file(path, "".join(whole).encode("utf-8"))
    return True


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run_study(
    config: str | None,
    prompts: str,
    ids: Sequence[str],
    workers: Sequence[int],
    out: Path,
    sets: Sequence[str],
    repeat: int,
    threads: int,
    say: Callable[[str], None],
) -> dict:
    """Run the job on ``schedule``'s runs (skipping every run whose records are complete). Returns the runs and
    the load average seen before each. A failed run raises ``RunFailed`` naming its P and exit code; Ctrl-C or
    SIGTERM stops the running P (its records stay) and raises ``StudyInterrupted``."""
    cores = available_cores()
    runs = schedule(workers, repeat, threads, cores)
    feed = warmup_prompts(prompts, ids, out)
    wanted = [*ids, json.loads(feed.read_text(encoding="utf-8").splitlines()[0])["id"]]
    loads = []
    for run in runs:
        path = records_path(out, run)
        if drop_torn_lines(path):
            say(f"{run.label(cores)} rep {run.rep}: a torn last line dropped from {path}")
        have = read_records(path)
        missing = [i for i in wanted if i not in have]
        if not missing:
            say(f"{run.label(cores)} rep {run.rep}: every prompt recorded in {path}, skipped")
            continue
        loads.append(load_average())
        say(f"{run.label(cores)} rep {run.rep}: running {len(missing)} of {len(wanted)} prompts (a warm-up first), "
            f"{run.threads} thread(s) a rank -> {path}")  # fmt: skip
        cmd = command(config, str(feed), path, run.workers, [*sets, "--set", f"model.threads={run.threads}"],
                      resume=path.exists())  # fmt: skip
        code, stopped = _run_child(cmd)
        if stopped or code == 130:
            raise StudyInterrupted(f"interrupted at {run.label(cores)}; its finished records are in {path}: run again "
                                   "to resume")  # fmt: skip
        if code != 0:
            raise RunFailed(f"the run at {run.label(cores)} failed (exit {code}, message above); records so far in "
                            f"{path}", code)  # fmt: skip
    return {"runs": runs, "cores": cores, "threads_per_rank": threads, "load_averages": loads, "repeat": repeat}


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


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    """The mean (2 decimals), or None where any value is unknown (a mean of the others would be another figure)."""
    known = [v for v in values if v is not None]
    return round(sum(known) / len(known), 2) if known and len(known) == len(values) else None


def spread(values: Sequence[float]) -> float:
    """(largest - smallest) / median of one P's repetitions; 0.0 for fewer than two."""
    if len(values) < 2:
        return 0.0
    med = _percentile(values, 0.5)
    return (max(values) - min(values)) / med if med else 0.0


def busiest_rank_rows(rec: dict) -> float | None:
    """The busiest rank's rows a round in one record (the largest rank's of each round, mean over the rounds):
    ``stats.busiest_rows`` over ``stats.rounds``. None for a record at P > 1 written before records carried every
    rank's rows (a resumed study's older file); at P = 1 the one rank's rows are the busiest.

    Example: rank 0 ran 5, 3, 3 rows and rank 1 ran 4, 6, 2 -> busiest_rows 14 over 3 rounds -> 4.67."""
    st = rec.get("stats", {})
    rounds = st.get("rounds", 0)
    if not rounds:
        return 0.0
    if "busiest_rows" in st:
        return st["busiest_rows"] / rounds
    return st.get("rows", 0) / rounds if rec.get("workers", 1) == 1 else None


def window_label(rec: dict) -> str:
    """The window a record ran: "no window" where the lookahead branch was off (W is inert then), else W-N-G."""
    la = rec.get("policy", {}).get("lookahead") or {}
    if la.get("lookahead_branch") is False:
        return f"no window (G={la.get('verification_set_size', rec.get('verification_set_size'))})"
    return f"{rec['window_size']}-{rec['ngram_size']}-{rec['verification_set_size']}"


def aggregate(per_rep: dict[str, list[float]], base_key: str) -> dict[str, dict]:
    """Per kind of run (``Run.key``): its repetitions' ms per token, their median and spread, and speed vs the
    base's median (> 1 faster), with the range of the ratio over the repetitions paired by repetition."""
    base = per_rep.get(base_key, [])
    base_med = _percentile(base, 0.5) if base else None
    out = {}
    for key, values in per_rep.items():
        med = _percentile(values, 0.5)
        ratios = [b / v for b, v in zip(base, values, strict=False) if v]
        out[key] = {
            "ms_per_token_reps": [round(v, 4) for v in values],
            "ms_per_token": round(med, 4),
            "spread": round(spread(values), 4),
            "speed_vs_p1": round(base_med / med, 3) if base_med and med else None,
            "speed_vs_p1_range": [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None,
        }
    return out


def warnings(loads: Sequence[float | None], cores: int, spreads: dict[str, float]) -> list[str]:
    """The study's warnings: a load average above the cores before any run (other work shared the machine), a P
    whose repetitions spread by more than ``SPREAD_WARNING``."""
    out = []
    seen = [x for x in loads if x is not None]
    if seen and max(seen) > cores:
        out.append(
            f"the load average reached {max(seen):.2f} on {cores} cores before a run: other work shared the machine, "
            "so the timings are not comparable; run the study on a quiet machine"
        )
    for key, sp in spreads.items():
        if sp > SPREAD_WARNING:
            out.append(f"{key}'s repetitions spread by {100 * sp:.0f}% (over {100 * SPREAD_WARNING:.0f}%): too noisy "
                       "to compare P values; run again on a quiet machine or with --repeat higher")  # fmt: skip
    return out


def summarize(
    out: Path, ids: Sequence[str], runs: Sequence[Run], loads: Sequence[float | None] = (), cores: int = 1
) -> dict:
    """Per kind of run: per-prompt figures of its first repetition (latency, tokens/s, tokens per forward, rows,
    the time split, identical to P = 1's), and over repetitions the median ms per token, its spread and speed vs
    P = 1 (> 1 faster); the warnings. A prompt without an output in some run is an ``InputError`` naming it."""
    kinds: dict[str, list[Run]] = {}
    for r in runs:
        kinds.setdefault(r.key, []).append(r)
    base_key = "P1" if "P1" in kinds else min(kinds, key=lambda k: kinds[k][0].workers)
    base = read_records(records_path(out, kinds[base_key][0]))
    per_rep: dict[str, list[float]] = {}
    rows = []
    for key, reps in kinds.items():
        first = None
        for run in sorted(reps, key=lambda r: r.rep):
            recs = read_records(records_path(out, run))
            missing = [i for i in ids if i not in recs]
            if missing:
                raise InputError(f"{key}: no record for {len(missing)} prompt(s) in {records_path(out, run)}")
            secs = sum(recs[i]["seconds"] or 0.0 for i in ids)
            tokens = sum(recs[i]["new_tokens"] for i in ids)
            per_rep.setdefault(key, []).append(1e3 * secs / tokens if tokens else 0.0)
            first = first or (run, recs)
        run, recs = first
        prompts = []
        for i in ids:
            r = recs[i]
            st = r.get("stats", {})
            secs = r["seconds"] or 0.0
            prompts.append(
                {
                    "id": i,
                    "latency_s": secs,
                    "new_tokens": r["new_tokens"],
                    "tokens_per_s": r["new_tokens"] / secs if secs else 0.0,
                    "tokens_per_forward": r["tokens_per_forward"],
                    "busiest_rank_rows": busiest_rank_rows(r),
                    "forward_s": st.get("forward_s", 0.0),
                    "host_s": st.get("host_s", 0.0),
                    "comm_s": st.get("comm_s", 0.0),
                    "identical_to_base": r["output_ids"] == base[i]["output_ids"],
                    "window": window_label(r),
                    "setting": r.get("policy", {}).get("setting"),
                }
            )
        lat = [x["latency_s"] for x in prompts]
        total = sum(lat) or 1.0
        rows.append(
            {
                "key": key,
                "label": run.label(cores),
                "workers": run.workers,
                "threads_per_rank": run.threads,
                "measured": True,
                "latency_p50_s": round(_percentile(lat, 0.5), 4),
                "latency_p90_s": round(_percentile(lat, 0.9), 4),
                "tokens_per_forward": round(sum(x["tokens_per_forward"] for x in prompts) / len(prompts), 3),
                "busiest_rank_rows": _mean_or_none([x["busiest_rank_rows"] for x in prompts]),
                "forward_share": round(sum(x["forward_s"] for x in prompts) / total, 4),
                "host_share": round(sum(x["host_s"] for x in prompts) / total, 4),
                "comm_share": round(sum(x["comm_s"] for x in prompts) / total, 4),
                "identical_to_base": all(x["identical_to_base"] for x in prompts),
                "window": ", ".join(sorted({x["window"] for x in prompts})),
                "settings": sorted({x["setting"] for x in prompts if x["setting"]}),
                "prompts": prompts,
            }
        )
    agg = aggregate(per_rep, base_key)
    for r in rows:
        r.update(agg[r["key"]])
    rows.sort(key=lambda r: (r["workers"], r["key"]))
    return {
        "base": base_key,
        "base_workers": kinds[base_key][0].workers,
        "identical_outputs": all(r["identical_to_base"] for r in rows),
        "points": rows,
        "warnings": warnings(loads, cores, {r["label"]: r["spread"] for r in rows}),
    }

"""A model's acceptance at LP's windows: recorded per prompt and window, resumable, and read as one table.

What a window buys (tokens per forward) depends on the model and the prompt, never on the machine: greedy output
is the same at every setting, and a round's plan is a function of the committed tokens and the model's own
guesses. So a recording is counts, one JSON line per (prompt, window), appended as each finishes: a killed
recording resumes where it stopped, and it can run for hours in the background at any speed.

A recording's lines (``records.jsonl``), in the order they were made::

    {"prompt": "HumanEval/0", "kind": "code", "window": [0, 0, 0], "prompt_ids": [...], "output_ids": [...], ...}
    {"prompt": "HumanEval/0", "kind": "code", "window": [7, 5, 7], "forwards": 61, "rows": [...], "shapes": [...]}

The first line of a prompt is its greedy output (window ``[0, 0, 0]``: no window, one candidate); every window's
output must equal it (lookahead is exact; a difference stops the recording). ``rows`` are the packed rows of each
round at P = 1, ``shapes`` the rounds as ``costmodel.RoundShape`` rows, which the auto preset and the study
replay at any P.

``table(...)`` turns a recording into what the preset and ``study --simulate`` read (``prior_from_dict``'s
format: the greedy samples and each window's shapes, plus per-prompt tokens per forward for the reports).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from lp_runner.config import LookaheadConfig
from lp_runner.errors import InputError, LPError
from lp_runner.tuning.costmodel import RoundShape

TABLE_FORMAT = 1
GREEDY = (0, 0, 0)  # the record that holds a prompt's output: no window, one candidate
# The default grid, cheapest first (rows per round at P = 1 grow with W x (N - 1) + G x (N - 1)): the Lookahead
# paper's W = G shapes from 7-5-7 to 63-8-63, and W != G on both sides, so a fit can tell the window's columns
# from its candidates and N from both.
DEFAULT_WINDOWS: tuple[tuple[int, int, int], ...] = (
    (7, 5, 7),
    (15, 5, 7),
    (7, 5, 15),
    (15, 5, 15),
    (15, 7, 15),
    (23, 6, 23),
    (31, 7, 15),
    (15, 9, 31),
    (31, 7, 31),
    (31, 9, 31),
    (31, 11, 31),
    (47, 7, 47),
    (63, 8, 63),
    (47, 11, 47),
)
BOOTSTRAP_DRAWS = 2000
SHIPPED_DEFAULT = "embedded-calibration8"  # the embedded model's table: tests and the study's default


@dataclass(frozen=True)
class Sample:
    """One generation: what was asked and what the model answered (greedy or sampled)."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]


@dataclass(frozen=True)
class Recorded:
    """A window setting's round shapes, recorded once with a real model (``lp_runner/tuning/data/acceptance/``)."""

    name: str
    lookahead: LookaheadConfig
    shapes: tuple[tuple[RoundShape, ...], ...]  # per calibration prompt


@dataclass(frozen=True)
class Prior:
    """What ships with the package: calibration samples and recorded window settings."""

    model: str
    samples: tuple[Sample, ...]
    recorded: tuple[Recorded, ...]


@lru_cache(maxsize=1)
def shipped_prior() -> Prior:
    """The embedded model's preset table (``SHIPPED_DEFAULT``); read once per process."""
    return load_table(SHIPPED_DEFAULT).prior


def prior_digest(prior: Prior) -> str:
    """What identifies a prior's content in the start-up cache key (a user's table lives outside the package,
    which ``code_digest`` covers)."""
    blob = repr((prior.model, prior.samples, [(r.name, r.shapes) for r in prior.recorded])).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def prior_from_dict(d: dict) -> Prior:
    samples = tuple(Sample(tuple(s["prompt_ids"]), tuple(s["output_ids"])) for s in d["samples"])
    recorded = tuple(
        Recorded(
            r["name"],
            LookaheadConfig(**r["lookahead"]),
            tuple(tuple(RoundShape(*row[:4], tuple(row[4]), *row[5:]) for row in prompt) for prompt in r["shapes"]),
        )
        for r in d.get("recorded", [])
    )
    return Prior(d["model"], samples, recorded)


@dataclass(frozen=True)
class PromptToRecord:
    id: str
    kind: str  # "code" or "chat": reported separately (code repeats itself far more)
    ids: tuple[int, ...]


def window_label(window: Sequence[int]) -> str:
    return "greedy" if tuple(window) == GREEDY else "-".join(map(str, window))


def lookahead_for(window: Sequence[int]) -> LookaheadConfig:
    """The fixed setting a window is recorded at: the window as given, nothing tuned (preset off, no row cap)."""
    w, n, g = window
    if tuple(window) == GREEDY:
        return LookaheadConfig(preset="off", lookahead_branch=False, verification_set_size=1, max_verify_rows=2)
    return LookaheadConfig(preset="off", window_size=w, ngram_size=n, verification_set_size=g)


class NotGreedy(LPError):
    """A window's output differs from the prompt's greedy one: its counts would not be the model's acceptance, so
    the recording stops (exit ``code``), keeping every record made before."""

    code = 1


def read_records(path: Path) -> list[dict]:
    """Every whole line of a recording (a torn last line, from a kill mid-write, is skipped and rewritten)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def threads_of(records: Iterable[dict]) -> list[int]:
    """The threads ``records`` ran on, each once, ascending (a record from before the field: one thread)."""
    return sorted({r.get("threads", 1) for r in records})


def record(
    run: Callable[[LookaheadConfig, Sequence[int]], tuple[list[int], list]],
    prompts: Sequence[PromptToRecord],
    windows: Iterable[Sequence[int]],
    out: Path,
    log: Callable[[str], None] = print,
    threads: int | None = None,
) -> list[dict]:
    """Record every (prompt, window) that ``out`` (a ``records.jsonl``) lacks, greedy first, then each window over
    every prompt (so a stopped recording holds whole windows first); returns every record of ``out``.

    ``run(lookahead, prompt_ids)`` generates once and returns (output ids, the generation's ``RoundRecord``s).
    Each record is appended and flushed as it finishes, with its wall seconds and (``threads``, when given) the
    threads that ran it: a recording resumed with other threads states each record's."""
    done = read_records(out)
    _rewrite_whole(out, done)
    have = {(r["prompt"], tuple(r["window"])) for r in done}
    greedy = {r["prompt"]: r["output_ids"] for r in done if tuple(r["window"]) == GREEDY}
    out.parent.mkdir(parents=True, exist_ok=True)
    order = [GREEDY, *(tuple(w) for w in windows if tuple(w) != GREEDY)]
    with open(out, "a", encoding="utf-8") as f:
        for window in order:
            la = lookahead_for(window)
            for p in prompts:
                if (p.id, window) in have:
                    continue
                start = time.perf_counter()
                output, rounds = run(la, p.ids)
                seconds = time.perf_counter() - start
                rec: dict = {"prompt": p.id, "kind": p.kind, "window": list(window)}
                if window == GREEDY:
                    greedy[p.id] = output
                    rec.update(prompt_ids=list(p.ids), output_ids=list(output))
                elif output != greedy[p.id]:
                    raise NotGreedy(
                        f"{p.id} at {window_label(window)}: the output differs from the prompt's greedy output (in "
                        "half precision a top-two tie can; record in float32)"
                    )
                rec.update(
                    new_tokens=len(output),
                    forwards=len(rounds),
                    rows=[r.rows for r in rounds],
                    shapes=[_shape_row(r, window[0]) for r in rounds],
                    seconds=round(seconds, 2),
                )
                if threads is not None:
                    rec["threads"] = threads
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
                f.flush()
                os.fsync(f.fileno())
                done.append(rec)
                log(
                    f"{p.id} {window_label(window)}: {len(output)} tokens in {len(rounds)} forwards "
                    f"({len(output) / max(len(rounds), 1):.2f}/forward, {seconds:.0f} s)"
                )
    return done


def _rewrite_whole(out: Path, whole: list[dict]) -> None:
    """Drop a torn last line before appending (atomic replace: an interrupted rewrite loses nothing)."""
    if not out.is_file():
        return
    text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in whole)
    if out.read_text(encoding="utf-8") == text:
        return
    tmp = out.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)


def _shape_row(r, window_size: int) -> list:
    """A ``RoundRecord`` as the positional ``RoundShape`` row ``prior_from_dict`` reads."""
    return [r.past_len, r.ordinary, window_size, r.depth, list(r.plan_candidates), r.winner_candidate, r.emitted]


def table(
    records: Sequence[dict],
    model: str,
    prompts: str,
    max_new_tokens: int,
    weights: str | None = None,
    preset: bool = False,
) -> dict:
    """The acceptance table of a recording: the greedy samples, each window's shapes per prompt (only windows
    recorded on every prompt that has a greedy record, so windows are compared on the same prompts), and a
    per-window summary with bootstrap intervals."""
    greedy = [r for r in records if tuple(r["window"]) == GREEDY]
    ids = [r["prompt"] for r in greedy]
    by_window: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if tuple(r["window"]) != GREEDY:
            by_window.setdefault(tuple(r["window"]), {})[r["prompt"]] = r
    recorded, summary = [], []
    for window, per in sorted(by_window.items(), key=lambda kv: _rows_hint(kv[0])):
        if not all(i in per for i in ids):
            continue
        la = lookahead_for(window)
        recorded.append(
            {
                "name": f"window-{window_label(window)}",
                "lookahead": dataclasses.asdict(la),
                "shapes": [per[i]["shapes"] for i in ids],
            }
        )
        summary.append(window_summary(window, [per[i] for i in ids]))
    return {
        "format": TABLE_FORMAT,
        "model": model,
        "weights": weights,
        "preset": preset,
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "samples": [{"id": r["prompt"], "prompt_ids": r["prompt_ids"], "output_ids": r["output_ids"]} for r in greedy],
        "kinds": {r["prompt"]: r["kind"] for r in greedy},
        "recorded": recorded,
        "summary": summary,
    }


def _rows_hint(window: tuple) -> int:
    w, n, g = window
    return (w + g) * (n - 1)


def decode_tpf(recs: Sequence[dict]) -> float:
    """Tokens per forward over the decode rounds (each prompt's prefill round left out, as the study prices)."""
    tokens = sum(sum(s[6] for s in r["shapes"][1:]) for r in recs)
    forwards = sum(max(len(r["shapes"]) - 1, 0) for r in recs)
    return tokens / forwards if forwards else 1.0


def mean_rows(recs: Sequence[dict]) -> float:
    rows = [x for r in recs for x in r["rows"][1:]]
    return sum(rows) / len(rows) if rows else 0.0


def bootstrap(recs: Sequence[dict], stat: Callable[[Sequence[dict]], float], seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of ``stat`` over prompts resampled with replacement (prompts are the unit: rounds
    within a prompt are not independent)."""
    rng = random.Random(seed)
    draws = sorted(stat([recs[rng.randrange(len(recs))] for _ in recs]) for _ in range(BOOTSTRAP_DRAWS))
    return draws[int(0.025 * len(draws))], draws[int(0.975 * len(draws)) - 1]


def paired_difference(a: Sequence[dict], b: Sequence[dict], seed: int = 0) -> tuple[float, float, float]:
    """Tokens per forward of window b minus window a on the same prompts (``a[i]`` and ``b[i]`` one prompt), with a
    paired bootstrap 95% interval."""
    rng = random.Random(seed)
    n = len(a)

    def diff(idx: Sequence[int]) -> float:
        return decode_tpf([b[i] for i in idx]) - decode_tpf([a[i] for i in idx])

    draws = sorted(diff([rng.randrange(n) for _ in range(n)]) for _ in range(BOOTSTRAP_DRAWS))
    return diff(range(n)), draws[int(0.025 * len(draws))], draws[int(0.975 * len(draws)) - 1]


def window_summary(window: Sequence[int], recs: Sequence[dict]) -> dict:
    lo, hi = bootstrap(recs, decode_tpf)
    out = {"window": list(window), "tokens_per_forward": round(decode_tpf(recs), 4), "interval": [lo, hi]}
    out.update(rows_per_round=round(mean_rows(recs), 1), prompts=len(recs))
    for kind in sorted({r["kind"] for r in recs}):
        part = [r for r in recs if r["kind"] == kind]
        lo, hi = bootstrap(part, decode_tpf)
        out[kind] = {"tokens_per_forward": round(decode_tpf(part), 4), "interval": [round(lo, 4), round(hi, 4)]}
    out["interval"] = [round(x, 4) for x in out["interval"]]
    return out


def slope_per_doubling(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of tokens per forward against log2(rows per round): tokens gained per doubling of rows.
    Example: (60, 2.0), (120, 2.2), (240, 2.4) -> 0.2."""
    if len(points) < 2:
        raise InputError("a slope needs at least two windows")
    xs = [math.log2(r) for r, _ in points]
    ys = [t for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise InputError("a slope needs windows of different row counts")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def slope_interval(by_window: dict[tuple, Sequence[dict]], seed: int = 0) -> tuple[float, float, float]:
    """The slope per doubling of rows over every window, with a 95% interval from resampling prompts (the same
    prompts in every window of a draw: the windows' values are paired by prompt)."""
    windows = list(by_window)
    n = len(next(iter(by_window.values())))

    def fit(idx: Sequence[int]) -> float:
        pts = []
        for w in windows:
            part = [by_window[w][i] for i in idx]
            pts.append((mean_rows(part), decode_tpf(part)))
        return slope_per_doubling(pts)

    rng = random.Random(seed)
    draws = sorted(fit([rng.randrange(n) for _ in range(n)]) for _ in range(BOOTSTRAP_DRAWS // 4))
    return fit(range(n)), draws[int(0.025 * len(draws))], draws[int(0.975 * len(draws)) - 1]


@dataclass(frozen=True)
class Table:
    """An acceptance table as the preset and the study read it: the ``Prior`` and whose it is."""

    prior: Prior
    name: str  # the shipped table's name, or the file's path
    model: str  # the model and precision it was recorded with
    prompts: str  # the prompts it was recorded on
    weights: str | None  # the model's ``fingerprint`` (None: not recorded; never matched to a model)
    summary: tuple[dict, ...]  # per window: tokens per forward with interval (``window_summary``)

    def label(self) -> str:
        return f"{self.model} on {self.prompts} ({self.name})"


SHIPPED_PACKAGE = "lp_runner.tuning"
SHIPPED_FOLDER = "data/acceptance"


def shipped_names() -> list[str]:
    """The tables the package ships (``lp_runner/tuning/data/acceptance/NAME.json``)."""
    from importlib import resources

    folder = resources.files(SHIPPED_PACKAGE).joinpath(SHIPPED_FOLDER)
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_table(spec: str) -> Table:
    """A table by shipped name (``shipped_names()``) or path; one ``InputError`` line for anything else."""
    from importlib import resources

    if spec in shipped_names():
        text = resources.files(SHIPPED_PACKAGE).joinpath(f"{SHIPPED_FOLDER}/{spec}.json").read_text(encoding="utf-8")
        name = spec
    else:
        path = Path(spec)
        if not path.is_file():
            raise InputError(
                f"acceptance table {spec!r}: no such file, and not a shipped table ({', '.join(shipped_names())})"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"cannot read acceptance table {spec}: {exc}") from None
        name = str(path)
    return table_from_text(text, name)


def table_from_text(text: str, name: str) -> Table:
    try:
        data = json.loads(text)
        if data.get("format") != TABLE_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {TABLE_FORMAT}")
        prior = prior_from_dict(data)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InputError(f"acceptance table {name}: not a table lp_runner wrote ({exc})") from None
    return Table(
        prior,
        name,
        str(data.get("model", "unknown model")),
        str(data.get("prompts", "unknown prompts")),
        data.get("weights"),
        tuple(data.get("summary", ())),
    )


FINGERPRINT_SAMPLES = 64


def fingerprint(model) -> str:
    """Which checkpoint a model is, in the precisions it runs in: names, shapes and strided weight samples rounded
    to bfloat16 (an fp32 and a bf16 load of one checkpoint agree; an fp16 load may not). A table recorded with a
    model carries its fingerprint, so the preset prices a model's own acceptance and never another model's."""
    import hashlib

    import torch

    h = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            flat = tensor.detach().reshape(-1)
            h.update(f"{name}|{tuple(tensor.shape)}|".encode())
            if flat.numel() == 0 or not flat.is_floating_point():
                continue
            stride = max(1, flat.numel() // FINGERPRINT_SAMPLES)
            sample = flat[::stride][:FINGERPRINT_SAMPLES].to(device="cpu", dtype=torch.bfloat16)
            h.update(sample.to(torch.float32).numpy().tobytes())
    return h.hexdigest()[:32]


CACHE_FOLDER = "acceptance"  # under lp_runner's cache: the tables ``study --record-acceptance`` wrote, one per model


def cached_table_path(cache_root: Path, model_fingerprint: str) -> Path:
    return cache_root / CACHE_FOLDER / f"{model_fingerprint}.json"


def table_text_for(spec: str, model_fingerprint: str, cache_root: Path | None) -> tuple[str | None, str]:
    """The text of the table the auto preset prices for the model of ``model_fingerprint`` (``fingerprint``, taken
    before a backend repacks the weights) and where it came from.

    ``spec`` (``model.acceptance``): a path or shipped name, used as given. Empty: the table recorded with this
    model: the cache's (``study --record-acceptance`` writes it there), else the package's made for the preset
    (``"preset": true``: recorded on calibration prompts kept apart from every benchmark prompt; the package's
    other tables are the study's);
    else ``(None, why)``: no other model's acceptance stands in for it."""
    from importlib import resources

    if spec:
        t = load_table(spec)  # checks it, one line for a bad one
        if t.name in shipped_names():
            text = resources.files(SHIPPED_PACKAGE).joinpath(f"{SHIPPED_FOLDER}/{spec}.json").read_text("utf-8")
            return text, f"shipped {spec} (model.acceptance)"
        return Path(spec).read_text(encoding="utf-8"), f"{spec} (model.acceptance)"
    mine = model_fingerprint
    if cache_root is not None:
        path = cached_table_path(cache_root, mine)
        if path.is_file():
            return path.read_text(encoding="utf-8"), f"recorded for this model ({path})"
    for name in shipped_names():
        text = resources.files(SHIPPED_PACKAGE).joinpath(f"{SHIPPED_FOLDER}/{name}.json").read_text("utf-8")
        data = json.loads(text)
        if data.get("weights") == mine and data.get("preset"):  # recorded on prompts apart from the benchmarks'
            return text, f"shipped {name}"
    return None, "none recorded for this model"

"""Strong scaling simulated with LP's lever: at each P, the window whose per-rank rows the device makes cheapest.

LP splits one round's rows (the window's columns, the candidates) over P ranks. Where a forward costs the same
up to a knee (a GPU: the weights' read dominates until the matmuls catch up), splitting a window that already
fits under the knee saves nothing; what P buys is a *larger* window (more columns and candidates, more tokens
per forward) whose share per rank sits at the knee. So for each P this module searches the window:

* **What a window buys** comes from an acceptance table (``tuning/acceptance.py``: recorded with a real model,
  per prompt and window; ``--acceptance``, default the embedded model's): its recorded rounds, every one, with
  their tokens per forward and a bootstrap interval over prompts. Beyond the recorded windows by a stated rule
  (``extend``): ``hold`` keeps the tokens per forward of the largest recorded window inside; ``log`` adds the
  recorded slope per doubling of rows (or ``--slope``'s, a what-if for the Lookahead paper's log-linear law).
* **What a window costs** is priced by the one pricing path the auto preset uses (``search.price``): every
  recorded round replayed at P ranks through the engine's own sharding (``costmodel.rank_rows``), the busiest
  rank's forward on the curve at that round's rows (on a GPU padded to the engine's row buckets,
  ``backends.buckets``), plus the host time at its rows and the all_gather of the link (``hardware``). A curve
  is a measured one (made monotone) or ``hardware.Roofline``, evaluated at the exact row count.
* **The search** starts from the recorded windows (smallest first; a larger one replaces the best only when it is
  ``MARGIN`` cheaper per token) and moves W, N, G one at a time (``search.coordinate_search``, the same 1% rule)
  over W, G up to about P x knee / (N - 1) and N up to ``MAX_NGRAM``, W and G free of each other.

Pure: no model, no device. Example (``tests/studies/test_simulate.py``): a curve flat to 128 rows then linear, and
acceptance that grows with the window: P = 1 runs a window near the knee, P = 8 a larger one whose share per rank
sits under the knee, and is faster; on acceptance flat in the window P = 8 keeps P = 1's window and only adds the
all_gather.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from lp_runner.config import MAX_ROUND_ROWS, LookaheadConfig
from lp_runner.decoding.layout import RowCounts
from lp_runner.studies.hardware import Interconnect
from lp_runner.tuning.acceptance import Table, bootstrap, decode_tpf, slope_per_doubling
from lp_runner.tuning.costmodel import CostCurve, HostCost, RoundShape, rank_rows
from lp_runner.tuning.search import MIN_GAIN, coordinate_search, price

EXTEND_RULES = ("hold", "log")
MARGIN = MIN_GAIN  # a window (or a split) is named better only when it is this much cheaper per token
MAX_NGRAM = 15
# W and G tried by the search (roughly x1.5 apart), each up to about P x knee / (N - 1) (``_within_reach``)
WIDTHS = (1, 2, 3, 4, 5, 7, 10, 15, 23, 31, 47, 63, 95, 127, 191, 255, 383, 511, 767, 1023)
NGRAMS = tuple(range(3, MAX_NGRAM + 1))
SLOPE_DRAWS = 400  # bootstrap draws of the slope's interval (prompts resampled)
# What the Lookahead paper (Fu et al., 2024) reports for lookahead and LP on GPUs: its figures, not simulated or
# measured here, so they stand in their own rows and never in a "speed vs" column.
PAPER_LP = (
    "Lookahead decoding on one GPU: 1.5-2.3x faster than greedy decoding (the paper's reported range)",
    "Lookahead Parallelism: up to ~4x with 8 GPUs on code completion (the paper's reported figure)",
)


@dataclass(frozen=True)
class Window:
    """W, N, G; W = 0 is plain decoding (no window, no candidates)."""

    window_size: int
    ngram_size: int
    verification_set_size: int

    @property
    def plain(self) -> bool:
        return self.window_size == 0

    def label(self) -> str:
        return "plain decoding" if self.plain else f"{self.window_size}-{self.ngram_size}-{self.verification_set_size}"

    def to_dict(self) -> dict:
        return {"W": self.window_size, "N": self.ngram_size, "G": self.verification_set_size}

    def lookahead(self) -> LookaheadConfig:
        """The fixed setting of this window (preset off, nothing else tuned), as the acceptance was recorded."""
        if self.plain:
            return LookaheadConfig(preset="off", lookahead_branch=False, verification_set_size=0)
        return LookaheadConfig(
            preset="off",
            window_size=self.window_size,
            ngram_size=self.ngram_size,
            verification_set_size=self.verification_set_size,
        )


PLAIN = Window(0, 0, 0)


@dataclass(frozen=True)
class Acceptance:
    """What a window buys: its rounds per prompt (replayed at any P) and its tokens per forward over the decode
    rounds, with a 95% interval over prompts (None where it is not a recording's)."""

    window: Window
    shapes: tuple[tuple[RoundShape, ...], ...]  # per prompt, the prefill round first
    tokens_per_forward: float
    interval: tuple[float, float] | None
    rows: float  # mean rows per decode round at P = 1
    source: str  # "recorded ...", "extended (rule) from ...", "by definition"

    @property
    def recorded(self) -> bool:
        return self.source.startswith("recorded") or self.window.plain


def decode_rows(shapes: Sequence[Sequence[RoundShape]]) -> list[list[int]]:
    """Rows of every decode round at P = 1, per prompt (the engine's own round size)."""
    return [[q for ((q, _),) in rank_rows(prompt, 1)[1:]] for prompt in shapes]


def _records(shapes: Sequence[Sequence[RoundShape]]) -> list[dict]:
    """Per prompt, what ``acceptance.decode_tpf`` and ``acceptance.mean_rows`` read: the emitted tokens of each
    round (row[6]) and its rows, round 0 the prefill."""
    rows = decode_rows(shapes)
    return [
        {"shapes": [[0] * 6 + [s.emitted] for s in prompt], "rows": [0, *r]}
        for prompt, r in zip(shapes, rows, strict=True)
    ]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def shift_kv(shapes: Sequence[Sequence[RoundShape]], kv_len: int) -> tuple[tuple[RoundShape, ...], ...]:
    """Each prompt's rounds moved so its first decode round sees ``kv_len`` cached positions (``--kv-len``: a
    longer context than the recording's prompts), every later round as many positions further."""
    out = []
    for prompt in shapes:
        if len(prompt) < 2:
            out.append(tuple(prompt))
            continue
        delta = kv_len - prompt[1].kv_len
        out.append((prompt[0], *(dataclasses.replace(s, kv_len=max(s.kv_len + delta, 0)) for s in prompt[1:])))
    return tuple(out)


def _plain_shapes(table: Table) -> tuple[tuple[RoundShape, ...], ...]:
    """Plain decoding of the table's greedy outputs: the prompt's prefill, then one row and one token a round."""
    out = []
    for s in table.prior.samples:
        n, kv = len(s.output_ids), len(s.prompt_ids)
        rounds = [RoundShape(0, kv, 0, -1, (), -1, 1)]
        rounds += [RoundShape(kv + i - 1, 1, 0, -1, (), -1, 1) for i in range(1, n)]
        out.append(tuple(rounds))
    return tuple(out)


def acceptance_of(table: Table, kv_len: int | None = None) -> list[Acceptance]:
    """Plain decoding first, then every window of ``table`` (``acceptance.load_table``), in order of rows."""
    plain = _plain_shapes(table)
    if kv_len is not None:
        plain = shift_kv(plain, kv_len)
    found = [Acceptance(PLAIN, plain, 1.0, (1.0, 1.0), 1.0, "by definition")]
    for rec in table.prior.recorded:
        la = rec.lookahead
        if not la.lookahead_branch or not rec.shapes:
            continue
        shapes = rec.shapes if kv_len is None else shift_kv(rec.shapes, kv_len)
        recs = _records(shapes)
        lo, hi = bootstrap(recs, decode_tpf) if len(recs) > 1 else (decode_tpf(recs),) * 2
        found.append(
            Acceptance(
                Window(la.window_size, la.ngram_size, la.verification_set_size),
                tuple(tuple(p) for p in shapes),
                decode_tpf(recs),
                (lo, hi),
                _mean([x for r in recs for x in r["rows"][1:]]),
                f"recorded {rec.name} ({len(shapes)} prompts, {sum(len(p) - 1 for p in shapes)} decode rounds)",
            )
        )
    return [found[0], *sorted(found[1:], key=lambda a: a.rows)]


def fitted_slope(table: Sequence[Acceptance]) -> float | None:
    """Tokens per forward gained per doubling of rows over the recorded windows (``acceptance.slope_per_doubling``);
    None with fewer than two windows of different rows."""
    windows = [a for a in table if not a.window.plain and a.recorded]
    if len({round(a.rows, 6) for a in windows}) < 2:
        return None
    return slope_per_doubling([(a.rows, a.tokens_per_forward) for a in windows])


def slope_interval(table: Sequence[Acceptance], seed: int = 0) -> tuple[float, float, float] | None:
    """The slope per doubling of rows with a 95% interval from resampling prompts (the same prompts in every window
    of a draw: a prompt's windows are paired); None where no slope can be fitted."""
    windows = [a for a in table if not a.window.plain and a.recorded]
    if fitted_slope(table) is None:
        return None
    per = {a.window: _records(a.shapes) for a in windows}
    n = min(len(r) for r in per.values())

    def fit(idx: Sequence[int]) -> float | None:
        pts = []
        for recs in per.values():
            part = [recs[i] for i in idx]
            pts.append((_mean([x for r in part for x in r["rows"][1:]]), decode_tpf(part)))
        try:
            return slope_per_doubling(pts)
        except ValueError:
            return None

    rng = random.Random(seed)
    draws = sorted(x for x in (fit([rng.randrange(n) for _ in range(n)]) for _ in range(SLOPE_DRAWS)) if x is not None)
    point = fit(range(n))
    if point is None or not draws:
        return None
    return point, draws[int(0.025 * len(draws))], draws[int(0.975 * len(draws)) - 1]


def _grow(s: RoundShape, window: Window, base: Window, scale: float) -> RoundShape:
    """One recorded round of ``base`` as ``window`` would plan it: W columns, the depth ramp to N - 2, G's share of
    candidates (count scaled by G / G_base), pool candidates (N_base - 1 long) N - 1 long."""
    if s.depth < 0:
        return dataclasses.replace(s, window_size=window.window_size)
    full = base.ngram_size - 2
    depth = window.ngram_size - 2 if s.depth >= full else min(s.depth, window.ngram_size - 2)
    count = round(len(s.candidates) * scale)
    cands = (
        tuple(
            window.ngram_size - 1 if c == base.ngram_size - 1 else c
            for c in (s.candidates * (count // max(len(s.candidates), 1) + 1))[:count]
        )
        if s.candidates
        else ()
    )
    winner = min(s.winner, len(cands) - 1) if cands and s.winner >= 0 else -1
    return dataclasses.replace(s, window_size=window.window_size, depth=depth, candidates=cands, winner=winner)


def extend(table: Sequence[Acceptance], window: Window, rule: str = "hold", slope: float | None = None) -> Acceptance:
    """``window``'s acceptance: the recorded one where it was recorded, else by ``rule`` from the largest recorded
    window inside it (its rounds replanned for ``window``: ``_grow``).

    ``hold``: the base's tokens per forward (no growth assumed past what was recorded). ``log``: the base's plus
    ``slope`` (default the recorded ``fitted_slope``) per doubling of the window's rows over the base's, never below
    ``hold``'s. Example: base 2.0 at 60 rows, slope 0.2: a window of 240 rows extends to 2.4 under ``log``."""
    if rule not in EXTEND_RULES:
        raise ValueError(f"unknown extension rule {rule!r}; use one of {EXTEND_RULES}")
    for acc in table:
        if acc.window == window:
            return acc
    inside = [
        a
        for a in table
        if not a.window.plain
        and a.recorded
        and a.window.window_size <= window.window_size
        and a.window.ngram_size <= window.ngram_size
        and a.window.verification_set_size <= window.verification_set_size
    ]
    if not inside:
        raise ValueError(f"no recorded window inside {window.label()} to extend from")
    base = max(inside, key=lambda a: (a.tokens_per_forward, a.rows))
    scale = window.verification_set_size / max(base.window.verification_set_size, 1)
    shapes = tuple(tuple(_grow(s, window, base.window, scale) for s in p) for p in base.shapes)
    rows = _mean([x for p in decode_rows(shapes) for x in p])
    gain = 0.0
    if rule == "log":
        s = fitted_slope(table) if slope is None else slope
        gain = max((s or 0.0) * math.log2(max(rows, 1.0) / max(base.rows, 1.0)), 0.0)
    lo, hi = base.interval or (base.tokens_per_forward,) * 2
    return Acceptance(
        window,
        shapes,
        base.tokens_per_forward + gain,
        (lo + gain, hi + gain),
        rows,
        f"extended ({rule}) from {base.window.label()}",
    )


@dataclass(frozen=True)
class Host:
    """Host time per round and where it comes from (every report says which)."""

    cost: HostCost
    label: str


@dataclass(frozen=True)
class Point:
    """One window priced at one P: per decode round the busiest rank's forward, the host's time and the
    all_gather, in ms; ms per token = their sum / tokens per forward."""

    workers: int
    window: Window
    busiest_rows: float  # the busiest rank's rows, mean over decode rounds
    tokens_per_forward: float
    interval: tuple[float, float] | None
    forward_ms: float
    host_ms: float
    collective_ms: float
    ms_per_token: float
    acceptance_source: str

    @property
    def round_ms(self) -> float:
        return self.forward_ms + self.host_ms + self.collective_ms

    def to_dict(self) -> dict:
        return {
            "workers": self.workers,
            "window": self.window.to_dict(),
            "busiest_rank_rows": round(self.busiest_rows, 1),
            "tokens_per_forward": round(self.tokens_per_forward, 3),
            "tokens_per_forward_interval": [round(x, 3) for x in self.interval] if self.interval else None,
            "forward_ms": round(self.forward_ms, 4),
            "host_ms": round(self.host_ms, 4),
            "collective_ms": round(self.collective_ms, 4),
            "ms_per_token": round(self.ms_per_token, 4),
            "acceptance": self.acceptance_source,
        }


def payload_bytes(window: Window) -> int:
    """One rank's all_gather payload: header, N emitted, W columns, int64 (as ``parallel/exchange.py`` sends)."""
    return 8 * (4 + window.ngram_size + window.window_size)


def price_window(
    acc: Acceptance, workers: int, curve: CostCurve, host: Host, link: Interconnect, row_plan: RowCounts | None
) -> Point:
    """``acc``'s window at P = ``workers``, by ``search.price`` (the auto preset's pricing): every recorded round
    replayed; ms per token over the rule's tokens per forward where the window is extended."""
    step = link.all_gather_s(workers, payload_bytes(acc.window)) / (workers - 1) if workers > 1 else 0.0
    scored = price(acc.window.lookahead(), acc.shapes, curve, workers, step, host.cost, row_plan)
    rounds = max(scored.rounds, 1)
    seconds = scored.forward_s + scored.host_s + scored.comm_s
    ms = scored.ms_per_token if acc.recorded else 1e3 * seconds / (rounds * acc.tokens_per_forward)
    return Point(
        workers,
        acc.window,
        scored.mean_rows,
        acc.tokens_per_forward if not acc.recorded else scored.tokens_per_forward,
        acc.interval,
        1e3 * scored.forward_s / rounds,
        1e3 * scored.host_s / rounds,
        1e3 * scored.comm_s / rounds,
        ms,
        acc.source,
    )


def knee_rows(curve: CostCurve, kv_len: int, tolerance: float = 0.1, top: int = MAX_ROUND_ROWS) -> int:
    """The most rows a forward takes within ``tolerance`` of one row's cost (the curve is monotone: a binary
    search), up to ``top`` or a measured curve's last point."""
    if isinstance(curve, CostCurve):
        top = min(top, max(p.rows for p in curve.points))
    limit = curve.seconds(1, 1, kv_len) * (1 + tolerance)
    lo, hi = 1, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if curve.seconds(mid, 1, kv_len) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _within_reach(w: int, n: int, workers: int, knee: int) -> bool:
    """W or G worth trying at P = ``workers``: up to about P x knee / (N - 1) (a rank's share of that many columns
    of N - 1 rows sits at the knee); 1.5x that, so the ladder's next step past the knee is tried too."""
    return w <= max(1.5 * workers * knee / max(n - 1, 1), 1)


@dataclass
class Search:
    """One P's window search: every window priced, and the winner."""

    best: Point
    priced: dict[Window, Point]


def best_window(
    table: Sequence[Acceptance],
    workers: int,
    curve: CostCurve,
    host: Host,
    link: Interconnect,
    row_plan: RowCounts | None,
    knee: int,
    rule: str = "hold",
    slope: float | None = None,
    extended: dict[Window, Acceptance | None] | None = None,
) -> Search:
    """The cheapest window per token at P = ``workers`` under the ``MARGIN`` rule (module docstring).
    ``extended``: windows already extended by the same rule (shared between the P values of one simulation)."""
    priced: dict[Window, Point] = {}
    known = {a.window: a for a in table}
    extended = {} if extended is None else extended

    def point(window: Window) -> Point | None:
        if window not in priced:
            acc = known.get(window)
            if acc is None:
                if window not in extended:
                    try:
                        extended[window] = extend(table, window, rule, slope)
                    except ValueError:
                        extended[window] = None
                acc = extended[window]
                if acc is None:
                    return None
            priced[window] = price_window(acc, workers, curve, host, link, row_plan)
        return priced[window]

    windows = [a for a in table if not a.window.plain]
    start = None
    for acc in windows:  # in order of rows: a larger window must be MARGIN cheaper
        p = point(acc.window)
        if start is None or p.ms_per_token < start.ms_per_token * (1 - MARGIN):
            start = p
    if start is not None:

        def evaluate(la: LookaheadConfig) -> tuple[float, int] | None:
            w = Window(la.window_size, la.ngram_size, la.verification_set_size)
            if w not in known and not (
                _within_reach(w.window_size, w.ngram_size, workers, knee)
                and _within_reach(w.verification_set_size, w.ngram_size, workers, knee)
            ):
                return None
            p = point(w)
            return None if p is None else (p.ms_per_token, workers)

        space = {"window_size": WIDTHS, "ngram_size": NGRAMS, "verification_set_size": WIDTHS}
        la, _ = coordinate_search(start.window.lookahead(), evaluate, space, max_passes=3, min_gain=MARGIN)
        start = point(Window(la.window_size, la.ngram_size, la.verification_set_size))
    plain = point(PLAIN)
    best = start if start is not None and start.ms_per_token < plain.ms_per_token * (1 - MARGIN) else plain
    return Search(best, priced)


@dataclass(frozen=True)
class Inputs:
    """Everything a simulation prices with besides the acceptance (one object, so the band reruns it)."""

    curve: CostCurve
    host: Host
    link: Interconnect
    row_plan: RowCounts | None
    kv_len: int  # the K/V length the knee is read at


def simulate(
    table: Sequence[Acceptance],
    workers: Sequence[int],
    inputs: Inputs,
    rule: str = "hold",
    slope: float | None = None,
) -> dict:
    """Per P: the best window and its figures (``Point.to_dict``), ``speed_vs_p1`` (P = 1's ms per token over
    this P's, > 1 faster; None where P = 1 is not among ``workers``), ``speed_vs_plain`` (plain decoding on one
    device over this P's) and ``same_window_as_p1_ms_per_token`` (what LP buys without its lever). Simulated."""
    workers = sorted(set(workers))
    knee = knee_rows(inputs.curve, inputs.kv_len)
    args = (inputs.curve, inputs.host, inputs.link, inputs.row_plan)
    extended: dict[Window, Acceptance | None] = {}
    searches = {p: best_window(table, p, *args, knee, rule, slope, extended) for p in workers}
    points = [searches[p].best for p in workers]
    plain = price_window(table[0], 1, *args)
    one = searches[1].best if 1 in searches else None
    rows = []
    for pt in points:
        d = pt.to_dict()
        d["busiest_rank_rows_over_knee"] = round(pt.busiest_rows / knee, 3)
        d["speed_vs_p1"] = round(one.ms_per_token / pt.ms_per_token, 3) if one else None
        d["speed_vs_plain"] = round(plain.ms_per_token / pt.ms_per_token, 3)
        if one is not None:
            same = extend(table, one.window, rule, slope)
            d["same_window_as_p1_ms_per_token"] = round(price_window(same, pt.workers, *args).ms_per_token, 4)
        d["windows_priced"] = len(searches[pt.workers].priced)
        d["simulated"] = True
        rows.append(d)
    return {
        "simulated": True,
        "knee_rows": knee,
        "plain_ms_per_token": round(plain.ms_per_token, 4),
        "points": rows,
        "limits": limits(points, knee),
    }


def band(
    table: Sequence[Acceptance], workers: Sequence[int], inputs: Inputs, interval: tuple[float, float, float]
) -> dict | None:
    """The largest P's speed vs P = 1 under the ``log`` rule at the slope's point and at both ends of its 95%
    interval (``slope_interval``: (point, low, high)): how far the answer moves over what the recording cannot rule
    out. None without P = 1 and a P > 1."""
    ps = sorted(set(workers))
    if 1 not in ps or ps[-1] == 1:
        return None
    top = ps[-1]
    point, low, high = interval
    ratios = {}
    for name, s in (("low", low), ("point", point), ("high", high)):
        pts = {p["workers"]: p for p in simulate(table, [1, top], inputs, "log", s)["points"]}
        ratios[name] = pts[top]["speed_vs_p1"]
    return {
        "workers": top,
        "slope_per_doubling": {"low": round(low, 4), "point": round(point, 4), "high": round(high, 4)},
        "speed_vs_p1": ratios,
        "rule": "log, at the recorded slope's point and the ends of its 95% interval (prompts resampled)",
    }


def limits(points: Sequence[Point], knee: int) -> str:
    """What the largest P's figures come from against the lowest P's, in one sentence of figures."""
    a, b = points[0], points[-1]
    if a is b:
        return "one P only"
    grown = (
        "the same window"
        if a.window == b.window
        else "a larger window"
        if b.tokens_per_forward > a.tokens_per_forward
        else "another window"
    )
    parts = [
        f"P={b.workers} vs P={a.workers}: speed {a.ms_per_token / b.ms_per_token:.2f}x (> 1 faster)",
        f"window {a.window.label()} -> {b.window.label()} ({grown}), tokens per forward {a.tokens_per_forward:.2f} -> "
        f"{b.tokens_per_forward:.2f}",
        f"busiest rank {a.busiest_rows:.0f} -> {b.busiest_rows:.0f} rows against a knee at {knee} rows, forward "
        f"{a.forward_ms:.3f} -> {b.forward_ms:.3f} ms",
        f"host {a.host_ms:.3f} -> {b.host_ms:.3f} ms, collective {a.collective_ms:.3f} -> {b.collective_ms:.3f} ms "
        f"a round ({100 * b.collective_ms / b.round_ms:.0f}% of P={b.workers}'s round)",
    ]
    return "; ".join(parts)


def inputs_dict(
    curve_label: str,
    model_shape: str,
    table: Table,
    host: Host,
    link: Interconnect,
    kv_len: int | None,
    rule: str,
    slope: float | None,
    buckets: bool,
) -> dict:
    """The simulation's inputs, named (every report carries them)."""
    if slope is not None:
        extension = f"what-if: the log-linear law at {slope:g} tokens per forward per doubling of rows (--slope)"
    elif rule == "hold":
        extension = "hold: tokens per forward of the largest recorded window inside"
    else:
        extension = "log: the recorded slope per doubling of rows, from the largest recorded window inside"
    return {
        "curve": curve_label,
        "model_shape": model_shape,
        "acceptance": table.label(),
        "acceptance_model": table.model,
        "acceptance_prompts": table.prompts,
        "extension": extension,
        "rows_priced_at": "the engine's GPU row buckets (backends/buckets.py)" if buckets else "their own count",
        "host": host.label,
        "host_cost": host.cost.to_dict(),
        "interconnect": {
            **asdict(link),
            "bandwidth_Bps": None if math.isinf(link.bandwidth_Bps) else link.bandwidth_Bps,
            "model": "all_gather: fixed + (P - 1) x (step latency + payload / bandwidth)",
        },
        "kv_len": "the recorded rounds' own" if kv_len is None else kv_len,
        "margin": f"a window is named better only when {100 * MARGIN:g}% cheaper per token",
        "excluded": "prefill (the same for every P)",
    }

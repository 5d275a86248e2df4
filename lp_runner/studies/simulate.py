"""Strong scaling simulated with LP's lever: at each P, the window whose per-rank rows the device makes cheapest.

LP splits one round's rows (the window's columns, the candidates) over P ranks. Where a forward costs the same
up to a knee (a GPU: the weights' read dominates until the matmuls catch up), splitting a window that already
fits under the knee saves nothing; what P buys is a *larger* window (more columns and candidates, more tokens
per forward) whose share per rank sits at the knee. So for each P this module searches the window:

* a window (W, N, G) is one representative round (``representative``): W columns at full depth N - 2, the
  candidates its recorded rounds verified on average (count and length), one ordinary row; its rows per rank
  come from the engine's own sharding (``costmodel.rank_rows``: ``column_blocks`` / ``assign_candidates``, with
  the LP re-feed of the last round's tokens on every rank that did not own its winner);
* its tokens per forward come from acceptance recorded with a real model at that window (``acceptance``: the
  shipped ``lp_runner/tuning/data/acceptance/``, the embedded SmolLM2-135M on 8 calibration prompts);
  beyond the recorded windows by a stated rule (``extend``): ``hold`` (default) keeps the largest recorded
  value that the window contains, so a window past the recording only costs; ``log`` extends the fitted line of
  tokens per forward against ln(rows of the window at P = 1) past the largest recorded window;
* a round costs the busiest rank's forward on the curve, plus host time (``HostCost`` at its rows; labelled:
  measured with the curve, given, or left out) and the all_gather of a named interconnect (``hardware``);
  ms per token = that / tokens per forward. Plain decoding (one row, one token) is always a candidate.

Pure: no model, no device; milliseconds for P = 1..8. Example (``tests/studies/test_simulate.py``): a curve flat
to 128 rows then linear, acceptance 1.5 / 2.2 / 3.0 tokens per forward at 4-4-4 / 15-5-15 / 31-7-31: P = 1
runs 15-5-15 (120 rows, under the knee; 31-7-31's 372 rows cost 3.4x), P = 8 runs 31-7-31 (68 rows on the busiest
rank) and is about 1.35x faster; on a curve linear from one row plain decoding wins at every P and P = 8 only
adds the all_gather.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from lp_runner.studies.hardware import Interconnect
from lp_runner.tuning.acceptance import Recorded
from lp_runner.tuning.costmodel import CostCurve, HostCost, RoundShape, rank_rows

EXTEND_RULES = ("hold", "log")
# windows tried beyond the recording (W = G, the Lookahead paper's shape), priced by the extension rule
EXTENDED_WINDOWS = tuple((w, n, w) for w in (47, 63) for n in (7, 8))
# What the Lookahead paper (Fu et al., 2024) reports for lookahead and LP on GPUs: its figures, not simulated or
# measured here, so they stand in their own rows and never in a "vs P=1" column.
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


PLAIN = Window(0, 0, 0)


@dataclass(frozen=True)
class Acceptance:
    """What a window buys, per decode round: tokens per forward and the candidates it verifies on average."""

    window: Window
    tokens_per_forward: float
    candidates: float  # candidates per round
    candidate_rows: float  # rows per candidate
    source: str  # "recorded ..." or "extended (rule) from ..."


def acceptance(recorded: Sequence[Recorded]) -> list[Acceptance]:
    """Each recorded window setting's decode rounds (the prefill round of every prompt left out) as one
    ``Acceptance``; plain decoding (one token per forward) first."""
    out = [Acceptance(PLAIN, 1.0, 0.0, 0.0, "by definition")]
    for rec in recorded:
        la = rec.lookahead
        if not la.lookahead_branch:
            continue
        rounds = [s for prompt in rec.shapes for s in prompt[1:]]
        if not rounds:
            continue
        cands = [c for s in rounds for c in s.candidates]
        out.append(
            Acceptance(
                Window(la.window_size, la.ngram_size, la.verification_set_size),
                sum(s.emitted for s in rounds) / len(rounds),
                len(cands) / len(rounds),
                sum(cands) / len(cands) if cands else 0.0,
                f"recorded {rec.name} ({len(rec.shapes)} prompts, {len(rounds)} rounds)",
            )
        )
    return out


def window_rows(acc: Acceptance) -> int:
    """Rows of ``acc``'s representative round at P = 1."""
    return sum(q for q, _ in rank_rows([representative(acc)] * 2, 1)[1])


def extend(table: Sequence[Acceptance], window: Window, rule: str = "hold") -> Acceptance:
    """``window``'s acceptance from ``table``: the recorded one where it was recorded, else by ``rule``.

    The candidates verified per round scale with G as in the largest recorded window it contains, and each is N - 1
    rows longer or shorter with N. ``hold``: tokens per forward of that window (no growth assumed past what was
    recorded). ``log``: the least-squares line of tokens per forward against ln(rows at P = 1) over the recorded
    windows, at this window's rows, never below ``hold``'s value. Example: recorded 1.5 at 60 rows and 2.0 at 240
    rows -> slope 0.5 / ln 4; a window of 960 rows extends to 2.5 under ``log``, stays 2.0 under ``hold``."""
    if rule not in EXTEND_RULES:
        raise ValueError(f"unknown extension rule {rule!r}; use one of {EXTEND_RULES}")
    for acc in table:
        if acc.window == window:
            return acc
    windows = [a for a in table if not a.window.plain]
    inside = [
        a
        for a in windows
        if a.window.window_size <= window.window_size
        and a.window.ngram_size <= window.ngram_size
        and a.window.verification_set_size <= window.verification_set_size
    ]
    if not inside:
        raise ValueError(f"no recorded window inside {window.label()} to extend from")
    base = max(inside, key=lambda a: (a.tokens_per_forward, window_rows(a)))
    share = base.candidates / max(base.window.verification_set_size, 1)
    rows = max(base.candidate_rows + window.ngram_size - base.window.ngram_size, 1.0)
    grown = Acceptance(window, base.tokens_per_forward, share * window.verification_set_size, rows, "")
    tpf = base.tokens_per_forward
    if rule == "log" and len(windows) >= 2:
        xs = [math.log(window_rows(a)) for a in windows]
        ys = [a.tokens_per_forward for a in windows]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
        tpf = max(tpf, my + slope * (math.log(window_rows(grown)) - mx))
    return replace(grown, tokens_per_forward=tpf, source=f"extended ({rule}) from {base.window.label()}")


def representative(acc: Acceptance, kv_len: int = 512) -> RoundShape:
    """One decode round of ``acc``'s window: full depth, its mean candidates (rounded), one ordinary row, the
    first candidate winning with its tokens per forward (rounded) emitted."""
    w = acc.window
    count, rows = round(acc.candidates), max(round(acc.candidate_rows), 1)
    return RoundShape(
        kv_len=kv_len,
        ordinary=1,
        window_size=w.window_size,
        depth=-1 if w.plain else max(w.ngram_size - 2, 0),
        candidates=(rows,) * count,
        winner=0 if count else -1,
        emitted=max(round(acc.tokens_per_forward), 1),
    )


@dataclass(frozen=True)
class Host:
    """Host time per round and where it comes from (every report says which)."""

    cost: HostCost
    label: str


@dataclass(frozen=True)
class Point:
    """One window priced at one P (milliseconds per round; ms per token = round / tokens per forward)."""

    workers: int
    window: Window
    rows_per_rank: tuple[int, ...]
    tokens_per_forward: float
    forward_ms: float
    host_ms: float
    collective_ms: float
    acceptance_source: str

    @property
    def round_ms(self) -> float:
        return self.forward_ms + self.host_ms + self.collective_ms

    @property
    def ms_per_token(self) -> float:
        return self.round_ms / self.tokens_per_forward

    def to_dict(self) -> dict:
        return {
            "workers": self.workers,
            "window": self.window.to_dict(),
            "rows_per_rank": max(self.rows_per_rank),
            "rows_each_rank": list(self.rows_per_rank),
            "tokens_per_forward": round(self.tokens_per_forward, 3),
            "forward_ms": round(self.forward_ms, 4),
            "host_ms": round(self.host_ms, 4),
            "collective_ms": round(self.collective_ms, 4),
            "ms_per_token": round(self.ms_per_token, 4),
            "acceptance": self.acceptance_source,
        }


def price(acc: Acceptance, workers: int, curve: CostCurve, host: Host, link: Interconnect, kv_len: int) -> Point:
    """``acc``'s window at P = ``workers``: the busiest rank's forward (every rank waits for it in the
    all_gather), host time at its rows, the all_gather of the round's payload (header, N emitted, W columns, as
    ``parallel/exchange.py`` sends them, int64)."""
    shape = representative(acc, kv_len)
    ranks = rank_rows([shape, shape], workers)[1]  # the second round: non-owners of the first winner re-feed
    forward = max(curve.seconds(q, lg, kv_len) for q, lg in ranks)
    busiest = max(q for q, _ in ranks)
    payload = 8 * (4 + acc.window.ngram_size + acc.window.window_size)
    return Point(
        workers,
        acc.window,
        tuple(q for q, _ in ranks),
        acc.tokens_per_forward,
        1e3 * forward,
        1e3 * host.cost.seconds(busiest),
        1e3 * link.all_gather_s(workers, payload),
        acc.source,
    )


def candidates(table: Sequence[Acceptance], rule: str) -> list[Acceptance]:
    """Every window the search tries: plain decoding, the recorded windows, and ``EXTENDED_WINDOWS`` by ``rule``."""
    out = list(table)
    seen = {a.window for a in table}
    for w, n, g in EXTENDED_WINDOWS:
        window = Window(w, n, g)
        if window not in seen:
            try:
                out.append(extend(table, window, rule))
            except ValueError:  # nothing recorded inside it: not offered
                continue
    return out


def best_window(
    options: Sequence[Acceptance], workers: int, curve: CostCurve, host: Host, link: Interconnect, kv_len: int
) -> tuple[Point, list[Point]]:
    """The cheapest window per token at P = ``workers`` (ties: fewer rows on the busiest rank), and every window
    priced."""
    priced = [price(a, workers, curve, host, link, kv_len) for a in options]
    return min(priced, key=lambda p: (round(p.ms_per_token, 9), max(p.rows_per_rank))), priced


def knee_rows(curve: CostCurve, kv_len: int, tolerance: float = 0.1) -> int:
    """The most rows a forward takes within ``tolerance`` of one row's cost (up to the curve's last point)."""
    one = curve.seconds(1, 1, kv_len)
    top = max(p.rows for p in curve.points)
    rows = 1
    for q in range(1, top + 1):
        if curve.seconds(q, 1, kv_len) <= one * (1 + tolerance):
            rows = q
    return rows


def simulate(
    table: Sequence[Acceptance],
    workers: Sequence[int],
    curve: CostCurve,
    host: Host,
    link: Interconnect,
    kv_len: int = 512,
    rule: str = "hold",
) -> dict:
    """Per P: the best window and its figures (``Point.to_dict`` plus ``speedup_vs_p1``, the lowest P's ms per
    token over this P's); ``fixed_window``: the lowest P's window kept at every P, which is what LP buys without
    its lever. Every figure is simulated."""
    options = candidates(table, rule)
    workers = sorted(set(workers))
    points = [best_window(options, p, curve, host, link, kv_len)[0] for p in workers]
    base = points[0]
    first = next(a for a in options if a.window == base.window)
    fixed = [price(first, p, curve, host, link, kv_len) for p in workers]
    rows = []
    for pt, fx in zip(points, fixed, strict=True):
        d = pt.to_dict()
        d["speedup_vs_p1"] = round(base.ms_per_token / pt.ms_per_token, 3)
        d["fixed_window_ms_per_token"] = round(fx.ms_per_token, 4)
        d["simulated"] = True
        rows.append(d)
    return {
        "simulated": True,
        "base_workers": base.workers,
        "knee_rows": knee_rows(curve, kv_len),
        "points": rows,
        "windows_tried": [a.window.label() for a in options],
        "limits": limits(points, knee_rows(curve, kv_len)),
    }


def limits(points: Sequence[Point], knee: int) -> str:
    """What the largest P's ratio to the lowest P's comes from, in one sentence of figures."""
    a, b = points[0], points[-1]
    if a is b:
        return "one P only"
    grown = "no growth: the same window" if a.window == b.window else "acceptance growth"
    parts = [
        f"P={b.workers} vs P={a.workers}: {b.ms_per_token / a.ms_per_token:.2f}x the ms per token",
        f"window {a.window.label()} -> {b.window.label()}, tokens per forward {a.tokens_per_forward:.2f} -> "
        f"{b.tokens_per_forward:.2f} ({grown})",
        f"busiest rank {max(a.rows_per_rank)} -> {max(b.rows_per_rank)} rows against a knee at {knee} rows, "
        f"forward {a.forward_ms:.3f} -> {b.forward_ms:.3f} ms",
        f"host {a.host_ms:.3f} -> {b.host_ms:.3f} ms, collective {a.collective_ms:.3f} -> {b.collective_ms:.3f} ms "
        f"a round ({100 * b.collective_ms / b.round_ms:.0f}% of P={b.workers}'s round)",
    ]
    return "; ".join(parts)


def inputs_dict(curve_label: str, model_shape: str, host: Host, link: Interconnect, kv_len: int, rule: str) -> dict:
    """The simulation's inputs, named (every report carries them)."""
    return {
        "curve": curve_label,
        "model_shape": model_shape,
        "acceptance": "the embedded SmolLM2-135M's, recorded on 8 calibration prompts (lp_runner/tuning/data/"
        "acceptance.json)" + ("" if model_shape == "embedded" else f"; it stands in for the {model_shape} shape"),
        "extension": f"{rule}: " + ("tokens per forward held at the largest recorded window inside" if rule == "hold"
                                    else "fitted line of tokens per forward vs ln(window rows), extended"),
        "host": host.label,
        "host_cost": host.cost.to_dict(),
        "interconnect": {
            **asdict(link),
            "bandwidth_Bps": None if math.isinf(link.bandwidth_Bps) else link.bandwidth_Bps,
            "model": "ring all_gather: (P - 1) x (latency + payload / bandwidth)",
        },
        "kv_len": kv_len,
        "excluded": "prefill (the same for every P)",
    }  # fmt: skip

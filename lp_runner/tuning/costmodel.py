"""Cost model: what one round costs on this device, and so what a token costs at any (W, N, G) and any P.

Lookahead wins only where a packed round of Q rows buys more tokens than Q rows cost relative to one row. The
model has three measured inputs and no free parameters:

* ``CostCurve``: seconds of one target forward versus packed rows Q, at one or more K/V lengths, with the LM
  head on one row ("body") and on every row ("all"); a round with L logit rows costs body + (all - body) * L/Q.
  Measured by ``measure_curve`` (interleaved repetitions, so slow drifts of a noisy machine hit every Q alike).
* ``RoundShape``s: what each round of a real greedy run planned (candidate lengths, window depth, the winning
  candidate, tokens emitted). Greedy output does not depend on P (LP is exact and plans the same rounds), so one
  P = 1 run gives every rank's rows at any P through the real sharding functions.
* the per-round communication (all_gather) cost, measured elsewhere and passed in, and the host time per round
  (``HostCost``: the engine's own rounds timed at calibration, a fixed part plus a part per packed row).

``predict`` turns these into seconds per token; ``benchmarks/scaling.py --simulate`` and ``lp_runner tune`` are
its users. Every prediction carries the inputs it came from.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property

import torch

from lp_runner.backends.staging import Rows
from lp_runner.decoding.layout import RowCounts, round_size
from lp_runner.parallel.sharding import assign_candidates, column_blocks, lookahead_rows


@dataclass(frozen=True)
class CurvePoint:
    kv_len: int  # cached positions before the forward
    rows: int  # packed rows Q
    body_s: float  # median seconds, LM head on one row
    all_s: float  # median seconds, LM head on every row


@dataclass(frozen=True)
class HostCost:
    """Host seconds of one round (plan, layout, verification, publication: everything but the forward and the
    collective) as a fixed part plus a part per packed row, measured from the engine's own rounds
    (``calibrate.measure_host``). Why measured: a fixed share of a forward is right for one device only; a fast
    GPU forward makes the host a large share of every round, and the share grows with the rows a round plans.

    ``through`` fits a line through two measured groups of rounds (their median rows and median host seconds),
    so a few slow rounds of a busy machine move neither point. Example: rounds of 1 row at 0.3 ms and of 25 rows
    at 0.9 ms -> row_s = 0.025 ms, round_s = 0.275 ms; seconds(9) = 0.5 ms."""

    round_s: float = 0.0
    row_s: float = 0.0

    def seconds(self, rows: float) -> float:
        return self.round_s + self.row_s * rows

    @classmethod
    def through(cls, groups: Sequence[Sequence[tuple[int, float]]]) -> HostCost:
        """The line through each group's (median rows, median host seconds); a group is one setting's rounds."""
        pts = sorted((_median([r for r, _ in g]), _median([h for _, h in g])) for g in groups if g)
        if not pts:
            return cls()
        (r0, h0), (r1, h1) = pts[0], pts[-1]
        row_s = max((h1 - h0) / (r1 - r0), 0.0) if r1 > r0 else 0.0
        return cls(max(h0 - row_s * r0, 0.0), row_s)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CostCurve:
    """Forward seconds as a function of (rows, logit rows, K/V length); piecewise linear between measurements.
    ``host``: the measured host time per round on the same device (None: not measured, priced as zero)."""

    points: tuple[CurvePoint, ...]
    # the measurement's noise (repetition_spread): 0.0 where unknown (one repetition, a synthetic curve, a cache
    # entry from before it was recorded)
    spread: float = 0.0
    host: HostCost | None = None
    # the noisiest row count's spread (``point_spreads``) and the timed sweeps it ended at (``measure_curve``'s
    # max_spread bounds the former); 0 where unknown
    worst_spread: float = 0.0
    sweeps: int = 0

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a cost curve needs at least one measured point")

    @property
    def kv_lens(self) -> list[int]:
        return list(self._tables[0])

    @cached_property
    def _tables(self) -> tuple[tuple[int, ...], dict[int, tuple[list[int], list[float], list[float]]]]:
        """(K/V lengths ascending, per K/V length its points' rows, body_s and all_s in row order), sorted once:
        the auto preset prices every simulated round of every setting it searches (about 25,000 rounds for a
        re-choice on 4,096 output tokens), and sorting the points per lookup was a third of that search's time."""
        kvs = tuple(sorted({p.kv_len for p in self.points}))
        tables = {}
        for kv in kvs:
            pts = sorted((p for p in self.points if p.kv_len == kv), key=lambda p: p.rows)
            tables[kv] = ([p.rows for p in pts], [p.body_s for p in pts], [p.all_s for p in pts])
        return kvs, tables

    def _at(self, kv_len: int, rows: float, which: str) -> float:
        xs, body, full = self._tables[1][kv_len]
        return _interp(xs, body if which == "body_s" else full, rows)

    def seconds(self, rows: int, logit_rows: int | None = None, kv_len: int | None = None) -> float:
        """Predicted forward seconds; ``logit_rows`` defaults to every row, ``kv_len`` to the first measured."""
        if rows <= 0:
            return 0.0
        logit_rows = rows if logit_rows is None else min(max(logit_rows, 1), rows)
        kvs, tables = self._tables
        kv = kvs[0] if kv_len is None else kv_len

        def at(k: int) -> float:
            xs, body_s, all_s = tables[k]
            full = _interp(xs, all_s, rows)
            if rows == 1:
                return full  # the one row's logits are always computed
            body = _interp(xs, body_s, rows)
            return body + max(full - body, 0.0) * (logit_rows - 1) / (rows - 1)

        return max(_interp(kvs, [at(k) for k in kvs], kv), 0.0)

    def ratio(self, rows: int, kv_len: int | None = None) -> float:
        """Cost of ``rows`` (head on all rows) relative to a one-row forward."""
        return self.seconds(rows, kv_len=kv_len) / self.seconds(1, kv_len=kv_len)

    def monotone(self) -> CostCurve:
        """This curve with no row count cheaper than a smaller one at the same K/V length (each point's times
        raised to the most of the points at fewer rows). Why: a measured curve is noisy, and a point that came
        out cheaper than a smaller row count (3 rows at 0.9x one row's cost, on a CPU) would make rows pay for
        themselves in every choice priced on it. Returns ``self`` where it is monotone already."""
        points, changed = [], False
        for kv in self.kv_lens:
            body = full = 0.0
            for p in sorted((p for p in self.points if p.kv_len == kv), key=lambda p: p.rows):
                body, full = max(body, p.body_s), max(full, p.all_s)
                changed |= (body, full) != (p.body_s, p.all_s)
                points.append(CurvePoint(kv, p.rows, body, full))
        return replace(self, points=tuple(points)) if changed else self

    def to_dict(self) -> dict:
        d = {"points": [asdict(p) for p in self.points], "spread": self.spread}
        if self.sweeps:
            d.update(worst_spread=self.worst_spread, sweeps=self.sweeps)
        return d if self.host is None else {**d, "host": self.host.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> CostCurve:
        host = HostCost(**d["host"]) if d.get("host") is not None else None
        points = tuple(CurvePoint(**p) for p in d["points"])
        worst, sweeps = float(d.get("worst_spread", 0.0)), int(d.get("sweeps", 0))
        return cls(points, float(d.get("spread", 0.0)), host, worst, sweeps)

    @classmethod
    def linear(cls, one_row_s: float, per_row_s: float, max_rows: int = 512, kv_len: int = 0) -> CostCurve:
        """A synthetic curve (tests, what-if studies): t(Q) = one_row_s + per_row_s * (Q - 1), head included."""
        qs = sorted({1, 2, max_rows})
        return cls(
            tuple(CurvePoint(kv_len, q, one_row_s + per_row_s * (q - 1), one_row_s + per_row_s * (q - 1)) for q in qs)
        )


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation; linear extrapolation past either end (a single point is constant)."""
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def measure_curve(
    adapter,
    kv_lens: Sequence[int],
    rows: Sequence[int],
    reps: int = 7,
    sync=None,
    seed: int = 0,
    head_rows: Sequence[int] | None = None,
    tick: Callable[[int, int], None] | None = None,
    max_spread: float | None = None,
    max_reps: int | None = None,
    budget_s: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> CostCurve:
    """Median forward seconds for every (K/V length, Q), head on one row and on all rows.

    ``max_spread``: measured until its spread is bounded: while the repetitions of some (K/V length, Q) disagree
    by more than this (``point_spreads``, the largest), another ``reps`` interleaved sweeps are run, up to
    ``max_reps`` in all (default 4 x ``reps``), and none once the sweeps so far say the next ``reps`` would end
    past ``budget_s`` seconds (None: no time bound). The curve records the spreads and the sweeps it ended at
    (``CostCurve.worst_spread``, ``spread``, ``sweeps``). Why: a curve measured while the machine was busy is
    bent by it (8 rows at 1.65x one row's cost in one start-up calibration, 1.05x an hour later), and every
    choice priced on it follows the bend; more sweeps let the median see through a passing load, and the trimmed
    spread (``point_spreads``) falls as they outvote it. ``clock``: the timer each forward is read with (a test
    injects a fake one to choose what every forward measures).

    Repetitions are interleaved (every Q once per sweep, sweep order rotated), so a slow drift of a shared
    machine spreads over all Q instead of bending the curve. ``sync`` (``device.synchronizer``: a GPU's own sync) runs
    before each clock read on asynchronous devices.

    ``head_rows``: measure the head on every row only at these Q (the quick start-up calibration); elsewhere
    ``all_s`` is ``body_s`` plus the measured cost of one more logit row times (Q - 1). The LM head is one
    matrix product per logit row, independent of how many rows the body ran, so one large Q measures it best.

    ``tick(done, total)``: called after each timed forward (the caller's progress line and time limit: it may
    raise to stop the measurement).
    """
    gen = torch.Generator().manual_seed(seed)
    sync = sync or (lambda: None)
    # one region per K/V length, all alive (every sweep visits every (K/V, Q, head) case), in the job's arena:
    # the rounds a job runs, on the arena it runs them on (a compiled adapter replays its graphs there)
    needs = dict(zip((max(kv_len, 1) for kv_len in kv_lens), curve_needs(kv_lens, rows), strict=True))
    with adapter.arena(list(needs.values())) as arena:
        bound = (max_spread, max_reps if max_reps is not None else 4 * reps, budget_s)
        return _sweep(adapter, arena, needs, rows, reps, head_rows, gen, sync, tick, bound, clock)


def curve_needs(kv_lens: Sequence[int], rows: Sequence[int]) -> list[int]:
    """The positions of each region ``measure_curve`` holds (one per K/V length, all alive): its prefix and the
    most rows a timed round adds. Example: kv_lens (0, 256), rows (1, 8) -> [9, 264]."""
    return [max(kv_len, 1) + max(rows) for kv_len in kv_lens]


def _sweep(
    adapter, arena, sizes, rows, reps, head_rows, gen, sync, tick, bound=(None, 0, None), clock=time.perf_counter
) -> CostCurve:
    """``measure_curve``'s timed forwards, on regions of ``arena`` for ``sizes`` positions per K/V length; ``bound``:
    (max_spread, max_reps, budget_s), more sweeps while a point's spread exceeds max_spread (None: ``reps``
    sweeps), within max_reps and budget_s."""
    caches = {}
    for kv_len, size in sizes.items():
        cache = arena.region(size)
        pre = torch.randint(0, adapter.vocab_size, (kv_len,), generator=gen)
        tril = torch.ones(kv_len, kv_len, dtype=torch.bool).tril()
        adapter.run([Rows.of(pre, torch.arange(kv_len), tril, [kv_len - 1])], [cache])
        caches[kv_len] = cache
    head_at = set(rows) if head_rows is None else set(head_rows)
    if not head_at <= set(rows):
        raise ValueError(f"head_rows {sorted(head_at)} must be among the measured rows {sorted(rows)}")
    cases = [(kv, q, "body_s") for kv in caches for q in rows]
    cases += [(kv, q, "all_s") for kv in caches for q in sorted(head_at)]
    times: dict[tuple[int, int, str], list[float]] = {c: [] for c in cases}
    max_spread, max_reps, budget_s = bound
    target = reps + 1  # sweeps to run, the first a warm-up
    done, rep = 0, 0
    began = clock()
    while True:
        while rep < target:
            k = (rep * 7) % len(cases)
            for kv, q, head in cases[k:] + cases[:k]:
                ids = torch.randint(0, adapter.vocab_size, (q,), generator=gen)
                vis = torch.ones(q, q, dtype=torch.bool).tril()
                logit_rows = torch.arange(q - 1, q) if head == "body_s" else torch.arange(q)
                sync()
                start = clock()
                adapter.run([Rows.of(ids, torch.arange(kv, kv + q), vis, logit_rows)], [caches[kv]])
                sync()
                elapsed = clock() - start
                caches[kv].crop(kv)
                if rep > 0:  # the first sweep warms allocators and kernels
                    times[(kv, q, head)].append(elapsed)
                done += 1
                if tick is not None:
                    tick(done, len(cases) * target)
            rep += 1
        if max_spread is None or target - 1 >= max_reps:
            break
        if max(point_spreads([times[(kv, q, "body_s")] for kv in caches for q in rows]), default=0.0) <= max_spread:
            break
        more = min(target + reps, max_reps + 1)
        if budget_s is not None and (clock() - began) * more / target > budget_s:
            break  # the sweeps so far, scaled to the next target: past the budget (a caller's time limit)
        target = more
    body = {(kv, q): _median(times[(kv, q, "body_s")]) for kv in caches for q in rows}
    full = {(kv, q): _median(times[(kv, q, "all_s")]) for kv in caches for q in head_at}
    per_logit_row = {  # seconds of one more logit row, per K/V length (from the largest Q with a head measured)
        kv: max(full[(kv, q)] - body[(kv, q)], 0.0) / (q - 1) if q > 1 else 0.0 for kv in caches for q in [max(head_at)]
    }
    points = [
        CurvePoint(kv, q, body[(kv, q)], full.get((kv, q), body[(kv, q)] + per_logit_row[kv] * (q - 1)))
        for kv in caches
        for q in rows
    ]
    repetitions = [times[(kv, q, "body_s")] for kv in caches for q in rows]
    worst = max(point_spreads(repetitions), default=0.0)
    return CostCurve(tuple(points), repetition_spread(repetitions), worst_spread=worst, sweeps=target - 1)


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


JITTER_S = 0.002  # what one time slice of another process adds to a forward (see repetition_spread)


def point_spreads(repetitions: Sequence[Sequence[float]]) -> list[float]:
    """Per point measured more than once: how far its repetitions disagree beyond the scheduler's jitter,
    (slowest - fastest - ``JITTER_S``, at least 0) / median, after leaving out the quarter of its repetitions at
    each end (none of fewer than 4). Why trimmed: the full range only grows as repetitions are added, so a
    measurement repeated until its spread is bounded would never stop once one forward met a passing load; with
    the ends left out, repetitions that outvote the load bring it down.

    Example (seconds): [0.10, 0.15, 0.10] -> (0.15 - 0.10 - 0.002) / 0.10 = 0.48; the same with five more 0.10s
    (8 repetitions, 2 left out at each end) -> 0.0."""
    out = []
    for t in repetitions:
        s = sorted(t)
        cut = len(s) // 4
        s = s[cut : len(s) - cut]
        if len(t) > 1 and _median(s) > 0:
            out.append(max(s[-1] - s[0] - JITTER_S, 0.0) / _median(s))
    return out


def repetition_spread(repetitions: Sequence[Sequence[float]]) -> float:
    """How far a curve's repetitions disagree beyond the scheduler's jitter: the median over the points measured
    more than once of ``point_spreads``; 0.0 where none was.

    Why: a curve measured while something else loads the machine (another job, a test suite, a build) is bent by
    it, and every choice priced by it follows the bend; the spread says so. Why less the jitter: a time slice
    lost to another process costs a forward a millisecond or two whatever its size, which is half of a tiny
    model's forward and a twentieth of the embedded model's. Measured with the quick grid on a 2-core
    CPU: the embedded model 0.08-0.22 before the jitter came off on the quiet machine,
    0.61-0.95 with one busy process beside it."""
    rel = sorted(point_spreads(repetitions))
    return rel[len(rel) // 2] if rel else 0.0


PAD_MARGIN = 0.05  # pad only where the curve says the larger row count is at least this much cheaper


@dataclass(frozen=True)
class RowPlan:
    """The row count each round runs at: the cheapest measured count at or above its own (``compile_round`` pads).

    A forward's cost is not monotone in its rows on every device: on one 2-core CPU 2-3 rows cost 1.6-1.9x one
    row while 8 rows cost 1.35x, so a 3-row round is cheaper run as 8 rows. The filler rows compute no logits, so
    both sides of the comparison are the body cost (head on one row). A target must beat the round's own count
    by ``margin`` (a 3-repetition median is noisy), and no round is padded past the largest measured count. A
    start-up calibration's curve is monotone (``calibrate.measure_quick``): on it no round is padded, since a dip
    one measurement found is not a cost the device can be trusted to repeat.

    Example (body ms at K/V 512: 1 -> 56, 2 -> 89, 3 -> 108, 4 -> 85, 8 -> 76, 16 -> 88):
    rows_for(1) = 1, rows_for(2..6) = 8, rows_for(7) = 7 (8 rows within the margin), rows_for(9..16) unchanged.
    """

    kv_lens: tuple[int, ...]  # measured K/V lengths, ascending
    targets: tuple[tuple[int, ...], ...]  # per K/V length: targets[k][q - 1] is the row count for q rows

    @classmethod
    def from_curve(cls, curve: CostCurve, margin: float = PAD_MARGIN) -> RowPlan:
        kvs = curve.kv_lens
        targets = []
        for kv in kvs:
            measured = sorted({p.rows for p in curve.points if p.kv_len == kv})
            row = []
            for q in range(1, measured[-1] + 1):
                own = curve._at(kv, q, "body_s")
                best, best_s = q, own * (1.0 - margin)
                for r in measured:
                    if r > q and curve._at(kv, r, "body_s") < best_s:
                        best, best_s = r, curve._at(kv, r, "body_s")
                row.append(best)
            targets.append(tuple(row))
        return cls(tuple(kvs), tuple(targets))

    @classmethod
    def identity(cls) -> RowPlan:
        """No padding (a plan for devices where the curve is monotone, or padding switched off)."""
        return cls((0,), ((1,),))

    def rows_for(self, rows: int, kv_len: int) -> int:
        """The row count to run a round of ``rows`` rows at, with ``kv_len`` cached positions (the measured K/V
        length at or below it, else the smallest)."""
        k = max(bisect.bisect_right(self.kv_lens, kv_len) - 1, 0)
        table = self.targets[k]
        return table[rows - 1] if 1 <= rows <= len(table) else rows

    @property
    def max_rows(self) -> int:
        """The most rows any padded round can have (bounds the cache a round may touch)."""
        return max(max(t) for t in self.targets)

    def to_dict(self) -> dict:
        return {"kv_lens": list(self.kv_lens), "targets": [list(t) for t in self.targets]}


def batched_curve(curve: CostCurve, batch: int) -> CostCurve:
    """What one generation's round of q rows costs when ``batch`` generations share every forward: a forward of
    batch x q rows (one logit row per generation for the body), divided among them. A search priced with it
    (``preset.AutoPreset``) spends fewer speculative rows per generation where the curve bends: on a CPU whose
    forward costs about the same at 1 and 8 rows but twice as much at 24, a speculative row is nearly free alone
    and costs what it earns in a batch of 8.

    Example (body ms: 1 -> 20, 8 -> 24, 16 -> 32, 48 -> 80), batch 8: q=1 -> 24/8 = 3.0 ms, q=2 -> 32/8 = 4.0 ms,
    q=6 -> 80/8 = 10.0 ms (points up to 48 / 8 rows; linear beyond, as the curve extrapolates)."""
    if batch <= 1:
        return curve
    points = []
    for kv in curve.kv_lens:
        top = max(p.rows for p in curve.points if p.kv_len == kv)
        for q in range(1, max(2, top // batch) + 1):
            rows = batch * q
            body = curve.seconds(rows, batch, kv) / batch
            points.append(CurvePoint(kv, q, body, max(curve.seconds(rows, rows, kv) / batch, body)))
    host = curve.host and HostCost(curve.host.round_s / batch, curve.host.row_s)  # the round's fixed part is shared
    return CostCurve(tuple(points), curve.spread, host)


@dataclass(frozen=True)
class RoundShape:
    """What one round planned and produced; independent of P (see the module docstring)."""

    kv_len: int  # cached positions before the round (on the winner's rank)
    ordinary: int  # ordinary rows at P = 1 (the prompt at prefill, else 1)
    window_size: int
    depth: int  # window depth this round; -1 when the lookahead branch is off
    candidates: tuple[int, ...]  # length of every candidate, in plan order
    winner: int  # global index of the winning candidate, -1 if none held
    emitted: int  # tokens committed


def rank_rows(shapes: Sequence[RoundShape], world_size: int) -> list[list[tuple[int, int]]]:
    """(rows, logit rows) per rank for every round at P = ``world_size``, by the engine's own sharding.

    Ordinary rows at P > 1: the previous round's winning rank has its K/V and feeds the live key alone; every
    other rank re-feeds the emitted tokens (the LP protocol in ``engine.py``). A round's winning rank is the owner
    of its winning candidate, rank 0 when none held (ties go to the lowest rank).
    """
    out: list[list[tuple[int, int]]] = []
    prev_winner_rank, prev_emitted = 0, 1
    for i, s in enumerate(shapes):
        if s.depth >= 0:
            blocks = column_blocks(s.window_size, world_size, s.depth)
            base = [lookahead_rows(b, s.depth) for b in blocks]
        else:
            blocks = ((0, 0),) * world_size
            base = [0] * world_size
        assignment = assign_candidates(list(s.candidates), base)
        per_rank = []
        for r in range(world_size):
            refed = r != prev_winner_rank and i > 0  # LP: this rank lacks the last round's K/V
            ordinary = prev_emitted if refed and world_size > 1 else s.ordinary
            depth = max(s.depth, 0)  # no window: empty column blocks, depth unused
            per_rank.append(round_size(ordinary, blocks[r], depth, [s.candidates[c] for c in assignment[r]]))
        out.append(per_rank)
        owner = next((r for r in range(world_size) if s.winner in assignment[r]), 0)
        prev_winner_rank, prev_emitted = owner, s.emitted
    return out


@dataclass
class Prediction:
    """Predicted time of a recorded run replayed at P ranks; ``simulated`` marks it as not measured."""

    world_size: int
    rounds: int
    tokens: int
    forward_s: float
    comm_s: float
    host_s: float
    mean_rows_max_rank: float
    simulated: bool = True
    inputs: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.forward_s + self.comm_s + self.host_s

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.seconds / self.tokens if self.tokens else float("inf")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(seconds=round(self.seconds, 6), ms_per_token=round(self.ms_per_token, 3))
        return d


def comm_seconds(world_size: int, allgather_2_s: float) -> float:
    """Per-round all_gather cost at P ranks from the measured 2-rank cost: a ring all_gather of a tiny payload
    takes P - 1 latency-bound steps, so (P - 1) x the 2-rank figure (an assumption, recorded with predictions)."""
    return 0.0 if world_size <= 1 else (world_size - 1) * allgather_2_s


def predict(
    shapes: Sequence[RoundShape],
    curve: CostCurve,
    world_size: int = 1,
    allgather_2_s: float = 0.0,
    host_s_per_round: float | HostCost = 0.0,
    skip_prefill: bool = True,
    row_plan: RowCounts | None = None,
) -> Prediction:
    """Seconds for the recorded rounds at P = ``world_size``: per round the slowest rank's forward (each rank
    waits for it in the all_gather), plus communication and host time (a ``HostCost`` prices each round at the
    busiest rank's own rows). The prefill round is left out by default: it is the same for every method and only
    prompt-length dependent. With ``row_plan`` each rank's round costs what the engine runs: its rows padded as
    the plan says (the same function the engine calls)."""
    per_round = rank_rows(shapes, world_size)
    first = 1 if skip_prefill and len(shapes) > 1 else 0
    fwd = 0.0
    rows_max = 0

    def run_rows(q: int, kv_len: int) -> int:
        return q if row_plan is None else row_plan.rows_for(q, kv_len)

    for s, ranks in zip(shapes[first:], per_round[first:], strict=True):
        fwd += max(curve.seconds(run_rows(q, s.kv_len), lg, s.kv_len) for q, lg in ranks)
        rows_max += max(q for q, _ in ranks)
    rounds = len(shapes) - first
    tokens = sum(s.emitted for s in shapes[first:])
    host = host_s_per_round if isinstance(host_s_per_round, HostCost) else HostCost(host_s_per_round)
    return Prediction(
        world_size=world_size,
        rounds=rounds,
        tokens=tokens,
        forward_s=fwd,
        comm_s=rounds * comm_seconds(world_size, allgather_2_s),
        host_s=rounds * host.round_s + rows_max * host.row_s,
        mean_rows_max_rank=rows_max / rounds if rounds else 0.0,
        inputs={
            "allgather_2_rank_us": round(1e6 * allgather_2_s, 1),
            "comm_assumption": "ring all_gather: (P - 1) x the measured 2-rank latency",
            "host_us_per_round": round(1e6 * host.round_s, 1),
            "host_us_per_row": round(1e6 * host.row_s, 3),
            "curve_kv_lens": curve.kv_lens,
        },
    )


def shapes_from_records(records: Sequence, window_size: int) -> list[RoundShape]:
    """The replayable shape of every round of one generation (``GenerationStats.records`` on any rank)."""
    return [
        RoundShape(
            kv_len=r.past_len,
            ordinary=r.ordinary,
            window_size=window_size,
            depth=r.depth,
            candidates=tuple(r.plan_candidates),
            winner=r.winner_candidate,
            emitted=r.emitted,
        )
        for r in records
    ]


def as_one_rank(shapes: Sequence[RoundShape], prompt_len: int) -> list[RoundShape]:
    """A generation's shapes as P = 1 would have run them, from any rank's records: the plan, the winner and the
    emitted tokens are the same at every P (LP is exact and plans the same rounds), but a rank's own K/V length
    and ordinary rows are not (a rank that did not own the last winner re-feeds its tokens). Every rank of a job
    turns its records into the same shapes, so choices priced on them agree (the auto preset's window rounds).
    At P = 1: round 0 feeds the prompt from an empty cache; round i > 0 feeds the live key alone, after
    prompt_len - 1 + the tokens emitted before it."""
    out, kv = [], 0
    for i, s in enumerate(shapes):
        out.append(replace(s, kv_len=kv, ordinary=prompt_len if i == 0 else 1))
        kv = (prompt_len - 1 if i == 0 else kv) + s.emitted
    return out

"""The one search over lookahead settings: one knob space, one coordinate search, one pricing, one gain rule.

A setting is priced the same way everywhere: its rounds' shapes (``costmodel.RoundShape``) replayed at P ranks
on this device's measured forward-cost curve, plus the measured host time per round (``costmodel.HostCost``,
timed from the engine's own rounds by ``calibrate.measure_host``) and the all_gather at P > 1 (``price``). The
search improves one knob at a time over ``SPACE`` and moves only on a predicted gain above ``MIN_GAIN``
(``coordinate_search``). What differs between the two callers is only where a setting's round shapes come from,
and so how much of the space each can afford:

* quick, at start-up (``tuning/preset.py``, every job): a window-off setting's shapes are *simulated* from outputs
  already known (the shipped samples, then the job's own; no model, milliseconds per setting), so the search
  moves the proposal knobs of ``QUICK_KNOBS`` in seconds; window settings, whose rounds depend on the model's own
  guesses, are priced from recorded rounds and offered to the same search as ``extra`` candidates. Quick because
  every job pays for it before its first token.
* thorough, offline (``lp_runner tune``, ``cli/tune.py``): every setting, the window's included, is *run* on the
  model over calibration prompts (``calibrate_setting``: the real shapes, minutes), over every knob of ``SPACE``
  and at every P asked for (the split, ``tuning/split.py``, is priced from the per-P winners). Running is what
  makes it thorough: window settings of any W, N, G are measured, not taken from a recording, and the chosen
  setting's shapes and host time were measured on the model, so the choice is validated by construction.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lp_runner.config import LookaheadConfig, check_lookahead, inert_knobs
from lp_runner.decoding.layout import RowCounts
from lp_runner.errors import ConfigError
from lp_runner.tuning.costmodel import CostCurve, HostCost, RoundShape, RowPlan, predict, shapes_from_records

# The knob space: knobs in search order, each with the values tried. W only matters when the window is on; the
# window reaches W = G = 15 and N = 7 (where rows are nearly free, as on a GPU, wide windows pay). The row cap
# is the knob that meets the curve: with padding, a cap of (cheap row count - 1) makes long proposals free.
SPACE: dict[str, tuple] = {
    "lookahead_branch": (False, True),
    "verification_set_size": (0, 1, 2, 3, 4, 6, 7, 10, 15),  # 0: plain decoding, where no proposal pays its rows
    "max_verify_rows": (0, 1, 2, 3, 4, 5, 7, 9, 11, 15, 23, 31),
    "long_match_ngram": (0, 2, 3, 4),
    "long_match_rows": (0, 4, 7, 11, 15),
    "context_tokens": (2, 3, 4, 6, 8, 10, 14, 16, 20),
    "context_max_ngram": (1, 2, 3, 4),
    "context_min_ngram": (1, 2, 3),
    "window_size": (2, 3, 4, 5, 7, 10, 15),
    "ngram_size": (3, 4, 5, 6, 7),
    "pool_from_prompt": (False, True),
    "pool_from_output": (False, True),
    "candidate_policy": ("context_first", "pool_first"),
}
WINDOW_KNOBS = ("window_size",)  # N also sets the pool's suffix length, so it matters without the window
# The knobs the quick (start-up) search moves, in its order: the proposal knobs that decide a window-off round's
# rows. The window is offered to it as recorded settings (``preset``); the pool and context-length knobs are left
# to ``lp_runner tune``: a start-up search of every knob would cost every job several times as long.
QUICK_KNOBS = ("verification_set_size", "max_verify_rows", "long_match_ngram", "long_match_rows", "context_tokens")
# A knob moves only on a predicted gain above this, in both modes: predictions carry the curve's noise, and
# calibration samples are not the prompts a setting will serve. Why 1% and not 2%: the search is path
# dependent, and a step of 1-2% can open the way to a larger gain (on two of four quiet curves of the embedded
# model on a 2-core CPU, 2% stopped the start-up search 4% short of what 1% reached); ``lp_runner tune
# --min-gain`` raises it where held-back prompts disagree (on SmolLM2 one predicted 1.9% gain measured -3%).
MIN_GAIN = 0.01


def space_of(knobs: Sequence[str]) -> dict[str, tuple]:
    """``SPACE`` restricted to ``knobs``, in their order."""
    return {k: SPACE[k] for k in knobs}


@dataclass
class SettingRun:
    """One setting run on the calibration prompts: its round shapes and measured host and forward time
    (prefill rounds excluded, as ``costmodel.predict`` excludes them)."""

    lookahead: LookaheadConfig
    shapes: list[list[RoundShape]]  # per prompt
    host_s_per_round: float
    tokens: int
    forward_s_per_round: float = 0.0  # measured: checks the cost model against the same rounds

    @property
    def tokens_per_forward(self) -> float:
        rounds = sum(len(s) for s in self.shapes)
        return self.tokens / rounds if rounds else 0.0


@dataclass
class Scored:
    lookahead: LookaheadConfig
    workers: int
    ms_per_token: float
    tokens_per_forward: float
    mean_rows: float  # the busiest rank's rows, mean over the decode rounds
    rounds: int = 0  # decode rounds priced
    # seconds of those rounds: the busiest rank's forwards, the host's share, the all_gathers
    forward_s: float = 0.0
    host_s: float = 0.0
    comm_s: float = 0.0


@dataclass
class TuneResult:
    best: Scored
    base: Scored
    evaluated: list[Scored] = field(default_factory=list)
    per_workers: dict[int, Scored] = field(default_factory=dict)  # the best setting found at each P


def price(
    la: LookaheadConfig,
    shapes: Sequence[Sequence[RoundShape]],
    curve: CostCurve,
    workers: int = 1,
    allgather_2_s: float = 0.0,
    host: HostCost | None = None,
    row_plan: RowCounts | None = None,
) -> Scored:
    """Predicted ms per token of a setting's rounds (per prompt) at P = ``workers``, prefill rounds excluded; with
    ``row_plan`` each round is priced at the row count the engine pads it to (a ``RowPlan``, or on a GPU the
    engine's ``backends.buckets.BucketLadder``: both answer ``rows_for``). ``host``: the measured host time
    (default: the curve's own, ``calibrate.measure_host``). ``curve``: a measured ``CostCurve`` or anything with
    its ``seconds`` and ``host`` (``studies.hardware.Roofline``). The one pricing path: the auto preset, ``tune``
    and ``study --simulate`` all call this, so one setting has one price."""
    host = host or curve.host or HostCost()
    preds = [predict(s, curve, workers, allgather_2_s, host, row_plan=row_plan) for s in shapes]
    seconds = sum(p.seconds for p in preds)
    tokens = sum(p.tokens for p in preds)
    rounds = sum(p.rounds for p in preds)
    rows = sum(p.mean_rows_max_rank * p.rounds for p in preds)
    return Scored(
        lookahead=la,
        workers=workers,
        ms_per_token=1e3 * seconds / tokens if tokens else float("inf"),
        tokens_per_forward=tokens / rounds if rounds else 0.0,
        mean_rows=rows / rounds if rounds else 0.0,
        rounds=rounds,
        forward_s=sum(p.forward_s for p in preds),
        host_s=sum(p.host_s for p in preds),
        comm_s=sum(p.comm_s for p in preds),
    )


def _key(la: LookaheadConfig) -> tuple:
    """Settings that behave identically share a key: every knob inert in ``la`` (each declares when, in
    ``config.LookaheadConfig``) is left out."""
    inert = inert_knobs(la)
    return tuple(sorted((k, v) for k, v in dataclasses.asdict(la).items() if k not in inert))


def coordinate_search(
    base: LookaheadConfig,
    evaluate: Callable[[LookaheadConfig], tuple[float, int] | None],
    space: dict[str, Sequence] | None = None,
    max_passes: int = 3,
    min_gain: float = 0.0,
    extra: Sequence[LookaheadConfig] = (),
) -> tuple[LookaheadConfig, dict[tuple, tuple[LookaheadConfig, float, int]]]:
    """Improve one knob at a time; ``evaluate`` returns (ms per token, workers) or None for an invalid setting.

    Returns the best setting and every evaluation (memoised by behaviour, so each distinct setting runs once).
    The search moves only on a predicted gain larger than ``min_gain`` (relative; both callers pass
    ``MIN_GAIN``). ``extra``: whole settings tried after the passes under the same rule (the quick search's
    recorded window settings, which it cannot reach one knob at a time); a knob the caller pins is simply left
    out of ``space``, and an ``extra`` setting that contradicts a pin is the caller's to leave out.
    """
    space = SPACE if space is None else space
    seen: dict[tuple, tuple[LookaheadConfig, float, int]] = {}

    def value(la: LookaheadConfig) -> float:
        k = _key(la)
        if k not in seen:
            try:
                check_lookahead(la)
            except ConfigError:
                return float("inf")
            got = evaluate(la)
            if got is None:
                return float("inf")
            seen[k] = (la, got[0], got[1])
        return seen[k][1]

    best = base
    best_v = value(best)
    for _ in range(max_passes):
        changed = False
        for knob, values in space.items():
            if knob in WINDOW_KNOBS and not best.lookahead_branch:
                continue
            for v in values:
                for cand in _moves(best, knob, v, space):
                    cv = value(cand)
                    if cv < best_v * (1.0 - min_gain):
                        best, best_v, changed = cand, cv, True
        if not changed:
            break
    for cand in extra:
        cv = value(cand)
        if cv < best_v * (1.0 - min_gain):
            best, best_v = cand, cv
    return best, seen


def _moves(best: LookaheadConfig, knob: str, v, space: dict[str, Sequence]) -> list[LookaheadConfig]:
    """The settings one coordinate step tries for ``knob = v``. Switching the window on is tried at every W in the
    space: W was inert while it was off, so the base's W (sized for a GPU) would otherwise decide alone whether a
    window pays, and a small window can pay where a large one cannot."""
    if knob == "lookahead_branch" and v and not best.lookahead_branch:
        widths = space.get("window_size", (best.window_size,))
        return [dataclasses.replace(best, lookahead_branch=True, window_size=w) for w in widths]
    return [dataclasses.replace(best, **{knob: v})]


def calibrate_setting(adapter, prompts: Sequence[Sequence[int]], la: LookaheadConfig, gen, eos_ids) -> SettingRun:
    """Run one setting greedily on the calibration prompts (P = 1; shapes at other P are replayed): the thorough
    mode's source of shapes, and its measured host and forward time per round (logged beside the prediction)."""
    from lp_runner.decoding.engine import LookaheadEngine

    engine = LookaheadEngine(adapter, la, gen, eos_ids)
    shapes, host, forward, rounds, tokens = [], 0.0, 0.0, 0, 0
    for ids in prompts:
        res = engine.generate(ids)
        shapes.append(shapes_from_records(res.stats.records, la.window_size))
        host += sum(r.host_s for r in res.stats.records[1:])
        forward += sum(r.forward_s for r in res.stats.records[1:])
        rounds += max(res.stats.rounds - 1, 0)
        tokens += sum(r.emitted for r in res.stats.records[1:])
    n = max(rounds, 1)  # no rounds beyond the prefill: nothing was timed either
    return SettingRun(la, shapes, host / n, tokens, forward / n)


def tune(
    adapter,
    prompts: Sequence[Sequence[int]],
    base: LookaheadConfig,
    gen,
    eos_ids: Sequence[int],
    curve: CostCurve,
    workers: Sequence[int] = (1,),
    allgather_2_s: float = 0.0,
    space: dict[str, Sequence] | None = None,
    log: Callable[[str], None] = lambda s: None,
    max_passes: int = 3,
    min_gain: float = MIN_GAIN,
    host: HostCost | None = None,
) -> TuneResult:
    """The thorough search: settings run on ``prompts`` and priced by predicted time per token, once per P in
    ``workers``.

    Each P gets its own coordinate search from ``base`` (the best setting at P = 4 may run a wider window than the
    best at P = 1); the searches share the calibration runs, so a setting two searches visit runs once and is
    priced at every P. ``best`` is the fastest of the per-P winners (ties: the smaller P). ``host``: the measured
    host time (``calibrate.measure_host``; default the curve's own), the same model the start-up preset prices."""
    scored: dict[tuple, list[Scored]] = {}  # per behaviour key: the setting priced at every P, in ``workers`` order

    def options(la: LookaheadConfig) -> list[Scored]:
        k = _key(la)
        if k not in scored:
            start = time.perf_counter()
            cal = calibrate_setting(adapter, prompts, la, gen, eos_ids)
            row_plan = RowPlan.from_curve(curve) if la.pad_rows else None
            scored[k] = [price(la, cal.shapes, curve, p, allgather_2_s, host, row_plan) for p in workers]
            first = scored[k][0]
            priced = "  ".join(f"P={s.workers} {s.ms_per_token:7.2f}" for s in scored[k])
            log(
                f"{describe(la):58s} tokens/forward {first.tokens_per_forward:5.2f}  rows {first.mean_rows:5.1f}  "
                f"predicted {priced} ms/token  (host measured {1e6 * cal.host_s_per_round:.0f} us/round; "
                f"{time.perf_counter() - start:.0f} s)"
            )
        return scored[k]

    per_workers: dict[int, Scored] = {}
    for i, p in enumerate(workers):
        if len(workers) > 1:
            log(f"searching the best setting at P={p}")

        def evaluate(la: LookaheadConfig, i: int = i) -> tuple[float, int]:
            s = options(la)[i]
            return s.ms_per_token, s.workers

        best_p, _ = coordinate_search(base, evaluate, space, max_passes, min_gain)
        per_workers[p] = options(best_p)[i]

    def fastest(candidates: Sequence[Scored]) -> Scored:
        return min(candidates, key=lambda s: (s.ms_per_token, s.workers))

    flat = [s for priced in scored.values() for s in priced]
    return TuneResult(
        best=fastest(list(per_workers.values())), base=fastest(options(base)), evaluated=flat, per_workers=per_workers
    )


def describe(la: LookaheadConfig) -> str:
    """One line naming what a setting does (shared by the tuner's log and the run summary)."""
    window = f"W={la.window_size} N={la.ngram_size}" if la.lookahead_branch else f"no window N={la.ngram_size}"
    ctx = f"ctx {la.context_min_ngram}-{la.context_max_ngram}/{la.context_tokens}" if la.context_lookup else "no ctx"
    pool = ("p" if la.pool_from_prompt else "-") + ("o" if la.pool_from_output else "-")
    cap = f" rows<={la.max_verify_rows}" if la.max_verify_rows else ""
    if la.long_match_ngram and la.context_lookup:
        cap += f" (match>={la.long_match_ngram}: rows<={la.long_match_rows or 'any'})"
    return f"{window} G={la.verification_set_size}{cap} {ctx} pool {pool} {la.candidate_policy}"

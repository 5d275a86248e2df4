"""One rank's round: its state, the round itself (layout, forward, verdict) and the publication of a decision.

``run_round`` computes; it publishes nothing: the only thing it changes is the cache, which holds the round's
rows past the committed length until ``publish`` keeps the winner's accepted rows (or crops them on a failed
forward). ``publish`` applies the round's ``Decision`` (the same on every rank) to the state: committed tokens,
K/V (copy the winner's rows, or crop and re-feed the emitted tokens next round: no K/V crosses devices) and the
window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from lp_runner.backends.adapter import ModelAdapter, crop, move_rows
from lp_runner.decoding.coordinator import RoundPlan
from lp_runner.decoding.layout import RoundLayout, RowCounts, compile_round, pad_layout
from lp_runner.decoding.verify.greedy import Verdict
from lp_runner.decoding.verify.verifier import Verifier
from lp_runner.decoding.window import JacobiWindow
from lp_runner.parallel.exchange import Decision


@dataclass
class RoundState:
    """What one rank carries from round to round of a generation."""

    history: list[int]  # every committed token: prompt, then output
    pending: list[int]  # committed tokens not yet in this rank's cache; the last is the live key
    past_len: int  # positions in the cache, all committed
    window: JacobiWindow
    cache: Any  # the adapter's cache (``ModelAdapter.new_cache``)

    @property
    def live(self) -> int:
        return self.pending[-1]


@dataclass(frozen=True)
class RoundResult:
    """This rank's outcome of one round, before the ranks agree."""

    layout: RoundLayout
    verdict: Verdict  # candidate: index into this rank's candidates
    candidate: int  # the same candidate as a global index into the plan's candidates, -1 if none
    columns: dict[int, int]  # global window column -> this rank's new trajectory token
    forward_s: float


def run_round(
    state: RoundState,
    plan: RoundPlan,
    rank: int,
    adapter: ModelAdapter,
    verifier: Verifier,
    row_plan: RowCounts | None,
    round_key: tuple[int | str, int],
) -> RoundResult:
    """Lay out this rank's share of ``plan``, run the one packed forward, verify its candidates."""
    columns, candidates = plan.for_rank(rank)
    layout = compile_round(state.pending, state.past_len, state.window.levels, columns, candidates)
    if row_plan is not None:
        layout = pad_layout(layout, row_plan.rows_for(layout.num_rows, state.past_len))
    t = time.perf_counter()
    try:
        logits = adapter.forward(
            layout.input_ids, layout.position_ids, layout.visibility, state.cache, layout.logit_rows
        )
        readback = verifier.read_back(logits, layout)  # the round's one device->host transfer
    except BaseException:
        crop(state.cache, state.past_len)  # a failed round publishes nothing
        raise
    forward_s = time.perf_counter() - t
    preds = readback.preds
    verdict = verifier.verify(readback, layout, plan.candidates, candidates, round_key)
    global_candidate = plan.assignment[rank][verdict.candidate] if verdict.candidate >= 0 else -1
    own_columns = dict(zip(range(*columns), (preds[i] for i in layout.column_logits), strict=True))
    return RoundResult(layout, verdict, global_candidate, own_columns, forward_s)


@dataclass(frozen=True)
class CommitPlan:
    """How the winner's K/V becomes committed: copy ``src`` rows to ``dst``, then keep ``length`` positions."""

    src: tuple[int, ...]
    dst: tuple[int, ...]
    length: int


def kv_commit_plan(past_len: int, layout: RoundLayout, candidate: int, hits: int) -> CommitPlan:
    """K/V rows belong to their input token: the ordinary rows stay, then the winner's first ``hits`` rows.

    Worked trace: past_len=128, one ordinary row (committed length 129), 14 lookahead rows (Q=21 with two
    candidates of suffix length 3; the cache holds 149), winner 1 with 2 hits -> copy 146->129, 147->130, keep 131;
    the third emitted token is the next round's input.
    """
    frontier = past_len + layout.num_ordinary
    src = tuple(past_len + layout.verify_row(candidate, s) for s in range(hits))
    dst = tuple(frontier + s for s in range(hits))
    return CommitPlan(src, dst, frontier + hits)


def publish(
    state: RoundState, result: RoundResult, decision: Decision, live: int, window_on: bool
) -> list[tuple[int, tuple[int, ...]]]:
    """After the decision's tokens are committed to ``state.history``: keep the winner's K/V (or crop to the
    frontier and re-feed the emitted tokens next round) and advance the window (``window_on``); returns the
    window's completed n-grams for the pool.

    ``live``: the round's live key (the window's anchor). Call only when the generation goes on (a finished
    generation's cache is dropped, not repaired).
    """
    if decision.won:
        kv = kv_commit_plan(state.past_len, result.layout, result.verdict.candidate, result.verdict.hits)
        move_rows(state.cache, kv.src, kv.dst)
        crop(state.cache, kv.length)
        state.past_len, state.pending = kv.length, [decision.emitted[-1]]
    else:
        frontier = state.past_len + result.layout.num_ordinary
        crop(state.cache, frontier)
        state.past_len, state.pending = frontier, list(decision.emitted)
    if not window_on:
        return []
    new_row = [tok for _, tok in sorted(decision.columns.items())]
    return state.window.step(live, new_row)

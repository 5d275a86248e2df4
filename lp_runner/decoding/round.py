"""One rank's round of one generation: its state, its layout and verdict, and the publication of a decision.

``lay_out`` and ``take_verdict`` compute; they publish nothing. Between them the forward (``engine.py`` runs it,
for one generation or a batch) writes the round's rows to the generation's K/V past its committed length, where
they stay until ``publish`` keeps the winner's accepted rows (or the caller crops them after a failed forward).
``publish`` applies the round's ``Decision`` (the same on every rank) to the state: committed tokens, K/V (copy
the winner's rows, or crop and re-feed the emitted tokens next round: no K/V crosses devices) and the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from lp_runner.decoding.coordinator import RoundPlan
from lp_runner.decoding.layout import RoundLayout, RowCounts, compile_round, round_size
from lp_runner.decoding.verify.greedy import Verdict
from lp_runner.decoding.verify.verifier import ReadBack, Verifier
from lp_runner.decoding.window import JacobiWindow
from lp_runner.parallel.exchange import Decision


class KVStore(Protocol):
    """A generation's K/V as publication sees it: positions 0..length-1 cached, rows movable within."""

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions."""
        ...

    def move(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy positions ``src`` to ``dst`` (every source read before any write)."""
        ...


@dataclass
class RoundState:
    """What one rank carries from round to round of a generation."""

    history: list[int]  # every committed token: prompt, then output
    pending: list[int]  # committed tokens not yet in this rank's cache; the last is the live key
    past_len: int  # positions in the cache, all committed
    window: JacobiWindow
    kv: KVStore  # the generation's K/V: its region of the job's arena (``kv_cache.KVRegion``)

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


def lay_out(state: RoundState, plan: RoundPlan, rank: int, row_plan: RowCounts | None) -> RoundLayout:
    """This rank's share of ``plan`` as one packed round (padded to the row count ``row_plan`` says, if any): its
    tokens and positions, and its shape's mask and logit rows (made once per shape). It makes no tensor: the
    backend stages every generation's rows of the round at once (``backends.staging``)."""
    columns, candidates = plan.for_rank(rank)
    levels = state.window.levels
    padding = 0
    if row_plan is not None:
        rows, _ = round_size(len(state.pending), columns, len(levels) - 1, [len(c) for c in candidates])
        padding = row_plan.rows_for(rows, state.past_len) - rows
    return compile_round(state.pending, state.past_len, levels, columns, candidates, padding)


def take_verdict(
    readback: ReadBack,
    layout: RoundLayout,
    plan: RoundPlan,
    rank: int,
    verifier: Verifier,
    round_key: tuple[int | str, int],
) -> RoundResult:
    """Verify this rank's candidates from the round's read-back; its new window columns."""
    columns, candidates = plan.for_rank(rank)
    preds = readback.preds
    verdict = verifier.verify(readback, layout, plan.candidates, candidates, round_key)
    global_candidate = plan.assignment[rank][verdict.candidate] if verdict.candidate >= 0 else -1
    own_columns = dict(zip(range(*columns), (preds[i] for i in layout.column_logits), strict=True))
    return RoundResult(layout, verdict, global_candidate, own_columns)


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
        state.kv.move(kv.src, kv.dst)
        state.kv.crop(kv.length)
        state.past_len, state.pending = kv.length, [decision.emitted[-1]]
    else:
        frontier = state.past_len + result.layout.num_ordinary
        state.kv.crop(frontier)
        state.past_len, state.pending = frontier, list(decision.emitted)
    if not window_on:
        return []
    new_row = [tok for _, tok in sorted(decision.columns.items())]
    return state.window.step(live, new_row)

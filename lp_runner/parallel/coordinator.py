"""The coordinator: the global n-gram pool and each round's plan (columns and candidates per rank).

It is a deterministic state machine fed only with data every rank holds after the round's all_gather (the live
key, the gathered trajectory row, the committed tokens). So instead of rank 0 broadcasting its plan (a second
collective per round), every rank runs an identical replica and rank 0's copy is the authority; the plan digest in
each round's payload (see ``exchange.py``) proves the replicas agree. One collective per round instead of two.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lp_runner.config import LookaheadConfig
from lp_runner.job_pool import JobPool, JobPoolSource
from lp_runner.parallel.sharding import assign_candidates, column_blocks, lookahead_rows
from lp_runner.pool import NGramPool, Suffix, sequence_ngrams
from lp_runner.sources import CandidateSource, ContextSource, PoolSource, merge_candidates

NO_COLUMNS = (0, 0)


@dataclass(frozen=True)
class RoundPlan:
    live_key: int
    candidates: tuple[Suffix, ...]  # all candidates this round, in verification order
    sources: tuple[str, ...]  # which source proposed each candidate
    columns: tuple[tuple[int, int], ...]  # per rank: [lo, hi)
    assignment: tuple[tuple[int, ...], ...]  # per rank: indices into candidates
    proposed: tuple[tuple[str, int], ...] = ()  # per source: suffixes proposed before dedup and budget

    def for_rank(self, rank: int) -> tuple[tuple[int, int], list[Suffix]]:
        return self.columns[rank], [self.candidates[c] for c in self.assignment[rank]]

    @property
    def digest(self) -> int:
        """A 31-bit fingerprint of the plan, small enough for the int64 payload."""
        blob = repr((self.live_key, self.candidates, self.columns, self.assignment)).encode()
        return zlib.crc32(blob) & 0x7FFFFFFF


class Coordinator:
    """Global pool, context index and per-round plan; see the module docstring for why it is replicated."""

    def __init__(
        self,
        la: LookaheadConfig,
        world_size: int,
        prompt_ids: Sequence[int],
        group_by_first_token: bool = False,
        store: JobPool | None = None,
    ) -> None:
        """``store``: the job's store (``pool_scope: job``), read only here; its source proposes right after the
        context source (the prompt's own text is the stronger evidence), before the Jacobi pool, unless it
        matched a longer suffix than the context index did (``job_ahead``)."""
        self.la = la
        self.world_size = world_size
        self.group_by_first_token = group_by_first_token  # exact sampling under LP: a group never spans ranks
        self.pool = NGramPool(cap=la.verification_set_size, suffix_len=la.ngram_size - 1)
        if la.pool_from_prompt:
            self.pool.insert_many(sequence_ngrams(prompt_ids, la.ngram_size))
        self.sources: list[CandidateSource] = [PoolSource(self.pool, la.ngram_size, la.pool_from_output)]
        self.context: ContextSource | None = None
        if la.context_lookup:
            self.context = ContextSource(
                la.context_max_ngram, la.context_tokens, la.context_adaptive, min_ngram=la.context_min_ngram
            )
            self.context.observe(prompt_ids, len(prompt_ids))
            self.sources.insert(0 if la.candidate_policy == "context_first" else 1, self.context)
        self.job: JobPoolSource | None = None
        if store is not None:
            # the context knobs shape its proposals only where the context index runs (they are declared inert
            # without it, ``config.inert_knobs``): without it, N-1 tokens (no longer than the pool's), any match
            if la.context_lookup:
                self.job = JobPoolSource(store, la.context_tokens, la.context_adaptive, la.context_min_ngram)
            else:
                self.job = JobPoolSource(store, la.ngram_size - 1)
            at = self.sources.index(self.context) + 1 if self.context is not None else 0
            self.sources.insert(at, self.job)

    def observe(self, trajectory_ngrams: Iterable[tuple[int, Sequence[int]]], history: Sequence[int], num_new: int):
        """After a round: the window's n-grams, then the committed tokens, reach the pool and the context index."""
        self.pool.insert_many(trajectory_ngrams)
        for source in self.sources:
            source.observe(history, num_new)

    def feedback(self, plan: RoundPlan, candidate: int, hits: int) -> None:
        """The round's winner (global candidate index, -1 if none) tells its source how its proposal fared."""
        if candidate < 0:
            return
        for source in self.sources:
            if source.name == plan.sources[candidate]:
                source.feedback(len(plan.candidates[candidate]), hits)

    def job_ahead(self, proposals: list[tuple[str, list[Suffix]]]) -> list[tuple[str, list[Suffix]]]:
        """The job store's proposals first when they follow a longer match than the context index's (measured
        on MT-bench with SmolLM2, ``benchmarks/results/global_pool.md``: a longer match is the better evidence,
        whichever text it is in). Example: context matched 1 token, the store 2 -> [job, context, pool]."""
        context_len = self.context.match_len if self.context is not None else 0
        if self.job is None or self.job.match_len <= context_len:
            return proposals
        at = next(i for i, (name, _) in enumerate(proposals) if name == self.job.name)
        return [proposals[at], *proposals[:at], *proposals[at + 1 :]]

    def row_cap(self, context_kept: bool) -> int:
        """This round's cap on verification rows: ``max_verify_rows``, lifted to ``long_match_rows`` when a kept
        context candidate comes from a match of at least ``long_match_ngram`` tokens (measured on SmolLM2: a 1-token
        match earns ~0.15 accepted tokens per verified row, a 4-token match ~0.7; code copies want long proposals,
        chat short ones)."""
        la = self.la
        long_match = (
            la.long_match_ngram > 0 and self.context is not None and self.context.match_len >= la.long_match_ngram
        )
        return la.long_match_rows if long_match and context_kept else la.max_verify_rows

    def plan(self, history: Sequence[int], depth: int | None) -> RoundPlan:
        """depth None: the lookahead branch is off (no window rows on any rank)."""
        budget = self.la.verification_set_size
        proposals = [(src.name, src.propose(history, budget)) for src in self.sources]
        if self.job is not None:
            proposals = self.job_ahead(proposals)
        merged = merge_candidates(proposals, budget)
        merged = cap_rows(merged, self.row_cap(any(name == "context" for name, _ in merged)))
        candidates = tuple(s for _, s in merged)
        if depth is None:
            blocks = (NO_COLUMNS,) * self.world_size
            base = [0] * self.world_size
        else:
            blocks = column_blocks(self.la.window_size, self.world_size, depth)
            base = [lookahead_rows(b, depth) for b in blocks]
        groups = [c[0] for c in candidates] if self.group_by_first_token else None
        assignment = assign_candidates([len(c) for c in candidates], base, groups)
        return RoundPlan(
            live_key=history[-1],
            candidates=candidates,
            sources=tuple(n for n, _ in merged),
            columns=blocks,
            assignment=tuple(tuple(a) for a in assignment),
            proposed=tuple((n, len(p)) for n, p in proposals),
        )


def cap_rows(merged: list[tuple[str, Suffix]], max_rows: int) -> list[tuple[str, Suffix]]:
    """Truncate candidates, in verification order, to at most ``max_rows`` rows together (0: no cap).

    Where a forward's cost steps up at some row count (``benchmarks/forward_cost.py``), rows past the step cost
    more than the tokens they rarely add; a truncated candidate is still an exact one.
    Example: [("context", (1, 2, 3)), ("pool", (4, 5))], max_rows 4 -> [("context", (1, 2, 3)), ("pool", (4,))];
    [("context", (1, 2, 3)), ("pool", (1, 5))], max_rows 4 -> [("context", (1, 2, 3))]: a cut that leaves a prefix
    of a kept candidate would spend a row on a path already verified.
    """
    if max_rows <= 0:
        return merged
    out: list[tuple[str, Suffix]] = []
    left = max_rows
    for name, suffix in merged:
        if left <= 0:
            break
        cut = suffix[:left]
        if any(kept[: len(cut)] == cut for _, kept in out):  # truncated into a prefix of a kept one: verified already
            continue
        out.append((name, cut))
        left -= len(cut)
    return out

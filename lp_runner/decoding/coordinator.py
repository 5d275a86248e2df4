"""The coordinator of one generation: its n-gram pool and each round's plan (columns and candidates per rank).

It is a deterministic state machine fed only with data every rank holds after the round's all_gather (the live
key, the gathered trajectory row, the committed tokens). So instead of rank 0 broadcasting its plan (a second
collective per round), every rank runs an identical replica and rank 0's copy is the authority; the plan digest in
each round's payload (see ``exchange.py``) proves the replicas agree. One collective per round instead of two.
"""

from __future__ import annotations

import dataclasses
import zlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from lp_runner.config import LookaheadConfig
from lp_runner.decoding.job_store import JobPool, JobPoolSource, StoreView
from lp_runner.decoding.pool import NGramPool, Suffix, sequence_ngrams
from lp_runner.decoding.sources import CandidateSource, ContextSource, Feedback, PoolSource, Proposal, merge_candidates
from lp_runner.parallel.sharding import assign_candidates, column_blocks, lookahead_rows

NO_COLUMNS = (0, 0)


@dataclass(frozen=True)
class RoundPlan:
    live_key: int
    proposals: tuple[Proposal, ...]  # every candidate of the round, in verification order, with its source
    columns: tuple[tuple[int, int], ...]  # per rank: [lo, hi)
    assignment: tuple[tuple[int, ...], ...]  # per rank: indices into candidates
    proposed: tuple[tuple[str, int], ...] = ()  # per source: suffixes proposed before dedup and budget

    @cached_property
    def candidates(self) -> tuple[Suffix, ...]:
        return tuple(p.tokens for p in self.proposals)

    @cached_property
    def sources(self) -> tuple[str, ...]:
        """Which source proposed each candidate."""
        return tuple(p.source for p in self.proposals)

    @cached_property
    def shares(self) -> tuple[tuple[tuple[int, int], tuple[Suffix, ...]], ...]:
        """Per rank: its columns and its candidates (made once a round: layout, verification and verdict read
        them)."""
        candidates = self.candidates
        return tuple(
            (cols, tuple(candidates[c] for c in own)) for cols, own in zip(self.columns, self.assignment, strict=True)
        )

    def for_rank(self, rank: int) -> tuple[tuple[int, int], tuple[Suffix, ...]]:
        return self.shares[rank]

    @property
    def digest(self) -> int:
        """A 31-bit fingerprint of the plan, small enough for the int64 payload: the CRC-32 of its integers (the
        live key; each candidate, each rank's columns and assignment, each with its length) as int64 bytes."""
        flat = [self.live_key]
        for candidate in self.candidates:
            flat += (len(candidate), *candidate)
        for cols in self.columns:
            flat += cols
        for own in self.assignment:
            flat += (len(own), *own)
        return zlib.crc32(array("q", flat)) & 0x7FFFFFFF


def make_sources(la: LookaheadConfig, prompt_ids: Sequence[int], pool: NGramPool, store: JobPool | StoreView | None):
    """The candidate sources of one generation, in policy order (adding a source: its class and a line here).

    The pool always; context lookup (``context_lookup``) first or second by ``candidate_policy``; the job store
    (``store``, ``pool_scope: job``) right after the context source (the prompt's own text is the stronger
    evidence; ``Coordinator.job_ahead`` moves it first after a longer match). Without the context index the
    context knobs are inert (``config.inert_knobs``), so the store's proposals are N-1 tokens long, as the pool's.
    """
    sources: list[CandidateSource] = [PoolSource(pool, la.ngram_size, la.pool_from_output)]
    context = None
    if la.context_lookup:
        context = ContextSource(la.context_max_ngram, la.context_tokens, la.context_adaptive, la.context_min_ngram)
        context.observe(prompt_ids, len(prompt_ids))
        sources.insert(0 if la.candidate_policy == "context_first" else 1, context)
    if store is not None:
        if la.context_lookup:
            job = JobPoolSource(store, la.context_tokens, la.context_adaptive, la.context_min_ngram)
        else:
            job = JobPoolSource(store, la.ngram_size - 1)
        sources.insert(sources.index(context) + 1 if context is not None else 0, job)
    return sources


class Coordinator:
    """Global pool, context index and per-round plan; see the module docstring for why it is replicated."""

    def __init__(
        self,
        la: LookaheadConfig,
        world_size: int,
        prompt_ids: Sequence[int],
        group_by_first_token: bool = False,
        store: JobPool | StoreView | None = None,
    ) -> None:
        """``store``: the job's store (``pool_scope: job``), read only here (see ``make_sources``)."""
        self.la = la
        self.world_size = world_size
        self.group_by_first_token = group_by_first_token  # exact sampling under LP: a group never spans ranks
        self.pool = NGramPool(cap=la.verification_set_size, suffix_len=la.ngram_size - 1)
        if la.pool_from_prompt:
            self.pool.insert_many(sequence_ngrams(prompt_ids, la.ngram_size))
        self.sources = make_sources(la, prompt_ids, self.pool, store)
        self._by_name = {src.name: src for src in self.sources}

    def observe(self, trajectory_ngrams: Iterable[tuple[int, Sequence[int]]], history: Sequence[int], num_new: int):
        """After a round: the window's n-grams, then the committed tokens, reach the pool and the context index.
        The pool queues them (``NGramPool.defer_many``): the next plan reads the live key's only, and inserts
        those; ``flush`` inserts the rest once the next forward is launched. Plans are the same either way."""
        self.pool.defer_many(trajectory_ngrams)
        for source in self.sources:
            source.observe(history, num_new)

    def flush(self) -> None:
        """The n-grams ``observe`` queued for keys the plan did not read, inserted (host work the round loop does
        while its forward runs)."""
        self.pool.flush()

    def feedback(self, plan: RoundPlan, candidate: int, hits: int) -> None:
        """The round's winner (global candidate index, -1 if none) tells its source how its proposal fared."""
        if candidate >= 0:
            proposal = plan.proposals[candidate]
            self._by_name[proposal.source].feedback(Feedback(proposal, hits))

    @staticmethod
    def job_ahead(named: list[tuple[str, list[Proposal]]]) -> list[tuple[str, list[Proposal]]]:
        """(source name, its proposals) in policy order -> the job store's first when its proposals follow a
        longer match than the context index's (measured on MT-bench with SmolLM2,
        ``benchmarks/results/global_pool.md``: a longer match is the better evidence, whichever text it is in).
        Example: context matched 1 token, the store 2 -> [job, context, pool]."""
        by_name = dict(named)
        job = by_name.get(JobPoolSource.name)
        if not job:  # no job proposals (most rounds): nothing to move
            return named
        context = by_name.get(ContextSource.name) or ()
        if max(p.match_len for p in job) <= max((p.match_len for p in context), default=0):
            return named
        at = next(i for i, (name, _) in enumerate(named) if name == JobPoolSource.name)
        return [named[at], *named[:at], *named[at + 1 :]]

    def row_cap(self, kept: Sequence[Proposal]) -> int:
        """This round's cap on verification rows: ``max_verify_rows``, lifted to ``long_match_rows`` when a kept
        context candidate comes from a match of at least ``long_match_ngram`` tokens (measured on SmolLM2: a 1-token
        match earns ~0.15 accepted tokens per verified row, a 4-token match ~0.7; code copies want long proposals,
        chat short ones)."""
        la = self.la
        long_match = la.long_match_ngram > 0 and any(
            p.source == ContextSource.name and p.match_len >= la.long_match_ngram for p in kept
        )
        return la.long_match_rows if long_match else la.max_verify_rows

    def _blocks(self, depth: int | None) -> tuple[tuple[tuple[int, int], ...], list[int]]:
        """Each rank's window columns at ``depth`` (None: the lookahead branch is off) and the rows they cost it."""
        if depth is None:
            return (NO_COLUMNS,) * self.world_size, [0] * self.world_size
        blocks = column_blocks(self.la.window_size, self.world_size, depth)
        return blocks, [lookahead_rows(b, depth) for b in blocks]

    def plan(self, history: Sequence[int], depth: int | None) -> RoundPlan:
        """depth None: the lookahead branch is off (no window rows on any rank)."""
        budget = self.la.verification_set_size
        named = self.job_ahead([(src.name, src.propose(history, budget)) for src in self.sources])
        merged = merge_candidates([p for _, props in named for p in props], budget)
        merged = cap_rows(merged, self.row_cap(merged))
        blocks, base = self._blocks(depth)
        groups = [p.tokens[0] for p in merged] if self.group_by_first_token else None
        assignment = assign_candidates([len(p.tokens) for p in merged], base, groups)
        return RoundPlan(
            live_key=history[-1],
            proposals=tuple(merged),
            columns=blocks,
            assignment=tuple(tuple(a) for a in assignment),
            proposed=tuple((name, len(props)) for name, props in named),
        )


def cap_rows(merged: list[Proposal], max_rows: int) -> list[Proposal]:
    """Truncate candidates, in verification order, to at most ``max_rows`` rows together (0: no cap).

    Where a forward's cost steps up at some row count (``benchmarks/forward_cost.py``), rows past the step cost
    more than the tokens they rarely add; a truncated candidate is still an exact one.
    Example (source: tokens): [context: (1, 2, 3), pool: (4, 5)], max_rows 4 -> [context: (1, 2, 3), pool: (4,)];
    [context: (1, 2, 3), pool: (1, 5)], max_rows 4 -> [context: (1, 2, 3)]: a cut that leaves a prefix of a kept
    candidate would spend a row on a path already verified.
    """
    if max_rows <= 0:
        return merged
    out: list[Proposal] = []
    left = max_rows
    for p in merged:
        if left <= 0:
            break
        cut = p.tokens[:left]
        if any(kept.tokens[: len(cut)] == cut for kept in out):  # a prefix of a kept one: verified already
            continue
        out.append(p if len(cut) == len(p.tokens) else dataclasses.replace(p, tokens=cut))  # most are kept whole
        left -= len(cut)
    return out

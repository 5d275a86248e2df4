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

from lp_runner.parallel.sharding import assign_candidates, column_blocks, lookahead_rows
from lp_runner.pool import NGramPool, Suffix, sequence_ngrams


@dataclass(frozen=True)
class RoundPlan:
    live_key: int
    candidates: tuple[Suffix, ...]  # all candidates this round, in verification order
    columns: tuple[tuple[int, int], ...]  # per rank: [lo, hi)
    assignment: tuple[tuple[int, ...], ...]  # per rank: indices into candidates

    def for_rank(self, rank: int) -> tuple[tuple[int, int], list[Suffix]]:
        return self.columns[rank], [self.candidates[c] for c in self.assignment[rank]]

    @property
    def digest(self) -> int:
        """A 31-bit fingerprint of the plan, small enough for the int64 payload."""
        blob = repr((self.live_key, self.candidates, self.columns, self.assignment)).encode()
        return zlib.crc32(blob) & 0x7FFFFFFF


class Coordinator:
    def __init__(self, window_size: int, ngram_size: int, guess_set_size: int, world_size: int) -> None:
        self.window_size = window_size
        self.ngram_size = ngram_size
        self.guess_set_size = guess_set_size
        self.world_size = world_size
        self.pool = NGramPool(cap=guess_set_size, suffix_len=ngram_size - 1)

    def seed(self, tokens: Sequence[int]) -> None:
        """Insert every n-gram of ``tokens`` (the prompt) into the pool."""
        self.pool.insert_many(sequence_ngrams(tokens, self.ngram_size))

    def observe(self, ngrams: Iterable[tuple[int, Sequence[int]]]) -> None:
        self.pool.insert_many(ngrams)

    def plan(self, live_key: int, depth: int) -> RoundPlan:
        candidates = tuple(self.pool.candidates(live_key, self.guess_set_size))
        blocks = column_blocks(self.window_size, self.world_size, depth)
        base = [lookahead_rows(b, depth) for b in blocks]
        assignment = assign_candidates(len(candidates), base, self.ngram_size - 1)
        return RoundPlan(live_key, candidates, blocks, tuple(tuple(a) for a in assignment))

"""Candidate sources: who proposes the suffixes a round verifies, and how they share one budget of G.

Sources share one small interface (``CandidateSource``): ``propose`` returns ``Proposal`` values (the tokens, the
source's name, the length of the match behind them), ``feedback`` receives a ``Feedback`` (the winning proposal as
verified, and how many of its tokens held), ``observe`` sees the committed tokens. Nothing is signalled through
attributes a caller must read after a call. ``coordinator.make_sources`` builds them from the config (adding a
source is its class and one line there). The sources:
* ``PoolSource``: the Jacobi n-gram pool keyed by the last committed token (trajectory n-grams, optionally seeded
  with the prompt's n-grams and repaired with the committed text's n-grams).
* ``ContextSource``: prompt-lookup style; the longest suffix of the committed tokens (prompt and generated text)
  that occurred earlier proposes the tokens that followed it there. Code and chat repeat their context; Jacobi
  trajectories find what the context does not contain.

* ``JobPoolSource`` (``job_store.py``): the job's earlier outputs (``pool_scope: job``).

``merge_candidates`` deduplicates (identical suffixes once; a suffix that is a prefix of a kept one adds nothing:
verifying the longer one checks it too) and fills the budget in policy order. Proposals never affect exactness:
every candidate is verified by the target in its own branch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from lp_runner.decoding.pool import NGramPool, Suffix, sequence_ngrams


@dataclass(frozen=True)
class Proposal:
    """One proposed suffix and where it came from."""

    tokens: Suffix
    source: str  # the proposing source's ``name`` (feedback goes back to it; statistics credit it)
    match_len: int = 0  # tokens of the committed suffix matched to find it (context, job); 0 for the pool


@dataclass(frozen=True)
class Feedback:
    """How the round's winning proposal fared: ``accepted`` of its tokens (as verified: after the row cap) held."""

    proposal: Proposal
    accepted: int


def adapt_length(length: int, fb: Feedback, longest: int) -> int:
    """Every verified row is paid for: grow a proposal length by 2 after a full accept, shrink it by 1 after a
    partial one (HF assisted generation's heuristic schedule), between 1 and ``longest``."""
    if fb.accepted >= len(fb.proposal.tokens):
        return min(longest, length + 2)
    return max(1, length - 1)


class CandidateSource(Protocol):
    name: str

    def propose(self, history: Sequence[int], limit: int) -> list[Proposal]:
        """Up to ``limit`` suffixes that may follow ``history`` (whose last token is the live key)."""
        ...

    def observe(self, history: Sequence[int], num_new: int) -> None:
        """``history`` grew by its last ``num_new`` committed tokens."""
        ...

    def feedback(self, fb: Feedback) -> None:
        """The round's winning candidate came from this source (``fb.proposal``)."""
        ...


class PoolSource:
    name = "pool"

    def __init__(self, pool: NGramPool, ngram_size: int, from_output: bool) -> None:
        self.pool = pool
        self.ngram_size = ngram_size
        self.from_output = from_output

    def propose(self, history: Sequence[int], limit: int) -> list[Proposal]:
        return [Proposal(s, self.name) for s in self.pool.candidates(history[-1], limit)]

    def feedback(self, fb: Feedback) -> None:
        pass  # pool suffixes have a fixed length

    def observe(self, history: Sequence[int], num_new: int) -> None:
        """Repair: the committed text's newly completed n-grams are verified continuations (queued: the pool
        inserts the next live key's before it plans, the rest after the round's launch)."""
        if self.from_output and num_new > 0:
            tail = history[-(num_new + self.ngram_size - 1) :]
            self.pool.defer_many(sequence_ngrams(tail, self.ngram_size))


class ContextSource:
    """Longest-suffix match against earlier positions, most recent occurrence first.

    Index: for each match length k in 1..max_ngram, k-gram -> end positions (ascending). A lookup tries k from
    max_ngram down to min_ngram and stops at the first k with an earlier occurrence (measured on SmolLM2 with
    bench16: a 1-token match gets ~0.15 accepted tokens per verified row, a 4-token match ~0.7, so a
    ``min_ngram`` of 2 can save more rows than it loses tokens where rows are dear); each occurrence (most recent first)
    proposes the up to ``num_tokens`` tokens that followed it; distinct continuations become distinct candidates.
    Example: history [5, 6, 7, 9, 5, 6, 7, 8, 5, 6], max_ngram 2, num_tokens 3 -> the suffix (5, 6) occurred at
    ends 1 and 5: candidates (7, 8, 5) (most recent) then (7, 9, 5).
    """

    name = "context"

    def __init__(self, max_ngram: int, num_tokens: int, adaptive: bool = True, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.num_tokens = num_tokens
        self.adaptive = adaptive
        # Proposal length per match length k, each adapted to how much of its proposals gets accepted: a 4-token
        # match in code is usually followed by a long copy, a 1-token match rarely by more than a token or two.
        self.lengths = [num_tokens] * (max_ngram + 1)
        self._index: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_ngram + 1)]
        self._indexed = 0  # history positions indexed so far

    def observe(self, history: Sequence[int], num_new: int) -> None:
        index, top = self._index, self.max_ngram
        for end in range(self._indexed, len(history)):
            for k in range(1, min(top, end + 1) + 1):
                key = tuple(history[end - k + 1 : end + 1])
                ends = index[k].get(key)
                if ends is None:  # a new k-gram (setdefault would build a list for every known one too)
                    index[k][key] = [end]
                else:
                    ends.append(end)
        self._indexed = len(history)

    def feedback(self, fb: Feedback) -> None:
        """Adapt the proposal length of the winning proposal's match length (``adapt_length``)."""
        if self.adaptive:
            k = fb.proposal.match_len
            self.lengths[k] = adapt_length(self.lengths[k], fb, self.num_tokens)

    def propose(self, history: Sequence[int], limit: int) -> list[Proposal]:
        if limit <= 0 or self.num_tokens <= 0:
            return []
        last = len(history) - 1
        for k in range(min(self.max_ngram, len(history)), self.min_ngram - 1, -1):
            ends = self._index[k].get(tuple(history[last - k + 1 :]))
            earlier = [e for e in reversed(ends or ()) if e < last]
            if not earlier:
                continue
            out: list[Suffix] = []
            for end in earlier:
                cont = tuple(history[end + 1 : end + 1 + self.lengths[k]])
                if cont and cont not in out:
                    out.append(cont)
                if len(out) == limit:
                    break
            return [Proposal(c, self.name, k) for c in out]
        return []


def merge_candidates(proposals: Sequence[Proposal], budget: int) -> list[Proposal]:
    """Proposals in policy order in, at most ``budget`` out, without redundant suffixes.

    A suffix equal to, or a prefix of, one already kept is dropped; a kept suffix that is a prefix of a new one is
    replaced by it in place (its slot in the order), since verifying the longer one verifies both. The replacing
    proposal keeps its own source and match: feedback and per-source statistics must credit the source whose
    tokens were verified.
    Example (source: tokens): [context: (1, 2, 3), pool: (1, 2), pool: (4, 5), pool: (1, 2, 3, 9)], budget 2 ->
    [pool: (1, 2, 3, 9), pool: (4, 5)].
    """
    kept: list[Proposal] = []
    for p in proposals:
        suffix = p.tokens
        if not suffix:
            continue
        if any(k.tokens[: len(suffix)] == suffix for k in kept):
            continue
        extended = next((i for i, k in enumerate(kept) if suffix[: len(k.tokens)] == k.tokens), None)
        if extended is not None:
            kept[extended] = p
            continue
        if len(kept) < budget:
            kept.append(p)
    return kept

"""Greedy verification of candidate suffixes against the target's own predictions (pure, host-side ints).

Verifying suffix g (length S = N-1) against predictions z (z_0 from the live key's row, z_k from the row whose
input is g_{k-1}): the hit length a is the longest prefix with g_0..g_{a-1} == z_0..z_{a-1}, and the emitted
tokens are z_0..z_a, i.e. up to N tokens per round: every accepted token plus the target's next prediction.
(The published reference implementation stops at N-1 tokens; the last verified row's prediction is just as
valid and costs nothing extra.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    candidate: int  # index of the winning candidate, -1 when none was verified
    hits: int  # accepted suffix tokens a
    emitted: tuple[int, ...]  # z_0 .. z_a


def greedy_verify(z0: int, candidates: Sequence[Sequence[int]], predictions: Sequence[Sequence[int]]) -> Verdict:
    """Longest verified path; ties go to the lowest candidate index.

    predictions[c][s] is the target's argmax after reading g_c[0..s].
    Example: z0 = 7, candidates [(7, 8, 9), (7, 3, 1)], predictions [(8, 5, 2), (3, 1, 6)]:
    candidate 0 accepts 7, 8 (then 9 != 5): a = 2; candidate 1 accepts 7, 3, 1: a = 3, emitted (7, 3, 1, 6).
    """
    best, best_hits = -1, 0
    for c, (suffix, preds) in enumerate(zip(candidates, predictions, strict=True)):
        expected = z0
        hits = 0
        for s, tok in enumerate(suffix):
            if tok != expected:
                break
            hits += 1
            expected = preds[s]
        if hits > best_hits or best < 0:
            best, best_hits = c, hits
    if best < 0:
        return Verdict(-1, 0, (z0,))
    emitted = (z0, *predictions[best][:best_hits])
    return Verdict(best, best_hits, emitted)


def cut_emitted(emitted: Sequence[int], eos_ids: frozenset[int], budget: int) -> tuple[tuple[int, ...], bool]:
    """Apply EOS and the max_new_tokens budget to an emitted run: returns (tokens to commit, finished)."""
    out: list[int] = []
    for tok in emitted:
        if len(out) == budget:
            return tuple(out), True
        out.append(tok)
        if tok in eos_ids:
            return tuple(out), True
    return tuple(out), len(out) == budget

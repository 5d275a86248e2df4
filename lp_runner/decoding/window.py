"""The 2-D Jacobi window: W columns x (N-1) trajectory levels, held as plain token lists.

Geometry (p = position of the live key, the last committed token, which is fed as the ordinary row):
    base stripe   b_0 .. b_{W-1}      b_0 = live key (the ordinary row), b_1..b_{W-1} = level 0 (W-1 tokens)
    level l >= 1  t_l[0] .. t_l[W-1]  t_l[j] sits at position p + j + l
A lookahead row (l, j) reads the causal sequence b_0..b_j, t_1[j]..t_l[j] (contiguous positions p..p+j+l), so the
output of the deepest row (N-2, j) is a fresh guess for position p + j + N - 1, and column j is one trajectory:
the n-gram (b_j, t_1[j], ..., t_{N-2}[j], new[j]) of N consecutive positions, keyed by b_j.

Warm-up: the window starts with level 0 only (ragged: W-1 tokens, because column 0 of the base is the live key)
and grows one level per round from the outputs of its deepest level until it holds N-1 levels:
[W-1], [W-1, W], ..., [W-1, W, ..., W].
"""

from __future__ import annotations

from collections.abc import Sequence

Levels = list[list[int]]


def initial_level0(prompt_ids: Sequence[int], window_size: int) -> list[int]:
    """Level 0 seeded from the prompt's tail, so the first guesses are plausible tokens rather than noise.

    Example: prompt [5, 6, 7], W = 5 -> [5, 6, 7, 5] (W-1 tokens: the prompt's tail, cycled when too short).
    """
    need = window_size - 1
    tail = list(prompt_ids[-need:]) if need and prompt_ids else [0]
    return [tail[i % len(tail)] for i in range(need)]


def keyed_ngrams(live_key: int, levels: Levels, new_row: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
    """The n-grams that a warm window (N-1 levels) and its new row define, one per column.

    Worked example (N=4, W=5): live key 10, levels [11..14], [21..25], [31..35], new row [41..45] ->
    10:(21,31,41), 11:(22,32,42), 12:(23,33,43), 13:(24,34,44), 14:(25,35,45).
    """
    keys = [live_key, *levels[0]]
    upper = levels[1:]
    return [(keys[j], (*(lvl[j] for lvl in upper), new_row[j])) for j in range(len(new_row))]


def advance(levels: Levels, new_row: Sequence[int], num_levels: int) -> Levels:
    """The window after one round (returns a new list; ``levels`` is not mutated).

    Warming up (fewer than ``num_levels`` levels): the new row becomes the next level.
    Warm: every level moves down one, the oldest is dropped, level 0 keeps columns 1.. of old level 1 (its
    column 0 is replaced by the next live key) and the new row becomes the deepest level.
    Example (N=4, W=3): [[11,12],[21,22,23],[31,32,33]] + [41,42,43] -> [[22,23],[31,32,33],[41,42,43]].
    """
    if len(levels) < num_levels:
        return [list(lvl) for lvl in levels] + [list(new_row)]
    return [list(levels[1][1:])] + [list(lvl) for lvl in levels[2:]] + [list(new_row)]


class JacobiWindow:
    """Window state for one generation; all ranks of a run hold identical copies."""

    def __init__(self, window_size: int, ngram_size: int, prompt_ids: Sequence[int]) -> None:
        self.window_size = window_size
        self.num_levels = ngram_size - 1
        self.levels: Levels = [initial_level0(prompt_ids, window_size)]

    @property
    def warm(self) -> bool:
        return len(self.levels) == self.num_levels

    @property
    def depth(self) -> int:
        """Index of the deepest present level: the level whose outputs this round are used."""
        return len(self.levels) - 1

    def step(self, live_key: int, new_row: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
        """Harvest this round's n-grams (only once warm) and advance; returns the n-grams for the pool."""
        ngrams = keyed_ngrams(live_key, self.levels, new_row) if self.warm else []
        self.levels = advance(self.levels, new_row, self.num_levels)
        return ngrams

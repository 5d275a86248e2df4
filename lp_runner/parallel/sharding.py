"""Which window columns and which candidates each rank computes in a round (pure functions).

A rank that owns columns [lo, hi) at depth d feeds hi-1 level-0 rows (its own plus the base-stripe context left
of its block, which every lookahead row of column j reads) and (hi-lo)*d trajectory rows. Higher column blocks
therefore cost more context rows, so blocks are chosen to minimise the largest rank, then candidates (S rows
each) go to the least-loaded rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache


def lookahead_rows(block: tuple[int, int], depth: int) -> int:
    """Rows a rank feeds for columns [lo, hi) at ``depth``: level-0 rows 1..hi-1 plus its trajectory rows."""
    lo, hi = block
    if hi <= lo:
        return 0
    return (hi - 1) + (hi - lo) * depth


@lru_cache(maxsize=256)
def column_blocks(window_size: int, world_size: int, depth: int) -> tuple[tuple[int, int], ...]:
    """Contiguous column blocks, one per rank in rank order, minimising the largest rank's lookahead rows.

    Exact dynamic programme over split points (W and P are small; cached per (W, P, depth)).
    Ties prefer wider low-rank blocks, so surplus ranks (W < P) end up with empty blocks at the top, where the
    candidate assignment fills them first. Example: W=7, P=2, depth=3 -> ((0, 4), (4, 7)): 3+12=15 and 6+9=15.
    """
    w, p = window_size, world_size
    inf = float("inf")
    # best[r][j]: minimal max cost covering columns [0, j) with ranks 0..r-1; choice[r][j]: start of block r-1
    best = [[inf] * (w + 1) for _ in range(p + 1)]
    choice = [[0] * (w + 1) for _ in range(p + 1)]
    best[0][0] = 0
    for r in range(1, p + 1):
        for j in range(w + 1):
            for i in range(j, -1, -1):  # block [i, j) for rank r-1; larger blocks first on ties
                if best[r - 1][i] == inf:
                    continue
                cost = max(best[r - 1][i], lookahead_rows((i, j), depth))
                if cost < best[r][j]:
                    best[r][j], choice[r][j] = cost, i
    blocks: list[tuple[int, int]] = []
    j = w
    for r in range(p, 0, -1):
        i = choice[r][j]
        blocks.append((i, j))
        j = i
    blocks.reverse()
    return tuple(blocks)


def assign_candidates(
    lengths: Sequence[int],
    base_rows: Sequence[int],
    groups: Sequence[int] | None = None,
) -> list[list[int]]:
    """Candidate indices per rank: each goes to the least-loaded rank (ties to the lowest rank).

    lengths: rows each candidate costs (its length). base_rows: rows each rank already feeds (lookahead rows).
    groups: optional group id per candidate; a group (for exact sampling: all candidates sharing a first token)
    is never split across ranks.
    Example: 5 candidates of 4 rows, base rows [10, 4] -> [[2, 4], [0, 1, 3]] (loads 18 and 16).
    """
    load = list(base_rows)
    out: list[list[int]] = [[] for _ in load]
    if groups is None:
        units = [[c] for c in range(len(lengths))]
    else:
        order: dict[int, list[int]] = {}
        for c, g in enumerate(groups):
            order.setdefault(g, []).append(c)
        units = list(order.values())
    for unit in units:
        r = min(range(len(load)), key=lambda k: (load[k], k))
        out[r].extend(unit)
        load[r] += sum(lengths[c] for c in unit)
    return out

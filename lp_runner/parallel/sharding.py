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

    Exact dynamic programme over split points, O(P x W) (cached per (W, P, depth)). Ties prefer wider low-rank
    blocks, so surplus ranks (W < P) end up with empty blocks at the top, where the candidate assignment fills them
    first. Example: W=7, P=2, depth=3 -> ((0, 4), (4, 7)): 3+12=15 and 6+9=15.

    The programme: best[r][j] is the least largest-rank cost covering columns [0, j) with ranks 0..r-1, and
    best[r][j] = min over i <= j of max(best[r-1][i], lookahead_rows((i, j))), the block [i, j) being rank r-1's;
    of the i that reach the minimum the largest is kept (the top rank's block as narrow as it can be). Scanning
    every i made the search grow with W^2 (minutes at W = 100000 before a single forward). It needs no scan:
    best[r-1][i] never decreases in i (more columns never cost less), and the block's cost never increases in i,
    so the maximum of the two falls, then rises, in i, and the minimum sits where they cross. That crossing, the
    first i with best[r-1][i] >= cost(i, j), only moves right as j grows (a block's cost grows with j), so one
    pointer per r finds it for every j; the largest minimiser is then either just left of the crossing, or the
    end of the run of equal best[r-1] values that starts at it (precomputed). Same choices as the scan, tested
    against it on a grid.
    """
    w, p = window_size, world_size

    def cost(i: int, j: int) -> int:
        return lookahead_rows((i, j), depth)

    inf = float("inf")
    prev: list[float] = [0] + [inf] * w  # best[0]: no rank covers no column
    choices: list[list[int]] = []  # choices[r-1][j]: start of rank r-1's block in best[r][j]
    for _ in range(p):
        run_end = list(range(w + 1))  # run_end[i]: the last index of prev's run of values equal to prev[i]
        for i in range(w - 1, -1, -1):
            if prev[i] == prev[i + 1]:
                run_end[i] = run_end[i + 1]
        best: list[float] = [inf] * (w + 1)
        choice = [0] * (w + 1)
        cross = 0  # first i with prev[i] >= cost(i, j); never past j, where the block is empty and costs 0
        for j in range(w + 1):
            while prev[cross] < cost(cross, j):
                cross += 1
            right = prev[cross]  # the least of max(...) over i >= cross
            left = cost(cross - 1, j) if cross > 0 else inf  # ... and over i < cross: its value at cross - 1
            if right <= left:
                best[j], choice[j] = right, min(run_end[cross], j)
            else:
                best[j], choice[j] = left, cross - 1
        choices.append(choice)
        prev = best
    blocks: list[tuple[int, int]] = []
    j = w
    for r in range(p, 0, -1):
        i = choices[r - 1][j]
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
    if len(base_rows) == 1:  # one rank: every candidate is its own
        return [list(range(len(lengths)))]
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

"""The round compiler: one list of rows -> input ids, position ids, visibility mask and logit row indices.

A round packs three kinds of rows into one target forward, in this order:

    [ ordinary rows | lookahead rows (level 0 context, then levels 1..depth of own columns) | verification rows ]

* ordinary: tokens whose K/V is not cached yet (the prompt at prefill, re-fed tokens under LP); the last one is
  the live key b_0 at position p. Causal among themselves, visible to every other row.
* lookahead (level l, column j): reads b_0..b_j and t_1[j]..t_l[j] (see ``window.py`` for the geometry).
* verification (candidate c, offset s): reads the ordinary rows and g_c[0..s] at positions p+1..p+1+s.
Lookahead and verification rows never see each other, candidates never see each other, and equal positions
never imply visibility: the mask is derived from row roles only.

Worked example (one ordinary row at p=9, W=3, depth 1, columns [0, 3), one candidate of length 2), Q = 8:

    row  token     role  level col  pos  sees (in-round)        logits
    0    b0        ORD   0     0    9    0                      yes  (z0)
    1    lvl0[0]   LA    0     1    10   0,1
    2    lvl0[1]   LA    0     2    11   0,1,2
    3    t1[0]     LA    1     0    10   0,3                    yes  (new[0])
    4    t1[1]     LA    1     1    11   0,1,4                  yes  (new[1])
    5    t1[2]     LA    1     2    12   0,1,2,5                yes  (new[2])
    6    g[0]      VER   c0,s0      10   0,6                    yes
    7    g[1]      VER   c0,s1      11   0,6,7                  yes
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from lp_runner.config import MAX_ROUND_ROWS, GenerationConfig, LookaheadConfig
from lp_runner.errors import ConfigError

ROLE_ORDINARY = 0
ROLE_LOOKAHEAD = 1
ROLE_VERIFY = 2
ROLE_PAD = 3  # filler making a round a cheaper row count (``compile_round``'s padding): sees itself, seen by no one
NO_INDEX = -1  # level / column / candidate / offset of a row that has none


@dataclass(frozen=True)
class Row:
    role: int
    token: int
    position: int
    level: int = NO_INDEX
    column: int = NO_INDEX
    candidate: int = NO_INDEX
    offset: int = NO_INDEX


RowShape = tuple[int, int, int, int, int]  # a row's (role, level, column, candidate, offset): what its mask reads


@dataclass(frozen=True, eq=False)
class RoundShape:
    """What a round's layout is besides its tokens and positions, for the round cut to its live key (row 0): the
    same for every round of the same sizes, so ``round_shape`` computes it once per shape. ``eq=False``: one object
    per shape (the cache hands out the same one), compared and hashed by identity.

    Example (the module docstring's round): rows (ORD), (LA, 0, 1), (LA, 0, 2), (LA, 1, 0), (LA, 1, 1), (LA, 1, 2),
    (VER, c0, s0), (VER, c0, s1); offsets 0, 1, 2, 1, 2, 3, 1, 2; logit_rows 0, 3, 4, 5, 6, 7.
    """

    key: tuple[tuple[int, int], int, tuple[int, ...]]  # (columns, depth, candidate lengths): ``round_shape``'s
    rows: tuple[RowShape, ...]  # [num_rows]: the key of the mask cache (``_visibility``)
    offsets: tuple[int, ...]  # [num_rows]: position - the live key's position
    logit_rows: tuple[int, ...]  # rows whose logits are computed (row indices of the cut round)
    column_logits: tuple[int, ...]  # indices into logit_rows, as ``RoundLayout.column_logits``
    verify_logits: tuple[tuple[int, ...], ...]  # indices into logit_rows, as ``RoundLayout.verify_logits``
    candidate_starts: tuple[int, ...]  # row of each candidate's first token (of the cut round)
    num_lookahead: int
    num_padding: int


@functools.lru_cache(maxsize=512)
def round_shape(columns: tuple[int, int], depth: int, lengths: tuple[int, ...], padding: int = 0) -> RoundShape:
    """The ``RoundShape`` of a round with one ordinary row (the live key), own ``columns`` of a window ``depth``
    levels deep, candidates of ``lengths`` and ``padding`` filler rows; computed once per shape (an LRU of 512:
    a setting's rounds take a few dozen shapes)."""
    lo, hi = columns
    rows: list[RowShape] = [(ROLE_ORDINARY, NO_INDEX, NO_INDEX, NO_INDEX, NO_INDEX)]
    offsets = [0]
    column_rows: list[int] = []
    if hi > lo:
        for j in range(1, hi):  # base stripe context and own level-0 rows
            rows.append((ROLE_LOOKAHEAD, 0, j, NO_INDEX, NO_INDEX))
            offsets.append(j)
            if depth == 0 and j >= lo:
                column_rows.append(len(rows) - 1)
        if depth == 0 and lo == 0:
            column_rows.insert(0, 0)  # column 0's level-0 token is the live key itself
        for level in range(1, depth + 1):
            for j in range(lo, hi):
                rows.append((ROLE_LOOKAHEAD, level, j, NO_INDEX, NO_INDEX))
                offsets.append(j + level)
                if level == depth:
                    column_rows.append(len(rows) - 1)
    num_lookahead = len(rows) - 1
    verify_rows: list[list[int]] = []
    for c, n in enumerate(lengths):
        verify_rows.append(list(range(len(rows), len(rows) + n)))
        rows.extend((ROLE_VERIFY, NO_INDEX, NO_INDEX, c, s) for s in range(n))
        offsets.extend(range(1, n + 1))
    rows.extend((ROLE_PAD, NO_INDEX, NO_INDEX, NO_INDEX, NO_INDEX) for _ in range(padding))
    offsets.extend(0 for _ in range(padding))  # a filler repeats the live key's token and position

    # Logit rows: the live key, then own-column outputs, then all verification rows (each row once).
    logit_rows = [0, *(r for r in column_rows if r != 0), *(r for rs in verify_rows for r in rs)]
    where = {r: i for i, r in enumerate(logit_rows)}
    return RoundShape(
        key=(columns, depth, lengths),
        rows=tuple(rows),
        offsets=tuple(offsets),
        logit_rows=tuple(logit_rows),
        column_logits=tuple(where[r] for r in column_rows),
        verify_logits=tuple(tuple(where[r] for r in rs) for rs in verify_rows),
        candidate_starts=tuple(rs[0] for rs in verify_rows),
        num_lookahead=num_lookahead,
        num_padding=padding,
    )


@dataclass(frozen=True)
class RoundLayout:
    """The contract of one packed forward: the round's tokens and positions, its ordinary rows and its shape
    (``RoundShape``: the rest of the round, shared by every round of its sizes); every tensor is derived from
    them once, when first read."""

    tokens: tuple[int, ...]  # [num_rows] each row's input token
    positions: tuple[int, ...]  # [num_rows] each row's position
    num_ordinary: int
    shape: RoundShape  # the round cut to its live key: rows 1.. of the shape are rows num_ordinary.. here

    @functools.cached_property
    def rows(self) -> tuple[Row, ...]:
        """Every row with its role and place (for inspection and tests; the round itself reads the tensors)."""
        k = self.num_ordinary - 1
        ordinary = [Row(ROLE_ORDINARY, t, p) for t, p in zip(self.tokens[: k + 1], self.positions, strict=False)]
        rest = [
            Row(role, self.tokens[k + i], self.positions[k + i], *place)
            for i, (role, *place) in enumerate(self.shape.rows[1:], start=1)
        ]
        return (*ordinary, *rest)

    @property
    def input_ids(self) -> torch.Tensor:
        """[num_rows] int64 (probes and inspection; a round reads ``tokens``: the backend stages them once)."""
        return torch.tensor(self.tokens, dtype=torch.long)

    @property
    def position_ids(self) -> torch.Tensor:
        """[num_rows] int64 (probes and inspection; a round reads ``positions``)."""
        return torch.tensor(self.positions, dtype=torch.long)

    @functools.cached_property
    def visibility(self) -> torch.Tensor:
        """[num_rows, num_rows] bool, True = row i may attend to row k (``visibility_mask``). Read only: a round of
        one ordinary row (every decode round) shares its shape's mask, made once per shape."""
        return _pasted(self.num_ordinary, self.shape.rows)

    @property
    def logit_rows(self) -> tuple[int, ...]:
        """Rows whose LM-head output is computed, in logit order."""
        k = self.num_ordinary - 1
        return tuple(r + k for r in self.shape.logit_rows) if k else self.shape.logit_rows

    @property
    def num_rows(self) -> int:
        return len(self.tokens)

    @property
    def num_lookahead(self) -> int:
        return self.shape.num_lookahead

    @property
    def num_candidates(self) -> int:
        return len(self.shape.candidate_starts)

    @property
    def num_padding(self) -> int:
        """Filler rows (``compile_round``'s padding): they follow every real row, so their K/V lies past anything a
        round commits and the next crop drops it."""
        return self.shape.num_padding

    @property
    def num_logit_rows(self) -> int:
        return len(self.shape.logit_rows)

    @property
    def candidate_starts(self) -> tuple[int, ...]:
        """Row index of each candidate's first token."""
        k = self.num_ordinary - 1
        return tuple(r + k for r in self.shape.candidate_starts) if k else self.shape.candidate_starts

    # indices into the logit rows (not into rows):
    @property
    def ordinary_logit(self) -> int:
        """Prediction z0 after the live key: always the first logit row."""
        return 0

    @property
    def column_logits(self) -> tuple[int, ...]:
        """One per own column, in column order: its new trajectory token."""
        return self.shape.column_logits

    @property
    def verify_logits(self) -> tuple[tuple[int, ...], ...]:
        """[num_candidates][len(candidate)]: prediction after g_c[s]."""
        return self.shape.verify_logits

    def verify_row(self, candidate: int, offset: int) -> int:
        """Row index (within the round) of candidate ``candidate``'s input at ``offset``."""
        return self.shape.candidate_starts[candidate] + self.num_ordinary - 1 + offset


def compile_round(
    ordinary: Sequence[int],
    start_position: int,
    levels: Sequence[Sequence[int]],
    columns: tuple[int, int],
    candidates: Sequence[Sequence[int]],
    padding: int = 0,
) -> RoundLayout:
    """Build the round for one rank.

    ordinary: uncached committed tokens, the last being the live key; the first sits at ``start_position``.
    levels: the full window (levels[0] has W-1 tokens, deeper levels W); the deepest present level is output.
    columns: [lo, hi) this rank computes (empty when lo == hi); it also feeds level-0 context for columns 1..lo-1.
    candidates: non-empty suffixes (any lengths) to verify, all following the live key.
    padding: filler rows after every real row, each repeating the live key's token and position (any valid values
    would do).

    Why padding: a forward's cost is not monotone in its row count on every device (``benchmarks/forward_cost.py``
    measures it), so a round is cheaper run at a larger row count that the calibrated curve says is cheaper
    (``costmodel.RowPlan``). Exactness: a filler row attends to itself only (a
    softmax needs one visible key) and no real row attends to it, so every real row computes what it would without
    it; no logits are computed for it; its K/V sits after the round's own rows, beyond any committed position, and
    the round's crop drops it. Example: a 3-row round (live key at position 9, one 2-token candidate) with padding
    2 has two more rows of role ROLE_PAD at position 9; ``logit_rows``, ``verify_row`` and the commit plan are
    those of the round without them.

    Only the tokens and positions are this round's own; the rest is its shape's (``round_shape``), in the row
    order of the module docstring: level-0 context b_1..b_{hi-1}, then levels 1..depth of columns [lo, hi).
    """
    if not ordinary:
        raise ValueError("a round needs at least one ordinary row (the live key)")
    for c, suffix in enumerate(candidates):
        if not suffix:
            raise ValueError(f"candidate {c} is empty")
    lo, hi = columns
    depth = len(levels) - 1
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    shape = round_shape(columns, depth, tuple(len(c) for c in candidates), padding)
    tokens = list(ordinary)
    if hi > lo:
        tokens.extend(levels[0][: hi - 1])
        for level in levels[1:]:
            tokens.extend(level[lo:hi])
    for suffix in candidates:
        tokens.extend(suffix)
    tokens.extend([ordinary[-1]] * padding)  # a filler repeats the live key's token (its offset 0: its position)
    p = start_position + len(ordinary) - 1  # position of the live key b_0
    positions = [*range(start_position, p + 1), *(p + o for o in shape.offsets[1:])]
    return RoundLayout(tuple(tokens), tuple(positions), len(ordinary), shape)


def round_size(
    num_ordinary: int, columns: tuple[int, int], depth: int, candidate_lengths: Sequence[int]
) -> tuple[int, int]:
    """(rows, logit rows) of the round ``compile_round`` builds from these sizes, without building it.

    The cost model prices rounds it never runs (other P, other settings) with this; a test holds it equal to
    ``compile_round`` over every small shape. Example: one ordinary row, columns [0, 3) at depth 1, one candidate
    of 2 (the module docstring's round) -> (8, 6).
    """
    lo, hi = columns
    window_rows = (hi - 1) + (hi - lo) * depth if hi > lo else 0
    own_outputs = (hi - lo) - (1 if depth == 0 and lo == 0 < hi else 0)  # depth 0: column 0's output is the key
    cand = sum(candidate_lengths)
    return num_ordinary + window_rows + cand, 1 + own_outputs + cand


def longest_candidate(la: LookaheadConfig) -> int:
    """The longest candidate a round can verify: N-1 from the pool, ``context_tokens`` from the context index (the
    job store proposes as long as the context index, N-1 without one)."""
    return max(la.ngram_size - 1, la.context_tokens if la.context_lookup else 0)


def max_round_rows(la: LookaheadConfig) -> int:
    """An upper bound on the rows of one round of ``la`` (P = 1, before padding): the live key, the window's rows
    and G candidates of the longest length (the tuner sizes the curve it measures with it)."""
    window_rows = (la.window_size - 1) + la.window_size * (la.ngram_size - 2) if la.lookahead_branch else 0
    return 1 + window_rows + la.verification_set_size * longest_candidate(la)


def visibility_mask(rows: Sequence[Row]) -> torch.Tensor:
    """[Q, Q] bool: which in-round rows each row attends to, from roles alone (see module docstring).

    A function of each row's (role, level, column, candidate, offset), not of its token or position. The leading
    ordinary rows are a causal block that every later row but a filler sees, so the mask is that block and the
    mask of the round with its ordinary rows cut to the live key (``_visibility``, computed once per shape: an LRU
    of 512), pasted together. Keying the LRU on the round without its ordinary rows keeps each entry as small as
    the window's rows whatever the prompt's length: keyed on every row, each distinct prompt length (a prefill)
    was an entry of its own, O(prompt^2) each. Computing the mask took about 120 us a round on a 2-core CPU, some
    1% of a 12 ms round; a paste takes a few.

    Example: 3 ordinary rows, then one 1-token candidate (Q = 4): rows 0-2 causal; row 3 sees rows 0, 1, 2 (the
    ordinary block, from the cut round's row 1 seeing its live key) and itself.
    """
    ordinary = 0
    while ordinary < len(rows) and rows[ordinary].role == ROLE_ORDINARY:
        ordinary += 1
    shape = tuple((r.role, r.level, r.column, r.candidate, r.offset) for r in rows[max(ordinary - 1, 0) :])
    return _pasted(ordinary, shape).clone()  # the caller's own


def _pasted(ordinary: int, cut_shape: tuple[RowShape, ...]) -> torch.Tensor:
    """[Q, Q] bool: ``visibility_mask`` of ``ordinary`` ordinary rows followed by rows 1.. of ``cut_shape`` (the
    round cut to its live key; all of it when ``ordinary`` is 0 or 1: then the shape's own mask, read only)."""
    cut = _visibility(cut_shape)
    if ordinary <= 1:  # nothing to paste: a decode round (one ordinary row), or a round of fillers only
        return cut
    q = ordinary - 1 + len(cut_shape)
    vis = torch.zeros(q, q, dtype=torch.bool)  # [Q, Q]
    vis[:ordinary, :ordinary] = torch.ones(ordinary, ordinary, dtype=torch.bool).tril()
    vis[ordinary - 1 :, ordinary - 1 :] = cut  # the live key's row and everything after it
    vis[ordinary:, : ordinary - 1] = cut[1:, :1]  # a later row sees the whole block iff it sees the live key
    return vis


@functools.lru_cache(maxsize=512)
def _visibility(shape: tuple[tuple[int, int, int, int, int], ...]) -> torch.Tensor:
    """``visibility_mask`` of rows whose (role, level, column, candidate, offset) are ``shape``."""
    role, level, column, cand, offset = (torch.tensor(field, dtype=torch.long) for field in zip(*shape, strict=True))
    q = len(shape)
    i_idx = torch.arange(q).unsqueeze(1)  # [Q, 1] attending row
    k_idx = torch.arange(q).unsqueeze(0)  # [1, Q] attended row

    def col(t: torch.Tensor) -> torch.Tensor:  # attribute of the attending row, [Q, 1]
        return t.unsqueeze(1)

    def row(t: torch.Tensor) -> torch.Tensor:  # attribute of the attended row, [1, Q]
        return t.unsqueeze(0)

    k_ord = row(role == ROLE_ORDINARY)
    k_la = row(role == ROLE_LOOKAHEAD)
    k_ver = row(role == ROLE_VERIFY)
    i_ord = col(role == ROLE_ORDINARY)
    i_la = col(role == ROLE_LOOKAHEAD)
    i_ver = col(role == ROLE_VERIFY)

    i_pad = col(role == ROLE_PAD)
    sees_ordinary = k_ord & ~i_pad & (~i_ord | (k_idx <= i_idx))
    sees_base = i_la & k_la & (row(level) == 0) & (row(column) <= col(column))
    sees_trajectory = i_la & k_la & (row(level) >= 1) & (row(column) == col(column)) & (row(level) <= col(level))
    sees_candidate = i_ver & k_ver & (row(cand) == col(cand)) & (row(offset) <= col(offset))
    sees_self_as_pad = i_pad & (k_idx == i_idx)
    return sees_ordinary | sees_base | sees_trajectory | sees_candidate | sees_self_as_pad  # [Q, Q]


def check_model_fits(la: LookaheadConfig, gen: GenerationConfig, positions: int | None) -> None:
    """The setting against a model's context of ``positions`` (None: the model states none) and MAX_ROUND_ROWS.

    Example: W=1024 N=5 (with the other defaults) -> 1 + 1023 + 1024 x 3 + 7 x 10 = 4166 rows, refused against
    MAX_ROUND_ROWS whatever the model; the defaults (W=7 N=5 G=7, 10-token context proposals: 98 rows) against a
    model of 64 positions: refused, the round alone would not fit; max_new_tokens=4096 against 4096 positions:
    refused, no prompt would fit."""
    rows = max_round_rows(la)
    what = (
        f"a round of this setting computes up to {rows} rows (the live token, "
        f"{'W-1 + W x (N-2) window rows, ' if la.lookahead_branch else ''}G x the longest proposal)"
    )
    if rows > MAX_ROUND_ROWS:
        raise ConfigError(
            f"lookahead: {what}, more than the {MAX_ROUND_ROWS} a round may have; lower window_size (W), "
            "ngram_size (N), verification_set_size (G) or context_tokens"
        )
    if positions is None:
        return
    if rows > positions:
        raise ConfigError(
            f"lookahead: {what}, more than the model's context of {positions} positions; lower window_size (W), "
            "ngram_size (N), verification_set_size (G) or context_tokens"
        )
    if gen.max_new_tokens >= positions:
        raise ConfigError(
            f"generation.max_new_tokens={gen.max_new_tokens} leaves no room for a prompt in the model's context of "
            f"{positions} positions (at most {positions - 1})"
        )


class RowCounts(Protocol):
    """The row count each round runs at (``compile_round`` pads to it): the tuner's measured ``costmodel.RowPlan`` is
    one. The decoding loop needs only these two answers, so it does not depend on how the plan was made."""

    def rows_for(self, rows: int, kv_len: int) -> int:
        """The row count to run a round of ``rows`` rows at, with ``kv_len`` cached positions."""
        ...

    @property
    def max_rows(self) -> int:
        """The most rows any padded round can have (bounds the cache a round may touch)."""
        ...

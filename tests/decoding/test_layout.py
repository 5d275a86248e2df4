"""The round compiler: the docstring's worked example, mask invariants, and packed forward == separate forwards.

The last test is the one that matters for exactness: every row of one packed forward (a real DynamicCache holding
a cached prefix, the 4-D mask from the layout) must produce the logits that a plain HF forward of that row's own
branch produces. Branches are built from row semantics (what a lookahead / verification row is supposed to read),
never from the visibility mask, so a wrong mask cannot agree with itself.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from helpers import FAMILIES, TINY_VOCAB, one_round, scratch_region

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.decoding import layout as layout_module
from lp_runner.decoding.layout import (
    ROLE_LOOKAHEAD,
    ROLE_ORDINARY,
    ROLE_VERIFY,
    RoundLayout,
    compile_round,
)

# ---------------------------------------------------------------------------------------------------------
# (a) The worked example of layout.py's docstring


def worked_example() -> RoundLayout:
    # one ordinary row b0 at p=9, W=3, depth 1, columns [0, 3), one candidate of length 2; tokens are labels
    return compile_round(
        ordinary=[100],  # b0
        start_position=9,
        levels=[[101, 102], [111, 112, 113]],  # level 0 (W-1 tokens), level 1 (W tokens)
        columns=(0, 3),
        candidates=[[201, 202]],
    )


def test_worked_example_rows_positions_and_mask() -> None:
    lay = worked_example()
    assert lay.input_ids.tolist() == [100, 101, 102, 111, 112, 113, 201, 202]
    assert lay.position_ids.tolist() == [9, 10, 11, 10, 11, 12, 10, 11]
    roles = [r.role for r in lay.rows]
    assert roles == [ROLE_ORDINARY] + [ROLE_LOOKAHEAD] * 5 + [ROLE_VERIFY] * 2
    T, F = True, False
    expected = torch.tensor(
        [
            # 0  1  2  3  4  5  6  7     (attended row)
            [T, F, F, F, F, F, F, F],  # 0 b0
            [T, T, F, F, F, F, F, F],  # 1 lvl0[0]
            [T, T, T, F, F, F, F, F],  # 2 lvl0[1]
            [T, F, F, T, F, F, F, F],  # 3 t1[0]
            [T, T, F, F, T, F, F, F],  # 4 t1[1]
            [T, T, T, F, F, T, F, F],  # 5 t1[2]
            [T, F, F, F, F, F, T, F],  # 6 g[0]
            [T, F, F, F, F, F, T, T],  # 7 g[1]
        ]
    )
    assert torch.equal(lay.visibility, expected)
    # logits: b0 (z0), the deepest level's three columns, both verification rows
    assert lay.logit_rows == (0, 3, 4, 5, 6, 7)
    assert lay.ordinary_logit == 0
    assert lay.column_logits == (1, 2, 3)
    assert lay.verify_logits == ((4, 5),)
    assert (lay.num_ordinary, lay.num_lookahead, lay.num_candidates, lay.num_rows) == (1, 5, 1, 8)
    assert lay.verify_row(0, 1) == 7


def test_visibility_is_one_per_shape_shared_by_rounds_and_copied_for_callers() -> None:
    """The mask depends on the rows' roles and places only: rounds of the same shape with other tokens and
    positions share one mask, computed once (the round path reads it only); ``visibility_mask`` hands a caller its
    own copy, so writing into it changes no round's."""
    first = worked_example()
    hits = layout_module._visibility.cache_info().hits
    again = compile_round(ordinary=[7], start_position=40, levels=[[8, 9], [10, 11, 12]], columns=(0, 3),
                          candidates=[[13, 14]])  # fmt: skip
    shape = tuple((r.role, r.level, r.column, r.candidate, r.offset) for r in first.rows)
    computed = layout_module._visibility.__wrapped__(shape)  # what the cache holds, computed afresh
    assert torch.equal(first.visibility, computed) and again.visibility is first.visibility
    assert layout_module._visibility.cache_info().hits > hits
    own = layout_module.visibility_mask(again.rows)
    assert torch.equal(own, computed)
    own.fill_(False)
    assert torch.equal(first.visibility, computed) and computed.any()


def test_compile_round_rejects_bad_rounds() -> None:
    with pytest.raises(ValueError, match="at least one ordinary row"):
        compile_round([], 0, [[1, 2]], (0, 3), [])
    with pytest.raises(ValueError, match="candidate 1 is empty"):
        compile_round([5], 0, [[1, 2]], (0, 3), [[1, 2], []])


def test_candidates_of_different_lengths() -> None:
    # context-lookup candidates may be longer than N-1: each candidate's rows start where the previous one ends
    lay = compile_round([9], 0, [[1, 2]], (0, 3), [[10], [20, 21, 22, 23], [30, 31]])
    first = lay.num_ordinary + lay.num_lookahead  # the verify rows follow the ordinary and lookahead rows
    assert lay.candidate_starts == (first, first + 1, first + 5)
    assert [lay.verify_row(1, s) for s in range(4)] == [first + 1, first + 2, first + 3, first + 4]
    assert [len(v) for v in lay.verify_logits] == [1, 4, 2]
    assert lay.input_ids[first:].tolist() == [10, 20, 21, 22, 23, 30, 31]
    assert lay.position_ids[first:].tolist() == [1, 1, 2, 3, 4, 1, 2]


# ---------------------------------------------------------------------------------------------------------
# Random round layouts


@dataclass
class RandomRound:
    prefix: list[int]  # already cached
    ordinary: list[int]
    levels: list[list[int]]
    columns: tuple[int, int]
    candidates: list[list[int]]
    n: int

    def compile(self) -> RoundLayout:
        return compile_round(self.ordinary, len(self.prefix), self.levels, self.columns, self.candidates)


def random_round(rng: random.Random, vocab: int = TINY_VOCAB) -> RandomRound:
    def toks(k: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(k)]

    n = rng.randint(3, 5)
    w = rng.randint(1, 6)
    depth = rng.randint(0, n - 2)  # 0 = first warm-up round (level 0 only), n-2 = warm
    levels = [toks(w - 1)] + [toks(w) for _ in range(depth)]
    lo = rng.randint(0, w)
    hi = rng.randint(lo, w)  # may be empty: a rank with only candidates
    return RandomRound(
        prefix=toks(rng.randint(5, 20)),
        ordinary=toks(rng.randint(1, 4)),
        levels=levels,
        columns=(lo, hi),
        # pool suffixes have N-1 tokens, context-lookup continuations other lengths
        candidates=[toks(rng.choice([n - 1, rng.randint(1, 6)])) for _ in range(rng.randint(0, 3))],
        n=n,
    )


def branch_of(rnd: RandomRound, row) -> list[int]:
    """The causal token sequence a row is supposed to read, from its role alone (not from the mask)."""
    if row.role == ROLE_ORDINARY:
        i = row.position - len(rnd.prefix)
        return rnd.prefix + rnd.ordinary[: i + 1]
    base = rnd.prefix + rnd.ordinary  # the committed text, ending with the live key b_0
    if row.role == ROLE_LOOKAHEAD:
        j, level = row.column, row.level
        stripe = rnd.levels[0][:j]  # b_1..b_j
        trajectory = [rnd.levels[k][j] for k in range(1, level + 1)]  # t_1[j]..t_l[j]
        return base + stripe + trajectory
    assert row.role == ROLE_VERIFY
    return base + rnd.candidates[row.candidate][: row.offset + 1]


def test_random_layout_invariants() -> None:
    rng = random.Random(1234)
    checked_pairs = 0
    for _ in range(300):
        rnd = random_round(rng)
        lay = rnd.compile()
        vis = lay.visibility
        rows = lay.rows
        pos = lay.position_ids.tolist()
        assert vis.shape == (lay.num_rows, lay.num_rows)
        assert vis.diagonal().all()  # every row reads its own K/V
        for i, ri in enumerate(rows):
            for k, rk in enumerate(rows):
                if {ri.role, rk.role} == {ROLE_LOOKAHEAD, ROLE_VERIFY}:
                    assert not vis[i, k], "lookahead and verification rows must not see each other"
                if ri.role == rk.role == ROLE_VERIFY and ri.candidate != rk.candidate:
                    assert not vis[i, k], "candidates must not see each other"
                if i != k and pos[i] == pos[k]:
                    checked_pairs += 1
                    assert not vis[i, k], "equal positions must never imply visibility"
                if rk.role == ROLE_ORDINARY and ri.role != ROLE_ORDINARY:
                    assert vis[i, k], "every row reads the ordinary rows"
            # what a row sees is one causal sequence: distinct, contiguous positions from the first ordinary
            # row up to its own position (so in-round RoPE positions equal plain-forward positions)
            seen = sorted(pos[k] for k in range(lay.num_rows) if vis[i, k])
            assert seen == list(range(len(rnd.prefix), pos[i] + 1)), (i, ri, seen)
            assert len(seen) + len(rnd.prefix) == len(branch_of(rnd, ri))
    assert checked_pairs > 100  # the equal-position rule was actually exercised


def expected_logit_rows(lay: RoundLayout, depth: int, columns: tuple[int, int]) -> list[int]:
    """Row indices (into rows) that must get logits: live key, deepest level's own columns, verification rows."""
    live = lay.num_ordinary - 1
    out = [live]
    for j in range(*columns):
        if depth == 0 and j == 0:
            continue  # column 0's level-0 token is the live key, already listed
        out.append(
            next(i for i, r in enumerate(lay.rows) if r.role == ROLE_LOOKAHEAD and (r.level, r.column) == (depth, j))
        )
    out += [i for i, r in enumerate(lay.rows) if r.role == ROLE_VERIFY]
    return out


def test_random_layout_logit_bookkeeping() -> None:
    rng = random.Random(99)
    for _ in range(300):
        rnd = random_round(rng)
        lay = rnd.compile()
        depth = len(rnd.levels) - 1
        lo, hi = rnd.columns
        assert sorted(lay.logit_rows) == sorted(expected_logit_rows(lay, depth, rnd.columns))
        assert len(set(lay.logit_rows)) == len(lay.logit_rows)  # each row once
        rows_of = lay.logit_rows  # logit index -> row index
        assert rows_of[lay.ordinary_logit] == lay.num_ordinary - 1
        assert len(lay.column_logits) == hi - lo
        for k, li in enumerate(lay.column_logits):
            r = lay.rows[rows_of[li]]
            if depth == 0 and lo + k == 0:
                assert rows_of[li] == lay.num_ordinary - 1  # column 0 at depth 0 is the live key
            else:
                assert (r.role, r.level, r.column) == (ROLE_LOOKAHEAD, depth, lo + k)
        assert len(lay.verify_logits) == len(rnd.candidates)
        for c, idxs in enumerate(lay.verify_logits):
            assert len(idxs) == len(rnd.candidates[c])
            for s, li in enumerate(idxs):
                r = lay.rows[rows_of[li]]
                assert (r.role, r.candidate, r.offset) == (ROLE_VERIFY, c, s)
                assert rows_of[li] == lay.verify_row(c, s)
                assert r.token == rnd.candidates[c][s]


# ---------------------------------------------------------------------------------------------------------
# (c) Packed forward == separate forwards, on real tiny models


def fill_prefix(adapter: ModelAdapter, prefix: list[int]):
    """A DynamicCache holding ``prefix``, written by a plain causal forward through the adapter."""
    cache = scratch_region(adapter)
    t = len(prefix)
    causal = torch.ones(t, t, dtype=torch.bool).tril()  # [T, T]
    one_round(adapter, torch.tensor(prefix), torch.arange(t), causal, cache, torch.tensor([t - 1]))
    assert cache.length == t
    return cache


@torch.inference_mode()
def plain_last_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits after the last token of an isolated plain forward (default positions and causal mask)."""
    return model(input_ids=torch.tensor([tokens])).logits[0, -1]  # [vocab]


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_forward_equals_separate_forwards(tiny, family: str) -> None:
    model = tiny(family)
    adapter = ModelAdapter(model)
    rng = random.Random(7)
    rows_checked = {ROLE_ORDINARY: 0, ROLE_LOOKAHEAD: 0, ROLE_VERIFY: 0}
    sabotaged = 0
    for _ in range(30):
        rnd = random_round(rng)
        lay = rnd.compile()
        cache = fill_prefix(adapter, rnd.prefix)
        past = len(rnd.prefix)

        # every row's logits, to check the mask row by row (base-stripe rows included)
        all_rows = torch.arange(lay.num_rows)
        packed = one_round(adapter, lay.input_ids, lay.position_ids, lay.visibility, cache, all_rows)  # [Q, vocab]
        assert packed.shape == (lay.num_rows, model.config.vocab_size)
        assert cache.length == past + lay.num_rows
        for i, row in enumerate(lay.rows):
            ref = plain_last_logits(model, branch_of(rnd, row))
            err = (packed[i] - ref).abs().max().item()
            assert err < 1e-4, f"{family}: row {i} {row} differs from its branch by {err:g}"
            rows_checked[row.role] += 1

        # the engine's call: only the logit rows; they must be exactly those rows of the full forward
        cache.crop(past)
        some = one_round(adapter, lay.input_ids, lay.position_ids, lay.visibility, cache, lay.logit_rows)
        assert some.shape == (len(lay.logit_rows), model.config.vocab_size)
        torch.testing.assert_close(some, packed[list(lay.logit_rows)], atol=1e-5, rtol=1e-5)

        # negative control: hiding one in-round token from the last row must move its logits past the
        # tolerance, or the comparison above could not have caught a wrong mask
        last = lay.num_rows - 1
        hidden = [k for k in range(last) if lay.visibility[last, k]]
        if hidden:
            cache.crop(past)
            wrong = lay.visibility.clone()
            wrong[last, hidden[-1]] = False
            bad = one_round(adapter, lay.input_ids, lay.position_ids, wrong, cache, torch.tensor([last]))
            assert (bad[0] - packed[last]).abs().max().item() > 1e-3
            sabotaged += 1
    # guards: every kind of row was compared, several times, and the negative control ran
    assert min(rows_checked.values()) >= 20, rows_checked
    assert sabotaged >= 10


def test_round_size_is_what_compile_round_builds() -> None:
    """The cost model sizes rounds with ``round_size`` instead of building them: it must agree with the real
    compiler on every small shape (ordinary rows, column block, depth, candidate lengths)."""
    from lp_runner.decoding.layout import round_size

    w = 5
    for depth in range(0, 4):
        levels = [list(range(100, 100 + w - 1))] + [
            list(range(200 * (lv + 1), 200 * (lv + 1) + w)) for lv in range(depth)
        ]
        for lo in range(0, w + 1):
            for hi in range(lo, w + 1):
                for ordinary in (1, 3):
                    for lengths in ((), (1,), (3, 2), (4, 4, 1)):
                        cands = [tuple(range(50 + 10 * c, 50 + 10 * c + n)) for c, n in enumerate(lengths)]
                        layout = compile_round(list(range(1, ordinary + 1)), 20, levels, (lo, hi), cands)
                        got = round_size(ordinary, (lo, hi), depth, lengths)
                        assert got == (layout.num_rows, len(layout.logit_rows)), (depth, lo, hi, ordinary, lengths)


def test_visibility_pasted_from_the_cut_round_equals_the_role_rules():
    """``visibility_mask`` pastes the ordinary block onto the mask of the round cut to its live key; it must equal
    the role rules applied to every row pair (``_visibility`` uncached, on the whole round), over ordinary blocks,
    window shapes, column ranges (LP ranks), candidates and filler rows."""
    from lp_runner.decoding.layout import _visibility

    def rules(rows):
        return _visibility.__wrapped__(tuple((r.role, r.level, r.column, r.candidate, r.offset) for r in rows))

    checked = 0
    for ordinary in (1, 2, 3, 7):
        for w in (1, 2, 4):
            for depth in (0, 1, 2):
                levels = [[5] * (w - 1)] + [[6] * w for _ in range(depth)]
                for columns in ((0, w), (0, 0), (1, w)):
                    for candidates in ([], [[1]], [[1, 2], [3]]):
                        layout = compile_round(list(range(ordinary)), 4, levels, columns, candidates)
                        padded_round = compile_round(list(range(ordinary)), 4, levels, columns, candidates, padding=2)
                        for padded in (layout, padded_round):
                            assert torch.equal(padded.visibility, rules(padded.rows)), (ordinary, w, depth, columns)
                            checked += 1
    assert checked == 648

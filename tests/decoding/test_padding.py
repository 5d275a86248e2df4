"""Row padding: a round run at a larger row count gives the same tokens and the same committed K/V.

Oracles: the same packed round without padding (logits of every real row, committed K/V after the commit plan)
and HF greedy ``generate`` for whole generations; ``RowPlan.from_curve`` against hand-worked curves.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import (
    AMD_MS,
    FAMILIES,
    TINY_VOCAB,
    curve_from_ms,
    hf_greedy,
    make_engine,
    one_round,
    random_prompt,
    scratch_region,
)

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.decoding.engine import kv_commit_plan
from lp_runner.decoding.layout import ROLE_PAD, compile_round
from lp_runner.tuning.costmodel import RowPlan, predict


def test_padding_appends_fillers_that_change_no_real_row() -> None:
    """``compile_round(..., padding)``: the round's own rows, then fillers repeating the live key's token and position;
    the real rows' mask, logit rows and commit plan are the unpadded round's; one shape object per padded shape."""
    args = ([5, 6, 7], 10, [[1, 2], [3, 4, 5]], (0, 3), [(8, 9), (8,)])
    layout = compile_round(*args)
    padded = compile_round(*args, padding=3)
    q = layout.num_rows
    assert padded.num_rows == q + 3 and padded.num_padding == 3 and layout.num_padding == 0
    assert padded.tokens == layout.tokens + (7,) * 3 and padded.positions == layout.positions + (12,) * 3
    assert [r.role for r in padded.rows[q:]] == [ROLE_PAD] * 3
    # real rows see exactly what they saw, and never a filler row
    assert torch.equal(padded.visibility[:q, :q], layout.visibility)
    assert not padded.visibility[:q, q:].any()
    # a filler row sees itself only (one visible key keeps its softmax finite)
    assert torch.equal(padded.visibility[q:, :], torch.eye(q + 3, dtype=torch.bool)[q:, :])
    # logits and the verification bookkeeping are untouched: no logits for fillers, same commit plan
    assert padded.logit_rows == layout.logit_rows
    assert padded.verify_logits == layout.verify_logits and padded.candidate_starts == layout.candidate_starts
    assert kv_commit_plan(10, padded, 0, 2) == kv_commit_plan(10, layout, 0, 2)
    assert compile_round(*args, padding=3).shape is padded.shape
    assert compile_round(*args, padding=0).shape is layout.shape
    one = compile_round([7], 10, [[1, 2]], (0, 0), [(8,)], padding=2)  # one ordinary row: the decode round's case
    assert one.tokens == (7, 8, 7, 7) and one.positions == (10, 11, 10, 10) and one.num_padding == 2
    with pytest.raises(ValueError, match="padding must be >= 0"):
        compile_round(*args, padding=-1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("extra", [1, 9])
def test_padded_round_same_logits_and_committed_kv(tiny, family: str, extra: int) -> None:
    """One packed round with and without filler rows: same real-row logits, same K/V after the commit."""
    model = tiny(family)
    adapter = ModelAdapter(model)
    rng = random.Random(extra)
    prefix = [rng.randrange(TINY_VOCAB) for _ in range(20)]
    levels = [[rng.randrange(TINY_VOCAB) for _ in range(w)] for w in (3, 4)]
    candidates = [[rng.randrange(TINY_VOCAB) for _ in range(3)], [rng.randrange(TINY_VOCAB) for _ in range(2)]]
    results = []
    for pad in (0, extra):
        cache = scratch_region(adapter)
        t = len(prefix)
        tril = torch.ones(t, t, dtype=torch.bool).tril()
        one_round(adapter, torch.tensor(prefix), torch.arange(t), tril, cache, torch.tensor([t - 1]))
        layout = compile_round([prefix[-1]], t, levels, (0, 4), candidates, padding=pad)
        logits = one_round(adapter, layout.input_ids, layout.position_ids, layout.visibility, cache, layout.logit_rows)
        assert logits.shape[0] == len(layout.logit_rows)  # [R, vocab]: no logits for the fillers
        plan = kv_commit_plan(t, layout, 0, 2)  # commit candidate 0's first two rows, as a winner would
        cache.move(plan.src, plan.dst)
        cache.crop(plan.length)
        kv = [(cache.keys(i).clone(), cache.values(i).clone()) for i in range(len(cache.arena.layers()))]
        results.append((logits, kv))
    (logits0, kv0), (logits1, kv1) = results
    assert torch.equal(logits0.argmax(-1), logits1.argmax(-1))
    torch.testing.assert_close(logits0, logits1, atol=1e-5, rtol=0)  # fp32 rounding: other row-count kernels
    for (k0, v0), (k1, v1) in zip(kv0, kv1, strict=True):
        assert k0.shape == k1.shape
        torch.testing.assert_close(k0, k1, atol=1e-5, rtol=0)
        torch.testing.assert_close(v0, v1, atol=1e-5, rtol=0)


def always_pad(to: int, by: int = 0) -> RowPlan:
    """A plan that pads every round of up to ``to`` rows to ``to`` rows (or by ``by`` rows if given)."""
    targets = tuple(q + by if by else to for q in range(1, to + 1))
    return RowPlan((0,), (targets,))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "setting",
    [
        dict(W=4, N=3, G=3),  # Jacobi window + pool + context: many roles padded together
        dict(W=1, N=4, G=2, lookahead_branch=False, max_verify_rows=3),  # the auto preset's kind of round
    ],
)
def test_padded_generation_equals_hf_greedy(tiny, family: str, setting: dict) -> None:
    model = tiny(family)
    prompt = random_prompt(24, seed=7)
    expected = hf_greedy(model, prompt, 40)
    kw = dict(setting)
    engine = make_engine(model, kw.pop("W"), kw.pop("N"), kw.pop("G"), max_new_tokens=40, **kw)
    engine.row_plan = always_pad(64)
    result = engine.generate(prompt)
    assert result.output_ids == expected
    assert result.stats.padded_rows > 0  # the rounds really ran padded
    assert all(r.rows + r.padded_rows == 64 for r in result.stats.records[1:] if r.rows <= 64)


def test_row_plan_from_amd_curve() -> None:
    plan = RowPlan.from_curve(curve_from_ms(AMD_MS))
    got = {q: plan.rows_for(q, 512) for q in range(1, 17)}
    assert got[1] == 1  # one row is the cheapest there is
    assert got[2] == got[3] == got[4] == 8  # 2-4 rows cost more than 8: run them as 8
    assert got[5] == got[6] == 8  # interpolated 4..8 rows: 82.8 and 80.5 ms, 8 rows is >5% cheaper
    assert got[7] == 7 and got[8] == 8  # 78.3 ms vs 76: inside the margin, not padded
    assert all(got[q] == q for q in range(9, 17))  # the curve rises from 8 to 16 rows
    assert plan.rows_for(40, 512) == 40  # beyond the measured rows: never padded
    assert plan.max_rows == 16


def test_row_plan_margin_and_monotone_curve() -> None:
    flat = RowPlan.from_curve(curve_from_ms({1: 50, 2: 60, 4: 70, 8: 90}))
    assert all(flat.rows_for(q, 0) == q for q in range(1, 9))  # a rising curve never pads
    near = RowPlan.from_curve(curve_from_ms({1: 50, 2: 80, 4: 78, 8: 120}))  # 4 rows only 2.5% under 2
    assert near.rows_for(2, 0) == 2  # inside the noise margin: not worth a padded row
    assert near.rows_for(3, 0) == 3  # interpolated 3 rows (79 ms) vs 78: also inside the margin
    far = RowPlan.from_curve(curve_from_ms({1: 50, 2: 80, 4: 60, 8: 120}))
    assert far.rows_for(2, 0) == 4 and far.rows_for(3, 0) == 4


def test_predict_prices_padded_rounds() -> None:
    """The cost model prices a round at the row count the engine runs it at (one RowPlan for both)."""
    from lp_runner.tuning.costmodel import RoundShape

    curve = curve_from_ms(AMD_MS)
    plan = RowPlan.from_curve(curve)
    shapes = [RoundShape(0, 10, 7, -1, (), -1, 1)] + [RoundShape(512, 1, 7, -1, (2,), 0, 2)] * 4  # 3-row rounds
    bare = predict(shapes, curve, 1)
    padded = predict(shapes, curve, 1, row_plan=plan)
    assert bare.forward_s == pytest.approx(4 * 0.108)
    assert padded.forward_s == pytest.approx(4 * 0.076)

"""K/V commit: the worked trace of ``kv_commit_plan``, and on a real model, that copying the winner's rows into the
committed frontier and cropping leaves exactly the cache of a plain forward of the committed tokens."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import FAMILIES, TINY_VOCAB, one_round, plain_cache, scratch_region

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.decoding.engine import CommitPlan, kv_commit_plan
from lp_runner.decoding.layout import compile_round
from lp_runner.decoding.verify.greedy import greedy_verify


def test_worked_trace() -> None:
    # one ordinary row at past_len=128, W=5, N=4 warm window (levels of 4, 5, 5 tokens), all columns,
    # two candidates of length 3: 1 + (4 + 5 * 2) + 2 * 3 = 21 rows
    layout = compile_round(
        ordinary=[1],
        start_position=128,
        levels=[[2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]],
        columns=(0, 5),
        candidates=[[20, 21, 22], [30, 31, 32]],
    )
    assert layout.num_rows == 21
    assert layout.num_lookahead == 14
    assert layout.verify_row(1, 0) == 18  # candidate 1 starts after 1 + 14 + 3 rows
    plan = kv_commit_plan(128, layout, candidate=1, hits=2)
    assert plan == CommitPlan(src=(146, 147), dst=(129, 130), length=131)


def test_plan_without_hits_only_crops() -> None:
    layout = compile_round([1, 2, 3], 40, [[4, 5]], (0, 3), [[7, 8]])
    # three re-fed ordinary rows at 40..42 stay; nothing is copied
    assert kv_commit_plan(40, layout, candidate=0, hits=0) == CommitPlan(src=(), dst=(), length=43)


def cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's cached (keys, values), each [1, H_kv, T, D]: a region of an arena, or transformers' own cache."""
    if hasattr(cache, "arena"):
        return [(cache.keys(i), cache.values(i)) for i in range(len(cache.arena.layers()))]
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("num_ordinary", "target_hits"),
    [
        (1, 2),  # the worked trace's shape: one live key, winner 1 accepts 2 of 3
        (3, 3),  # re-fed rows (LP) and a full hit
        (2, 0),  # no hit: crop only
    ],
)
def test_commit_equals_plain_forward(tiny, family: str, num_ordinary: int, target_hits: int) -> None:
    model = tiny(family)
    adapter = ModelAdapter(model)
    rng = random.Random(num_ordinary * 10 + target_hits)
    prefix = [rng.randrange(TINY_VOCAB) for _ in range(12)]
    ordinary = [rng.randrange(TINY_VOCAB) for _ in range(num_ordinary)]
    committed = prefix + ordinary

    # the true greedy continuation after the live key, to build a candidate that hits exactly target_hits
    with torch.inference_mode():
        z = []
        seq = list(committed)
        for _ in range(4):  # z_0..z_3: a full hit emits all four
            z.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
            seq.append(z[-1])
    winner = [*z[:target_hits], *[(t + 1) % TINY_VOCAB for t in z[target_hits:3]]]  # wrong from target_hits on
    decoy = [(z[0] + 1) % TINY_VOCAB, z[1], z[2]]  # misses its first token
    candidates = [decoy, winner]

    # the cached prefix, then one packed round (W=5, N=4 warm window, all columns, two candidates)
    cache = scratch_region(adapter)
    t = len(prefix)
    one_round(
        adapter,
        torch.tensor(prefix),
        torch.arange(t),
        torch.ones(t, t, dtype=torch.bool).tril(),
        cache,
        torch.tensor([t - 1]),
    )
    levels = [[rng.randrange(TINY_VOCAB) for _ in range(w)] for w in (4, 5, 5)]
    layout = compile_round(ordinary, t, levels, (0, 5), candidates)
    logits = one_round(adapter, layout.input_ids, layout.position_ids, layout.visibility, cache, layout.logit_rows)
    preds = logits.argmax(-1).tolist()
    verdict = greedy_verify(
        preds[layout.ordinary_logit], candidates, [[preds[i] for i in rows] for rows in layout.verify_logits]
    )
    assert cache.length == t + layout.num_rows
    if target_hits:
        assert (verdict.candidate, verdict.hits) == (1, target_hits)  # the packed round really verified it
    else:
        assert verdict.hits == 0
    assert verdict.emitted == tuple(z[: target_hits + 1])  # packed predictions equal plain greedy

    plan = kv_commit_plan(t, layout, verdict.candidate, verdict.hits)
    cache.move(plan.src, plan.dst)
    cache.crop(plan.length)
    assert cache.length == len(committed) + target_hits

    expected = plain_cache(model, committed + z[:target_hits])  # K/V rows belong to their input tokens
    got, ref = cache_tensors(cache), cache_tensors(expected)
    assert len(got) == len(ref) == model.config.num_hidden_layers
    for (k, v), (k_ref, v_ref) in zip(got, ref, strict=True):
        assert k.shape == k_ref.shape, (k.shape, k_ref.shape)
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=0)
    if target_hits:
        # negative control: without the copy, the frontier holds lookahead rows' K/V, not the winner's
        stale = scratch_region(adapter)
        one_round(
            adapter,
            torch.tensor(prefix),
            torch.arange(t),
            torch.ones(t, t, dtype=torch.bool).tril(),
            stale,
            torch.tensor([t - 1]),
        )
        one_round(adapter, layout.input_ids, layout.position_ids, layout.visibility, stale, layout.logit_rows)
        stale.crop(plan.length)
        assert not torch.allclose(cache_tensors(stale)[0][0], ref[0][0], atol=1e-5)


def test_move_rows_reads_sources_before_writing(tiny) -> None:
    # overlapping src/dst (shift left by one): every destination must get the *old* source value
    adapter = ModelAdapter(tiny("llama"))
    cache = scratch_region(adapter)
    one_round(
        adapter,
        torch.arange(10),
        torch.arange(10),
        torch.ones(10, 10, dtype=torch.bool).tril(),
        cache,
        torch.tensor([9]),
    )
    before = [k.clone() for k, _ in cache_tensors(cache)]
    cache.move([3, 4, 5], [2, 3, 4])
    for (k, _), k0 in zip(cache_tensors(cache), before, strict=True):
        torch.testing.assert_close(k[:, :, 2:5], k0[:, :, 3:6], atol=0, rtol=0)
        torch.testing.assert_close(k[:, :, 5:], k0[:, :, 5:], atol=0, rtol=0)
        torch.testing.assert_close(k[:, :, :2], k0[:, :, :2], atol=0, rtol=0)

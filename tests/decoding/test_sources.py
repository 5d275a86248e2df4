"""Candidate sources on hand-made sequences: context lookup, the pool source, dedup and the shared budget."""

from __future__ import annotations

import pytest
from helpers import hf_greedy, random_prompt, run_lookahead, tiny_model

from lp_runner.config import LookaheadConfig
from lp_runner.decoding.coordinator import Coordinator, cap_rows
from lp_runner.decoding.pool import NGramPool
from lp_runner.decoding.sources import ContextSource, Feedback, PoolSource, Proposal, merge_candidates


def tokens(proposals) -> list[tuple[int, ...]]:
    return [p.tokens for p in proposals]


def P(source: str, toks: tuple[int, ...], match_len: int = 0) -> Proposal:
    return Proposal(toks, source, match_len)


def labelled(proposals) -> list[tuple[str, tuple[int, ...]]]:
    return [(p.source, p.tokens) for p in proposals]


def context(history, max_ngram=3, num_tokens=3, adaptive=False) -> ContextSource:
    src = ContextSource(max_ngram, num_tokens, adaptive)
    src.observe(history, len(history))
    return src


@pytest.mark.parametrize(
    "history,max_ngram,num_tokens,limit,expected",
    [
        # docstring example: (5, 6) occurred at ends 1 and 5 -> most recent first, distinct continuations
        ([5, 6, 7, 9, 5, 6, 7, 8, 5, 6], 2, 3, 2, [(7, 8, 5), (7, 9, 5)]),
        # longest match wins: (1, 2, 3) matches once (-> 4, 4); the 1-gram (3) alone would also match -> 9
        ([1, 2, 3, 4, 4, 3, 9, 9, 1, 2, 3], 3, 2, 2, [(4, 4)]),
        # most recent occurrence first when the same suffix occurred several times with the same continuation
        ([7, 1, 7, 2, 7], 1, 1, 3, [(2,), (1,)]),
        # nothing matches: nothing proposed
        ([1, 2, 3, 4], 3, 3, 2, []),
        # the live occurrence itself is never a match; the continuation may be short near the end
        ([8, 9, 8], 1, 5, 1, [(9, 8)]),
        # limit 0: nothing
        ([5, 6, 5], 2, 2, 0, []),
    ],
)
def test_context_lookup(history, max_ngram, num_tokens, limit, expected):
    assert tokens(context(history, max_ngram, num_tokens).propose(history, limit)) == expected


def test_context_proposals_carry_their_source_and_match_length():
    history = [5, 6, 7, 9, 5, 6, 7, 8, 5, 6]
    assert context(history, 2, 3).propose(history, 2) == [P("context", (7, 8, 5), 2), P("context", (7, 9, 5), 2)]


def test_context_min_ngram_drops_short_matches():
    history = [1, 2, 3, 4, 4, 3, 9, 9, 1, 2, 3]  # the suffix (1, 2, 3) occurred once, (3) twice
    assert tokens(context(history, 3, 2).propose(history, 2)) == [(4, 4)]
    src = ContextSource(3, 2, adaptive=False, min_ngram=3)
    src.observe(history, len(history))
    assert tokens(src.propose(history, 2)) == [(4, 4)]  # a 3-token match is long enough
    short = [7, 1, 7, 2, 7]  # only the 1-token suffix (7) ever matched
    assert tokens(context(short, 3, 1).propose(short, 1)) == [(2,)]
    src = ContextSource(3, 1, adaptive=False, min_ngram=2)
    src.observe(short, len(short))
    assert src.propose(short, 1) == []


@pytest.mark.parametrize(
    "max_rows,expected",
    [
        (0, [("context", (1, 2, 3)), ("pool", (4, 5))]),  # no cap
        (4, [("context", (1, 2, 3)), ("pool", (4,))]),  # docstring example
        (3, [("context", (1, 2, 3))]),  # the cap is spent: later candidates are dropped
        (2, [("context", (1, 2))]),
        (9, [("context", (1, 2, 3)), ("pool", (4, 5))]),
    ],
)
def test_cap_rows(max_rows, expected):
    assert labelled(cap_rows([P("context", (1, 2, 3)), P("pool", (4, 5))], max_rows)) == expected


def test_cap_rows_drops_a_cut_that_repeats_a_kept_prefix():
    merged = [P("context", (1, 2, 3), 2), P("pool", (1, 5)), P("pool", (6, 7))]
    # (1,) would re-verify (1, 2, 3)'s head; a cut keeps its proposal's source and match
    assert cap_rows(merged, 4) == [P("context", (1, 2, 3), 2), P("pool", (6,))]
    assert cap_rows(merged, 0) == merged  # uncapped: merge_candidates already removed prefixes


@pytest.mark.parametrize(
    "history,long_match_ngram,long_match_rows,expected",
    [
        # the suffix (1, 2, 3) matched: a 3-token match lifts the cap of 2 to 5
        ([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], 3, 5, (4, 5, 6, 7, 8)),
        # ... and to no cap at all with long_match_rows 0 (the proposal's own length, 6, is the limit)
        ([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], 3, 0, (4, 5, 6, 7, 8, 1)),
        # only the 1-token suffix (3) matched: the cap of 2 stays
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 3], 3, 5, (4, 5)),
        # long_match_ngram 0: never lifted
        ([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], 0, 5, (4, 5)),
    ],
)
def test_long_context_match_lifts_the_row_cap(history, long_match_ngram, long_match_rows, expected):
    la = LookaheadConfig(
        verification_set_size=1,
        context_tokens=6,
        context_adaptive=False,
        max_verify_rows=2,
        long_match_ngram=long_match_ngram,
        long_match_rows=long_match_rows,
        pool_from_prompt=False,
    )
    plan = Coordinator(la, 1, history).plan(history, None)
    assert plan.candidates == (expected,) and plan.sources == ("context",)


def test_context_index_grows_incrementally():
    history = [1, 2, 3]
    src = context(history, 2, 2)
    assert src.propose(history, 1) == []
    history += [1, 2]  # two committed tokens arrive
    src.observe(history, 2)
    assert tokens(src.propose(history, 1)) == [(3, 1)]


def test_adaptive_length_grows_after_full_accepts_and_shrinks_after_partial():
    src = ContextSource(1, 10, adaptive=True)
    assert src.lengths[1] == 10

    def fb(proposed: int, accepted: int) -> Feedback:  # about a proposal from a 1-token match
        return Feedback(P("context", tuple(range(proposed)), 1), accepted)

    src.feedback(fb(proposed=10, accepted=3))
    assert src.lengths[1] == 9
    for _ in range(20):
        src.feedback(fb(proposed=9, accepted=0))
    assert src.lengths[1] == 1  # floor
    src.feedback(fb(proposed=1, accepted=1))
    assert src.lengths[1] == 3


def test_adaptive_length_is_kept_per_match_length():
    """A long match's proposals keep their length while 1-token matches shrink theirs."""
    src = ContextSource(2, 6, adaptive=True)
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]  # suffix (1, 2) matched: k = 2
    src.observe(history, len(history))
    assert tokens(src.propose(history, 1)) == [(3, 4, 5, 6, 7, 8)]
    history += [9]  # suffix (2, 9) unseen, (9) seen at 8: k = 1
    src.observe(history, 1)
    (short,) = src.propose(history, 1)
    assert short == P("context", (1, 2, 9), 1)  # what followed position 8, up to the live key
    for _ in range(5):
        src.feedback(Feedback(short, 0))  # the k = 1 proposal: the feedback says which match it came from
    assert src.lengths[1] == 1 and src.lengths[2] == 6
    history += [3, 1, 2]  # (1, 2) again: k = 2 keeps its length
    src.observe(history, 3)
    assert tokens(src.propose(history, 1)) == [(9, 3, 1, 2)]


def test_pool_source_repairs_with_committed_ngrams():
    pool = NGramPool(cap=2, suffix_len=2)
    src = PoolSource(pool, ngram_size=3, from_output=True)
    history = [4, 5, 6, 7]
    src.observe(history, 2)  # tokens 6, 7 are new: n-grams (4,5,6) and (5,6,7) completed
    assert pool.bucket(4) == [(5, 6)] and pool.bucket(5) == [(6, 7)]
    assert src.propose([9, 5], 2) == [P("pool", (6, 7))]
    off = PoolSource(NGramPool(cap=2, suffix_len=2), ngram_size=3, from_output=False)
    off.observe(history, 2)
    assert len(off.pool) == 0


@pytest.mark.parametrize(
    "proposals,budget,expected",
    [
        # docstring example: a pool prefix of a context suffix is dropped; a longer pool suffix replaces it, in
        # the context suffix's slot but under its own label (the pool's tokens are what gets verified)
        (
            [("context", (1, 2, 3)), ("pool", (1, 2)), ("pool", (4, 5)), ("pool", (1, 2, 3, 9))],
            2,
            [("pool", (1, 2, 3, 9)), ("pool", (4, 5))],
        ),
        # identical suffixes are verified once, first source keeps it
        ([("context", (1, 2)), ("pool", (1, 2)), ("pool", (3, 4))], 3, [("context", (1, 2)), ("pool", (3, 4))]),
        # the budget counts distinct kept suffixes, in policy order
        (
            [("context", (1,)), ("context", (2,)), ("pool", (3,)), ("pool", (4,))],
            3,
            [("context", (1,)), ("context", (2,)), ("pool", (3,))],
        ),
        # budget 0: nothing
        ([("context", (1,))], 0, []),
    ],
)
def test_merge_candidates(proposals, budget, expected):
    assert labelled(merge_candidates([P(name, toks) for name, toks in proposals], budget)) == expected


def test_a_replacing_proposal_keeps_its_own_match_length():
    """The replaced proposal's match says nothing about the replacing one's; feedback adapts the right length."""
    kept = merge_candidates([P("context", (1, 2), 3), P("job", (1, 2, 3), 1)], 2)
    assert kept == [P("job", (1, 2, 3), 1)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_context_lookup_exact_and_accepting(family):
    model = tiny_model(family)
    prompt = random_prompt(24, seed=3)
    prompt = prompt + prompt[:12]  # a repeated span: context lookup has something to propose from the start
    expected = hf_greedy(model, prompt, 48)
    cases = ((True, 1, 0, 0), (False, 1, 0, 0), (False, 2, 0, 0), (True, 1, 3, 0), (False, 1, 2, 0), (False, 1, 1, 2))
    for branch, min_ngram, cap, long_match in cases:
        result = run_lookahead(
            model,
            prompt,
            4,
            4,
            3,
            True,
            48,
            lookahead_branch=branch,
            context_min_ngram=min_ngram,
            max_verify_rows=cap,
            long_match_ngram=long_match,
            long_match_rows=0,
        )
        assert result.output_ids == expected
        if cap and not long_match:
            assert all(sum(r.plan_candidates) <= cap for r in result.stats.records)
            assert any(sum(r.plan_candidates) == cap for r in result.stats.records)  # the cap did bind
        if long_match:  # both regimes occurred: capped rounds and rounds lifted by a long match
            assert any(sum(r.plan_candidates) == cap for r in result.stats.records)
            assert any(sum(r.plan_candidates) > cap for r in result.stats.records)
        assert result.stats.sources["context"]["accepted"] > 0  # guard: the context source really contributed

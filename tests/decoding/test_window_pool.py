"""The Jacobi window (warm-up, n-gram extraction, advance) and the n-gram pool (LRU per key), from small tables."""

from __future__ import annotations

import pytest

from lp_runner.decoding.pool import NGramPool, sequence_ngrams
from lp_runner.decoding.window import JacobiWindow, advance, initial_level0, keyed_ngrams

# ---------------------------------------------------------------------------------------------------------
# Window


def test_keyed_ngrams_worked_example() -> None:
    # The docstring's example (N=4, W=5): the live key pairs with column 0, level 0 supplies keys 1..W-1.
    levels = [[11, 12, 13, 14], [21, 22, 23, 24, 25], [31, 32, 33, 34, 35]]
    new_row = [41, 42, 43, 44, 45]
    assert keyed_ngrams(10, levels, new_row) == [
        (10, (21, 31, 41)),
        (11, (22, 32, 42)),
        (12, (23, 33, 43)),
        (13, (24, 34, 44)),
        (14, (25, 35, 45)),
    ]


def test_window_step_harvests_the_worked_example_once_warm() -> None:
    window = JacobiWindow(window_size=5, ngram_size=4, prompt_ids=[1, 2, 3])
    window.levels = [[11, 12, 13, 14], [21, 22, 23, 24, 25], [31, 32, 33, 34, 35]]
    assert window.warm
    assert window.step(10, [41, 42, 43, 44, 45]) == [
        (10, (21, 31, 41)),
        (11, (22, 32, 42)),
        (12, (23, 33, 43)),
        (13, (24, 34, 44)),
        (14, (25, 35, 45)),
    ]
    # and it advanced: level 0 keeps columns 1.. of old level 1, the new row is the deepest level
    assert window.levels == [[22, 23, 24, 25], [31, 32, 33, 34, 35], [41, 42, 43, 44, 45]]


@pytest.mark.parametrize(
    ("prompt", "w", "expected"),
    [
        ([5, 6, 7], 5, [5, 6, 7, 5]),  # docstring: prompt tail, cycled when too short
        ([1, 2, 3, 4, 5, 6, 7], 4, [5, 6, 7]),  # long prompt: its last W-1 tokens
        ([9], 3, [9, 9]),
        ([1, 2, 3], 1, []),  # W=1: level 0 is empty, column 0 is the live key itself
    ],
)
def test_initial_level0(prompt: list[int], w: int, expected: list[int]) -> None:
    assert initial_level0(prompt, w) == expected


@pytest.mark.parametrize(("w", "n"), [(1, 3), (2, 3), (5, 4), (7, 5), (3, 6)])
def test_warm_up_level_sizes_then_constant(w: int, n: int) -> None:
    window = JacobiWindow(window_size=w, ngram_size=n, prompt_ids=list(range(20)))
    expected_sizes = [[w - 1] + [w] * k for k in range(n - 1)]  # [W-1], [W-1, W], ... (N-1 levels)
    seen_sizes = [[len(lvl) for lvl in window.levels]]
    harvested = []
    for r in range(n + 3):  # through warm-up and several warm rounds
        assert window.depth == len(window.levels) - 1
        assert window.warm == (len(window.levels) == n - 1)
        ngrams = window.step(live_key=100 + r, new_row=[1000 * (r + 1) + j for j in range(w)])
        harvested.append(len(ngrams))
        seen_sizes.append([len(lvl) for lvl in window.levels])
    assert seen_sizes[: n - 1] == expected_sizes
    assert all(s == expected_sizes[-1] for s in seen_sizes[n - 1 :]), seen_sizes  # constant once warm
    # n-grams are harvested only from a warm window: none during warm-up (N-2 rounds), then W per round
    assert harvested == [0] * (n - 2) + [w] * (len(harvested) - (n - 2))


def test_warm_round_ngram_has_n_consecutive_positions() -> None:
    # N=3, W=3: the window warms after one round; the harvested n-gram of column j is
    # (b_j, t_1[j], new[j]) and keys are the live key then level 0.
    window = JacobiWindow(window_size=3, ngram_size=3, prompt_ids=[7, 8])
    assert window.levels == [[7, 8]]
    assert window.step(live_key=50, new_row=[61, 62, 63]) == []  # warming up
    assert window.levels == [[7, 8], [61, 62, 63]]
    assert window.step(live_key=51, new_row=[71, 72, 73]) == [(51, (61, 71)), (7, (62, 72)), (8, (63, 73))]
    assert window.levels == [[62, 63], [71, 72, 73]]


def test_advance_examples_and_no_mutation() -> None:
    levels = [[11, 12], [21, 22, 23], [31, 32, 33]]
    snapshot = [list(lvl) for lvl in levels]
    # docstring example (N=4, W=3)
    assert advance(levels, [41, 42, 43], num_levels=3) == [[22, 23], [31, 32, 33], [41, 42, 43]]
    assert levels == snapshot  # a helper returns a new value and leaves its argument alone
    # warming up: the new row is appended as the next level
    assert advance([[11, 12]], [21, 22, 23], num_levels=3) == [[11, 12], [21, 22, 23]]
    # N=3 (two levels): level 1 shifts into level 0 minus its column 0
    assert advance([[11, 12], [21, 22, 23]], [31, 32, 33], num_levels=2) == [[22, 23], [31, 32, 33]]


# ---------------------------------------------------------------------------------------------------------
# Pool


def test_pool_docstring_example() -> None:
    pool = NGramPool(cap=2, suffix_len=2)
    pool.insert(5, (1, 2))
    pool.insert(5, (3, 4))
    pool.insert(5, (1, 2))  # re-insert: moves to most recent, no duplicate
    assert pool.bucket(5) == [(3, 4), (1, 2)]
    pool.insert(5, (7, 8))  # full bucket: the oldest goes
    assert pool.bucket(5) == [(1, 2), (7, 8)]
    assert pool.candidates(5, 2) == [(7, 8), (1, 2)]  # most recent first
    assert pool.candidates(5, 1) == [(7, 8)]
    assert pool.candidates(5, 0) == []
    assert pool.candidates(6, 3) == []  # unknown key


def test_pool_reinsertion_protects_from_eviction() -> None:
    pool = NGramPool(cap=3, suffix_len=1)
    for s in (1, 2, 3):
        pool.insert(0, (s,))
    pool.insert(0, (1,))  # (1,) is now the most recent: (2,) is the oldest
    pool.insert(0, (4,))
    assert pool.bucket(0) == [(3,), (1,), (4,)]
    assert pool.candidates(0, 10) == [(4,), (1,), (3,)]


def test_pool_keys_are_independent_and_sizes_counted() -> None:
    pool = NGramPool(cap=1, suffix_len=2)
    pool.insert_many([(1, (2, 3)), (4, (5, 6)), (1, (7, 8))])
    assert pool.bucket(1) == [(7, 8)]  # cap 1: the newer one replaced the older
    assert pool.bucket(4) == [(5, 6)]
    assert len(pool) == 2
    assert len(pool._buckets) == 2  # two keys, each its own bucket


def test_pool_cap_zero_stores_nothing() -> None:
    pool = NGramPool(cap=0, suffix_len=2)
    pool.insert_many([(1, (2, 3)), (1, (4, 5))])
    assert len(pool) == 0
    assert not pool._buckets  # not even an empty bucket per key
    assert pool.candidates(1, 5) == []


def test_pool_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="cap must be >= 0"):
        NGramPool(cap=-1, suffix_len=2)
    pool = NGramPool(cap=2, suffix_len=3)
    with pytest.raises(ValueError, match="suffix length 2 != 3"):
        pool.insert(1, (2, 3))


@pytest.mark.parametrize(
    ("tokens", "n", "expected"),
    [
        ([1, 2, 3, 4], 3, [(1, (2, 3)), (2, (3, 4))]),  # docstring
        ([1, 2, 3, 4], 4, [(1, (2, 3, 4))]),  # exactly one n-gram
        ([1, 2], 3, []),  # too short
        ([5, 5, 5, 5], 3, [(5, (5, 5)), (5, (5, 5))]),  # repeats are kept in order (the pool dedups)
    ],
)
def test_sequence_ngrams(tokens: list[int], n: int, expected: list) -> None:
    assert sequence_ngrams(tokens, n) == expected


def test_deferred_ngrams_reach_a_key_before_it_is_read() -> None:
    """Queued n-grams are inserted, in order, for the key read (the rest stay queued until ``flush``): every read
    sees what inserting at once gives."""
    pool, eager = NGramPool(cap=2, suffix_len=1), NGramPool(cap=2, suffix_len=1)
    ngrams = [(5, (1,)), (7, (2,)), (5, (3,)), (5, (1,)), (5, (4,))]  # 5: (1,) re-used, then (3,) evicted
    pool.defer_many(ngrams)
    eager.insert_many(ngrams)
    assert pool.candidates(5, 2) == eager.candidates(5, 2) == [(4,), (1,)]
    assert pool._queued == [(7, (2,))]  # the other key's n-gram waits
    pool.insert(7, (9,))  # a direct insert into a key with queued n-grams keeps their order
    eager.insert(7, (9,))
    assert pool.bucket(7) == eager.bucket(7) == [(2,), (9,)]
    pool.defer_many([(8, (6,))])
    pool.flush()
    assert pool._queued == [] and pool.bucket(8) == [(6,)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("from_output", [True, False])
def test_plans_are_the_same_with_the_pool_flushed_after_planning(seed: int, from_output: bool) -> None:
    """Two coordinators fed the same rounds: one flushes its queued n-grams right after ``observe`` (every
    insertion before the next plan, as the pool did before), the other as the round loop does (after planning,
    while the forward runs). Every plan is the same, and so is the pool at the end. A small vocabulary and cap
    make keys collide and buckets evict; the guards check that plans did read n-grams still queued."""
    import random

    from lp_runner.config import LookaheadConfig
    from lp_runner.decoding.coordinator import Coordinator

    rng = random.Random(seed)
    la = LookaheadConfig(window_size=5, ngram_size=3, verification_set_size=3, pool_from_output=from_output)
    prompt = [rng.randrange(12) for _ in range(16)]
    late, early = Coordinator(la, 2, prompt), Coordinator(la, 2, prompt)
    history = list(prompt)
    settled = queued_after = pooled = 0
    for _ in range(60):
        live = history[-1]
        waiting = sum(1 for key, _ in late.pool._queued if key == live)
        plans = [coord.plan(history, depth=2) for coord in (late, early)]
        assert plans[0] == plans[1] and plans[0].digest == plans[1].digest
        pooled += "pool" in plans[0].sources
        settled += waiting and "pool" in plans[0].sources  # the plan read n-grams that were queued
        queued_after += bool(late.pool._queued)  # other keys' n-grams were still waiting at launch
        late.flush()  # the round loop: after the forward's launch
        emitted = [rng.randrange(12) for _ in range(rng.randint(1, 3))]
        history += emitted
        ngrams = [(rng.randrange(12), tuple(rng.randrange(12) for _ in range(2))) for _ in range(5)]
        for coord in (late, early):
            coord.observe(ngrams, history, len(emitted))
        early.flush()  # the old order: every insertion before the next plan
    assert settled > 0 and queued_after > 0 and pooled > 0
    assert all(late.pool.bucket(k) == early.pool.bucket(k) for k in range(12))

"""Greedy verification and the EOS / budget cut, from small tables (tokens are plain ints)."""

from __future__ import annotations

import pytest

from lp_runner.decoding.verify.greedy import Verdict, cut_emitted, greedy_verify

# (intent, z0, candidates, predictions, expected verdict)
GREEDY_CASES = [
    ("no candidates: only z0 is emitted", 5, [], [], Verdict(-1, 0, (5,))),
    (
        "none hits: z0 only; the (tied) first candidate is reported with 0 hits",
        5,
        [(1, 2, 3), (4, 5, 6)],
        [(9, 9, 9), (9, 9, 9)],
        Verdict(0, 0, (5,)),
    ),
    (
        "first token matches z0 but the second misses",
        5,
        [(5, 6, 7)],
        [(1, 6, 7)],  # after reading 5 the target says 1, not 6
        Verdict(0, 1, (5, 1)),
    ),
    (
        "full hit (N=4): N tokens = z0 + N-1 predictions, the last row's prediction included",
        7,
        [(7, 8, 9)],
        [(8, 9, 10)],
        Verdict(0, 3, (7, 8, 9, 10)),
    ),
    (
        "tie on hit length goes to the lowest index",
        7,
        [(7, 8, 1), (7, 8, 2)],
        [(8, 5, 0), (8, 5, 0)],
        Verdict(0, 2, (7, 8, 5)),
    ),
    (
        "a later, longer hit beats an earlier shorter one",
        7,
        [(7, 1, 1), (3, 3, 3), (7, 8, 9)],
        [(8, 0, 0), (0, 0, 0), (8, 9, 4)],
        Verdict(2, 3, (7, 8, 9, 4)),
    ),
    (
        "docstring example",
        7,
        [(7, 8, 9), (7, 3, 1)],
        [(8, 5, 2), (3, 1, 6)],
        Verdict(1, 3, (7, 3, 1, 6)),
    ),
    (
        "a match after a miss does not count: hits are a prefix",
        4,
        [(9, 5, 6)],
        [(5, 6, 7)],
        Verdict(0, 0, (4,)),
    ),
]


@pytest.mark.parametrize(
    ("z0", "candidates", "predictions", "expected"),
    [case[1:] for case in GREEDY_CASES],
    ids=[case[0] for case in GREEDY_CASES],
)
def test_greedy_verify(z0: int, candidates: list, predictions: list, expected: Verdict) -> None:
    assert greedy_verify(z0, candidates, predictions) == expected


def test_greedy_verify_needs_one_prediction_row_per_candidate() -> None:
    with pytest.raises(ValueError):  # zip(strict=True): a mis-sliced logit table must not be silently truncated
        greedy_verify(1, [(1, 2)], [])


# (intent, emitted, eos ids, budget, expected (tokens, finished))
CUT_CASES = [
    ("nothing to cut", (1, 2, 3), frozenset({9}), 10, ((1, 2, 3), False)),
    ("EOS in the middle: kept, the rest dropped", (3, 9, 4, 5), frozenset({9}), 10, ((3, 9), True)),
    ("EOS first", (9, 4), frozenset({9}), 10, ((9,), True)),
    ("any of several EOS ids", (1, 2, 8, 3), frozenset({8, 9}), 10, ((1, 2, 8), True)),
    ("no EOS ids: EOS-like tokens are ordinary", (1, 9, 2), frozenset(), 10, ((1, 9, 2), False)),
    ("budget cut", (1, 2, 3, 4), frozenset({9}), 2, ((1, 2), True)),
    ("budget used exactly", (1, 2), frozenset(), 2, ((1, 2), True)),
    ("budget and EOS on the same token", (1, 9, 3), frozenset({9}), 2, ((1, 9), True)),
    ("EOS after the budget is never reached", (1, 2, 9), frozenset({9}), 2, ((1, 2), True)),
]


@pytest.mark.parametrize(
    ("emitted", "eos_ids", "budget", "expected"),
    [case[1:] for case in CUT_CASES],
    ids=[case[0] for case in CUT_CASES],
)
def test_cut_emitted(emitted: tuple, eos_ids: frozenset, budget: int, expected: tuple) -> None:
    assert cut_emitted(emitted, eos_ids, budget) == expected

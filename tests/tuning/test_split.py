"""Choosing D and P (``tuning.split``): every split of N devices priced from the cost model on synthetic curves,
where the winners can be worked out by hand."""

from __future__ import annotations

import pytest

from lp_runner.tuning.costmodel import CostCurve, RoundShape, predict
from lp_runner.tuning.split import highest_throughput, lowest_latency, split_table, splits_of

# three rounds (the first is the prefill, left out): no window, 8 candidates of 4 rows, 2 tokens per round.
# Busiest rank: 1 + 32 = 33 rows at P = 1; 2 + 16 = 18 at P = 2 and 2 + 8 = 10 at P = 4 (a rank that did not own
# the last winner re-feeds its 2 tokens).
SHAPES = [RoundShape(100, 1, 7, -1, (4,) * 8, -1, 2) for _ in range(3)]


def _table(curve: CostCurve, allgather_2_s: float, devices: int = 4):
    def ms(d: int, p: int) -> float:
        return predict(SHAPES, curve, p, allgather_2_s).ms_per_token

    return split_table(devices, ms)


def test_splits_of_every_divisor():
    assert splits_of(1) == [(1, 1)]
    assert splits_of(4) == [(4, 1), (2, 2), (1, 4)]
    assert splits_of(6) == [(6, 1), (3, 2), (2, 3), (1, 6)]
    assert splits_of(7) == [(7, 1), (1, 7)]
    with pytest.raises(ValueError, match=">= 1"):
        splits_of(0)


def test_rows_that_cost_and_cheap_comm_latency_wants_p_throughput_wants_d():
    """Rows cost 1 ms each on a 10 ms forward and the all_gather is cheap (0.5 ms at 2 ranks): splitting a round
    over P ranks shortens it, but never by P times (the one-row cost stays), so latency favours P = N and
    throughput D = N. By hand (the module docstring's table): 21.00 / 13.75 / 10.25 ms per token."""
    table = _table(CostCurve.linear(0.010, 0.001), 5e-4)
    assert [(s.groups, s.workers) for s in table] == [(4, 1), (2, 2), (1, 4)]
    assert [s.ms_per_token for s in table] == pytest.approx([21.0, 13.75, 10.25])
    assert [s.tokens_per_s for s in table] == pytest.approx([4000 / 21.0, 2000 / 13.75, 1000 / 10.25])
    assert (lowest_latency(table).groups, lowest_latency(table).workers) == (1, 4)
    assert (highest_throughput(table).groups, highest_throughput(table).workers) == (4, 1)


def test_steep_curve_with_dear_comm_d_wins_both():
    """The same rounds, but an all_gather of 20 ms at 2 ranks (60 ms at 4): the rows LP saves (16 and 23 ms per
    round) cost more in communication, so D = N, P = 1 has both the lowest latency and the highest throughput."""
    table = _table(CostCurve.linear(0.010, 0.001), 0.020)
    assert [s.ms_per_token for s in table] == pytest.approx([21.0, (27 + 20) / 2, (19 + 60) / 2])
    assert lowest_latency(table).workers == 1 and lowest_latency(table).groups == 4
    assert highest_throughput(table).workers == 1 and highest_throughput(table).groups == 4


def test_flat_curve_and_free_comm_ties_go_to_the_smaller_p():
    """Rows free and no communication: every P has the same latency (10 ms / 2 tokens), so the latency tie goes to
    P = 1 (fewer collectives), and D = N has N times one group's throughput."""
    table = _table(CostCurve.linear(0.010, 0.0), 0.0)
    assert [s.ms_per_token for s in table] == pytest.approx([5.0, 5.0, 5.0])
    assert lowest_latency(table).workers == 1
    best = highest_throughput(table)
    assert (best.groups, best.workers) == (4, 1) and best.tokens_per_s == pytest.approx(800.0)


def test_a_per_split_latency_is_honoured():
    """The latency is a function of (D, P): a caller with a curve per split (e.g. groups that share a CPU's
    memory bandwidth and slow down with D) prices each split with its own figure."""
    table = split_table(2, lambda d, p: 10.0 * d if p == 1 else 12.0)  # two groups slow each other to 20 ms
    assert [(s.label, s.ms_per_token, s.tokens_per_s) for s in table] == [
        ("D=2 x P=1", 20.0, pytest.approx(100.0)),
        ("D=1 x P=2", 12.0, pytest.approx(1000 / 12)),
    ]
    assert highest_throughput(table).workers == 1 and lowest_latency(table).workers == 2
    assert table[0].to_dict() == {"groups": 2, "workers": 1, "devices": 2, "ms_per_token": 20.0, "tokens_per_s": 100.0}


def _scored(p: int, ms: float, tpf: float, rows: float, w: int):
    from lp_runner.config import LookaheadConfig
    from lp_runner.tuning.search import Scored

    return Scored(LookaheadConfig(window_size=w, verification_set_size=w), p, ms, tpf, rows)


def test_tune_devices_says_why_the_latency_winner_wins():
    """``tune --devices``'s last line: the winner's tokens per forward and busiest-rank rows against P = 1's, or,
    where P = 1 wins, that no P > 1 is faster and why."""
    from lp_runner.cli.tune import device_splits, split_lines
    from lp_runner.tuning.search import TuneResult

    per = {1: _scored(1, 2.0, 2.0, 120.0, 15), 2: _scored(2, 1.5, 3.0, 90.0, 31)}
    lines = split_lines(TuneResult(per[2], per[1], [], per), device_splits(TuneResult(per[2], per[1], [], per), 2))
    assert lines[-2].startswith("highest throughput: D=2 x P=1")
    assert lines[-1].startswith("why: P = 2 runs 3.00 tokens/forward on 90.0 rows") and "2.00 on 120.0" in lines[-1]
    per[2] = _scored(2, 2.5, 2.0, 70.0, 15)
    lines = split_lines(TuneResult(per[1], per[1], [], per), device_splits(TuneResult(per[1], per[1], [], per), 2))
    assert lines[-1].startswith("why: no P > 1 is faster")

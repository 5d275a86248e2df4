"""The strong-scaling simulation prices LP's lever: on a curve flat to a knee, a larger P affords a larger window
(more tokens per forward at the same forward cost) where acceptance grows with the window, and nothing where it
does not. Its pricing is the auto preset's (one function, one number), the roofline is its closed form at the
exact row count, and a GPU round is priced at the engine's row bucket.

Synthetic curves and acceptance tables, so each case's outcome follows from numbers written here."""

from __future__ import annotations

import math

import pytest

from lp_runner.backends.buckets import BucketLadder
from lp_runner.studies.hardware import (
    BANDWIDTH_FRACTION,
    FLOPS_FRACTION,
    GPUS,
    INTERCONNECTS,
    MODEL_SHAPES,
    Interconnect,
    curve_from_source,
    measured_interconnect,
)
from lp_runner.studies.simulate import (
    MARGIN,
    PLAIN,
    Acceptance,
    Host,
    Inputs,
    Window,
    acceptance_of,
    band,
    decode_rows,
    extend,
    knee_rows,
    price_window,
    simulate,
    slope_interval,
)
from lp_runner.tuning.acceptance import load_table
from lp_runner.tuning.costmodel import CostCurve, CurvePoint, HostCost, RoundShape
from lp_runner.tuning.search import price

KV = 512
NO_HOST = Host(HostCost(), "left out")
NO_LINK = Interconnect("none", 0.0, 0.0, float("inf"), "test")
LINK = INTERCONNECTS["nvlink"]


def flat_then_linear(flat_ms: float = 10.0, knee: int = 128, per_row_ms: float = 0.1) -> CostCurve:
    """A GPU-like forward: flat up to ``knee`` rows, then linear."""
    rows = (1, knee, 4 * knee, 8 * knee)
    ms = [flat_ms if q <= knee else flat_ms + per_row_ms * (q - knee) for q in rows]
    return CostCurve(tuple(CurvePoint(KV, q, 1e-3 * t, 1e-3 * t) for q, t in zip(rows, ms, strict=True)))


def _emitted(tpf: float, rounds: int) -> list[int]:
    """Integers whose mean over ``rounds`` is ``tpf`` (where rounds x tpf is whole): floor steps of i x tpf."""
    return [math.floor((i + 1) * tpf + 1e-9) - math.floor(i * tpf + 1e-9) for i in range(rounds)]


def recorded(w: int, n: int, g: int, tpf: float, prompts: int = 4, rounds: int = 40) -> Acceptance:
    """A recorded window: every decode round at full depth, G candidates of N - 1 tokens, ``tpf`` tokens a round
    (prompt i gets tpf - 0.05 + 0.025 i, so the bootstrap interval is not a point)."""
    window, shapes = Window(w, n, g), []
    for p in range(prompts):
        kv, rows = 64, [RoundShape(0, 64, w, 0, (), -1, 1)]
        for e in _emitted(tpf - 0.05 + 0.025 * p, rounds):
            rows.append(RoundShape(kv, 1, w, n - 2, (n - 1,) * g, 0, e))
            kv += e
        shapes.append(tuple(rows))
    per_round = [x for p in decode_rows(shapes) for x in p]
    mean = sum(sum(s.emitted for s in p[1:]) for p in shapes) / sum(len(p) - 1 for p in shapes)
    return Acceptance(window, tuple(shapes), mean, (mean - 0.05, mean + 0.05), sum(per_round) / len(per_round),
                      "recorded synthetic")  # fmt: skip


def plain(prompts: int = 4, rounds: int = 40) -> Acceptance:
    shapes = tuple(
        (RoundShape(0, 64, 0, -1, (), -1, 1), *(RoundShape(64 + i, 1, 0, -1, (), -1, 1) for i in range(rounds)))
        for _ in range(prompts)
    )
    return Acceptance(PLAIN, shapes, 1.0, (1.0, 1.0), 1.0, "by definition")


GROWING = [plain(), recorded(4, 4, 4, 1.5), recorded(15, 5, 15, 2.2), recorded(31, 7, 31, 3.0)]
FLAT = [plain(), recorded(4, 4, 4, 2.0), recorded(15, 5, 15, 2.0), recorded(31, 7, 31, 2.0)]


def _by_p(result: dict) -> dict[int, dict]:
    return {p["workers"]: p for p in result["points"]}


def _inputs(curve: CostCurve, link: Interconnect = LINK, row_plan=None) -> Inputs:
    return Inputs(curve, NO_HOST, link, row_plan, KV)


def test_growing_acceptance_p8_picks_a_larger_window_and_gains():
    """P = 1 fits 15-5-15 (about 120 rows) under the 128-row knee; 31-7-31's ~370 rows would cost 2.4x. At P = 8
    each rank runs its share of 31-7-31 (or a window the search grew from it) under the knee: more tokens per
    forward for one flat forward."""
    assert GROWING[2].rows <= 128 < GROWING[3].rows  # the premise: 15-5-15 fits, 31-7-31 does not
    p = _by_p(simulate(GROWING, [1, 2, 4, 8], _inputs(flat_then_linear())))
    assert p[1]["window"] == {"W": 15, "N": 5, "G": 15}
    assert p[8]["window"] != p[1]["window"] and p[8]["tokens_per_forward"] > p[1]["tokens_per_forward"] + 0.5
    assert p[8]["busiest_rank_rows"] <= 128
    assert p[8]["speed_vs_p1"] == pytest.approx(p[1]["ms_per_token"] / p[8]["ms_per_token"], rel=1e-3)
    assert p[8]["speed_vs_p1"] > 1.3
    assert p[8]["speed_vs_plain"] > p[1]["speed_vs_plain"] > 1.0
    # the same window as P = 1 at P = 8 saves nothing: the forward was flat already, and the collective is added
    assert p[8]["same_window_as_p1_ms_per_token"] > p[1]["ms_per_token"]


def test_flat_acceptance_p8_keeps_the_window_and_gains_nothing():
    """Acceptance that does not grow with the window: every window buys 2.0 tokens per forward, so the smallest
    is cheapest at every P (a larger one is never 1% cheaper), and P = 8 only adds the all_gather."""
    p = _by_p(simulate(FLAT, [1, 8], _inputs(flat_then_linear())))
    assert p[1]["window"] == p[8]["window"] == {"W": 4, "N": 4, "G": 4}
    assert p[8]["speed_vs_p1"] < 1.0


def test_cpu_like_curve_plain_decoding_wins():
    """Linear from one row (1 ms + 1 ms a row): every speculative row costs what a token does, so plain decoding
    wins at P = 1, and at P = 8 too."""
    p = _by_p(simulate(GROWING, [1, 8], _inputs(CostCurve.linear(0.001, 0.001))))
    assert p[1]["window"] == p[8]["window"] == {"W": 0, "N": 0, "G": 0}
    assert p[1]["speed_vs_plain"] == 1.0


def test_speed_vs_p1_is_none_without_p1():
    p = _by_p(simulate(GROWING, [2, 4], _inputs(flat_then_linear())))
    assert p[2]["speed_vs_p1"] is None and p[4]["speed_vs_p1"] is None
    assert p[2]["speed_vs_plain"] > 1.0


def test_a_window_must_be_one_percent_cheaper():
    """Two recorded windows on a flat curve: a larger one 0.5% better in tokens per forward is not named better;
    one 5% better is."""
    curve = flat_then_linear()
    small = recorded(4, 4, 4, 2.0)
    for tpf, wins in ((2.0 * 1.005, False), (2.0 * 1.05, True)):
        table = [plain(), small, recorded(7, 4, 7, tpf, rounds=200)]
        best = _by_p(simulate(table, [1], _inputs(curve, NO_LINK)))[1]
        assert (best["window"] == {"W": 7, "N": 4, "G": 7}) is wins, tpf
    assert MARGIN == 0.01


def test_preset_and_study_price_one_setting_identically():
    """One recorded window of the shipped table at P = 2: the study's price (``price_window``) and the auto
    preset's (``preset.search`` with that window pinned) are the same number from the same function."""
    from lp_runner.tuning import preset

    table = load_table("embedded-calibration8")
    curve, _, _ = curve_from_source("roofline:H200", "llama-8b", [KV])
    rec = next(r for r in table.prior.recorded if r.name == "window-15-5-15")
    acc = next(a for a in acceptance_of(table) if a.window == Window(15, 5, 15))
    ladder = BucketLadder()
    study = price_window(acc, 2, curve, NO_HOST, NO_LINK, ladder)
    choice = preset.search(
        rec.lookahead, ["lookahead_branch", "window_size", "ngram_size", "verification_set_size"], curve, ladder,
        table.prior.samples, [rec], world_size=2,
    )  # fmt: skip
    assert choice.lookahead.window_size == 15
    assert study.ms_per_token == choice.predicted_ms_per_token
    assert study.ms_per_token == price(acc.window.lookahead(), rec.shapes, curve, 2, 0.0, None, ladder).ms_per_token
    assert preset.price is price  # one function


def test_roofline_at_exact_rows_is_the_closed_form():
    """The llama-8b shape on an H200 at 151 rows: max(bytes / achievable bandwidth, FLOPs / achievable peak),
    written out here from the shape's numbers; the same at 150 and 152 rows (no sampled points between)."""
    curve, label, on_gpu = curve_from_source("roofline:H200", "llama-8b", [KV])
    assert on_gpu and "exact row count" in label and "lower bound" not in label
    sh = MODEL_SHAPES["llama-8b"]
    body = 32 * (4096 * 4096 * 2 + 4096 * 2048 + 3 * 4096 * 14336)  # q, o; k, v (8 heads of 128); gate, up, down
    head = 4096 * 128256
    bandwidth, peak = GPUS["H200"]
    for rows in (150, 151, 152):
        read = 2 * (body + head + 32 * 2048 * (KV + rows))
        flops = 2 * body * rows + 4 * 32 * 4096 * rows * (KV + rows) + 2 * head * 1
        closed = max(read / (bandwidth * BANDWIDTH_FRACTION), flops / (peak * FLOPS_FRACTION))
        assert curve.seconds(rows, 1, KV) == pytest.approx(closed, rel=1e-12)
    assert sh["num_key_value_heads"] * sh["head_dim"] * 2 == 2048
    # the knee: where the matmuls catch up with the weights' read, within 10% of one row
    knee = knee_rows(curve, KV)
    assert curve.seconds(knee, 1, KV) <= 1.1 * curve.seconds(1, 1, KV) < curve.seconds(knee + 1, 1, KV)
    wider, _, _ = curve_from_source("roofline:H200", "llama-8b", [KV], flops_fraction=1.0, bandwidth_fraction=1.0)
    assert knee_rows(wider, KV) > knee  # the fractions are inputs, and they move the knee


def test_bucket_padding_is_priced():
    """On a GPU a round runs at the engine's row bucket (3-3-2's 10 rows as 16): the study's forward is the curve
    at the padded counts, more than at the rounds' own counts on a curve that charges every row."""
    curve = CostCurve.linear(0.001, 0.0001, max_rows=1024, kv_len=KV)
    acc = recorded(3, 3, 2, 1.5)
    ladder = BucketLadder()
    rows = [q for p in decode_rows(acc.shapes) for q in p]
    assert any(ladder.rows_for(q) != q for q in rows)  # the premise: some rounds are padded
    padded = price_window(acc, 1, curve, NO_HOST, NO_LINK, ladder)
    own = price_window(acc, 1, curve, NO_HOST, NO_LINK, None)
    expect = sum(curve.seconds(ladder.rows_for(q), 1, KV) for q in rows) / len(rows)
    assert padded.forward_ms == pytest.approx(1e3 * expect, rel=1e-6)
    assert padded.forward_ms > own.forward_ms


def test_extension_rules():
    """Past the recording, ``hold`` keeps the base's tokens per forward; ``log`` adds the slope per doubling of
    rows over the base's rows, never less than ``hold``; a recorded window is as recorded."""
    big = Window(63, 7, 63)
    held = extend(GROWING, big, "hold")
    grown = extend(GROWING, big, "log", slope=0.2)
    base = GROWING[3]
    assert held.tokens_per_forward == base.tokens_per_forward and "hold" in held.source
    assert grown.rows > 1.8 * base.rows
    assert grown.tokens_per_forward == pytest.approx(base.tokens_per_forward + 0.2 * math.log2(grown.rows / base.rows))
    assert extend(GROWING, big, "log", slope=-1.0).tokens_per_forward == base.tokens_per_forward
    assert extend(GROWING, Window(15, 5, 15), "log") is GROWING[2]
    with pytest.raises(ValueError):
        extend(GROWING, Window(3, 3, 3), "hold")  # nothing recorded inside it


def test_band_over_the_slope_interval():
    """The band: P = 8's speed vs P = 1 at the slope interval's ends; a steeper slope buys P = 8 more."""
    result = band(GROWING, [1, 8], _inputs(flat_then_linear()), (0.2, 0.0, 0.5))
    assert result["workers"] == 8
    r = result["speed_vs_p1"]
    assert r["low"] <= r["point"] <= r["high"] and r["high"] > r["low"]
    interval = slope_interval(GROWING)
    assert interval is not None and interval[1] <= interval[0] <= interval[2]
    assert slope_interval(FLAT)[0] == pytest.approx(0.0, abs=0.05)


def test_host_time_and_collective():
    """Host time at the busiest rank's rows; the NVLink all_gather from the cited small-message figures: about
    8 us at 2 ranks and 20 us at 8; a measured 2-rank figure is (P - 1) steps of it."""
    host = Host(HostCost(0.001, 0.00001), "given")
    pt = price_window(GROWING[2], 2, flat_then_linear(), host, LINK, None)
    assert pt.host_ms == pytest.approx(1.0 + 0.01 * pt.busiest_rows)
    assert LINK.all_gather_s(2, 200) == pytest.approx(8e-6, rel=0.05)
    assert LINK.all_gather_s(8, 200) == pytest.approx(20e-6, rel=0.05)
    assert pt.collective_ms == pytest.approx(1e3 * LINK.all_gather_s(2, 8 * (4 + 5 + 15)))
    assert measured_interconnect(300.0).all_gather_s(4, 400) == pytest.approx(3 * 300e-6)


def test_a_measured_curve_is_made_monotone():
    """A point cheaper than a smaller row count's (3 rows at 0.9x one row's) is raised to it."""
    curve = CostCurve(tuple(CurvePoint(KV, q, t, t) for q, t in ((1, 1.0), (3, 0.9), (8, 1.2))))
    mono = curve.monotone()
    assert mono.seconds(3, 3, KV) == pytest.approx(1.0) and mono.seconds(8, 8, KV) == pytest.approx(1.2)
    assert curve.seconds(3, 3, KV) == pytest.approx(0.9)  # the original is unchanged
    assert mono.monotone() is mono


def test_shipped_table_reads_as_acceptance():
    """The shipped recording: plain decoding first, windows in order of rows with intervals around their value."""
    table = acceptance_of(load_table("embedded-calibration8"))
    assert table[0].window == PLAIN
    assert len(table) >= 5 and all(a.tokens_per_forward > 1.0 for a in table[1:])
    assert [a.rows for a in table[1:]] == sorted(a.rows for a in table[1:])
    assert all(a.interval[0] <= a.tokens_per_forward <= a.interval[1] for a in table[1:])

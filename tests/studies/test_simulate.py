"""The strong-scaling simulation prices LP's lever: on a curve flat to a knee, a larger P affords a larger window
(more tokens per forward at the same forward cost); on a curve linear from one row it does not.

Synthetic curves and acceptance tables, so each case's outcome follows from numbers written here."""

from __future__ import annotations

import pytest

from lp_runner.studies.hardware import INTERCONNECTS, MODEL_SHAPES, curve_from_source, measured_interconnect
from lp_runner.studies.simulate import (
    PLAIN,
    Acceptance,
    Host,
    Window,
    acceptance,
    extend,
    price,
    simulate,
    window_rows,
)
from lp_runner.tuning.acceptance import shipped_prior
from lp_runner.tuning.costmodel import CostCurve, CurvePoint, HostCost

KV = 512
NO_HOST = Host(HostCost(), "left out")
LINK = INTERCONNECTS["nvlink"]


def flat_then_linear(flat_ms: float = 10.0, knee: int = 128, per_row_ms: float = 0.1) -> CostCurve:
    """A GPU-like forward: flat up to ``knee`` rows, then linear."""
    rows = (1, knee, 4 * knee, 8 * knee)
    ms = [flat_ms if q <= knee else flat_ms + per_row_ms * (q - knee) for q in rows]
    return CostCurve(tuple(CurvePoint(KV, q, 1e-3 * t, 1e-3 * t) for q, t in zip(rows, ms, strict=True)))


# acceptance that grows with the window (the candidates verified per round: count and rows each)
GROWING = [
    Acceptance(PLAIN, 1.0, 0.0, 0.0, "by definition"),
    Acceptance(Window(4, 4, 4), 1.5, 2.0, 3.0, "synthetic"),
    Acceptance(Window(15, 5, 15), 2.2, 15.0, 4.0, "synthetic"),
    Acceptance(Window(31, 7, 31), 3.0, 31.0, 6.0, "synthetic"),
]


def _by_p(result: dict) -> dict[int, dict]:
    return {p["workers"]: p for p in result["points"]}


def test_flat_curve_p8_chooses_a_larger_window_and_is_faster():
    """P = 1 fits 15-5-15 (about 120 rows) under the knee; 31-7-31's 372 rows would cost 3.4x. At P = 8 each rank
    runs its share of 31-7-31 (68 rows on the busiest), under the knee: 3.0 tokens per forward for one flat forward."""
    result = simulate(GROWING, [1, 2, 4, 8], flat_then_linear(), NO_HOST, LINK, KV)
    p = _by_p(result)
    assert window_rows(GROWING[2]) <= 128 < window_rows(GROWING[3])  # the premise: 15-5-15 fits, 31-7-31 does not
    assert p[1]["window"] == {"W": 15, "N": 5, "G": 15}
    assert p[8]["window"] == {"W": 31, "N": 7, "G": 31}
    assert p[8]["rows_per_rank"] <= 128
    assert p[8]["ms_per_token"] < p[1]["ms_per_token"]
    assert p[8]["speedup_vs_p1"] == pytest.approx(p[1]["ms_per_token"] / p[8]["ms_per_token"], rel=1e-3)
    assert p[8]["speedup_vs_p1"] > 1.3
    # the same window as P = 1 at P = 8 saves nothing: the forward was flat already, and the collective is added
    assert p[8]["fixed_window_ms_per_token"] > p[1]["ms_per_token"]
    # the knee: the most rows within 10% of one row's cost, 128 + 1 ms / 0.1 ms a row
    assert "acceptance growth" in result["limits"] and result["knee_rows"] == 138


def test_cpu_like_curve_p8_is_not_faster_and_keeps_the_window():
    """Linear from one row (1 ms + 1 ms a row): every speculative row costs what a token does, so plain decoding
    wins at P = 1, and at P = 8 too; the all_gather then only adds time."""
    curve = CostCurve.linear(0.001, 0.001)
    p = _by_p(simulate(GROWING, [1, 8], curve, NO_HOST, LINK, KV))
    assert p[1]["window"] == p[8]["window"] == {"W": 0, "N": 0, "G": 0}
    assert p[8]["ms_per_token"] > p[1]["ms_per_token"]
    assert p[8]["speedup_vs_p1"] < 1.0


def test_rows_per_rank_come_from_the_engine_sharding():
    """31-7-31 at P = 8: the busiest rank's rows are those of ``costmodel.rank_rows`` on the representative round
    (column blocks with their context rows, candidates to the least loaded, the re-feed of 3 emitted tokens)."""
    from lp_runner.studies.simulate import representative
    from lp_runner.tuning.costmodel import rank_rows

    pt = price(GROWING[3], 8, flat_then_linear(), NO_HOST, LINK, KV)
    shape = representative(GROWING[3], KV)
    assert list(pt.rows_per_rank) == [q for q, _ in rank_rows([shape, shape], 8)[1]]
    assert sum(pt.rows_per_rank) > window_rows(GROWING[3])  # context rows and re-feeds are LP's overhead
    assert pt.collective_ms == pytest.approx(1e3 * 7 * (LINK.latency_s + 8 * (4 + 7 + 31) / LINK.bandwidth_Bps))


def test_extension_rules():
    """Past the recording, ``hold`` keeps the largest recorded tokens per forward inside the window; ``log``
    extends the fitted line of tokens per forward vs ln(rows) and never falls below ``hold``."""
    big = Window(63, 8, 63)
    held = extend(GROWING, big, "hold")
    grown = extend(GROWING, big, "log")
    assert held.tokens_per_forward == 3.0 and "hold" in held.source
    assert grown.tokens_per_forward > 3.0 and "log" in grown.source
    assert held.candidates == pytest.approx(63.0)  # every candidate slot used, as in 31-7-31
    assert extend(GROWING, Window(15, 5, 15), "log") is GROWING[2]  # recorded: as recorded
    with pytest.raises(ValueError):
        extend(GROWING, Window(3, 3, 3), "hold")  # nothing recorded inside it


def test_host_time_is_priced_at_the_busiest_rank():
    host = Host(HostCost(0.001, 0.00001), "given")
    pt = price(GROWING[2], 2, flat_then_linear(), host, LINK, KV)
    assert pt.host_ms == pytest.approx(1.0 + 0.01 * max(pt.rows_per_rank))


def test_shipped_acceptance_and_roofline_inputs():
    """The shipped recording reads as acceptance (plain decoding first, windows with more than one token per
    forward); a roofline of the 8B shape on an H200 is flat to a knee near 200 rows."""
    table = acceptance(shipped_prior().recorded)
    assert table[0].window == PLAIN
    assert len(table) >= 5 and all(a.tokens_per_forward > 1.0 for a in table[1:])
    curve, label = curve_from_source("roofline:H200", "llama-8b", [KV])
    assert "H200" in label and "lower bound" in label
    assert curve.seconds(100, 1, KV) == pytest.approx(curve.seconds(1, 1, KV), rel=0.01)
    assert curve.seconds(1000, 1, KV) > 3 * curve.seconds(1, 1, KV)
    assert set(MODEL_SHAPES) == {"embedded", "llama-8b"}
    two = measured_interconnect(300.0)
    assert two.all_gather_s(4, 400) == pytest.approx(3 * 300e-6)

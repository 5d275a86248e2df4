"""The one search: the window chosen where rows are free and not where they are dear, the window's payoff taken
from the job's own rounds, host time measured, and the calibration plan chosen by device."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.config import LookaheadConfig
from lp_runner.device import rows_are_cheap
from lp_runner.tuning import calibrate, preset
from lp_runner.tuning.acceptance import shipped_prior
from lp_runner.tuning.calibrate import GPU_KV, GPU_ROWS, QUICK_KV, QUICK_ROWS, measure_host, measurement_plan
from lp_runner.tuning.costmodel import (
    CostCurve,
    CurvePoint,
    HostCost,
    RoundShape,
    RowPlan,
    as_one_rank,
    predict,
    shapes_from_records,
)
from lp_runner.tuning.preset import AutoPreset, search
from lp_runner.tuning.search import MIN_GAIN, SPACE

HOST = HostCost(round_s=0.0004, row_s=0.00002)  # 0.4 ms a round + 20 us a row: a host of the measured kind


def gpu_like(one_row_s: float = 0.008, flat_to: int = 96) -> CostCurve:
    """A GPU's shape: a forward of 1 to ``flat_to`` rows costs one row's time, then grows with the rows."""
    rows = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512)
    return CostCurve(
        tuple(
            CurvePoint(kv, q, one_row_s * max(1.0, q / flat_to), one_row_s * max(1.0, q / flat_to))
            for kv in (512, 2048)
            for q in rows
        ),
        host=HOST,
    )


def cpu_like(one_row_s: float = 0.030) -> CostCurve:
    """A CPU's shape: flat for a few rows, then each row costs a quarter of a one-row forward."""
    ms = {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.2, 6: 1.7, 8: 2.2, 12: 3.2, 16: 4.2, 24: 6.2, 32: 8.2, 48: 12.2}
    return CostCurve(
        tuple(CurvePoint(kv, q, one_row_s * r, one_row_s * r) for kv in (64, 512) for q, r in ms.items()), host=HOST
    )


def _choose(curve: CostCurve, recorded=None):
    prior = shipped_prior()
    rec = prior.recorded if recorded is None else recorded
    return search(LookaheadConfig(), (), curve, RowPlan.from_curve(curve), prior.samples, rec)


def test_space_reaches_wide_windows() -> None:
    assert max(SPACE["window_size"]) >= 15 and max(SPACE["verification_set_size"]) >= 15
    assert max(SPACE["ngram_size"]) >= 7 and set(SPACE["lookahead_branch"]) == {False, True}
    assert max(r.lookahead.ngram_size for r in shipped_prior().recorded) >= 7  # the preset can price N = 7
    assert max(r.lookahead.window_size for r in shipped_prior().recorded) >= 15


def test_gpu_like_curve_chooses_the_window() -> None:
    """Rows free to ~100: a window of 15 pays, and the choice is one of the widest windows recorded."""
    choice = _choose(gpu_like())
    assert choice.lookahead.lookahead_branch, choice.reason
    assert choice.lookahead.window_size >= 7 and choice.lookahead.verification_set_size >= 7, choice.reason
    without = _choose(gpu_like(), recorded=())  # the same search with no window to offer
    assert choice.predicted_ms_per_token < (1 - MIN_GAIN) * without.predicted_ms_per_token


def test_cpu_like_curve_keeps_the_window_off() -> None:
    choice = _choose(cpu_like())
    assert not choice.lookahead.lookahead_branch, choice.reason
    assert "recorded window" in choice.reason  # a window was priced, and lost
    assert choice.predicted_ms_per_token < 30.0 + 1e3 * HOST.seconds(1)  # better than plain decoding


def test_host_time_is_priced_and_can_turn_the_choice() -> None:
    """Host time per row is part of every price: where it is large enough a wide window stops paying."""
    curve = gpu_like()
    assert _choose(curve).lookahead.lookahead_branch
    heavy = dataclasses.replace(curve, host=HostCost(0.0004, 0.002))  # 2 ms a row on the host
    assert not _choose(heavy).lookahead.lookahead_branch


def _window_preset(curve: CostCurve, monkeypatch) -> AutoPreset:
    """A preset that chose the window; its re-choice from the job's rounds comes once they cover the 805 tokens
    of the eight shipped samples (the samples are the job: distinct prompts, as a job's are)."""
    monkeypatch.setattr(preset, "ADAPT_AFTER_TOKENS", (256, 800))
    monkeypatch.setattr(preset, "WINDOW_EVIDENCE_TOKENS", 800)
    auto = AutoPreset(LookaheadConfig(), (), curve, RowPlan.from_curve(curve), prior=shipped_prior())
    assert auto.lookahead.lookahead_branch
    return auto


def _recorded_for(la: LookaheadConfig):
    return next(
        r
        for r in shipped_prior().recorded
        if (r.lookahead.window_size, r.lookahead.ngram_size, r.lookahead.verification_set_size)
        == (la.window_size, la.ngram_size, la.verification_set_size)
    )


def test_window_kept_when_the_jobs_own_rounds_pay(monkeypatch) -> None:
    """A job running the window observes its own window rounds: where they pay as recorded, the window stays."""
    auto = _window_preset(gpu_like(), monkeypatch)
    rec = _recorded_for(auto.lookahead)
    pairs = zip(shipped_prior().samples, rec.shapes, strict=True)
    changed = [auto.observe(s.prompt_ids, s.output_ids, shapes) for s, shapes in pairs]
    assert len(auto.history) >= 2 and auto.choice.samples == "observed"
    assert "this job's rounds" in auto.choice.reason  # priced from its own rounds, not the shipped ones
    assert not any(changed) and auto.lookahead.lookahead_branch, auto.choice.reason


def test_window_dropped_when_the_jobs_own_rounds_do_not_pay(monkeypatch) -> None:
    """The same job on a model whose window never hits (every window round emits one token): its own rounds price
    the window, and the preset turns it off once they cover ``WINDOW_EVIDENCE_TOKENS``."""
    auto = _window_preset(gpu_like(), monkeypatch)
    rec = _recorded_for(auto.lookahead)
    changed = []
    for s, shapes in zip(shipped_prior().samples, rec.shapes, strict=True):
        misses = [dataclasses.replace(x, winner=-1, emitted=1) for x in shapes]
        misses += [misses[-1]] * (sum(x.emitted for x in shapes) - len(misses))  # one token a round, as many rounds
        changed.append(auto.observe(s.prompt_ids, s.output_ids, misses))
    assert changed[-1] and not any(changed[:-1]), changed  # judged once, on all of its rounds
    assert not auto.lookahead.lookahead_branch and "this job's rounds" in auto.choice.reason, auto.choice.reason


def test_policy_feeds_the_window_rounds_it_ran(tiny, monkeypatch) -> None:
    """``RoundPolicy.observe`` hands a window generation's real records to the preset as its own rounds."""
    from lp_runner.config import GenerationConfig
    from lp_runner.decoding.engine import LookaheadEngine
    from lp_runner.tuning.policy import RoundPolicy

    curve = gpu_like()
    auto = _window_preset(curve, monkeypatch)
    policy = RoundPolicy(auto.lookahead, None, None, auto)
    engine = LookaheadEngine(ModelAdapter(tiny("llama")), policy.lookahead, GenerationConfig(max_new_tokens=12), [])
    res = engine.generate([1, 2, 3, 4, 5])
    policy.observe([1, 2, 3, 4, 5], res.output_ids, res.stats.records, res.lookahead)
    assert len(auto._window_rounds) == 1 and sum(s.emitted for s in auto._window_rounds[0]) == len(res.output_ids)
    assert list(auto._window_rounds[0]) == shapes_from_records(res.stats.records, policy.lookahead.window_size)  # P=1


def test_window_rounds_from_any_rank_read_as_one_rank() -> None:
    """Under LP a rank's records hold its own K/V length and ordinary rows (a rank that did not own the last winner
    re-feeds it): ``as_one_rank`` gives every rank the same shapes, P = 1's."""
    plan = dict(window_size=4, depth=3, candidates=(3, 3), winner=0)
    rank1 = [
        RoundShape(0, 5, emitted=2, **plan),
        RoundShape(5, 2, emitted=3, **plan),
        RoundShape(7, 3, emitted=1, **plan),
    ]
    one = as_one_rank(rank1, prompt_len=5)
    assert [(s.kv_len, s.ordinary) for s in one] == [(0, 5), (6, 1), (9, 1)]
    assert [s.emitted for s in one] == [2, 3, 1] and as_one_rank(one, 5) == one


def test_host_cost_through_two_groups() -> None:
    host = HostCost.through([[(1, 0.0003), (1, 0.0003), (1, 0.05)], [(25, 0.0009), (25, 0.0009), (26, 0.0009)]])
    assert host.row_s == pytest.approx(0.000025) and host.round_s == pytest.approx(0.000275)
    assert host.seconds(9) == pytest.approx(0.0005)
    assert HostCost.through([[(4, 0.001)], [(4, 0.002)]]).row_s == 0.0  # no spread in rows: no per-row part
    shapes = [RoundShape(0, 3, 0, -1, (), -1, 1), RoundShape(3, 1, 0, -1, (4,), 0, 5)]
    p = predict(shapes, CostCurve.linear(0.01, 0.0), host_s_per_round=host)
    assert p.host_s == pytest.approx(host.seconds(5))  # the prefill left out; the round's 5 rows priced


def test_curve_keeps_its_host_time() -> None:
    curve = gpu_like()
    assert CostCurve.from_dict(curve.to_dict()) == curve
    assert CostCurve.from_dict({"points": curve.to_dict()["points"]}).host is None


def test_measure_host_times_real_rounds(tiny) -> None:
    host = measure_host(ModelAdapter(tiny("llama")))
    assert host.round_s >= 0.0 and host.row_s >= 0.0 and host.seconds(10) > 0.0


def test_measurement_plan_by_device() -> None:
    assert rows_are_cheap(torch.device("cuda", 1)) and not rows_are_cheap(torch.device("cpu"))
    gpu = measurement_plan(True)
    assert max(gpu.rows) == 512 and gpu.rows == GPU_ROWS and len(gpu.kv_lens) == 2 and gpu.kv_lens == GPU_KV
    assert gpu.head_rows == (512,) and gpu.forwards == (len(GPU_ROWS) + 1) * 2 * (gpu.reps + 1)
    cpu = measurement_plan(False)
    assert (cpu.rows, cpu.kv_lens, cpu.head_rows) == (QUICK_ROWS, QUICK_KV, (48,)) and max(cpu.rows) == 48
    short = measurement_plan(True, max_positions=1024)  # a model of 1024 positions: K/V cut to fit 512 rows
    assert max(short.kv_lens) + max(short.rows) <= 1024 and len(short.kv_lens) == 2
    assert measurement_plan(True, max_positions=8192).kv_lens == GPU_KV


def test_cuda_calibration_measures_the_gpu_plan(monkeypatch) -> None:
    seen = {}

    def measure(adapter, kvs, rows, reps, sync, head_rows, tick, max_spread, max_reps, budget_s, clock):
        seen.update(kvs=tuple(kvs), rows=tuple(rows), head_rows=tuple(head_rows))
        seen.update(bound=(max_spread, max_reps, budget_s))
        return CostCurve.linear(0.01, 0.001)

    monkeypatch.setattr(calibrate, "measure_curve", measure)
    monkeypatch.setattr(calibrate, "synchronizer", lambda device: None)
    calibrate.measure_quick(SimpleNamespace(device=torch.device("cuda", 0), max_positions=None), budget_s=1.0)
    bound = (calibrate.CURVE_SPREAD, calibrate.CURVE_MAX_REPS, 1.0)  # repeated until bounded, within the budget
    assert seen == {"kvs": GPU_KV, "rows": GPU_ROWS, "head_rows": (512,), "bound": bound}

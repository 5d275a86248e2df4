"""Start-up calibration: measured once, cached under a key of everything that changes it, shared by LP ranks."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch
from dist_helpers import env_with_repo, free_port, make_tiny_folder, read_jsonl, write_prompts

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.models.loading import weights_checksum
from lp_runner.tuning import costmodel
from lp_runner.tuning.calibrate import (
    COARSE_ROWS,
    CURVE_MAX_REPS,
    CURVE_SPREAD,
    NOISY_SPREAD,
    NOISY_TRIES,
    QUICK_HEAD_ROWS,
    QUICK_KV,
    QUICK_REPS,
    QUICK_ROWS,
    CalibrationTimeout,
    Ticker,
    cache_file,
    calibrate,
    calibration_key,
    measure_quick,
    save,
)
from lp_runner.tuning.costmodel import CostCurve, RowPlan, measure_curve, point_spreads, repetition_spread


def test_each_build_of_the_native_kernels_has_its_own_curve(native_routing) -> None:
    """A new version of the native kernels' sources (or another compiler, or other flags) changes what a forward
    costs: its curve is measured again, not read from a cache filled by other code. torch's kernels keep their key."""
    from lp_runner.backends.cpu.backend import CpuBackend
    from lp_runner.backends.cpu.prepack import PrepackChoice, native_unavailable_reason
    from lp_runner.backends.torch_backend import TorchBackend
    from lp_runner.models.loading import default_cache_dir

    native = native_routing
    if native_unavailable_reason(torch.nn.Linear(2, 2), default_cache_dir()) is not None:
        pytest.skip("no native kernel here")
    cpu = torch.device("cpu")
    native.load(default_cache_dir())
    backend = CpuBackend(PrepackChoice("native", 2, "as set", 1, "native"))  # the key reads the routed build
    key = calibration_key(cpu, torch.float32, "abc", backend=backend.key())
    torch_key = calibration_key(cpu, torch.float32, "abc", backend=TorchBackend().key())
    assert key["kernels"] == "native-packed-fused" and torch_key["kernels"] == "torch"
    assert key["build"] == native.build_id() != "" and torch_key["build"] == ""
    assert calibration_key(cpu, torch.float32, "abc") == torch_key  # no backend: torch's kernels
    native.route(native.library(str(default_cache_dir()), ("-DLP_RUNNER_ANOTHER_BUILD",)))
    assert native.build_id() != key["build"]
    assert calibration_key(cpu, torch.float32, "abc", backend=backend.key()) != key
    assert calibration_key(cpu, torch.float32, "abc", backend=TorchBackend().key()) == torch_key


@pytest.fixture
def jitter_allowance(monkeypatch):
    """The suite's other worker takes time slices of several ms from the tiny model's sub-millisecond forwards: a
    larger allowance for scheduler jitter (``costmodel.JITTER_S``) keeps that from reading as a busy machine in
    tests about the cache (the noise policy has its own test, with noise far above this allowance)."""
    monkeypatch.setattr(costmodel, "JITTER_S", 0.02)


def test_curve_is_cached_and_keyed(tiny, tmp_path, jitter_allowance) -> None:
    model = tiny("llama")
    adapter = ModelAdapter(model)
    checksum = weights_checksum(model)
    first = calibrate(adapter, tmp_path, checksum)
    assert first.source == "measured"
    assert sorted({p.rows for p in first.curve.points}) == list(QUICK_ROWS)
    again = calibrate(adapter, tmp_path, checksum)
    assert again.source == "cache" and again.curve == first.curve and again.path == first.path
    assert calibrate(adapter, tmp_path, checksum, recalibrate=True).source == "measured"  # --recalibrate

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # another thread count is another curve
        assert calibrate(adapter, tmp_path, checksum).source == "measured"
    finally:
        torch.set_num_threads(threads)
    assert calibrate(adapter, tmp_path, "other-weights").source == "measured"  # another model
    half = ModelAdapter(tiny("llama", seed=5).to(torch.bfloat16))  # another dtype (and weights)
    key_half = calibration_key(half.device, half.dtype, checksum)
    assert key_half["dtype"] == "bfloat16"
    assert cache_file(tmp_path, key_half) != cache_file(
        tmp_path, calibration_key(adapter.device, adapter.dtype, checksum)
    )
    assert calibrate(adapter, tmp_path, checksum).source == "cache"  # the first key is still there


def test_measurement_fits_a_time_budget(tiny, tmp_path) -> None:
    """Under LP the other ranks wait for rank 0's measurement inside a collective: a budget the quick grid would
    overrun gets the coarse grid (a budget of a nanosecond always does)."""
    adapter = ModelAdapter(tiny("llama"))
    coarse = calibrate(adapter, tmp_path, "w", budget_s=1e-9)
    assert sorted({p.rows for p in coarse.curve.points}) == list(COARSE_ROWS)
    roomy = calibrate(adapter, tmp_path / "other", "w", budget_s=1e6)
    assert sorted({p.rows for p in roomy.curve.points}) == list(QUICK_ROWS)


def test_unreadable_or_foreign_cache_is_remeasured(tiny, tmp_path) -> None:
    adapter = ModelAdapter(tiny("llama"))
    cal = calibrate(adapter, tmp_path, "w")
    path = cal.path
    with open(path, "w") as f:
        f.write("{not json")
    assert calibrate(adapter, tmp_path, "w").source == "measured"
    with open(path) as f:
        data = json.load(f)
    data["key"]["threads"] = 999  # a file whose key does not match what it is read for
    with open(path, "w") as f:
        json.dump(data, f)
    assert calibrate(adapter, tmp_path, "w").source == "measured"


def _plant(cache_root, key: dict, ms: dict[int, float]) -> None:
    """Write a curve into a cache folder, as if measured there (body = all, ms per row count)."""
    points = [{"kv_len": kv, "rows": q, "body_s": t / 1e3, "all_s": t / 1e3} for kv in QUICK_KV for q, t in ms.items()]
    path = cache_file(cache_root, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "curve": {"points": points}}))


@pytest.mark.slow
def test_lp_ranks_use_rank0_curve(tmp_path) -> None:
    """Two real ranks whose caches hold opposite curves: rank 1 must use rank 0's (else the auto preset makes two
    different plans and the plan digest stops the run), and the record shows rank 0's choice."""
    folder = make_tiny_folder(tmp_path / "tiny")
    from lp_runner.backends import select_backend
    from lp_runner.models.loading import load_model_and_tokenizer

    model, _, _ = load_model_and_tokenizer(folder)
    checksum = weights_checksum(model)  # the checkpoint's, taken before the backend repacks it, as the runner does
    cpu = torch.device("cpu")
    backend = select_backend("auto", model, cpu)  # the runner's default model.backend
    key = calibration_key(cpu, torch.float32, checksum, backend=ModelAdapter(model, backend=backend).backend.key())
    key["threads"] = 1
    dear = {q: 50.0 + 30.0 * (q - 1) for q in QUICK_ROWS}  # no window, few rows
    free = {q: 50.0 for q in QUICK_ROWS}  # rows cost nothing: the window
    _plant(tmp_path / "c0", key, dear)
    _plant(tmp_path / "c1", key, free)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "def add(a, b):"}])
    port = free_port()
    procs = []
    for rank in range(2):
        env = env_with_repo(
            RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LP_RUNNER_CACHE=str(tmp_path / f"c{rank}"),
        )  # fmt: skip
        args = ["--prompts", str(prompts), "--set", f"model.path={folder}", "--set", "model.threads=1",
                "--set", "generation.max_new_tokens=12", "--set", "parallel.workers=2"]  # fmt: skip
        if rank == 0:
            args += ["--output", str(tmp_path / "out.jsonl")]
        cmd = [sys.executable, "-m", "lp_runner", *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    rec = read_jsonl(tmp_path / "out.jsonl")[0]
    assert rec["policy"]["calibration"]["source"] == "cache"
    assert not rec["policy"]["lookahead"]["lookahead_branch"]  # rank 0's dear curve decided
    assert not os.path.exists(tmp_path / "c1" / "calibration" / "x")  # (rank 1 measured nothing new)
    assert len(os.listdir(tmp_path / "c1" / "calibration")) == 1


def test_curve_roundtrip() -> None:
    curve = CostCurve.linear(0.01, 0.001)
    assert CostCurve.from_dict(json.loads(json.dumps(curve.to_dict()))) == curve
    noisy = CostCurve(curve.points, 0.7)
    assert CostCurve.from_dict(json.loads(json.dumps(noisy.to_dict()))) == noisy != curve
    assert CostCurve.from_dict({"points": noisy.to_dict()["points"]}).spread == 0.0  # a cache entry from before
    bounded = CostCurve(curve.points, 0.05, worst_spread=0.09, sweeps=6)  # what the repeated measurement ended at
    assert CostCurve.from_dict(json.loads(json.dumps(bounded.to_dict()))) == bounded


def test_repetition_spread() -> None:
    """Per point (slowest - fastest - jitter allowance) / median, the median over the points measured twice or
    more; differences within the scheduler's jitter are no noise."""
    j = costmodel.JITTER_S
    assert repetition_spread([[0.010, 0.010, 0.010]]) == 0.0
    assert repetition_spread([[0.010, 0.020, 0.030]]) == pytest.approx((0.020 - j) / 0.020)
    assert repetition_spread([[0.001, 0.001 + j, 0.001]]) == 0.0  # a time slice, not a load
    assert repetition_spread([[0.010], [0.5]]) == 0.0  # one repetition: unknown
    points = [[0.010, 0.010, 0.010], [0.010, 0.020, 0.030], [0.010, 0.010, 0.050], [0.2]]
    assert repetition_spread(points) == pytest.approx((0.020 - j) / 0.020)  # the middle of 0, 0.9 and 3.8


class BusyMachine:
    """The tiny model's adapter on a machine something else loads: half of its forwards (a seeded draw) lose
    80 ms to the other load, as a busy process's time slices cost a forward."""

    def __init__(self, adapter: ModelAdapter, seed: int = 0) -> None:
        self._adapter, self._draw = adapter, random.Random(seed)

    def run(self, *args, **kwargs):
        if self._draw.random() < 0.5:
            time.sleep(0.08)
        return self._adapter.run(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._adapter, name)


def test_a_noisy_curve_is_measured_again_and_the_quieter_kept(tiny, tmp_path, jitter_allowance) -> None:
    """A curve measured on a busy machine is used, said to be noisy, and cached; the next run measures again and
    the quieter curve stays in the cache. Without this a moment's load would price every later run's choices until
    --recalibrate (the auto preset once chose plain decoding for a tiny model from such a curve)."""
    quiet = ModelAdapter(tiny("llama"))
    logs: list[str] = []
    noisy = calibrate(BusyMachine(quiet), tmp_path, "w", log=logs.append)
    assert noisy.source == "measured" and noisy.noisy and noisy.curve.spread > NOISY_SPREAD
    assert noisy.summary()["noisy"] and "noisy" in logs[-1] and "next run measures again" in logs[-1]
    again = calibrate(quiet, tmp_path, "w", log=logs.append)
    assert "is noisy" in logs[-1] and "measuring it again" in logs[-1]
    assert again.source == "measured" and not again.noisy and again.path == noisy.path
    kept = calibrate(quiet, tmp_path, "w")
    assert kept.source == "cache" and kept.curve == again.curve

    # a cached noisy curve stays where the new measurement is noisier still
    key = calibration_key(quiet.device, quiet.dtype, "v", False, quiet.backend.key())
    planted = CostCurve(again.curve.points, NOISY_SPREAD + 0.01)
    save(cache_file(tmp_path, key), key, planted, 1.0)
    busy = calibrate(BusyMachine(quiet, seed=1), tmp_path, "v")
    assert busy.source == "cache" and busy.curve == planted
    assert calibrate(quiet, tmp_path, "v").source == "measured"  # and is measured again on a quiet machine


def test_the_summary_line_says_the_curve_is_noisy() -> None:
    from lp_runner.jobs.report import policy_lines

    choice = {"samples": "shipped", "evaluated": 9, "predicted_ms_per_token": 20.0,
              "predicted_tokens_per_forward": 1.5, "curve_body_ms": {"1": 20.0, "8": 24.0}}  # fmt: skip
    cal = {"device": "AMD EPYC", "source": "measured", "seconds": 4.2, "spread": 0.61, "noisy": True}
    lines = policy_lines({"preset": "auto", "choice": choice, "calibration": cal})
    assert "curve (AMD EPYC, measured 4.2 s, noisy: 61% spread): rows 1:1.00x  8:1.20x" in lines[-1]
    quiet = policy_lines({"preset": "auto", "choice": choice, "calibration": {**cal, "spread": 0.1, "noisy": False}})
    assert "noisy" not in quiet[-1]


def test_a_noisy_curve_is_measured_again_at_most_noisy_tries_times(tiny, tmp_path, jitter_allowance) -> None:
    """On a machine that stays busy every start-up would measure again (105-233 s each on the embedded model): the
    cache counts the measurements its curve is the quietest of, and past NOISY_TRIES keeps it, saying so."""
    quiet = ModelAdapter(tiny("llama"))
    key = calibration_key(quiet.device, quiet.dtype, "w", False, quiet.backend.key())
    path = cache_file(tmp_path, key)
    noisy = CostCurve(calibrate(quiet, tmp_path / "other", "w").curve.points, NOISY_SPREAD + 0.01)
    logs: list[str] = []
    save(path, key, noisy, 1.0, tries=NOISY_TRIES)
    kept = calibrate(quiet, tmp_path, "w", log=logs.append)
    assert kept.source == "cache" and kept.curve == noisy
    assert logs == [logs[0]] and f"the quietest of {NOISY_TRIES} measurements: using it (--recalibrate" in logs[0]

    save(path, key, noisy, 1.0, tries=NOISY_TRIES - 1)  # one more try left: measured, and said which it is
    calibrate(quiet, tmp_path, "w", log=logs.append)
    assert f"measuring it again (measurement {NOISY_TRIES} of at most {NOISY_TRIES})" in logs[1], logs

    save(path, key, noisy, 1.0, tries=1)  # a noisier measurement leaves the cached curve, one try more
    assert calibrate(BusyMachine(quiet, seed=2), tmp_path, "w").curve == noisy
    assert json.loads(path.read_text())["tries"] == 2


def test_a_measurement_past_its_time_limit_ends_in_one_line_and_the_run_goes_on(tiny, tmp_path, monkeypatch) -> None:
    """Too many threads for the cores, or a machine far busier than its cores, once made calibration run for many
    minutes with no word: it stops at its limit, says so, caches nothing, and the job runs its setting as written."""
    from lp_runner.config import load_config
    from lp_runner.parallel.comm import SoloCommunicator
    from lp_runner.tuning import policy

    adapter = ModelAdapter(tiny("llama"))
    logs: list[str] = []
    assert calibrate(adapter, tmp_path, "w", log=logs.append, limit_s=0.0) is None
    assert logs[-1].startswith("warning: calibrating took longer than 0 s") and "\n" not in logs[-1]
    assert not (tmp_path / "calibration").exists() or not any((tmp_path / "calibration").iterdir())

    monkeypatch.setattr(policy, "CALIBRATION_LIMIT_S", 0.0)
    cfg = load_config(None, [])
    built = policy.RoundPolicy.build(cfg, adapter, SoloCommunicator(), tmp_path, lambda: "w", log=logs.append)
    assert built.lookahead == cfg.lookahead and built.row_plan is None and built.auto is None
    assert built.calibration is None and logs[-1].startswith("warning: calibrating took longer than 0 s")


def test_a_long_measurement_says_how_far_it_got() -> None:
    """A line every PROGRESS_EVERY_S, none between; past the limit CalibrationTimeout."""
    now = [100.0]
    lines: list[str] = []
    tick = Ticker(300.0, lines.append, clock=lambda: now[0])
    for seconds, done in ((5, 1), (16, 2), (20, 3), (31.5, 4)):
        now[0] = 100.0 + seconds
        tick(done, 90)
    assert lines == ["calibrating: 2 of 90 forwards measured (16 s)", "calibrating: 4 of 90 forwards measured (32 s)"]
    now[0] = 401.0
    with pytest.raises(CalibrationTimeout):
        tick(5, 90)


class FakeTimer:
    """A clock that moves only when the wrapped adapter runs a forward, by ``cost(rows, logit rows, forward
    index)`` seconds: the real forward runs (its K/V is what the measurement expects), and the test chooses what
    each timed forward reads (``measure_curve(clock=...)``), noise included, with no wait."""

    def __init__(self, adapter: ModelAdapter, cost) -> None:
        self._adapter, self._cost = adapter, cost
        self.now, self.forwards = 0.0, 0

    def __call__(self) -> float:
        return self.now

    def run(self, rounds, regions):
        out = self._adapter.run(rounds, regions)
        self.now += self._cost(len(rounds[0].tokens), len(rounds[0].logit_rows), self.forwards)
        self.forwards += 1
        return out

    def __getattr__(self, name: str):
        return getattr(self._adapter, name)


def _sweep_of(i: int) -> int:
    """The sweep of forward ``i`` of ``measure_curve([8, 24], [1, 3])`` with the head at every row: 2 prefills,
    then 8 cases a sweep (sweep 0 the warm-up)."""
    return (i - 2) // 8


def _cost(noisy) -> object:
    """0.1 s + 10 ms a row + 1 ms a logit row, 1.5x in the sweeps ``noisy(sweep)`` names (a load on the machine)."""
    return lambda rows, logits, i: (0.1 + 0.01 * rows + 0.001 * logits) * (1.5 if noisy(_sweep_of(i)) else 1.0)


def test_point_spreads_leave_out_the_ends_so_more_sweeps_can_outvote_a_load() -> None:
    """The full range of a point's repetitions only grows with more of them; the quarter at each end left out, a
    load that met one forward of eight no longer counts. Fewer than 4 repetitions: nothing left out."""
    j = costmodel.JITTER_S
    assert point_spreads([[0.10, 0.15, 0.10]]) == [pytest.approx((0.05 - j) / 0.10)]
    assert point_spreads([[0.10, 0.15, *[0.10] * 6]]) == [0.0]  # 2 left out at each end
    assert point_spreads([[0.10, 0.15, 0.10, 0.15]]) == [pytest.approx((0.05 - j) / 0.15)]  # half of them: a load
    assert point_spreads([[0.3], [0.1, 0.1]]) == [0.0]  # one repetition: no spread known


def test_the_curve_is_measured_until_every_point_is_bounded(tiny) -> None:
    """A load during the first timed sweep makes every point's repetitions 50% apart: 3 more sweeps are run, and
    with 6 the load is outvoted (the trimmed spread is 0), so it stops there; without the load it stops after 3.
    The curve records the sweeps and the spread it ended at, and its medians are the quiet costs."""
    adapter = ModelAdapter(tiny("llama"))
    for noisy, sweeps in ((lambda sweep: sweep == 1, 6), (lambda sweep: False, 3)):
        fake = FakeTimer(adapter, _cost(noisy))
        seen: list[int] = []
        curve = measure_curve(fake, [8, 24], [1, 3], reps=3, max_spread=CURVE_SPREAD, max_reps=12, clock=fake,
                              tick=lambda done, total, seen=seen: seen.append(done))  # fmt: skip
        assert (curve.sweeps, len(seen)) == (sweeps, 8 * (sweeps + 1))
        assert curve.worst_spread == 0.0 and curve.spread == 0.0
        body = {(p.kv_len, p.rows): p.body_s for p in curve.points}
        assert body == {(kv, q): pytest.approx(0.1 + 0.01 * q + 0.001) for kv in (8, 24) for q in (1, 3)}


def test_the_repetitions_stop_at_their_cap_and_within_the_budget(tiny) -> None:
    """A load every other sweep never lets the spread fall under the bound: the measurement stops at ``max_reps``
    sweeps and records the spread it could not bound (the curve is then noisy, measured again next start-up);
    with a time budget it stops where the next 3 sweeps would end past it (4 sweeps took 5.3 s of the fake
    clock, 7 would take about 9.2 s, over 8)."""
    adapter = ModelAdapter(tiny("llama"))
    odd = _cost(lambda sweep: sweep % 2 == 1)
    fake = FakeTimer(adapter, odd)
    capped = measure_curve(fake, [8, 24], [1, 3], reps=3, max_spread=CURVE_SPREAD, max_reps=9, clock=fake)
    assert capped.sweeps == 9 and capped.worst_spread > CURVE_SPREAD
    fake = FakeTimer(adapter, odd)
    timed = measure_curve(fake, [8, 24], [1, 3], reps=3, max_spread=CURVE_SPREAD, max_reps=9, clock=fake, budget_s=8.0)
    assert timed.sweeps == 3 and timed.worst_spread > CURVE_SPREAD
    assert fake.forwards == 2 + 8 * 4  # the prefills and 4 sweeps: none begun past the budget


def test_a_dip_in_the_measured_curve_is_priced_at_the_smaller_row_counts_cost(tiny) -> None:
    """The start-up curve (``measure_quick``) on a device where 3 rows measure cheaper than 1 (0.090 s against
    0.100 s, exactly, every sweep): measured as is, the dip pads every 1- and 2-row round to 3 rows
    (``RowPlan``); the calibrated curve prices 3 rows at 2 rows' cost, is monotone at both K/V lengths, and pads
    no round."""
    body = {1: 0.100, 2: 0.105, 3: 0.090, 4: 0.108}

    def cost(rows: int, logits: int, i: int) -> float:
        return body.get(rows, 0.1 + 0.002 * rows) + 0.0005 * (logits - 1)

    adapter = ModelAdapter(tiny("llama"))
    fake = FakeTimer(adapter, cost)
    raw = measure_curve(fake, QUICK_KV, QUICK_ROWS, reps=QUICK_REPS, head_rows=QUICK_HEAD_ROWS, clock=fake)
    assert [RowPlan.from_curve(raw).rows_for(q, QUICK_KV[0]) for q in (1, 2, 3, 4)] == [3, 3, 3, 4]  # the dip's

    fake = FakeTimer(adapter, cost)
    curve = measure_quick(fake, clock=fake)
    assert curve.sweeps == QUICK_REPS and QUICK_REPS < CURVE_MAX_REPS  # quiet: no sweep beyond the first 3
    for kv in QUICK_KV:
        priced = [curve.seconds(q, 1, kv) for q in QUICK_ROWS]
        assert priced == sorted(priced), kv
        assert curve.seconds(3, 1, kv) == pytest.approx(0.105) and curve.seconds(1, 1, kv) == pytest.approx(0.100)
        plan = RowPlan.from_curve(curve)
        assert [plan.rows_for(q, kv) for q in range(1, max(QUICK_ROWS) + 1)] == list(range(1, max(QUICK_ROWS) + 1))

"""Cost model and tuner: arithmetic on hand-made inputs, replay against the engine's real rows, the search's
choice where the optimum is known, and the ``tune`` command end to end on a tiny model."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from dist_helpers import env_with_repo, make_tiny_folder
from helpers import make_engine, random_prompt, shared_tiny_model

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.config import GenerationConfig, LookaheadConfig, load_config
from lp_runner.decoding.coordinator import Coordinator
from lp_runner.parallel.sharding import lookahead_rows
from lp_runner.tuning.costmodel import (
    CostCurve,
    CurvePoint,
    RoundShape,
    comm_seconds,
    measure_curve,
    predict,
    rank_rows,
    shapes_from_records,
)
from lp_runner.tuning.search import _key, coordinate_search, tune


def test_curve_interpolates_rows_logit_rows_and_kv():
    pts = (
        CurvePoint(100, 1, 0.010, 0.010),
        CurvePoint(100, 9, 0.014, 0.018),  # head on all 9 rows adds 4 ms
        CurvePoint(300, 1, 0.012, 0.012),
        CurvePoint(300, 9, 0.016, 0.020),
    )
    c = CostCurve(pts)
    assert c.seconds(1, kv_len=100) == pytest.approx(0.010)
    assert c.seconds(5, kv_len=100) == pytest.approx(0.012 + 0.002)  # body 12 ms, all 14 ms: head all by default
    assert c.seconds(5, logit_rows=1, kv_len=100) == pytest.approx(0.012)
    assert c.seconds(5, logit_rows=3, kv_len=100) == pytest.approx(0.012 + 0.002 * 2 / 4)
    assert c.seconds(9, kv_len=200) == pytest.approx(0.019)  # halfway between K/V lengths
    assert c.seconds(17, kv_len=100) == pytest.approx(0.026)  # linear extrapolation past the last row count
    assert c.seconds(0) == 0.0
    assert c.ratio(9, kv_len=100) == pytest.approx(1.8)
    assert CostCurve.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def _seconds_by_definition(points, rows, logit_rows, kv_len):
    """``CostCurve.seconds`` written from its definition, the points filtered and sorted on every lookup."""

    def interp(xs, ys, x):
        if len(xs) == 1:
            return ys[0]
        i = min(max(sum(1 for v in xs if v < x), 1), len(xs) - 1)
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])

    def at(kv):
        pts = sorted((p for p in points if p.kv_len == kv), key=lambda p: p.rows)
        xs = [p.rows for p in pts]
        body, full = interp(xs, [p.body_s for p in pts], rows), interp(xs, [p.all_s for p in pts], rows)
        return full if rows == 1 else body + max(full - body, 0.0) * (logit_rows - 1) / (rows - 1)

    kvs = sorted({p.kv_len for p in points})
    return max(interp(kvs, [at(k) for k in kvs], kv_len), 0.0)


def test_curve_lookup_equals_its_definition():
    """The curve's tables, sorted once, give every lookup bit for bit (the auto preset prices ~25,000 rounds a
    search with them): unsorted points, K/V lengths with different row counts, extrapolation on both axes."""
    rng = random.Random(2)
    for _ in range(60):
        points = [
            CurvePoint(kv, q, rng.uniform(0.01, 0.05), rng.uniform(0.01, 0.08))
            for kv in rng.sample([64, 128, 300, 512, 1000], rng.randrange(1, 4))
            for q in rng.sample(range(1, 40), rng.randrange(1, 6))
        ]
        rng.shuffle(points)
        curve = CostCurve(tuple(points))
        for _ in range(25):
            rows, kv_len = rng.randrange(1, 60), rng.randrange(0, 1500)
            logit_rows = rng.randrange(1, rows + 1)
            assert curve.seconds(rows, logit_rows, kv_len) == _seconds_by_definition(points, rows, logit_rows, kv_len)


def test_linear_curve_and_comm_assumption():
    c = CostCurve.linear(0.05, 0.002)
    assert c.seconds(1) == pytest.approx(0.05)
    assert c.seconds(11) == pytest.approx(0.07)
    assert comm_seconds(1, 3e-4) == 0.0
    assert comm_seconds(2, 3e-4) == pytest.approx(3e-4)
    assert comm_seconds(4, 3e-4) == pytest.approx(9e-4)


def _shape(**kw) -> RoundShape:
    base = dict(kv_len=100, ordinary=1, window_size=7, depth=-1, candidates=(), winner=-1, emitted=1)
    base.update(kw)
    return RoundShape(**base)


def test_rank_rows_by_hand():
    # W=7, depth 3, P=2: blocks (0,4),(4,7) -> 15 lookahead rows each; candidates of 4 rows to the least loaded
    shapes = [
        _shape(ordinary=20, depth=3, candidates=(4, 4, 4), winner=1, emitted=3),
        _shape(depth=3, candidates=(4,), winner=-1, emitted=1),
    ]
    p1 = rank_rows(shapes, 1)
    assert p1 == [[(20 + 27 + 12, 1 + 7 + 12)], [(1 + 27 + 4, 1 + 7 + 4)]]  # 6 level-0 + 7 x 3 rows
    p2 = rank_rows(shapes, 2)
    # round 0: candidates 0 -> rank 0, 1 -> rank 1, 2 -> rank 0 (tie at 19/19 goes to the lowest rank)
    assert p2[0] == [(20 + 15 + 8, 1 + 4 + 8), (20 + 15 + 4, 1 + 3 + 4)]
    # round 1: candidate 1 won on rank 1 -> rank 1 feeds the live key, rank 0 re-feeds the 3 emitted tokens
    assert p2[1] == [(3 + 15 + 4, 1 + 4 + 4), (1 + 15, 1 + 3)]


def test_predict_arithmetic():
    curve = CostCurve.linear(0.010, 0.001)
    shapes = [
        _shape(ordinary=50, candidates=(3,), winner=0, emitted=4),  # prefill: skipped
        _shape(candidates=(3,), winner=0, emitted=4),  # 4 rows: 13 ms
        _shape(candidates=(), emitted=1),  # 1 row: 10 ms
    ]
    p = predict(shapes, curve, 1, host_s_per_round=0.001)
    assert (p.rounds, p.tokens) == (2, 5)
    assert p.forward_s == pytest.approx(0.023)
    assert p.seconds == pytest.approx(0.025)
    assert p.ms_per_token == pytest.approx(5.0)
    assert p.mean_rows_max_rank == pytest.approx(2.5)
    assert p.simulated and "comm_assumption" in p.inputs
    p2 = predict(shapes, curve, 2, allgather_2_s=0.0005)
    # P=2 round 1: the candidate goes to rank 0 (4 rows), rank 1 re-feeds 4 emitted tokens of the prefill round
    # (its winner was rank 0) -> 4 rows each: 13 ms; round 2: rank 0 won -> 1 row, rank 1 re-feeds 4 -> 13 ms
    assert p2.forward_s == pytest.approx(0.026)
    assert p2.comm_s == pytest.approx(0.001)


def test_replay_matches_the_engines_rows():
    """Replaying a run's shapes at P=1 gives exactly the rows the engine packed, round by round."""
    model = shared_tiny_model("llama")
    engine = make_engine(model, 5, 4, 3, max_new_tokens=30)
    res = engine.generate(random_prompt(12, seed=3))
    shapes = shapes_from_records(res.stats.records, 5)
    assert [r[0][0] for r in rank_rows(shapes, 1)] == [r.rows for r in res.stats.records]
    assert [r[0][1] for r in rank_rows(shapes, 1)] == [r.logit_rows for r in res.stats.records]
    assert any(s.candidates for s in shapes) and any(s.winner >= 0 for s in shapes)


def test_replay_matches_the_coordinators_split():
    """At P=2 the replay's lookahead + candidate rows per rank equal the real coordinator's plan."""
    la = LookaheadConfig(7, 5, 4, True)
    history = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 9, 9, 1, 2, 3]  # the live key 3 and its suffix repeat
    coord = Coordinator(la, 2, history)
    plan = coord.plan(history, 3)
    shape = _shape(depth=3, candidates=tuple(len(c) for c in plan.candidates))
    rows = rank_rows([shape], 2)[0]
    assert plan.candidates and plan.columns[1] != (0, 0)
    for r in range(2):
        cols, cands = plan.for_rank(r)
        assert rows[r][0] == shape.ordinary + lookahead_rows(cols, 3) + sum(len(c) for c in cands)


def test_measure_curve_on_a_real_model():
    adapter = ModelAdapter(shared_tiny_model("llama"))
    curve = measure_curve(adapter, [8, 24], [1, 3, 6], reps=2)
    assert sorted((p.kv_len, p.rows) for p in curve.points) == [(k, q) for k in (8, 24) for q in (1, 3, 6)]
    assert all(p.body_s > 0 and p.all_s > 0 for p in curve.points)
    assert curve.seconds(4, kv_len=16) > 0


def test_measure_curve_repeats_until_its_spread_is_bounded():
    """``max_spread``: more interleaved sweeps while the repetitions disagree by more than the bound, up to
    ``max_reps``. A bound no measurement meets (-1) runs every allowed sweep; a bound every one meets runs ``reps``.
    Counted by the forwards ``tick`` sees (2 K/V lengths x 2 row counts x 2 heads = 8 cases a sweep, plus the
    warm-up sweep)."""
    adapter = ModelAdapter(shared_tiny_model("llama"))
    for max_spread, sweeps in ((-1.0, 6), (1e9, 2)):
        seen: list[int] = []
        curve = measure_curve(adapter, [8, 24], [1, 3], reps=2, max_spread=max_spread, max_reps=6,
                              tick=lambda done, total, seen=seen: seen.append(done))  # fmt: skip
        assert len(seen) == 8 * (sweeps + 1), max_spread
        assert curve.spread >= 0.0


def test_measure_curve_times_the_rounds_a_job_runs_where_it_runs_them():
    """On a bucketed adapter (a GPU's path, eager here) every timed round runs in the adapter's job arena, the one
    whose rounds replay captured graphs (a scratch arena's run eager: a compiled job would be priced at eager
    costs); the arena is handed back after, with no region left."""
    adapter = ModelAdapter(shared_tiny_model("llama"), bucketed=True)
    seen = []
    real = adapter.rounds.forward

    def recording(rounds, regions):
        seen.extend(region.arena for region in regions)
        return real(rounds, regions)

    adapter.rounds.forward = recording
    measure_curve(adapter, [8, 24], [1, 3], reps=1)
    with adapter.arena() as job:
        assert seen and all(arena is job for arena in seen) and not job.growable and not job.regions


def test_coordinate_search_finds_a_known_optimum():
    """A separable objective with its minimum at G=3, context_tokens=6, no window: reached from the base."""
    calls = []

    def evaluate(la):
        calls.append(la)
        v = (la.verification_set_size - 3) ** 2 + (la.context_tokens - 6) ** 2 + (5 if la.lookahead_branch else 0)
        return float(v), 1

    base = LookaheadConfig(7, 5, 7, True, lookahead_branch=True, context_tokens=10)
    space = {"lookahead_branch": (False, True), "verification_set_size": (1, 2, 3, 4), "context_tokens": (4, 6, 8)}
    best, seen = coordinate_search(base, evaluate, space)
    assert (best.verification_set_size, best.context_tokens, best.lookahead_branch) == (3, 6, False)
    assert len(calls) == len(seen)  # each distinct setting evaluated once


def test_coordinate_search_keeps_the_base_on_ties_and_small_gains():
    base = LookaheadConfig(7, 5, 2, True, lookahead_branch=False)
    best, _ = coordinate_search(base, lambda la: (1.0, 1), {"verification_set_size": (1, 2, 3)})
    assert best == base
    gains = {1: 0.995, 2: 1.0, 3: 0.9}  # G=1 is 0.5% better, G=3 10%

    def evaluate(la):
        return gains[la.verification_set_size], 1

    best, _ = coordinate_search(base, evaluate, {"verification_set_size": (1, 2)}, min_gain=0.01)
    assert best == base
    best, _ = coordinate_search(base, evaluate, {"verification_set_size": (1, 2, 3)}, min_gain=0.01)
    assert best.verification_set_size == 3


SPACE = {"lookahead_branch": (False, True), "verification_set_size": (0, 2, 4), "context_tokens": (2, 6)}


@pytest.mark.parametrize("per_row_s", [0.0, 100.0])
def test_tuner_choice_on_synthetic_curves(per_row_s):
    """Free rows: the best setting is the one with the most tokens per forward among those evaluated.
    Rows costing 100x a forward: nothing beats a one-row round (G=0, no window). A one-row forward of 1 s makes
    the measured host time (milliseconds) irrelevant to the choice."""
    model = shared_tiny_model("llama")
    prompts = [random_prompt(16, seed=s) for s in (5, 6)]
    base = LookaheadConfig(4, 3, 2, True, lookahead_branch=False)
    curve = CostCurve.linear(1.0, per_row_s)
    res = tune(ModelAdapter(model), prompts, base, GenerationConfig(max_new_tokens=24), [], curve, space=SPACE)
    if per_row_s == 0.0:
        assert res.best.tokens_per_forward == max(s.tokens_per_forward for s in res.evaluated)
        assert res.best.tokens_per_forward > 1.2
    else:
        assert res.best.lookahead.verification_set_size == 0 and not res.best.lookahead.lookahead_branch
        assert res.best.mean_rows == pytest.approx(1.0)
    assert res.best.ms_per_token <= res.base.ms_per_token


def test_tuner_picks_more_workers_only_when_they_pay():
    """With a window, P=2 halves the rows per rank: chosen when rows are expensive and comm is cheap."""
    model = shared_tiny_model("llama")
    prompts = [random_prompt(16, seed=7)]
    base = LookaheadConfig(6, 4, 2, True, context_lookup=False)
    space = {"verification_set_size": (2,)}
    curve = CostCurve.linear(1.0, 1.0)
    adapter, gen = ModelAdapter(model), GenerationConfig(max_new_tokens=20)
    cheap = tune(adapter, prompts, base, gen, [], curve, workers=(1, 2), allgather_2_s=1e-3, space=space)
    dear = tune(adapter, prompts, base, gen, [], curve, workers=(1, 2), allgather_2_s=1000.0, space=space)
    assert cheap.best.workers == 2 and dear.best.workers == 1


def _tune_inputs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """What a ``tune`` CLI run needs: a tiny model folder, two calibration prompts, a linear cost curve file."""
    tiny_model_folder = make_tiny_folder(tmp_path / "tiny", "llama", seed=3)
    prompts = tmp_path / "calib.jsonl"
    prompts.write_text('{"id": "a", "prompt": "def add(a, b):"}\n{"id": "b", "prompt": "Hello"}\n')
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps(CostCurve.linear(0.01, 0.001).to_dict()))
    return tiny_model_folder, prompts, curve


def test_tune_command_writes_a_loadable_config(tmp_path):
    tiny_model_folder, prompts, curve = _tune_inputs(tmp_path)
    out, report = tmp_path / "tuned.yaml", tmp_path / "report.json"
    cmd = [
        sys.executable, "-m", "lp_runner", "tune", "--prompts", str(prompts), "--output", str(out),
        "--report", str(report), "--curve", str(curve), "--max-new-tokens", "8",
        "--set", f"model.path={tiny_model_folder}", "--set", "model.threads=1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env_with_repo())
    assert proc.returncode == 0, proc.stderr
    cfg = load_config(out)
    assert cfg.model.path == str(tiny_model_folder)
    data = json.loads(report.read_text())
    assert data["best"]["ms_per_token"] <= data["base"]["ms_per_token"]
    assert dataclasses.asdict(cfg.lookahead) == data["best"]["lookahead"]
    assert "predicted" in out.read_text().splitlines()[2]
    host = data["curve"]["host"]  # measured on the model (the --curve file has none), as calibration measures it
    assert host["round_s"] >= 0 and host["row_s"] >= 0 and "host time per round" in proc.stderr


def test_tune_command_bad_input(tmp_path):
    prompts = tmp_path / "calib.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x"}\n')
    cmd = [sys.executable, "-m", "lp_runner", "tune", "--prompts", str(prompts), "--output", str(tmp_path / "o.yaml")]
    proc = subprocess.run(
        [*cmd, "--workers", "1,two"], capture_output=True, text=True, timeout=120, env=env_with_repo()
    )
    assert proc.returncode == 2 and "--workers expects comma-separated integers" in proc.stderr
    proc = subprocess.run(
        [*cmd, "--set", "lookahead.window_size=0"], capture_output=True, text=True, timeout=120, env=env_with_repo()
    )
    assert proc.returncode == 2 and "window_size" in proc.stderr


def test_tune_command_devices_names_both_splits(tmp_path):
    """``tune --devices 2`` prices D=2 x P=1 and D=1 x P=2. An all_gather of one second per round makes P=2 slower
    whatever the setting, so D=2 x P=1 wins both latency and throughput (twice one group's tokens/s), and the
    written config is that split: P=1 and D=2, every device used."""
    tiny_model_folder, prompts, curve = _tune_inputs(tmp_path)
    out, report = tmp_path / "tuned.yaml", tmp_path / "report.json"
    cmd = [
        sys.executable, "-m", "lp_runner", "tune", "--prompts", str(prompts), "--output", str(out),
        "--report", str(report), "--curve", str(curve), "--max-new-tokens", "8", "--devices", "2",
        "--allgather-us", "1000000", "--passes", "1",
        "--set", f"model.path={tiny_model_folder}", "--set", "model.threads=1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env_with_repo())
    assert proc.returncode == 0, proc.stderr
    data = json.loads(report.read_text())
    splits = {(s["groups"], s["workers"]): s for s in data["splits"]}
    assert sorted(splits) == [(1, 2), (2, 1)] and data["devices"] == 2
    per_p = {s["workers"]: s["ms_per_token"] for s in data["per_workers"]}
    for (d, p), s in splits.items():
        assert s["ms_per_token"] == pytest.approx(per_p[p], abs=1e-3)
        assert s["tokens_per_s"] == pytest.approx(d * 1e3 / s["ms_per_token"], rel=1e-3)
    assert splits[(1, 2)]["ms_per_token"] > splits[(2, 1)]["ms_per_token"] + 1e3 / 8  # >= 1 s per 8 tokens
    winners = {k: (data[k]["groups"], data[k]["workers"]) for k in ("lowest_latency", "highest_throughput")}
    assert winners == {"lowest_latency": (2, 1), "highest_throughput": (2, 1)}
    assert "lowest latency: D=2 x P=1" in proc.stderr and "highest throughput: D=2 x P=1" in proc.stderr
    cfg = load_config(out)
    assert (cfg.parallel.groups, cfg.parallel.workers) == (2, 1)
    assert "highest throughput: D=2 x P=1" in out.read_text().splitlines()[2]


def test_tune_command_rejects_bad_devices(tmp_path, capsys):
    """--devices takes one integer >= 1 and excludes --workers; each mistake is one error line, exit 2, before any
    model is loaded."""
    from lp_runner.cli.tune import main

    prompts = tmp_path / "calib.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x"}\n')
    base = ["--prompts", str(prompts), "--output", str(tmp_path / "o.yaml")]
    cmd = [sys.executable, "-m", "lp_runner", "tune", *base, "--devices", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env_with_repo())
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --devices expects one integer >= 1 (the number of devices), got '0'"
    ]
    for extra, message in [
        (["--devices", "two"], "--devices expects one integer >= 1"),
        (["--devices", "-4"], "--devices expects one integer >= 1"),
        (["--devices", "2.5"], "--devices expects one integer >= 1"),
        (["--devices", "4", "--workers", "1,2"], "give --devices (every split D x P = N) or --workers"),
    ]:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], (extra, err)
    assert not (tmp_path / "o.yaml").exists()


def test_settings_that_behave_alike_are_evaluated_once():
    """The search's memo key drops inert knobs: no cap is lifted without long_match_ngram, nothing is verified or
    capped at G=0; a knob that matters keeps settings apart."""
    off = LookaheadConfig(long_match_ngram=0, long_match_rows=4)
    assert _key(off) == _key(dataclasses.replace(off, long_match_rows=8))
    on = dataclasses.replace(off, long_match_ngram=2)
    assert _key(on) != _key(dataclasses.replace(on, long_match_rows=8))
    uncapped = LookaheadConfig(max_verify_rows=0, long_match_ngram=3, long_match_rows=0)  # no cap either way
    assert _key(uncapped) == _key(dataclasses.replace(uncapped, long_match_ngram=0))
    g0 = LookaheadConfig(verification_set_size=0, max_verify_rows=2, long_match_ngram=2)
    assert _key(g0) == _key(dataclasses.replace(g0, max_verify_rows=4, long_match_rows=6, context_tokens=3))
    assert _key(LookaheadConfig(max_verify_rows=2)) != _key(LookaheadConfig(max_verify_rows=4))


def test_coordinate_search_tries_the_window_at_every_width():
    """A window that pays only at W=2: found from a base with the window off and W=7 (W is inert while off)."""

    def evaluate(la):
        if not la.lookahead_branch:
            return 10.0, 1
        return (5.0 if la.window_size == 2 else 20.0), 1

    base = LookaheadConfig(7, 5, 2, True, lookahead_branch=False)
    space = {"lookahead_branch": (False, True), "window_size": (2, 4, 7)}
    best, _ = coordinate_search(base, evaluate, space)
    assert best.lookahead_branch and best.window_size == 2


@pytest.mark.parametrize(
    "base",
    [
        LookaheadConfig(lookahead_branch=False, verification_set_size=0),  # nothing verified
        LookaheadConfig(lookahead_branch=False, verification_set_size=2, context_lookup=False),  # pool only
        LookaheadConfig(lookahead_branch=False, verification_set_size=1, max_verify_rows=3),  # cap never lifted
        LookaheadConfig(lookahead_branch=False, verification_set_size=1, long_match_ngram=2, long_match_rows=7),
    ],
)
def test_declared_inert_knobs_change_no_round(base: LookaheadConfig) -> None:
    """Every knob a setting declares inert (``config.inert_knobs``) leaves every round of it unchanged: replayed
    through the real coordinator on real outputs (``preset.simulate``), any other value of it from the tuner's
    space gives the same round shapes. A wrong declaration would let the tuner skip a setting that differs."""
    from lp_runner.config import inert_knobs
    from lp_runner.tuning.acceptance import shipped_prior
    from lp_runner.tuning.preset import simulate
    from lp_runner.tuning.search import SPACE

    samples = shipped_prior().samples[:3]

    def shapes(la: LookaheadConfig) -> list:
        return [[dataclasses.replace(r, window_size=0) for r in simulate(la, s)] for s in samples]

    inert = inert_knobs(base) - {"lookahead_branch"}
    assert inert, "the case must declare something inert"
    reference = shapes(base)
    tried = 0
    for knob in sorted(inert):
        for value in SPACE.get(knob, ()):
            other = dataclasses.replace(base, **{knob: value})
            if knob in inert_knobs(other) or other == base:
                tried += 1
                assert shapes(other) == reference, (knob, value)
    assert tried > 0
    active = [k for k in SPACE if k not in inert and k not in ("lookahead_branch", "window_size")]
    assert any(  # and the check can tell: some knob it calls active does change the rounds
        shapes(dataclasses.replace(base, **{k: v})) != reference for k in active for v in SPACE[k]
    )

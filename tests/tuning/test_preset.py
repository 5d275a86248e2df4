"""The auto preset: simulated rounds equal real ones, and choices follow the curve.

Oracles: the engine's own recorded round shapes (``simulate`` must reproduce them exactly, since it replaces
running the model) and synthetic curves whose right answer is known: rows free -> the Jacobi window, rows
dear -> no window, an expensive small row count dominated by a cheaper larger one -> never run.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
from helpers import AMD_MS, FAMILIES, curve_from_ms, make_engine, random_prompt

from lp_runner.config import LookaheadConfig, load_config
from lp_runner.tuning import preset
from lp_runner.tuning.acceptance import Sample, shipped_prior
from lp_runner.tuning.costmodel import CostCurve, CurvePoint, RoundShape, RowPlan, rank_rows, shapes_from_records
from lp_runner.tuning.preset import AutoPreset, search, simulate

WINDOW_OFF = [
    dict(verification_set_size=1, max_verify_rows=2, long_match_ngram=3),  # the old fixed CPU default
    dict(verification_set_size=3, max_verify_rows=7),
    dict(verification_set_size=2, context_tokens=4, context_adaptive=False, candidate_policy="pool_first"),
    dict(verification_set_size=4, context_lookup=False, pool_from_prompt=True),  # pool only
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("knobs", WINDOW_OFF)
def test_simulated_rounds_equal_real_rounds(tiny, family: str, knobs: dict) -> None:
    model = tiny(family)
    prompt = random_prompt(30, seed=3)
    knobs = dict(knobs)  # the parameter is shared by every family
    g = knobs.pop("verification_set_size")
    engine = make_engine(model, 7, 4, g, max_new_tokens=60, lookahead_branch=False, **knobs)
    result = engine.generate(prompt)
    real = shapes_from_records(result.stats.records, engine.la.window_size)
    assert any(s.winner >= 0 and s.emitted > 1 for s in real)  # candidates were really accepted
    assert simulate(engine.la, Sample(tuple(prompt), tuple(result.output_ids))) == real


@pytest.mark.slow
def test_simulated_rounds_equal_real_rounds_embedded(embedded) -> None:
    """The same on the embedded model and a shipped calibration prompt (real text, long context matches)."""
    from lp_runner.backends.adapter import ModelAdapter
    from lp_runner.config import GenerationConfig
    from lp_runner.decoding.engine import LookaheadEngine

    model, tok = embedded
    sample = shipped_prior().samples[0]
    la = LookaheadConfig(preset="off", lookahead_branch=False, verification_set_size=2, max_verify_rows=7)
    engine = LookaheadEngine(ModelAdapter(model), la, GenerationConfig(max_new_tokens=64), [tok.eos_token_id])
    result = engine.generate(list(sample.prompt_ids))
    assert result.output_ids == list(sample.output_ids[:64])  # the shipped sample is the model's greedy output
    real = shapes_from_records(result.stats.records, la.window_size)
    assert simulate(la, Sample(sample.prompt_ids, tuple(result.output_ids))) == real


def test_simulate_refuses_window() -> None:
    with pytest.raises(ValueError, match="cannot be simulated"):
        simulate(LookaheadConfig(lookahead_branch=True), Sample((1, 2), (3,)))


def _auto(curve: CostCurve, pinned=(), base: LookaheadConfig | None = None):
    prior = shipped_prior()
    plan = RowPlan.from_curve(curve)
    return search(base or LookaheadConfig(), pinned, curve, plan, prior.samples, prior.recorded)


def test_shipped_prior_is_usable() -> None:
    prior = shipped_prior()
    assert len(prior.samples) >= 8 and all(s.output_ids for s in prior.samples)
    assert {r.lookahead.lookahead_branch for r in prior.recorded} == {True}
    assert all(len(r.shapes) == len(prior.samples) for r in prior.recorded)


def test_auto_chooses_window_where_rows_are_free() -> None:
    free = CostCurve.linear(0.050, 0.0, max_rows=512)  # every row count costs one row's time
    choice = _auto(free)
    assert choice.lookahead.lookahead_branch, choice.reason
    assert choice.lookahead.preset == "off"  # a resolved setting runs as written


def test_auto_chooses_no_window_where_rows_are_dear() -> None:
    dear = CostCurve.linear(0.050, 0.030, max_rows=512)  # each extra row costs 60% of a one-row forward
    choice = _auto(dear)
    assert not choice.lookahead.lookahead_branch, choice.reason
    assert choice.predicted_ms_per_token <= 1.02 * 50.0  # never worse than plain decoding (50 ms + 2% host)


def test_auto_avoids_a_dominated_row_count() -> None:
    """On the AMD curve 2-3 rows cost more than 8: the choice must fill the cheap 8-row point, and no round of it
    may run at 2-4 rows (its rounds, padded as the engine pads them)."""
    curve = curve_from_ms(AMD_MS)
    plan = RowPlan.from_curve(curve)
    choice = _auto(curve)
    assert not choice.lookahead.lookahead_branch
    cap = choice.lookahead.max_verify_rows
    assert cap == 0 or cap >= 7, choice.reason  # rows up to the 8-row point are free: a cap of 2 wastes them
    for sample in shipped_prior().samples:
        for shape in simulate(choice.lookahead, sample)[1:]:
            rows = shape.ordinary + sum(shape.candidates)
            assert plan.rows_for(rows, shape.kv_len) not in (2, 3, 4)
    # against the old fixed default, the same model predicts a clear gain on this curve
    old = dataclasses.replace(LookaheadConfig(), lookahead_branch=False, verification_set_size=1, max_verify_rows=2)
    base_choice = _auto(curve, pinned=list(dataclasses.asdict(old)), base=old)
    assert choice.predicted_ms_per_token < 0.95 * base_choice.predicted_ms_per_token


def test_pinned_knobs_win() -> None:
    free = CostCurve.linear(0.050, 0.0, max_rows=512)
    base = LookaheadConfig(lookahead_branch=False, verification_set_size=2)
    choice = _auto(free, pinned=["lookahead_branch", "verification_set_size"], base=base)
    assert not choice.lookahead.lookahead_branch and choice.lookahead.verification_set_size == 2


def test_config_records_explicit_keys(tmp_path) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("lookahead:\n  verification_set_size: 3\n")
    cfg = load_config(cfg_file, ["advanced.max_verify_rows=5", "generation.max_new_tokens=9"])
    assert cfg.pinned_lookahead() == ("max_verify_rows", "verification_set_size")
    assert load_config(None).pinned_lookahead() == ()


def test_auto_preset_adapts_to_observed_outputs_deterministically() -> None:
    """Two replicas fed the same outputs choose the same setting (LP ranks stay identical), and a job whose own
    outputs copy long spans moves to a setting with more proposal rows than one that never repeats."""
    curve = curve_from_ms(AMD_MS)
    plan = RowPlan.from_curve(curve)
    a = AutoPreset(LookaheadConfig(), (), curve, plan, prior=shipped_prior())
    b = AutoPreset(LookaheadConfig(), (), curve, plan, prior=shipped_prior())
    assert a.lookahead == b.lookahead
    span = list(range(100, 164))
    repetitive = Sample(tuple(span), tuple(span * 5))  # the output copies the prompt again and again
    changed = [p.observe(repetitive.prompt_ids, repetitive.output_ids) for p in (a, b)]
    assert changed[0] == changed[1]
    assert a.lookahead == b.lookahead and a.choice.samples == "observed"
    assert len(a.history) == 2


def test_re_choice_runs_only_while_the_job_left_can_repay_it() -> None:
    """A re-choice (a search on the job's critical path) runs at a token threshold only when at least as many
    generations are still to start as were observed; with the count unknown (the API) it always runs."""
    curve = curve_from_ms(AMD_MS)
    plan = RowPlan.from_curve(curve)
    span = list(range(100, 164))
    out = tuple(span * 5)  # 320 tokens: past the first threshold (256) in one generation
    searched = {}
    for remaining in (None, 0, 1, 5):
        p = AutoPreset(LookaheadConfig(), (), curve, plan, prior=shipped_prior())
        p.observe(tuple(span), out, remaining=remaining)
        searched[remaining] = len(p.history) - 1
    assert searched == {None: 1, 0: 0, 1: 1, 5: 1}
    late = AutoPreset(LookaheadConfig(), (), curve, plan, prior=shipped_prior())
    late.observe(tuple(span), out[:200], remaining=9)  # below every threshold: no search
    late.observe(tuple(span), out[:200], remaining=1)  # crosses 256 with 2 observed and 1 left
    assert len(late.history) == 1
    assert [preset.payback(n, r) for n, r in ((2, 38), (8, 32), (34, 6), (3, None))] == [True, True, False, True]


def test_search_through_store_views_chooses_as_with_a_store_per_setting(monkeypatch) -> None:
    """Under pool_scope: job every setting simulates the samples in order against the store of the samples
    before each: one store read through views (the fast path) and one store built per setting (the path where
    the samples would make the store evict) give the same choice, to the last bit of its prediction."""
    curve = curve_from_ms(AMD_MS)
    plan = RowPlan.from_curve(curve)
    samples = shipped_prior().samples * 2  # the second pass repeats the first: the store proposes
    la = LookaheadConfig(pool_scope="job")
    with_views = search(la, (), curve, plan, samples, (), "observed")
    monkeypatch.setattr(preset, "store_views", lambda *args: None)
    per_setting = search(la, (), curve, plan, samples, (), "observed")
    assert with_views == per_setting
    no_store = search(dataclasses.replace(la, pool_scope="prompt"), ("pool_scope",), curve, plan, samples, (), "x")
    assert no_store.predicted_ms_per_token != with_views.predicted_ms_per_token  # the store is in the prediction


def test_search_holds_the_collector_off_and_restores_it(monkeypatch) -> None:
    seen = []

    def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return simulate(*args, **kwargs)

    monkeypatch.setattr(preset, "simulate", recording)
    curve, samples = curve_from_ms(AMD_MS), shipped_prior().samples[:2]
    assert gc.isenabled()
    search(LookaheadConfig(), (), curve, RowPlan.identity(), samples)
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()  # a caller's own setting is left as it was
    try:
        search(LookaheadConfig(), (), curve, RowPlan.identity(), samples)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_startup_choice_is_cached_for_the_same_inputs_only(tmp_path) -> None:
    """The start-up search's result, read back from the cache, equals the search itself; another curve, pin or
    world size searches again, and so does an unreadable file."""
    curve = curve_from_ms(AMD_MS)
    plan = RowPlan.from_curve(curve)
    searched = AutoPreset(LookaheadConfig(), (), curve, plan, prior=shipped_prior())  # no cache at all
    first = AutoPreset(LookaheadConfig(), (), curve, plan, cache_root=tmp_path, prior=shipped_prior())
    again = AutoPreset(LookaheadConfig(), (), curve, plan, cache_root=tmp_path, prior=shipped_prior())
    assert not searched.from_cache and not first.from_cache and again.from_cache
    assert again.choice == first.choice == searched.choice
    files = list((tmp_path / "preset").glob("startup-*.json"))
    assert len(files) == 1
    dearer = curve_from_ms({q: 56 * q for q in AMD_MS})  # every row costs a whole forward: no proposal pays
    others = [
        AutoPreset(
            LookaheadConfig(), (), dearer, plan, cache_root=tmp_path, prior=shipped_prior()
        ),  # only the curve differs
        AutoPreset(
            LookaheadConfig(max_verify_rows=3),
            ("max_verify_rows",),
            curve,
            plan,
            cache_root=tmp_path,
            prior=shipped_prior(),
        ),
        AutoPreset(LookaheadConfig(), (), curve, plan, world_size=2, cache_root=tmp_path, prior=shipped_prior()),
    ]
    assert not any(o.from_cache for o in others)
    assert others[0].choice != searched.choice  # the dearer rows move the choice: the key must hold the curve
    assert len(list((tmp_path / "preset").glob("startup-*.json"))) == 4
    files[0].write_text("{not json")
    broken = AutoPreset(LookaheadConfig(), (), curve, plan, cache_root=tmp_path, prior=shipped_prior())
    assert not broken.from_cache and broken.choice == searched.choice


def test_startup_choice_is_not_cached_without_a_code_digest(tmp_path, monkeypatch) -> None:
    """Sources that cannot be read as files give no digest: a cached choice could outlive the code that made it,
    so nothing is written or read."""
    from lp_runner.tuning import preset

    monkeypatch.setattr(preset, "code_digest", lambda: None)
    curve = curve_from_ms(AMD_MS)
    runs = [
        AutoPreset(LookaheadConfig(), (), curve, RowPlan.from_curve(curve), cache_root=tmp_path, prior=shipped_prior())
        for _ in "ab"
    ]
    assert not any(r.from_cache for r in runs) and runs[0].choice == runs[1].choice
    assert not (tmp_path / "preset").exists()


def _recorded_window(w: int, n: int, g: int, emitted: int, rounds: int = 40) -> preset.Recorded:
    """A window setting whose every decode round runs the full window and G candidates of N - 1 rows and emits
    ``emitted`` tokens (a synthetic recording: what the shipped file holds for real windows)."""
    la = LookaheadConfig(window_size=w, ngram_size=n, verification_set_size=g, lookahead_branch=True, preset="off")
    shapes = [RoundShape(0, 20, w, 0, (), -1, 1)]
    shapes += [RoundShape(20 + emitted * i, 1, w, n - 2, (n - 1,) * g, 0, emitted) for i in range(rounds)]
    return preset.Recorded(f"window-{w}-{n}-{g}", la, (tuple(shapes),))


def test_auto_at_p_ranks_prices_each_ranks_share_and_may_choose_a_larger_window() -> None:
    """A forward flat to 72 rows, then 1 ms a row: at P = 1 the 7-5-7 window (56 rows, 2 tokens a forward) fits
    under the knee and 31-7-31 (372 rows, 3 tokens) costs 30x; at P = 8 each rank runs its share of 31-7-31 (the
    engine's sharding: 68 rows on the busiest), so the preset prices that and chooses it. The choice is a pure
    function of its inputs, so every LP rank, searching the same inputs, makes it too. Window-off settings find
    nothing in a sample of distinct tokens (one token a forward)."""
    pts = [(1, 10.0), (72, 10.0), (512, 10.0 + 440.0), (1024, 10.0 + 952.0)]
    curve = CostCurve(tuple(CurvePoint(kv, q, 1e-3 * ms, 1e-3 * ms) for kv in (0, 512) for q, ms in pts))
    small, large = _recorded_window(7, 5, 7, 2), _recorded_window(31, 7, 31, 3)
    sample = Sample(tuple(range(100, 120)), tuple(range(200, 320)))

    def choose(world_size: int):
        return search(LookaheadConfig(), (), curve, RowPlan.identity(), [sample], [small, large],
                      world_size=world_size).lookahead  # fmt: skip

    assert max(q for q, _ in rank_rows(large.shapes[0][1:3], 8)[1]) <= 72  # the premise: a rank's share fits
    at_one, at_eight = choose(1), choose(8)
    assert (at_one.window_size, at_one.ngram_size, at_one.verification_set_size) == (7, 5, 7)
    assert (at_eight.window_size, at_eight.ngram_size, at_eight.verification_set_size) == (31, 7, 31)
    assert choose(8) == at_eight  # deterministic: every rank of the group chooses the same

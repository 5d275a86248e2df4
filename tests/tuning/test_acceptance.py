"""Acceptance recordings and tables: resumable recording checked against greedy, the table the preset and the study
read, and the rule that the auto preset prices the acceptance of the model that runs, never another model's."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import curve_from_ms, random_prompt, tiny_model

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.config import GenerationConfig, LookaheadConfig
from lp_runner.decoding.engine import LookaheadEngine
from lp_runner.errors import InputError
from lp_runner.tuning.acceptance import (
    GREEDY,
    NotGreedy,
    PromptToRecord,
    fingerprint,
    load_table,
    read_records,
    record,
    shipped_names,
    shipped_prior,
    slope_per_doubling,
    table,
    table_from_text,
    table_text_for,
    threads_of,
)
from lp_runner.tuning.costmodel import RowPlan
from lp_runner.tuning.preset import AutoPreset

AMD_MS = {1: 10.0, 8: 11.0, 16: 13.0, 32: 17.0, 64: 26.0, 128: 45.0}


def _runner(model, max_new_tokens: int):
    adapter = ModelAdapter(model)
    gen = GenerationConfig(max_new_tokens=max_new_tokens)

    def run(la, ids):
        res = LookaheadEngine(adapter, la, gen, []).generate(list(ids))
        return list(res.output_ids), list(res.stats.records)

    return run


def test_recording_resumes_after_a_torn_line_and_checks_every_window_against_greedy(tiny, tmp_path) -> None:
    """Each (prompt, window) is recorded once: a second call records only what the first lacked, a torn last line
    (a kill mid-write) is dropped and redone, and each window's output is the greedy record's."""
    model = tiny("llama")
    run = _runner(model, 12)
    prompts = [PromptToRecord("a", "code", tuple(random_prompt(9, 1))), PromptToRecord("b", "chat", (5, 6, 5, 6))]
    out = tmp_path / "records.jsonl"
    first = record(run, prompts, [(3, 3, 3)], out, log=lambda m: None)
    assert [(r["prompt"], tuple(r["window"])) for r in first] == [
        ("a", GREEDY),
        ("b", GREEDY),
        ("a", (3, 3, 3)),
        ("b", (3, 3, 3)),
    ]
    for r in first:
        assert r["new_tokens"] == 12 and r["forwards"] == len(r["rows"]) == len(r["shapes"])
        assert sum(s[6] for s in r["shapes"]) == 12  # every committed token is in one round's emitted count
    with open(out, "a", encoding="utf-8") as f:
        f.write('{"prompt": "a", "wind')  # torn
    calls = []

    def counting(la, ids):
        calls.append(la.window_size)
        return run(la, ids)

    second = record(counting, prompts, [(3, 3, 3), (4, 3, 2)], out, log=lambda m: None, threads=3)
    assert calls == [4, 4]  # only the new window, on both prompts
    assert len(second) == 6 and len(read_records(out)) == 6
    # a resumed recording states the threads of the records it adds, and only of those
    assert [r.get("threads") for r in read_records(out)] == [None] * 4 + [3, 3]
    assert threads_of(read_records(out)) == [1, 3]  # the first four ran before the field: one thread

    def wrong(la, ids):
        output, rounds = run(la, ids)
        return [*output[:-1], output[-1] + 1], rounds

    with pytest.raises(NotGreedy, match="differs from the prompt's greedy output"):
        record(wrong, prompts, [(5, 3, 5)], out, log=lambda m: None)


def test_table_holds_windows_recorded_on_every_prompt_and_reads_back(tiny, tmp_path) -> None:
    model = tiny("llama")
    run = _runner(model, 10)
    prompts = [PromptToRecord(str(i), "code" if i else "chat", tuple(random_prompt(8, i))) for i in range(3)]
    out = tmp_path / "records.jsonl"
    recs = record(run, prompts, [(3, 3, 3)], out, log=lambda m: None)
    partial = recs + [{**recs[-1], "window": [7, 3, 7]}]  # one prompt only: not comparable, left out
    data = table(partial, "tiny llama", "three prompts", 10, weights=fingerprint(model))
    assert [r["name"] for r in data["recorded"]] == ["window-3-3-3"]
    (summary,) = data["summary"]
    lo, hi = summary["interval"]
    assert lo <= summary["tokens_per_forward"] <= hi
    assert set(summary) >= {"code", "chat", "rows_per_round"}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    t = load_table(str(path))
    assert len(t.prior.samples) == 3 and t.prior.recorded[0].lookahead.window_size == 3
    assert t.weights == fingerprint(model) and "tiny llama" in t.label()


def test_bad_tables_are_one_input_error(tmp_path) -> None:
    with pytest.raises(InputError, match="no such file, and not a shipped table"):
        load_table(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": 99}', encoding="utf-8")
    with pytest.raises(InputError, match="not a table lp_runner wrote"):
        load_table(str(bad))
    with pytest.raises(InputError):
        table_from_text("not json", "x")


def test_fingerprint_tells_models_apart_and_survives_bf16() -> None:
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(a) == fingerprint(tiny_model("llama", seed=0).to(torch.bfloat16))


def test_the_preset_prices_the_model_that_runs(embedded, tiny, tmp_path) -> None:
    """The embedded model finds its own shipped table; a model nothing was recorded for gets none (not the embedded
    model's), unless the cache holds one recorded for it or the config names one."""
    model, _ = embedded
    text, whose = table_text_for("", fingerprint(model), tmp_path)
    assert text is not None and "embedded-calibration8" in whose
    other = tiny("llama")
    assert table_text_for("", fingerprint(other), tmp_path) == (None, "none recorded for this model")
    from lp_runner.tuning.acceptance import cached_table_path

    path = cached_table_path(tmp_path, fingerprint(other))
    path.parent.mkdir(parents=True)
    path.write_text(text, encoding="utf-8")
    found, whose = table_text_for("", fingerprint(other), tmp_path)
    assert found == text and str(path) in whose
    assert table_text_for("embedded-calibration8", fingerprint(other), None)[1].startswith(
        "shipped embedded-calibration8"
    )
    assert "embedded-calibration8" in shipped_names()


def test_without_a_table_the_first_choice_probes_the_window_only_where_the_device_makes_it_cheap() -> None:
    """No acceptance for this model: the configured window where a round of it costs at most PROBE_COST one-row
    forwards (a GPU under its knee), else the window off, unless the config pins the window; the choice says
    whose acceptance it priced (none)."""
    base = LookaheadConfig()  # W=7 N=5 G=7: 57 rows
    flat = curve_from_ms({1: 10.0, 64: 10.5, 128: 11.0})
    steep = curve_from_ms(AMD_MS)  # 57 rows cost about 2.4 one-row forwards
    on = AutoPreset(base, (), flat, RowPlan.from_curve(flat), prior=None, acceptance="none recorded for this model")
    assert on.lookahead.lookahead_branch and on.lookahead.window_size == base.window_size
    assert on.choice.samples == "none" and on.choice.acceptance == "none recorded for this model"
    off = AutoPreset(base, (), steep, RowPlan.from_curve(steep), prior=None, acceptance="none")
    assert not off.lookahead.lookahead_branch and "window off" in off.choice.reason
    pinned = AutoPreset(base, ("window_size",), steep, RowPlan.from_curve(steep), prior=None, acceptance="none")
    assert pinned.lookahead.lookahead_branch
    curve = curve_from_ms(AMD_MS)
    priced = AutoPreset(
        base, (), curve, RowPlan.from_curve(curve), prior=shipped_prior(), acceptance="shipped embedded-calibration8"
    )
    assert priced.choice.acceptance == "shipped embedded-calibration8" and priced.choice.evaluated > 1


@pytest.mark.parametrize(
    ("points", "slope"),
    [
        ([(60, 2.0), (120, 2.2), (240, 2.4)], 0.2),  # +0.2 tokens per forward per doubling of rows
        ([(50, 3.0), (400, 3.0)], 0.0),  # flat
    ],
)
def test_slope_per_doubling(points, slope) -> None:
    assert slope_per_doubling(points) == pytest.approx(slope)


def test_recording_a_configured_model_writes_the_table_its_preset_then_finds(tiny_dir, tmp_path) -> None:
    """``study --record-acceptance``'s body: the model loads as a job's does, the table lands in OUT and in the cache
    under the model's fingerprint, and the lookup the auto preset makes for that model finds exactly that table."""
    from lp_runner.cli.acceptance import parse_windows, record_acceptance
    from lp_runner.config import load_config
    from lp_runner.models.loading import load_model_and_tokenizer

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "def f(x):"}\n{"id": "b", "prompt": "hello hello"}\n', "utf-8")
    cache = tmp_path / "cache"
    cfg = load_config(None, [f"model.path={tiny_dir}", f"advanced.cache_dir={cache}", "generation.max_new_tokens=8"])
    data = record_acceptance(cfg, str(prompts), tmp_path / "out", parse_windows("3-3-3"), log=lambda m: None)
    assert [s["window"] for s in data["summary"]] == [[3, 3, 3]]
    on_disk = (tmp_path / "out" / "table.json").read_text("utf-8")
    model, _, _ = load_model_and_tokenizer(tiny_dir)
    found, whose = table_text_for("", fingerprint(model), cache)
    assert found == on_disk and "recorded for this model" in whose


@pytest.mark.parametrize("bad", ["7-5", "7-5-x", "0-5-7", "7-2-7", "7-5-7," * 70, "99999-5-7"])
def test_window_grids_are_bounded(bad) -> None:
    from lp_runner.cli.acceptance import parse_windows

    with pytest.raises(InputError, match="--windows"):
        parse_windows(bad.rstrip(","))

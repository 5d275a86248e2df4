"""The measured study's schedule and aggregation: P values interleaved over repetitions (no P always first), the
same threads per rank at every P plus a labelled all-cores P = 1 run, the spread of each P's repetitions, speed
vs P = 1 (> 1 faster), and the warnings for a loaded machine or a noisy spread. Pure functions on hand-made
numbers; the real runs are in ``test_study_cli.py``."""

from __future__ import annotations

import json

import pytest

from lp_runner.studies.measured import (
    SPREAD_WARNING,
    Run,
    aggregate,
    busiest_rank_rows,
    drop_torn_lines,
    records_path,
    schedule,
    spread,
    summarize,
    threads_per_rank,
    warnings,
    window_label,
)
from lp_runner.studies.report import markdown


def test_schedule_interleaves_p_values_over_repetitions():
    """P = 1, 2 with 1 thread a rank on 2 cores: each repetition runs P = 1, P = 1 on all cores and P = 2 once,
    in an order rotated by one each repetition, so every kind runs first once."""
    runs = schedule([1, 2], 3, threads=1, cores=2)
    order = [[r.key for r in runs if r.rep == rep] for rep in range(3)]
    assert order == [["P1", "P1-all", "P2"], ["P1-all", "P2", "P1"], ["P2", "P1", "P1-all"]]
    assert {r.threads for r in runs if r.key != "P1-all"} == {1}
    assert {r.threads for r in runs if r.key == "P1-all"} == {2}
    assert Run(1, 2, 0, all_cores=True).label(2) == "P=1 (all 2 cores)"
    # no all-cores row where a rank already has every core, or without P = 1
    assert [r.key for r in schedule([1, 2], 3, threads=2, cores=2)][:2] == ["P1", "P2"]
    assert {r.key for r in schedule([2, 4], 3, threads=1, cores=4)} == {"P2", "P4"}


def test_threads_per_rank_is_the_same_at_every_p():
    assert threads_per_rank(0, 2, cores=2) == 1  # the largest P's share of the cores, at every P
    assert threads_per_rank(0, 8, cores=2) == 1
    assert threads_per_rank(0, 2, cores=16) == 8
    assert threads_per_rank(3, 2, cores=16) == 3  # model.threads set: as set


def test_aggregate_spread_and_speed_vs_p1():
    """Medians over repetitions, spread = (max - min) / median, speed vs P = 1 = P = 1's median over this P's
    (> 1 faster), and its range over repetitions paired by repetition."""
    agg = aggregate({"P1": [10.0, 11.0, 12.0], "P2": [5.0, 6.0, 8.0]}, "P1")
    assert agg["P1"]["ms_per_token"] == 11.0 and agg["P1"]["speed_vs_p1"] == 1.0
    assert agg["P2"]["ms_per_token"] == 6.0 and agg["P2"]["spread"] == pytest.approx(0.5)
    assert agg["P2"]["speed_vs_p1"] == pytest.approx(11.0 / 6.0, rel=1e-3)
    assert agg["P2"]["speed_vs_p1_range"] == [1.5, 2.0]  # 12 / 8 and 10 / 5
    assert spread([1.0]) == 0.0


def test_warnings_for_load_and_spread():
    """A load average above the cores, and a spread above 10%, each give a warning; a quiet machine and a tight
    spread give none."""
    assert warnings([0.5, 1.2], 2, {"P=1": 0.02, "P=2": 0.05}) == []
    loaded = warnings([0.5, 3.4], 2, {"P=1": 0.02})
    assert len(loaded) == 1 and "load average reached 3.40 on 2 cores" in loaded[0]
    noisy = warnings([None], 2, {"P=1": 0.02, "P=2": SPREAD_WARNING + 0.05})
    assert len(noisy) == 1 and noisy[0].startswith("P=2's repetitions spread by 15%")


def test_window_label_says_no_window_when_the_branch_is_off():
    """A record whose setting runs no window names no W-N-G (W is inert then), not "7-5-1"."""
    off = {"window_size": 7, "ngram_size": 5, "verification_set_size": 1,
           "policy": {"lookahead": {"lookahead_branch": False, "verification_set_size": 1}}}  # fmt: skip
    on = {**off, "policy": {"lookahead": {"lookahead_branch": True}}}
    assert window_label(off) == "no window (G=1)"
    assert window_label(on) == "7-5-1"


def test_drop_torn_lines(tmp_path):
    path = tmp_path / "P1-r0.jsonl"
    whole = json.dumps({"id": "a", "output_ids": [1]}) + "\n"
    path.write_text(whole + '{"id": "b", "outp')
    assert drop_torn_lines(path) is True
    assert path.read_text() == whole
    assert drop_torn_lines(path) is False


def _record(pid: str, workers: int, seconds: float, stats: dict) -> dict:
    base = {"forward_s": 0.0, "host_s": 0.0, "comm_s": 0.0}
    return {"id": pid, "output_ids": [1, 2, 3], "new_tokens": 3, "seconds": seconds, "tokens_per_forward": 1.0,
            "window_size": 4, "ngram_size": 3, "verification_set_size": 4, "workers": workers,
            "stats": {**base, **stats}}  # fmt: skip


def test_study_table_reads_the_busiest_ranks_rows(tmp_path):
    """The measured table's rows a round are the busiest rank's (``stats.busiest_rows`` over the rounds), not rank
    0's: at P = 2 rank 0 ran 11 rows in 3 rounds but the busiest rank of each round ran 14 in all (4.67 a round).
    At P = 1 the one rank is the busiest; a P = 2 record written before records carried every rank's rows reads
    as unknown ("n/a"), never as rank 0's."""
    p1 = _record("a", 1, 0.3, {"rounds": 3, "rows": 12, "rank_rows": [12], "busiest_rows": 12})
    p2 = _record("a", 2, 0.2, {"rounds": 3, "rows": 11, "rank_rows": [11, 12], "busiest_rows": 14})
    runs = [Run(1, 1, 0), Run(2, 1, 0)]
    for run, rec in zip(runs, (p1, p2), strict=True):
        records_path(tmp_path, run).write_text(json.dumps(rec) + "\n")
    meas = summarize(tmp_path, ["a"], runs)
    by_p = {pt["workers"]: pt for pt in meas["points"]}
    assert by_p[1]["busiest_rank_rows"] == 4.0
    assert by_p[2]["busiest_rank_rows"] == pytest.approx(14 / 3, abs=0.01)
    assert by_p[2]["prompts"][0]["busiest_rank_rows"] == pytest.approx(14 / 3)
    meas.update(prompts=1, prompts_file="p.jsonl", config=None, repeat=1, threads_per_rank=1)
    table = markdown({"date": "today", "measured": meas})
    assert "busiest rank's rows/round" in table and "rank 0" not in table
    p2_line = next(line for line in table.splitlines() if line.startswith("| P=2 "))
    assert "| 4.7 |" in p2_line and "| 3.7 |" not in p2_line  # 14 / 3, not rank 0's 11 / 3

    older = {**p2, "stats": {k: v for k, v in p2["stats"].items() if k not in ("rank_rows", "busiest_rows")}}
    assert busiest_rank_rows(older) is None
    assert busiest_rank_rows({**older, "workers": 1}) == pytest.approx(11 / 3)  # one rank: its rows
    records_path(tmp_path, runs[1]).write_text(json.dumps(older) + "\n")
    meas = summarize(tmp_path, ["a"], runs)
    assert [pt["busiest_rank_rows"] for pt in meas["points"]] == [4.0, None]
    meas.update(prompts=1, prompts_file="p.jsonl", config=None, repeat=1, threads_per_rank=1)
    assert "| n/a |" in next(line for line in markdown({"measured": meas, "date": "today"}).splitlines()
                            if line.startswith("| P=2 "))  # fmt: skip

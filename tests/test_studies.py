"""The study instruments produce what they promise: plots exist with the axes their JSON names, and the forward
cost benchmark's curve reads back into the cost model the tuner uses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from dist_helpers import REPO, env_with_repo

pytest.importorskip("matplotlib")

from benchmarks import compare, scaling  # noqa: E402
from lp_runner.costmodel import CostCurve  # noqa: E402


def _entry(speedup: float, tpf: float | None) -> dict:
    d = {"tokens_per_s": 10 * speedup, "speedup": speedup}
    if tpf is not None:
        d["tokens_per_forward"] = tpf
    return d


def test_compare_plot_and_axes(tmp_path):
    report = {
        "date": "2026-11-30",
        "machine": "test",
        "max_new_tokens": 8,
        "methods": {
            "hf-greedy": {s: _entry(1.0, 1.0) for s in ("all", "humaneval", "mtbench")},
            "hf-prompt-lookup": {s: _entry(1.1, None) for s in ("all", "humaneval", "mtbench")},
            "lean-g2": {s: _entry(1.3, 1.8) for s in ("all", "humaneval", "mtbench")},
        },
    }
    png = tmp_path / "c.png"
    compare.plot(report, png)
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert report["plot"]["left"] == {"x_label": "method", "y_label": "speedup vs HF greedy (tokens/s ratio)"}
    assert report["plot"]["right"]["y_label"] == "tokens per forward"
    assert "| lean-g2 | 13.00 | 1.30x |" in compare.markdown(report)


def test_scaling_plot_and_simulated_labels(tmp_path):
    report = {
        "date": "2026-11-30",
        "wng": [15, 5, 15],
        "prompts": 2,
        "max_new_tokens": 8,
        "collective": {"all_gather_us": 300.0},
        "setups": {
            "P1-1thread": {"workers": 1, "threads_per_worker": 1, "token_ms": 100.0},
            "P2-1thread-each": {"workers": 2, "threads_per_worker": 1, "token_ms": 80.0},
        },
        "simulation": {
            "simulated": True,
            "inputs": {
                "curve_threads": 1,
                "host_us_per_round": 500.0,
                "allgather_2_rank_us": 300.0,
                "comm_assumption": "ring",
            },
            "validation": {"p1_forward_ms_per_round_measured": 210.0, "p1_forward_ms_per_round_predicted": 200.0},
            "x_label": "workers P",
            "y_label": "per-token latency (ms)",
            "points": [
                {
                    "workers": p,
                    "simulated": True,
                    "token_ms": 100.0 / p**0.5,
                    "round_ms": 200.0 / p**0.5,
                    "rows_max_rank": 80.0 / p,
                    "comm_ms_per_round": 0.3 * (p - 1),
                }
                for p in range(1, 5)
            ],  # fmt: skip
        },
    }
    png = tmp_path / "s.png"
    scaling.plot(report, png)
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    md = scaling.markdown({**report, "setups": {}})
    assert "**Simulated**" in md and "| 4 | 50.0 | 0.50x |" in md
    assert "forward 210.0 ms/round measured, 200.0 predicted" in md
    assert all(p["simulated"] for p in report["simulation"]["points"])


def test_forward_cost_benchmark_writes_curve_plot_and_axes(tmp_path):
    out = tmp_path / "fc"
    cmd = [
        sys.executable, str(REPO / "benchmarks/forward_cost.py"), "--random-llama", "tiny", "--rows", "1", "3",
        "--prefix", "8", "16", "--reps", "2", "--threads", "1", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env_with_repo())
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.with_suffix(".json").read_text())
    assert (data["x_label"], data["y_label"]) == ("packed rows Q", "forward ms")
    assert sorted((c["prefix"], c["rows"]) for c in data["curves"]) == [(8, 1), (8, 3), (16, 1), (16, 3)]
    curve = CostCurve.from_dict(data["curve"])  # what `lp_runner tune --curve` reads
    assert curve.kv_lens == [8, 16] and curve.seconds(2, kv_len=12) > 0
    assert out.with_suffix(".png").stat().st_size > 1000
    assert out.with_suffix(".md").read_text().startswith("| prefix | rows Q |")

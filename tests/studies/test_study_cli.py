"""``python -m lp_runner study``, run for real: the simulation's report, bad input in one line, and the measured
study at P = 1 and 2 (self-launched gloo ranks) with every output identical across P and an interrupted study
resumed."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
from dist_helpers import REPO, env_with_repo, lp_runner_cmd, read_jsonl, wait_for, write_prompts

SIM_FIELDS = {
    "workers", "window", "busiest_rank_rows", "tokens_per_forward", "tokens_per_forward_interval", "forward_ms",
    "host_ms", "collective_ms", "ms_per_token", "speed_vs_p1", "speed_vs_plain",
}  # fmt: skip


def _study(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        lp_runner_cmd("study", *args), env=env_with_repo(), capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def test_simulated_study_writes_json_markdown_and_plot(tmp_path):
    """The issue's command: every P's fields, its inputs named, the paper's figures on their own lines."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "sim"
    proc = _study("--simulate", "--curve", "roofline:H200", "--model-shape", "llama-8b", "--workers", "1,2,4,8",
                  "--out", str(out), "--devices", "8")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "study.json").read_text())
    sim = report["simulated"]
    assert [p["workers"] for p in sim["points"]] == [1, 2, 4, 8]
    assert all(set(p) >= SIM_FIELDS and p["simulated"] for p in sim["points"])
    assert sim["points"][0]["speed_vs_p1"] == 1.0
    inputs = sim["inputs"]
    assert "H200" in inputs["curve"] and inputs["model_shape"] == "llama-8b"
    assert "NVLink" in inputs["interconnect"]["name"] and "engine's host time" in inputs["host"]
    assert "SmolLM2" in inputs["acceptance"] and "bucket" in inputs["rows_priced_at"]
    assert "lower bound" not in json.dumps(sim)
    assert set(sim["band"]["speed_vs_p1"]) == {"low", "point", "high"}
    assert [s["workers"] for s in sim["splits"]["table"]] == [1, 2, 4, 8]
    md = (out / "study.md").read_text()
    assert "**Simulated** (not measured)" in md and "What limits it:" in md and "speed vs plain decoding" in md
    paper = md.index("The Lookahead paper's reported figures")
    assert "~4x with 8 GPUs" in md[paper:] and "~4x" not in md[:paper]  # its own lines, never in the table
    assert (out / "study.png").read_bytes()[:4] == b"\x89PNG"


def test_a_given_host_time_is_priced_and_labelled(tmp_path):
    """``--host-us R,ROW`` with ``--host-label``: every P's host_ms is R + ROW x its busiest rank's rows, the
    label names the source, and the curve's own label stays."""
    out = tmp_path / "host"
    proc = _study("--simulate", "--curve", "roofline:H100-SXM", "--workers", "1,2", "--out", str(out),
                  "--host-us", "300,5", "--host-label", "a CPU's host time")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    sim = json.loads((out / "study.json").read_text())["simulated"]
    assert sim["inputs"]["host"] == "a CPU's host time (--host-us 300,5)" and "H100-SXM" in sim["inputs"]["curve"]
    for p in sim["points"]:
        assert p["host_ms"] == pytest.approx(0.3 + 0.005 * p["busiest_rank_rows"], abs=2e-3)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--simulate"], "--simulate needs --curve"),
        (["--simulate", "--curve", "roofline:B999"], "unknown GPU"),
        (["--simulate", "--curve", "/nonexistent.json"], "not roofline:NAME"),
        (["--simulate", "--curve", "roofline:H200", "--workers", "0,2"], "--workers must be from 1 to 1024, got 0"),
        (["--simulate", "--curve", "roofline:H200", "--interconnect", "smoke"], "--interconnect 'smoke'"),
        ([], "needs --prompts"),
    ],
)
def test_bad_input_is_one_error_line(tmp_path, args, fragment):
    proc = _study(*args, "--out", str(tmp_path / "x"), timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_measured_study_identical_across_p_and_resumes(tmp_path, tiny_dir):
    """2 prompts at P = 1 and 2 on a tiny model, window 4-3-4 pinned, 3 repetitions interleaved. The first study
    is stopped with SIGTERM while P = 2's first run runs (P = 1's done): exit 130, one line. The second finds
    P = 1's first run complete and skips it, runs the rest, and reports every output identical to P = 1's, with
    the per-prompt fields the study promises, and the simulation beside it on the job's own calibrated curve
    (``--curve job``)."""
    pytest.importorskip("matplotlib")
    prompts = write_prompts(tmp_path / "p.jsonl", [
        {"id": "a", "prompt": "The quick brown fox jumps over the lazy dog. The quick brown"},
        {"id": "b", "prompt": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"},
    ])  # fmt: skip
    out = tmp_path / "study"
    args = [
        "--prompts", str(prompts), "--workers", "1,2", "--out", str(out), "--wng", "4,3,4",
        "--set", f"model.path={tiny_dir}", "--set", "model.threads=1", "--set", "generation.max_new_tokens=12",
    ]  # fmt: skip
    first = subprocess.Popen(lp_runner_cmd("study", *args), env=env_with_repo(), stderr=subprocess.PIPE)
    wait_for(lambda: (out / "P2-r0.jsonl.lock").exists(), 240, first)  # P = 1 finished, P = 2 started
    first.send_signal(signal.SIGTERM)
    err = first.communicate(timeout=120)[1].decode()
    assert first.returncode == 130, err
    assert "error: interrupted at P=2" in err and "Traceback" not in err
    p1 = read_jsonl(out / "P1-r0.jsonl")
    assert sorted(r["id"] for r in p1 if "id" in r) == ["a", "b", "study-warmup"]
    assert not (out / "study.json").exists()

    second = _study(*args, "--curve", "job", "--interconnect", "measured:400")  # the simulation beside it
    assert second.returncode == 0, second.stderr
    assert "P=1 rep 0: every prompt recorded" in second.stderr and "P=2 rep 0: running" in second.stderr
    assert read_jsonl(out / "P1-r0.jsonl") == p1  # untouched
    report = json.loads((out / "study.json").read_text())
    meas = report["measured"]
    assert meas["identical_outputs"] is True and meas["pinned_window"] == [4, 3, 4]
    assert [r["workers"] for r in meas["points"]][-1] == 2 and meas["repeat"] == 3
    for point in meas["points"]:
        assert {"latency_p50_s", "latency_p90_s", "tokens_per_forward", "busiest_rank_rows", "spread", "forward_share",
                "host_share", "comm_share", "speed_vs_p1", "ms_per_token_reps"} <= set(point)  # fmt: skip
        assert len(point["ms_per_token_reps"]) == 3
        assert point["busiest_rank_rows"] > 0  # every record carries every rank's rows
        assert [x["id"] for x in point["prompts"]] == ["a", "b"]
        assert all(x["identical_to_base"] and x["window"] == "4-3-4" for x in point["prompts"])
        assert all(x["latency_s"] > 0 and x["new_tokens"] > 0 for x in point["prompts"])
    assert meas["points"][-1]["comm_share"] > 0  # P = 2 ran an all_gather per round
    sim = report["simulated"]  # priced on the curve the P = 1 run calibrated, with its measured host time
    assert "measured curve from curve-" in sim["inputs"]["curve"] and "measured with the curve" in sim["inputs"]["host"]
    assert [p["workers"] for p in sim["points"]] == [1, 2] and sim["points"][0]["host_ms"] > 0
    md = (out / "study.md").read_text()
    assert "**Measured**" in md and "**Simulated** (not measured)" in md
    assert (out / "study.png").read_bytes()[:4] == b"\x89PNG"

"""``python -m lp_runner study`` as a hostile user drives it, run for real: every option bounded and checked before
any P runs, ``--out`` under ``outfiles.py``'s rule, and a measured study that fails loudly when a P's output
differs from P = 1's. Each bad input is exit 2 and one short ``error:`` line, no traceback.

The simulated cases read a small synthetic acceptance table (written here), so each run takes a second or two."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import pytest
from dist_helpers import REPO, env_with_repo, lp_runner_cmd, write_prompts

from lp_runner.config import LookaheadConfig
from lp_runner.studies.measured import available_cores, schedule

MAX_LINE = 400
SIM = ["--simulate", "--curve", "roofline:H200", "--model-shape", "llama-8b"]


def _study(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        lp_runner_cmd("study", *args), env=env_with_repo(), capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def _one_error_line(proc: subprocess.CompletedProcess, fragment: str, code: int = 2) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr[-2000:]
    assert len(lines[0]) < MAX_LINE, lines[0][:500]
    return lines[0]


def write_table(path, windows=((4, 4, 4, 2), (15, 5, 15, 3)), prompts: int = 3, rounds: int = 20):
    """A format-1 acceptance table (``tuning/acceptance.py``): greedy samples and each window's rounds, every
    decode round at full depth emitting the window's tokens (prompt i one more every fourth round)."""
    samples, recorded = [], []
    for _ in range(prompts):
        samples.append({"prompt_ids": list(range(1, 33)), "output_ids": list(range(100, 100 + 3 * rounds))})
    for w, n, g, e in windows:
        la = dataclasses.asdict(LookaheadConfig(preset="off", window_size=w, ngram_size=n, verification_set_size=g))
        shapes = []
        for p in range(prompts):
            rows, kv = [[0, 32, w, 0, [], -1, 1]], 32
            for i in range(rounds):
                emitted = e + (1 if (i + p) % 4 == 0 else 0)
                rows.append([kv, 1, w, n - 2, [n - 1] * g, 0, emitted])
                kv += emitted
            shapes.append(rows)
        recorded.append({"name": f"window-{w}-{n}-{g}", "lookahead": la, "shapes": shapes})
    table = {"format": 1, "model": "a synthetic model", "prompts": "three synthetic prompts", "samples": samples,
             "recorded": recorded}  # fmt: skip
    path.write_text(json.dumps(table))
    return path


@pytest.fixture
def table(tmp_path):
    return write_table(tmp_path / "table.json")


def _curve_file(path, scale: float):
    points = [{"kv_len": 512, "rows": q, "body_s": scale * (0.01 + 0.0001 * q), "all_s": scale * (0.01 + 0.0001 * q)}
              for q in (1, 8, 64)]  # fmt: skip
    path.write_text(json.dumps({"points": points}))
    return path


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--workers", "99999999999999999999"], "--workers expects an integer from 1 to 1024"),
        (["--workers", "9" * 5000], "(5000 characters)"),
        (["--workers", "1,1025"], "--workers must be from 1 to 1024, got 1025"),
        (["--devices", "1000000"], "--devices must be from 1 to 1024, got 1000000"),
        (["--devices", "0"], "--devices must be from 1 to 1024, got 0"),
        (["--kv-len", "100000000"], "--kv-len must be from 0 to 1048576"),
        (["--interconnect", "measured:nan"], "--interconnect measured:US must be a finite number > 0"),
        (["--interconnect", "measured:-5"], "--interconnect measured:US must be a finite number > 0"),
        (["--interconnect", "measured:inf"], "--interconnect measured:US must be a finite number > 0"),
        (["--host-us", "nan"], "--host-us must be a finite number >= 0"),
        (["--host-us", "300,-1"], "--host-us must be a finite number >= 0"),
        (["--slope", "nan"], "--slope must be a finite number"),
        (["--bandwidth-fraction", "0"], "--bandwidth-fraction must be a finite number > 0 and <= 1"),
        (["--flops-fraction", "1.5"], "--flops-fraction must be a finite number > 0 and <= 1"),
        (["--acceptance", "no-such-table"], "acceptance table 'no-such-table': no such file"),
    ],
)
def test_bad_options_are_one_line_before_anything_runs(tmp_path, table, args, fragment):
    out = tmp_path / "out"
    proc = _study(*SIM, "--acceptance", str(table), *args, "--out", str(out), timeout=60)
    line = _one_error_line(proc, fragment)
    assert "add --simulate" not in line
    assert not (out / "study.json").exists()


@pytest.mark.parametrize("scale", [float("nan"), -1.0])
def test_a_curve_file_with_nan_or_negated_times_is_refused(tmp_path, table, scale):
    curve = _curve_file(tmp_path / "curve.json", scale)
    proc = _study("--simulate", "--curve", str(curve), "--acceptance", str(table), "--out", str(tmp_path / "o"))
    _one_error_line(proc, "every forward time must be a positive number")


def test_out_must_be_a_writable_folder(tmp_path, table):
    """``--out`` a regular file, a FIFO, a folder that cannot be made (under /proc), or the prompts file: one line
    each, before any work; nothing replaced."""
    regular = tmp_path / "file.txt"
    regular.write_text("keep")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for out, fragment in ((regular, "is a file, not a folder"), (fifo, "is a file, not a folder"),
                          ("/proc/lp_study_out", "cannot write --out /proc/lp_study_out")):  # fmt: skip
        proc = _study(*SIM, "--acceptance", str(table), "--out", str(out), timeout=60)
        _one_error_line(proc, fragment)
    assert regular.read_text() == "keep"
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi"}])
    before = prompts.read_text()
    proc = _study("--prompts", str(prompts), "--out", str(prompts), timeout=60)
    _one_error_line(proc, "is the same file as --prompts")
    assert prompts.read_text() == before


def test_simulated_report_names_the_acceptance_and_needs_p1_for_speed_vs_p1(tmp_path, table):
    """``--acceptance FILE``: the report names the table's model and prompts; without P = 1 in --workers no
    "speed vs P=1" is printed as 1.00x (there is none), while speed vs plain decoding is."""
    out = tmp_path / "sim"
    proc = _study(*SIM, "--acceptance", str(table), "--workers", "2,4", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "speed vs P=1 n/a (P=1 not in --workers)" in proc.stdout and "1.00x" not in proc.stdout
    sim = json.loads((out / "study.json").read_text())["simulated"]
    assert sim["inputs"]["acceptance_model"] == "a synthetic model"
    assert "three synthetic prompts" in sim["inputs"]["acceptance"]
    assert all(p["speed_vs_p1"] is None and p["speed_vs_plain"] > 0 for p in sim["points"])
    assert "a synthetic model" in (out / "study.md").read_text()


def test_default_acceptance_is_said(tmp_path):
    """No ``--acceptance``: the embedded model's table, and the log says so."""
    out = tmp_path / "sim"
    proc = _study(*SIM, "--workers", "1,2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "acceptance: embedded-calibration8, the embedded model's table (default" in proc.stderr
    for p in json.loads((out / "study.json").read_text())["simulated"]["points"]:
        assert {"busiest_rank_rows", "tokens_per_forward_interval", "forward_ms", "collective_ms", "host_ms",
                "ms_per_token", "speed_vs_p1", "speed_vs_plain"} <= set(p)  # fmt: skip
    assert "band: P=2 speed vs P=1" in proc.stdout


def test_a_p_too_large_for_this_machine_is_refused_before_any_p_runs(tmp_path):
    """P = 1000 ranks need hundreds of GB: refused in one line before P = 1 runs (no records file made)."""
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi"}])
    out = tmp_path / "m"
    proc = _study("--prompts", str(prompts), "--workers", "1,1000", "--set", "model.threads=1", "--out", str(out))
    _one_error_line(proc, "parallel.workers=1000")
    assert not list(out.glob("P*.jsonl"))


def _record(pid: str, output: list[int]) -> dict:
    return {"id": pid, "output_ids": output, "seconds": 0.5, "new_tokens": len(output), "tokens_per_forward": 1.5,
            "window_size": 7, "ngram_size": 5, "verification_set_size": 7, "stats": {"rounds": 2, "rows": 10},
            "policy": {"lookahead": {"lookahead_branch": True}}}  # fmt: skip


def test_outputs_that_differ_fail_the_study_and_torn_lines_are_dropped(tmp_path):
    """Every run's records already complete (so no model runs): P = 2's output for one prompt differs from
    P = 1's. The study writes its report, names the P, and exits 1; a torn last line left by a killed run in
    P1-r0.jsonl is dropped on the rerun."""
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": "yo"}])
    out = tmp_path / "m"
    out.mkdir()
    for run in schedule([1, 2], 3, threads=1, cores=available_cores()):
        b = [9, 9] if run.workers == 2 else [3, 4]
        recs = [_record("study-warmup", [1]), _record("a", [1, 2]), _record("b", b)]
        text = "".join(json.dumps(r) + "\n" for r in recs)
        if run.key == "P1" and run.rep == 0:
            text += '{"id": "a", "output_i'
        (out / f"{run.key}-r{run.rep}.jsonl").write_text(text)
    proc = _study("--prompts", str(prompts), "--workers", "1,2", "--set", "model.threads=1", "--out", str(out))
    _one_error_line(proc, "outputs differ from P=1's at P=2", code=1)
    assert "running" not in proc.stderr and "torn last line dropped" in proc.stderr
    assert (out / "P1-r0.jsonl").read_text().endswith("\n")
    assert all(json.loads(line) for line in (out / "P1-r0.jsonl").read_text().splitlines())
    report = json.loads((out / "study.json").read_text())["measured"]
    assert report["identical_outputs"] is False
    assert [p["identical_to_base"] for p in report["points"] if p["key"] == "P2"] == [False]

"""``lp_runner study --record-acceptance`` through the real CLI: a model's acceptance recorded on the user's prompts,
then priced by ``study --simulate --acceptance OUT/table.json``, which names the model it came from; bad input is
one ``error:`` line before the model loads."""

from __future__ import annotations

import json
import subprocess

import pytest
from dist_helpers import REPO, env_with_repo, lp_runner_cmd

pytestmark = pytest.mark.slow


def _study(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        lp_runner_cmd("study", *args), env=env_with_repo(), capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def test_record_then_simulate_with_the_recorded_table(tiny_dir, tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "def f(x):"}\n{"id": "b", "prompt": "one two one two"}\n', "utf-8")
    out = tmp_path / "rec"
    sets = ["--set", f"model.path={tiny_dir}", "--set", f"advanced.cache_dir={tmp_path / 'cache'}"]
    sets += ["--set", "generation.max_new_tokens=8", "--set", "model.threads=1"]
    rec = _study("--record-acceptance", "--prompts", str(prompts), "--windows", "3-3-3,4-4-2", "--out", str(out), *sets)
    assert rec.returncode == 0, rec.stderr[-3000:]
    lines = (out / "records.jsonl").read_text("utf-8").splitlines()
    assert len(lines) == 6  # greedy and two windows, two prompts
    table = json.loads((out / "table.json").read_text("utf-8"))
    assert [s["window"] for s in table["summary"]] == [[3, 3, 3], [4, 4, 2]]  # by rows a round
    assert table["preset"] and table["weights"] and str(tiny_dir) in table["model"]
    assert list((tmp_path / "cache" / "acceptance").glob("*.json"))  # the preset's copy for this model
    again = _study("--record-acceptance", "--prompts", str(prompts), "--windows", "3-3-3", "--out", str(out), *sets)
    assert again.returncode == 0 and "forwards" not in again.stderr  # nothing left to record
    sim = _study("--simulate", "--curve", "roofline:H200", "--acceptance", str(out / "table.json"), "--workers",
                 "1,2", "--out", str(tmp_path / "sim"))  # fmt: skip
    assert sim.returncode == 0, sim.stderr[-3000:]
    assert str(tiny_dir) in (tmp_path / "sim" / "study.md").read_text("utf-8")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--simulate", "--curve", "roofline:H200"], "drop --simulate"),
        ([], "needs --prompts"),
        (["--prompts", "PROMPTS", "--windows", "7-5"], "--windows"),
    ],
)
def test_bad_record_options_are_one_line(args, fragment, tmp_path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x"}\n', "utf-8")
    args = [str(prompts) if a == "PROMPTS" else a for a in args]
    proc = _study("--record-acceptance", *args, "--out", str(tmp_path / "o"), timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and fragment in errors[0], proc.stderr[-2000:]

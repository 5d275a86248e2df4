"""The prepared check for one lease of a GPU machine (``benchmarks/gpu_check.sh``) works before the machine is lent.

A GPU is lent to few tasks, for minutes, with no network, and its return folder brings back at most 8 files: a
script broken by a change elsewhere, or one whose results do not come back, would waste the only GPU run this
project gets. Its CPU smoke mode runs the same steps on tiny shapes. Here: the smoke with a step cut by its limit
and a small budget leaves exactly the summary and the tarball in OUT, every step's JSON in the tarball, and ends
inside its budget; the whole smoke passes its decisive steps; and the pieces the summary is made of read what the
steps write, partial or not."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
from dist_helpers import REPO, env_with_repo

from benchmarks.gpu_check import STEP_JSONS, cmd_cli_json, cmd_summarize
from benchmarks.gpu_probes import capture_counts, compile_check, compile_counts
from lp_runner.device import fp32_precision_readings

RETURN_FILES = {"gpu_check_summary.md", "gpu_check.tar.gz"}
MAX_RETURN_BYTES = 16 * 2**20


@pytest.mark.parametrize(
    ("before", "after", "device", "expected"),
    [
        # one compilation, no skip: what one compiled round function gives on CUDA
        ((3, 0), (4, 0), "cuda", {"compilations": 1, "cudagraph_skips": 0, "ok": True}),
        # a recompilation mid-step fails, on any device
        ((0, 0), (2, 0), "cpu", {"compilations": 2, "cudagraph_skips": 0, "ok": False}),
        # a skipped capture fails on CUDA; a CPU has nothing to capture, so it skips by design
        ((0, 0), (1, 1), "cuda", {"compilations": 1, "cudagraph_skips": 1, "ok": False}),
        ((0, 0), (1, 1), "cpu", {"compilations": 1, "cudagraph_skips": 1, "ok": True}),
        # a counter this torch lacks is unknown, not 0, and does not fail; nor does a compile count that never moved
        ((0, None), (1, None), "cuda", {"compilations": 1, "cudagraph_skips": "unknown", "ok": True}),
        ((5, 0), (5, 0), "cuda", {"compilations": "unknown", "cudagraph_skips": 0, "ok": True}),
    ],
)
def test_compile_check_wants_one_compilation_and_no_skipped_capture_on_cuda(before, after, device, expected):
    counts = lambda c: {"compilations": c[0], "cudagraph_skips": c[1]}  # noqa: E731
    assert compile_check(counts(before), counts(after), torch.device(device)) == expected


def test_compile_counts_reads_this_torchs_counters():
    counts = compile_counts()  # torch 2.13 keeps both: integers, not None
    assert isinstance(counts["compilations"], int) and isinstance(counts["cudagraph_skips"], int)


def test_probes_read_the_flags_and_leave_capture_counts_to_cuda():
    """The probe's TF32 readers answer on a CPU (the legacy ones and, on this torch, the per-backend ones); a CPU
    records no CUDA graph, so its capture counts are None, not 0."""
    flags = fp32_precision_readings()
    assert flags["get_float32_matmul_precision"] in ("highest", "high", "medium", "raises")
    assert "cuda.matmul.fp32_precision" in flags  # torch 2.13 has the per-backend flags
    assert capture_counts(torch.device("cpu")) is None


def _records(path: Path, stats: list[dict]) -> None:
    lines = [{"id": "warmup", "new_tokens": 4, "forwards": 4, "stats": {"rounds": 4, "seconds": 9.0}}]
    lines += [{"id": f"p{i}", "new_tokens": 10, "forwards": 5, "stats": s} for i, s in enumerate(stats)]
    lines[1]["policy"] = {"compile": {"mode": "on", "compiled": True, "compile_s": 3.5}}
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_cli_json_gives_host_us_and_forward_ms_per_round(tmp_path):
    """Two prompts of 5 rounds each (the warm-up prompt left out): 1 ms of host time over 10 rounds is 100 us a
    round, 30 ms of forwards 3 ms a round; the compile choice comes from the records' policy."""
    stats = {"rounds": 5, "seconds": 0.5, "forward_s": 0.015, "host_s": 0.0005, "rows": 20}
    _records(tmp_path / "cli.jsonl", [stats, stats])
    args = type("A", (), {"records": str(tmp_path / "cli.jsonl"), "status": "timeout", "out": str(tmp_path / "o")})
    cmd_cli_json(args)
    got = json.loads((tmp_path / "o").read_text())
    assert got["figures"]["host_us_per_round"] == 100.0 and got["figures"]["forward_ms_per_round"] == 3.0
    assert got["figures"]["prompts"] == 2 and got["compile"]["compiled"] is True
    assert got["complete"] is False and got["status"] == "timeout"  # a cut run's records: what it finished


def test_summary_reads_partial_and_stub_jsons(tmp_path, capsys):
    """A core step cut in its identity part (its JSON partial), a stub for a step that never ran: the summary
    says which part was cut and which JSON is missing, and writes its file."""
    res = tmp_path / "res"
    res.mkdir()
    (res / "steps.tsv").write_text("step\tstatus\texit\tseconds\ttimeout_s\ncore\ttimeout\t124\t30\t25\n")
    identity = {"model": "m", "dtype": "torch.float32", "device_name": "cpu", "prompts": 2, "complete": False,
                "stage": "W7-N5-G7-eager", "runs": {"preset-eager": {"identical": 2, "first_difference": {},
                                                                     "setting": "W 7, N 5, G 7"}}}  # fmt: skip
    (res / "identity.json").write_text(json.dumps(identity))
    (res / "speed.json").write_text(json.dumps({"step": "speed", "status": "no-time", "complete": False}))
    cmd_summarize(type("A", (), {"res": str(res), "smoke": True}))
    summary = (res / "gpu_check_summary.md").read_text()
    assert "| core | timeout | 124 | 30 | 25 |" in summary
    assert "**Partial**: the step stopped during its W7-N5-G7-eager part" in summary
    assert "- preset-eager (W 7, N 5, G 7): identical to HF greedy on 2 of 2 prompts" in summary
    assert "- core: probe.json" in summary and "- speed: speed.json" not in summary  # missing vs stubbed
    capsys.readouterr()


def _smoke(tmp_path: Path, **env_vars: str) -> tuple[subprocess.CompletedProcess, Path, float]:
    out = tmp_path / "return"
    env = env_with_repo()
    env.update(GPU_CHECK_SMOKE="1", OUT=str(out), PYTHON=sys.executable, TMPDIR=str(tmp_path), **env_vars)
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh")], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    return proc, out, time.monotonic() - start


def _returned(out: Path, tmp_path: Path) -> tuple[dict[str, str], dict[str, dict]]:
    """The return folder's rule (two files: the summary and the tarball, none over 16 MiB, no folder), and from the
    tarball each step's status and every JSON."""
    files = list(out.rglob("*"))
    assert {f.name for f in files} == RETURN_FILES and all(f.is_file() for f in files)
    assert all(f.stat().st_size <= MAX_RETURN_BYTES for f in files)
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    res = tmp_path / "unpacked" / "gpu_check"
    steps = {}
    for line in (res / "steps.tsv").read_text().splitlines()[1:]:
        name, status, *_ = line.split("\t")
        steps[name] = status
    jsons = {f: json.loads((res / f).read_text()) for files in STEP_JSONS.values() for f in files}
    assert (res / "gpu_check_summary.md").read_text() == (out / "gpu_check_summary.md").read_text()
    assert not list(res.rglob("*.tmp"))  # every JSON written whole
    return steps, jsons


@pytest.mark.slow
def test_smoke_with_a_cut_step_returns_two_files_and_every_steps_json(tmp_path):
    """A 100 s budget with the core step cut at 20 s (during its compile): the run ends inside its budget, exit 1,
    OUT holds the summary and the tarball only, and the tarball holds every step's JSON: the cut step's as far as
    it got (or a stub saying it was cut), the steps left no time a stub each."""
    budget = 100
    proc, out, seconds = _smoke(tmp_path, GPU_CHECK_BUDGET_S=str(budget), GPU_CHECK_LIMIT_CORE="20")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert seconds < budget + 10  # its own budget, the summary and the tarball included (+ bash and tar start-up)
    steps, jsons = _returned(out, tmp_path)
    assert steps["env"] == "ok" and steps["core"] == "timeout"
    assert all(not jsons[f].get("complete") for f in STEP_JSONS["core"])  # cut: partial or a stub, never complete
    assert any(jsons[f].get("status") == "timeout" for f in STEP_JSONS["core"])  # what the cut left unwritten
    assert steps["speed"] == "no-time" and jsons["speed.json"]["status"] == "no-time"
    assert "| core | timeout | 124 |" in (out / "gpu_check_summary.md").read_text()


@pytest.mark.slow
def test_smoke_runs_the_decisive_steps(tmp_path):
    """The whole smoke within its default budget (540 s): the probe, fp32 identity at both settings eager and
    captured, the buckets (one compilation; the job's arena allocated once; the prefill's peaks beside HF's; the
    capacity sweep), and the CLI's compiled job, all complete; later steps ok or cut by the budget, never failed."""
    proc, out, seconds = _smoke(tmp_path)
    assert seconds < 540 + 10
    # on a GPU the decisive steps at their longest fit the default budget less the summary's reserve
    plan = re.search(r"decisive plan \(GPU\): env to cli-compiled take at most (\d+)s of (\d+)s", proc.stdout)
    assert plan and int(plan[1]) <= int(plan[2]) == 540 - 20
    steps, jsons = _returned(out, tmp_path)
    decisive = ("env", "core", "make-model", "cli-compiled")
    assert {s: steps.get(s) for s in decisive} == dict.fromkeys(decisive, "ok"), proc.stdout[-4000:]
    assert set(steps.values()) <= {"ok", "skipped", "timeout", "no-time"}
    assert jsons["probe.json"]["ok"] and "raises" not in jsons["probe.json"]["flags"].values()
    identity = jsons["identity.json"]
    assert identity["ok"] and set(identity["runs"]) == {
        f"{s}-{p}" for s in ("preset", "W7-N5-G7") for p in ("eager", "captured")
    }
    assert all(r["identical"] == identity["prompts"] == 2 for r in identity["runs"].values())
    assert identity["runs"]["W7-N5-G7-captured"]["setting"] == "W 7, N 5, G 7"
    buckets = jsons["buckets.json"]
    assert buckets["complete"] and buckets["compile"]["compilations"] == 1 and buckets["job"]["ok"]
    assert set(buckets["buckets"]) == {"2", "4"}
    assert all(r["logit_max_abs_diff"] >= 0 and r["captured_ms"] > 0 for r in buckets["buckets"].values())
    assert buckets["prefill"]["tokens"] > buckets["prefill"]["chunk_rows"] and "peak_mib" in buckets["prefill"]["hf"]
    sizes = [int(s) for s in buckets["capacity_sweep"]["sizes"]]
    assert len(sizes) == 2 and sizes[1] >= 4 * sizes[0]
    cli = jsons["cli_compiled.json"]
    assert cli["complete"] and cli["compile"]["compiled"] and cli["figures"]["forward_ms_per_round"] > 0

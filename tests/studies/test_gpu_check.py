"""The prepared check for a lent GPU machine (``benchmarks/gpu_check.sh``) works before the machine is lent.

A GPU is lent to few tasks, for minutes, with no network: a script broken by a change elsewhere (a renamed
option of ``forward_cost.py``, a CLI key) would waste the only GPU run this project gets. Its CPU smoke mode runs
the same steps on a tiny model; here it must finish with every step ok, and its summary must carry each section
and the comparison of every CLI run's output with the engine's own one-token decoding."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from dist_helpers import REPO, env_with_repo

from benchmarks.gpu_check import agreement
from benchmarks.gpu_probes import compile_check, compile_counts

STEPS = (
    "env",
    "rounds-buckets",
    "rounds-8b",
    "rounds-speed",
    "rounds-identity",
    "forward-cost",
    "forward-cost-compiled",
    "nccl-probe",
    "make-model",
    "cli-default",
    "cli-lookahead",
    "cli-greedy",
    "cli-two-ranks",
)


def test_agreement_counts_identical_outputs_and_first_differences():
    reference = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8], "only-in-reference": [9]}
    outputs = {"a": [1, 2, 3], "b": [4, 0, 6], "c": [7, 8, 1]}
    got = agreement(outputs, reference)
    # a prompt the run lacks is not counted; a longer output differs where the shorter one ends
    assert got == {"prompts": 3, "identical": 1, "first_difference": {"b": 1, "c": 2}}
    assert agreement(reference, reference)["identical"] == 4


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


@pytest.mark.slow
def test_smoke_mode_runs_every_step(tmp_path):
    out = tmp_path / "gpu"
    env = env_with_repo()
    env.update(GPU_CHECK_SMOKE="1", OUT=str(out), PYTHON=sys.executable, TMPDIR=str(tmp_path))
    env.pop("GPU_CHECK_BUDGET_S", None)
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    steps = {}
    for line in (out / "steps.tsv").read_text().splitlines()[1:]:
        name, status, *_ = line.split("\t")
        steps[name] = status
    assert proc.returncode == 0, (steps, proc.stdout[-4000:])
    assert {name: steps.get(name) for name in STEPS} == dict.fromkeys(STEPS, "ok")
    assert set(steps.values()) <= {"ok", "skipped"}

    summary = (out / "gpu_check_summary.md").read_text()
    for heading in ("## Forward cost vs packed rows", "## The same forward compiled", "## CLI runs"):
        assert heading in summary
    for heading in ("## Rounds per row bucket: eager vs captured", "## Tokens/s against HF greedy", "## HF-greedy"):
        assert heading in summary
    # the GPU run's steps 1 and 6 fit its budget (540 s less the summary's 25) with every step at its longest
    plan = re.search(r"rounds plan \(GPU\): steps 1 and 6 take at most (\d+)s of (\d+)s", proc.stdout)
    assert plan and int(plan[1]) <= int(plan[2]) == 540 - 25
    for name in ("rounds_buckets", "rounds_buckets_8b"):  # the step-6 model and the 8B shape cut: the same checks
        data = json.loads((out / f"{name}.json").read_text())
        assert data["complete"] and data["stage"] == "done"
        buckets = data["buckets"]
        assert set(buckets) == {"2", "4"} and all(r["captured_ms"] > 0 and r["eager_ms"] > 0 for r in buckets.values())
        # device and host time per round exist on CUDA only; the keys are there on a CPU (null)
        assert all(r[f"{p}_host_us"] is None and r[f"{p}_device_ms"] is None for r in buckets.values() for p in
                   ("eager", "captured"))  # fmt: skip
        # one compilation of the round over buckets, two K/V widths, the job and the prefill; a CPU skips captures
        assert data["compile"]["compilations"] == 1 and data["compile"]["ok"]
        job = data["job"]  # the second prompt needs a larger arena; the warm-up at the longer one made it once
        assert job["arena_slots"][1] > job["arena_slots"][0]
        assert job["arena_allocations_before"] == job["arena_allocations_after"] == 1 and job["ok"]
        assert job["capture_s_before"] == job["capture_s_after"] and len(job["captured_s"]) == 2
        prefill = data["prefill"]  # longer than one chunk: cached in chunks before the first round
        assert prefill["tokens"] > prefill["chunk_rows"] == 512
        assert all(set(prefill[p]) >= {"peak_mib", "added_mib", "seconds"} for p in ("eager", "captured"))
    assert "llama8b-tiny" in data["model"]  # the last one read: the 8B shape's step
    assert "## Peak device memory of a long prefill" in summary and "(Llama-3-8B shape, cut)" in summary
    for name in ("rounds_speed", "rounds_identity"):
        assert json.loads((out / f"{name}.json").read_text())["compile"]["compilations"] == 1
    speed = json.loads((out / "rounds_speed.json").read_text())["runs"]
    assert set(speed) == {"hf-greedy", "hf-prompt-lookup", "engine-only-eager", "engine-only-captured",
                          "default-eager", "default-captured"}  # fmt: skip
    assert all(r["tokens_per_s"] > 0 and r["same_as_hf_greedy"] in ("0/1", "1/1") for r in speed.values())  # bf16
    identity = json.loads((out / "rounds_identity.json").read_text())
    assert identity["ok"] and identity["default-captured"]["identical"] == identity["prompts"] == 2
    runs = json.loads((out / "cli_summary.json").read_text())
    assert set(runs) == {"default", "lookahead", "greedy", "two-ranks"}
    prompts = sum(1 for line in (out / "prompts.jsonl").read_text().splitlines() if line.strip())
    assert "Peak host memory of each rank right after loading the model (two-ranks run, MiB): rank 0: " in summary
    assert "rank 1: " in summary
    for name in ("default", "lookahead", "two-ranks"):
        same = runs[name]["agreement"]
        assert same["prompts"] == prompts  # every prompt of the run compared with the one-token run
        assert f"- {name}: output identical to greedy on {same['identical']} of {prompts} prompts" in summary
    for name in ("forward_cost.png", "forward_cost_compiled.png", "nccl_probe.json", "env.json"):
        assert (out / name).stat().st_size > 0
    assert all((out / "logs" / f"{name}.log").stat().st_size > 0 for name in STEPS)

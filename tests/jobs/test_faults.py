"""Jobs that lose nothing: real processes killed, interrupted and raced, then resumed.

Every case runs the real CLI on a tiny random model folder (the embedded tokenizer, a 2-layer body) and compares
the final output file with an uninterrupted run's, record by record by id (order aside). Timing and telemetry
fields are left out of the comparison: they measure a run, not what it generated.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_helpers import (
    alive,
    complete_lines,
    descendants,
    env_with_repo,
    job_args,
    make_tiny_folder,
    read_jsonl,
    run_job,
    start_job,
    stop,
    torchrun_cmd,
    wait_for,
    write_prompts,
)

PROMPTS = 40  # enough that a kill after the first record lands mid-run
MAX_NEW = 16
# Fields that measure the run (time, placement, per-round telemetry), not what it generated. The lookahead
# setting that ran (``policy`` and W / N / G / pool_from_prompt) and so ``forwards`` depend on what the process saw
# before: the auto preset adapts the setting prompt by prompt, and a resumed run starts afresh. The tokens do not.
RUN_FIELDS = {"seconds", "tokens_per_s", "stats", "workers", "dist_backend", "recovery", "forwards"}
RUN_FIELDS |= {"tokens_per_forward", "policy", "window_size", "ngram_size", "verification_set_size", "pool_from_prompt"}
RUN_FIELDS |= {"run"}  # the whole config, versions and device of the run that wrote the record (workers differ)
LAUNCHERS = {"single": [], "torchrun-self": ["--set", "parallel.workers=2"]}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    return write_prompts(path, [{"id": f"p{i}", "prompt": f"Item {i}: the list goes on and"} for i in range(PROMPTS)])


@pytest.fixture(scope="module")
def reference(tiny_dir, prompts, tmp_path_factory) -> dict[str, dict]:
    """The uninterrupted run's records by id."""
    out = tmp_path_factory.mktemp("ref") / "o.jsonl"
    proc = cli(tiny_dir, prompts, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return by_id(read_jsonl(out))


def args(model: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    """This file's job: the shared arguments, a 30 s peer timeout (the stalled-peer cases wait for it)."""
    return job_args(model, prompts, out, "--set", "parallel.timeout_s=30", *extra, max_new_tokens=MAX_NEW)


def cli(model: Path, prompts: Path, out: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_job(args(model, prompts, out, *extra), timeout=timeout, check=False)


def start(model: Path, prompts: Path, out: Path, *extra: str) -> subprocess.Popen:
    return start_job(args(model, prompts, out, *extra))


def by_id(records: list[dict]) -> dict[str, dict]:
    out = {r["id"]: {k: v for k, v in r.items() if k not in RUN_FIELDS} for r in records}
    assert len(out) == len(records), "an id appears twice in the output"
    return out


# ---------------------------------------------------------------- refusals (no model is loaded)


def test_existing_output_is_refused_and_left_untouched(tiny_dir, prompts, tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "old"}\n')
    proc = cli(tiny_dir, prompts, out)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: output file {out} already exists; give --resume to continue it or --overwrite to replace it"
    ]  # one line: no traceback
    assert out.read_text() == '{"id": "old"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl"]  # no lock or sibling left behind


@pytest.mark.slow
def test_resume_with_other_settings_or_weights_is_refused(tiny_dir, prompts, tmp_path, reference):
    out = tmp_path / "o.jsonl"
    out.write_text("".join(json.dumps(dict(r, stats={})) + "\n" for r in list(reference.values())[:2]))
    before = out.read_bytes()
    proc = cli(tiny_dir, prompts, out, "--resume", "--set", "lookahead.window_size=3")
    assert proc.returncode == 2
    assert "error: --resume: " in proc.stderr and "lookahead.window_size: 7 in the file, 3 now" in proc.stderr
    assert "Traceback" not in proc.stderr
    # the same settings but other weights: the config names the same path, a link swapped to another model
    other = make_tiny_folder(tmp_path / "other", "llama", seed=4)
    swapped = tmp_path / "model"
    swapped.symlink_to(tiny_dir)
    first = cli(swapped, prompts, tmp_path / "w.jsonl", "--set", "advanced.summary=false")
    assert first.returncode == 0, first.stderr[-2000:]
    lines = (tmp_path / "w.jsonl").read_text().splitlines()
    (tmp_path / "w.jsonl").write_text(lines[0] + "\n")
    swapped.unlink()
    swapped.symlink_to(other)
    proc = cli(swapped, prompts, tmp_path / "w.jsonl", "--resume")
    assert proc.returncode == 2
    assert "was generated from other model weights" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "w.jsonl").read_text() == lines[0] + "\n"
    assert out.read_bytes() == before


@pytest.mark.slow
def test_overwrite_replaces_only_when_the_first_record_is_ready(tiny_dir, prompts, tmp_path, reference):
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "old"}\n')
    # fails after the model is loaded (every prompt is too long for the model's 4096 positions): the old file stays
    proc = cli(tiny_dir, prompts, out, "--overwrite", "--set", "generation.max_new_tokens=4090")
    assert proc.returncode == 2
    assert "error: prompt 'p0' (" in proc.stderr and ":1): prompt of" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert out.read_text() == '{"id": "old"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl"]
    proc = cli(tiny_dir, prompts, out, "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert by_id(read_jsonl(out)) == reference


# ---------------------------------------------------------------- kill, interrupt, resume


@pytest.mark.slow
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
@pytest.mark.parametrize(
    ("point", "sig"),
    [
        ("mid-run", signal.SIGKILL),
        ("mid-run", signal.SIGINT),
        ("mid-run", signal.SIGTERM),
        ("start-up", signal.SIGKILL),
        ("start-up", signal.SIGTERM),
    ],
    ids=lambda v: getattr(v, "name", v),
)
def test_interrupted_run_resumes_to_the_uninterrupted_output(
    tiny_dir, prompts, tmp_path, reference, launcher, point, sig
):
    """``start-up``: the input is checked and the output locked, the model is loading; ``mid-run``: records are
    being written."""
    out = tmp_path / "o.jsonl"
    proc = start(tiny_dir, prompts, out, *LAUNCHERS[launcher])
    try:
        if point == "start-up":
            wait_for(lambda: (tmp_path / "o.jsonl.lock").exists(), 60, proc)
        else:
            wait_for(lambda: complete_lines(out) >= 2, 180, proc)
        below = descendants(proc.pid)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        stop(proc)
    err = err.decode()
    assert "Traceback" not in err, err[-3000:]
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        end = time.monotonic() + 40  # nothing to forward a kill -9: torchrun gets SIGTERM as its parent dies
        while alive(below) and time.monotonic() < end:
            time.sleep(0.2)
        assert not alive(below), "processes outlived the killed launcher"
    else:
        assert proc.returncode == 130, err[-3000:]
        assert err.strip().splitlines()[-1] == "error: interrupted", err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert not alive(below), "processes outlived the launcher"
    kept = complete_lines(out)
    assert (kept == 0) if point == "start-up" else (1 <= kept < PROMPTS), kept
    resumed = cli(tiny_dir, prompts, out, "--resume", *LAUNCHERS[launcher])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    if kept:
        assert f"skipped: {kept} already in the output (--resume)" in resumed.stderr
    assert by_id(read_jsonl(out)) == reference  # nothing lost, nothing twice, the same tokens
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl"]


@pytest.mark.slow
def test_torn_last_line_is_dropped_on_resume(tiny_dir, prompts, tmp_path, reference):
    out = tmp_path / "o.jsonl"
    lines = [json.dumps(dict(r, stats={})) for r in list(reference.values())[:3]]
    out.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:57])  # a kill in the middle of a write
    proc = cli(tiny_dir, prompts, out, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped: 2 already in the output" in proc.stderr and "Traceback" not in proc.stderr
    assert by_id(read_jsonl(out)) == reference


@pytest.mark.slow
def test_failed_peer_exits_3_and_leaves_no_process(tiny_dir, prompts, tmp_path):
    out = tmp_path / "o.jsonl"
    proc = start(tiny_dir, prompts, out, "--set", "parallel.workers=2")
    try:
        wait_for(lambda: complete_lines(out) >= 2, 180, proc)
        below = descendants(proc.pid)
        ranks = [pid for pid in below if b"RANK=1\0" in Path(f"/proc/{pid}/environ").read_bytes()]
        rank1 = [pid for pid in ranks if not (descendants(pid) & set(ranks))]  # the rank itself, not a helper
        assert len(rank1) >= 1, ranks
        for pid in rank1:
            os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        stop(proc)
    err = err.decode()
    assert proc.returncode == 3, err[-3000:]
    assert not alive(below)
    assert 2 <= complete_lines(out) < PROMPTS
    # the surviving rank's own line (its peer failed, or it was stopped), then the parent's one summary line
    lines = err.strip().splitlines()
    assert "Traceback" not in err and all(line.startswith("error: [rank 0] ") for line in lines[:-1]), err[-3000:]
    assert lines[-1] == "error: LP workers failed (exit code 3): worker rank 1 was killed by SIGKILL first", err


@pytest.mark.slow
def test_a_stopped_rank_is_named_as_the_cause(tiny_dir, prompts, tmp_path):
    """Rank 0 stopped (SIGSTOP) mid-run: rank 1's collective times out and it ends first (exit 3), but the parent's
    line names rank 0, found stopped at that moment, as why (it named rank 1 "first", as if rank 1 had failed)."""
    out = tmp_path / "o.jsonl"
    proc = start(tiny_dir, prompts, out, "--set", "parallel.workers=2", "--set", "parallel.timeout_s=5")
    try:
        wait_for(lambda: complete_lines(out) >= 1, 180, proc)
        below = descendants(proc.pid)
        rank0 = [pid for pid in below if b"\0RANK=0\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()]
        assert rank0, below
        for pid in rank0:
            os.kill(pid, signal.SIGSTOP)
        _, err = proc.communicate(timeout=120)
    finally:
        stop(proc)
    err = err.decode()
    assert proc.returncode == 3 and "Traceback" not in err, err[-3000:]
    assert not alive(below)
    assert err.strip().splitlines()[-1] == (
        "error: LP workers failed (exit code 3): worker rank 0 was stopped (SIGSTOP or a debugger) and stopped "
        "answering; worker rank 1 gave up waiting for it (see its message above)"
    ), err[-3000:]


@pytest.mark.parametrize(
    ("first", "stopped", "said", "story"),
    [
        ((1, -9), [], [], "worker rank 1 was killed by SIGKILL first"),
        ((1, 3), [], [1], "worker rank 1 exited with code 3 first; see its message above"),  # nobody found stopped
        ((1, 2), [0], [1], "worker rank 1 exited with code 2 first; see its message above"),  # its own input error
        ((1, 1), [], [], "worker rank 1 exited with code 1 first; see its message above"),  # Python's traceback
        ((1, 143), [], [], "worker rank 1 exited with code 143 first; see its message above"),  # its SIGTERM line
        ((1, 3), [], [0], "worker rank 1 exited with code 3 first without an error line"),  # rank 0 spoke, not 1
        ((2, 3), [0, 1], [2], "worker rank 0 and 1 were stopped"),
        (
            (1, 3),
            [0],
            [],
            "worker rank 0 was stopped (SIGSTOP or a debugger) and stopped answering; worker rank 1 "
            "gave up waiting for it (it wrote no error line)",
        ),
    ],
)
def test_failure_story(first, stopped, said, story):
    """The parent's summary points at a rank's message "above" only when that rank wrote one."""
    from lp_runner.cli.launch import RankExit
    from lp_runner.cli.main import failure_story

    assert failure_story(RankExit(*first), stopped, said).startswith(story)


# A rank of a fake job: rank 0 stops itself (SIGSTOP, as a stalled worker); rank 1 waits until it is stopped, as a
# peer's collective would time out on it, then exits 3 (a failed peer), with or without an error line.
_RANK = """
import os, signal, sys, time
from pathlib import Path
folder = Path(os.environ["FAKE_JOB_DIR"])
if os.environ["RANK"] == "0":
    (folder / "rank0.pid").write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60)
    sys.exit(0)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    pid = folder / "rank0.pid"
    if pid.exists() and pid.read_text():
        stat = Path(f"/proc/{pid.read_text()}/stat").read_text()
        if stat[stat.rfind(")") + 2] == "T":
            break
    time.sleep(0.05)
if os.environ["FAKE_RANK1_SAYS"] == "1":
    from lp_runner.logs import tell_launcher
    line = "error: [rank 1] a peer worker died or stalled during a collective"
    print(line, file=sys.stderr, flush=True)
    tell_launcher(line)
sys.exit(3)
"""
# The parent: ``run_self_launched``'s launch and summary, on the fake ranks, with short grace periods (rank 0 only
# ends at SIGKILL). Prints the result as JSON.
_PARENT = """
import json, sys
from lp_runner.cli import launch
from lp_runner.cli.main import failure_story
launch.PEER_GRACE_S, launch.STOP_GRACE_S = 0.2, 0.5
result = launch.launch_ranks(2, [sys.executable, "-c", sys.argv[1]])
first = result.first_failure
print(json.dumps({"first": [first.rank, first.returncode], "stopped": result.stopped, "said": result.said,
                  "story": failure_story(first, result.stopped, result.said)}))
"""


@pytest.mark.parametrize("says", [False, True])
def test_a_stopped_rank_s_silent_peer_is_not_sent_above(tmp_path, says):
    """Rank 0 stopped and rank 1 giving up on it (exit 3) through the real launcher: the summary sends the reader
    to rank 1's message "above" only when rank 1 wrote one (it used to, whether or not it had), and
    ``LaunchResult.said`` holds the line it reported."""
    env = env_with_repo(FAKE_JOB_DIR=str(tmp_path), FAKE_RANK1_SAYS="1" if says else "0")
    proc = subprocess.run(
        [sys.executable, "-c", _PARENT, _RANK], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["first"] == [1, 3] and result["stopped"] == [0], result  # the case the story is about
    line = "error: [rank 1] a peer worker died or stalled during a collective"
    assert result["said"] == ({"1": line} if says else {})
    assert (line in proc.stderr) == says  # what reached the terminal: the same as what the parent was told
    head = "worker rank 0 was stopped (SIGSTOP or a debugger) and stopped answering; worker rank 1 gave up waiting"
    tail = "see its message above" if says else "it wrote no error line"
    assert result["story"] == f"{head} for it ({tail})"


@pytest.mark.slow
def test_self_launch_returns_the_ranks_input_error(tiny_dir, prompts, tmp_path):
    out = tmp_path / "o.jsonl"
    proc = cli(tiny_dir, prompts, out, "--set", "parallel.workers=2", "--set", "generation.max_new_tokens=4090")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"error: [rank 0] prompt 'p0' ({prompts}:1): prompt of " in proc.stderr
    assert not out.exists()
    # the ranks' own lines, then the parent's summary: no launcher banner, warning or traceback
    lines = proc.stderr.strip().splitlines()
    assert all(re.match(r"error: \[rank [01]\] prompt 'p0' ", line) for line in lines[:-1]), proc.stderr
    assert re.fullmatch(
        r"error: LP workers failed \(exit code 2\): worker rank [01] exited with code 2 first; see its message above",
        lines[-1],
    ), proc.stderr


@pytest.mark.slow
def test_self_launch_checks_what_it_can_before_starting_the_ranks(tiny_dir, prompts, tmp_path):
    """A setting that cannot run on this machine is the parent's one line and exit 2 before any rank starts:
    parallel.dist_backend=nccl without CUDA (each rank used to fail its process group: exit 3, the failed-peer
    code, and a launcher traceback), a round that does not fit the model's context, more model copies than
    memory."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nccl can run here")
    out = tmp_path / "o.jsonl"
    nccl = cli(tiny_dir, prompts, out, "--set", "parallel.workers=2", "--set", "parallel.dist_backend=nccl")
    assert nccl.returncode == 2, nccl.stderr[-3000:]
    assert nccl.stderr.splitlines() == [
        "error: parallel.dist_backend=nccl needs CUDA devices, and this machine has none; use gloo or auto"
    ]
    wide = cli(tiny_dir, prompts, out, "--set", "parallel.workers=2", "--set", "lookahead.window_size=1024")
    assert wide.returncode == 2, wide.stderr[-3000:]
    assert wide.stderr.splitlines() == [
        "error: lookahead: a round of this setting computes up to 4166 rows (the live token, W-1 + W x (N-2) "
        "window rows, G x the longest proposal), more than the 4096 a round may have; lower window_size (W), "
        "ngram_size (N), verification_set_size (G) or context_tokens"
    ]
    many = cli(tiny_dir, prompts, out, "--set", "parallel.workers=1024", "--set", "model.threads=1")
    assert many.returncode == 2, many.stderr[-3000:]
    assert re.fullmatch(
        r"error: parallel.workers=1024 x parallel.groups=1 needs at least [\d.]+ GiB of memory \(1024 processes of "
        r"400 MiB \+ the model's 6 MiB each\); this machine has [\d.]+ GiB available; lower parallel.workers or "
        r"parallel.groups\n",
        many.stderr,
    ), many.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


# ---------------------------------------------------------------- one writer per file


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [*sorted(LAUNCHERS), "torchrun"])
def test_second_writer_fails_at_once_naming_the_holder(tiny_dir, prompts, tmp_path, reference, launcher):
    """The lock's holder: the only process, the parallel.workers=P parent, or rank 0 under a user's torchrun."""
    out = tmp_path / "o.jsonl"
    if launcher == "torchrun":
        first = subprocess.Popen(
            torchrun_cmd(2, *args(tiny_dir, prompts, out)), env=env_with_repo(), stderr=subprocess.PIPE
        )
    else:
        first = start(tiny_dir, prompts, out, *LAUNCHERS[launcher])
    try:
        wait_for(lambda: (tmp_path / "o.jsonl.lock").exists(), 120, first)
        holders = {first.pid} if launcher != "torchrun" else descendants(first.pid)
        began = time.monotonic()
        second = cli(tiny_dir, prompts, out, "--resume", timeout=120)
        assert time.monotonic() - began < 30  # before any model is loaded
        _, err = first.communicate(timeout=300)
    finally:
        stop(first)
    assert second.returncode == 2 and "Traceback" not in err.decode()
    message = re.fullmatch(
        rf"error: output file {re.escape(str(out))} is being written by another lp_runner run \(pid (\d+)\); wait "
        "for it to end or choose another --output",
        second.stderr.strip(),
    )
    assert message and int(message[1]) in holders, second.stderr
    assert first.returncode == 0, err.decode()[-3000:]
    assert by_id(read_jsonl(out)) == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl"]  # the lock went with its holder


# ---------------------------------------------------------------- bad prompts


def test_bad_prompt_stops_before_the_model_is_loaded(prompts_with_empty, tmp_path):
    # model.path does not exist: the prompt's error must come first, so it was found before any loading
    proc = cli(Path("/nonexistent-model"), prompts_with_empty, tmp_path / "o.jsonl")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: prompt 'empty' ({prompts_with_empty}:2): empty prompt: at least one token is needed"
    )
    assert not (tmp_path / "o.jsonl").exists()


@pytest.fixture
def prompts_with_empty(tmp_path) -> Path:
    return write_prompts(
        tmp_path / "bad.jsonl",
        [
            {"id": "a", "prompt": "Item 1:"},
            {"id": "empty", "prompt": ""},
            {"id": "long", "prompt": "word " * 5000},  # beyond the tiny model's 4096 positions
            {"id": "b", "prompt": "Item 2:"},
        ],
    )


@pytest.mark.slow
def test_on_error_skip_writes_error_records_and_counts_them(tiny_dir, prompts_with_empty, tmp_path):
    out = tmp_path / "o.jsonl"
    proc = cli(tiny_dir, prompts_with_empty, out, "--set", "run.on_error=skip")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    records = {r["id"]: r for r in read_jsonl(out)}
    assert sorted(records) == ["a", "b", "empty", "long"]
    assert (
        records["empty"]["error"]
        == f"prompt 'empty' ({prompts_with_empty}:2): empty prompt: at least one token is needed"
    )
    assert records["long"]["error"].startswith(f"prompt 'long' ({prompts_with_empty}:3): prompt of ")
    assert "output_ids" not in records["long"] and len(records["a"]["output_ids"]) == MAX_NEW
    assert "prompts 2  new tokens" in proc.stderr and "2 error records (run.on_error=skip)" in proc.stderr
    # the default stops at the over-long prompt after tokenizing, before generating anything
    stopped = cli(tiny_dir, prompts_with_empty, tmp_path / "s.jsonl", "--set", "run.on_error=stop")
    assert stopped.returncode == 2
    assert f"error: prompt 'empty' ({prompts_with_empty}:2)" in stopped.stderr
    no_empty = write_prompts(
        tmp_path / "long.jsonl", [json.loads(x) for x in prompts_with_empty.read_text().split("\n")[2:3]]
    )
    stopped = cli(tiny_dir, no_empty, tmp_path / "s.jsonl")
    assert stopped.returncode == 2 and "Traceback" not in stopped.stderr
    assert f"error: prompt 'long' ({no_empty}:1): prompt of " in stopped.stderr
    assert not (tmp_path / "s.jsonl").exists()


# ---------------------------------------------------------------- a foreign pool file


@pytest.mark.slow
def test_pool_file_with_ids_outside_the_vocabulary_is_refused_before_loading(tiny_dir, prompts, tmp_path):
    """A pool file made with this tokenizer (it passes the format checks) holding a token id beyond the model's
    49152: one line naming the file and the first bad entry, before the weights load (the folder's weights are
    damaged: loading them would fail with another message). It used to reach the first forward: an IndexError."""
    import shutil

    from transformers import AutoTokenizer

    from lp_runner.decoding.job_store import JobPool, tokenizer_fingerprint

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # only the tokenizer and config.json can be read
    store = JobPool(1000)
    store.add((), (5, 6, 7))
    store.add((), (8, 99999, 9, 70000))
    pool = tmp_path / "pool.json"
    store.save(pool, tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_dir)))
    proc = cli(model, prompts, tmp_path / "o.jsonl", "--pool-in", str(pool))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"error: pool file {pool}: sequence 1, token 1: id 99999 is outside the model's vocabulary of 49152 ids"
    ]
    # the same file on the intact model, self-launched: the parent refuses it before starting any rank
    proc = cli(tiny_dir, prompts, tmp_path / "o.jsonl", "--pool-in", str(pool), "--set", "parallel.workers=2")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"error: pool file {pool}: sequence 1, token 1: id 99999 is outside the model's vocabulary of 49152 ids"
    ], proc.stderr[-3000:]
    assert not (tmp_path / "o.jsonl").exists()


# ---------------------------------------------------------------- a full disk

PAGE = 4096  # tmpfs counts whole pages per file
NO_SPACE = "No space left on device"


@pytest.fixture
def small_disk(tmp_path):
    """A real file system of 64 KiB (a tmpfs mounted under the test's folder; about a dozen records fit), and a
    function that resizes it (``mount -o remount``). Skipped where this process may not mount one."""
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")

    def resize(size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)

    try:
        yield disk, resize
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_full_disk_mid_run_is_one_line_and_resumes(tiny_dir, prompts, small_disk, reference, launcher):
    """ENOSPC in the middle of a job: exit 2, one line naming the file, its record count and --resume, no torn
    tail; once there is space again, --resume ends with the uninterrupted records."""
    disk, resize = small_disk
    out = disk / "o.jsonl"
    proc = cli(tiny_dir, prompts, out, *LAUNCHERS[launcher])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    kept = complete_lines(out)
    assert 1 <= kept < PROMPTS
    writer = "[rank 0] " if launcher == "torchrun-self" else ""  # rank 0 writes; its line is prefixed
    line = f"error: {writer}cannot write {out} ({NO_SPACE}); {kept} records written, resume with --resume"
    assert line in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert out.read_bytes().endswith(b"\n")  # the failed write's torn tail was cut off
    assert sorted(p.name for p in disk.iterdir()) == ["o.jsonl"]  # no lock, no sibling left
    resize("2m")
    resumed = cli(tiny_dir, prompts, out, "--resume", *LAUNCHERS[launcher])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert by_id(read_jsonl(out)) == reference


@pytest.mark.slow
def test_full_disk_before_the_first_record_leaves_the_old_file(tiny_dir, prompts, small_disk):
    """--overwrite on a disk the old output fills: OUT.new cannot take the first record; exit 2, one line, the old
    file as it was and no OUT.new."""
    disk, _ = small_disk
    out = disk / "o.jsonl"
    old = b'{"id": "old"}\n' * (15 * PAGE // 14)  # 15 of the 16 pages; the lock takes the last one
    out.write_bytes(old[: 15 * PAGE - 1] + b"\n")
    before = out.read_bytes()
    proc = cli(tiny_dir, prompts, out, "--overwrite")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: cannot write {out}.new ({NO_SPACE}); the existing file is unchanged"
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert out.read_bytes() == before
    assert sorted(p.name for p in disk.iterdir()) == ["o.jsonl"]


_WRITE_UNDER_A_FILE_SIZE_LIMIT = """
import json, resource, signal, sys
from pathlib import Path
from lp_runner.config import Config
from lp_runner.jobs.output import OutputError, OutputFile
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
sink = OutputFile.open(sys.argv[1], sys.argv[2], Config())
try:
    for i in range(100):
        sink.write({"id": f"r{i}", "pad": "x" * 150})
except OutputError as exc:
    print(exc)
finally:
    sink.close()
"""


@pytest.mark.parametrize("mode", ["new", "overwrite", "resume"])
def test_output_write_error_is_one_line_and_cuts_the_torn_tail(tmp_path, mode):
    """Without a mount: a file-size limit (RLIMIT_FSIZE) makes a real write fail mid-record (EFBIG). Whatever the
    mode, the file keeps its complete records and nothing after them, and the error says how many."""
    from lp_runner.config import Config
    from lp_runner.jobs.output import output_digest

    out = tmp_path / "o.jsonl"
    a, b = (json.dumps({"id": i, "config_digest": output_digest(Config())}).encode() for i in "ab")
    old = a + b"\n" + b + b'\n{"id": "c", "pa'  # resume: two records and a torn line
    if mode != "new":
        out.write_bytes(old)
    script = [sys.executable, "-c", _WRITE_UNDER_A_FILE_SIZE_LIMIT, str(out), mode, "1000"]
    proc = subprocess.run(script, env=env_with_repo(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    data = out.read_bytes()
    lines = data.split(b"\n")
    assert data.endswith(b"\n") and len(data) <= 1000
    assert all(json.loads(line) for line in lines[:-1])
    held = len(lines) - 1
    assert proc.stdout == f"cannot write {out} (File too large); {held} records written, resume with --resume\n"
    if mode == "resume":
        assert data.startswith(a + b"\n" + b + b'\n{"id": "r0"')
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl"]
    # the first record alone does not fit: OUT.new goes, an old file stays as it was
    out.write_bytes(old)
    proc = subprocess.run(script[:-2] + ["overwrite", "100"], env=env_with_repo(), capture_output=True, text=True)
    assert proc.stdout == f"cannot write {out}.new (File too large); the existing file is unchanged\n", proc.stderr
    assert out.read_bytes() == old and sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl"]

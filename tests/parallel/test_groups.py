"""``parallel.groups = D``: D LP groups of P ranks in one job, fed by one work queue.

Groups change how many prompts run at once, not what any prompt generates: every record must equal the D = 1
run's (output ids and forwards) and HF greedy. The queue itself is tested in-process on a real TCPStore; the
job paths (self-launch, torchrun, a dead group, ``--resume``) with real processes on gloo.
"""

from __future__ import annotations

import re
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import (
    JOB_PROMPTS,
    env_with_repo,
    hf_greedy_of,
    job_args,
    launch_ranks,
    read_jsonl,
    run_job,
    stop_all,
    torchrun_cmd,
    wait_for_file_lines,
    write_prompts,
)
from helpers import hf_greedy

from lp_runner.config import load_config
from lp_runner.errors import ConfigError
from lp_runner.jobs.prompts import queue_order
from lp_runner.jobs.report import job_line, percentile
from lp_runner.parallel import groups as groups_mod
from lp_runner.parallel.cores import PERIOD_S, CoreShare, shared_threads
from lp_runner.parallel.groups import (
    GroupLayout,
    Heartbeat,
    JobQueue,
    RecordCollector,
    group_layout,
    store_client,
)

PROMPTS = [
    *JOB_PROMPTS,
    {"id": "short", "prompt": "One two three"},
    {"id": "list", "prompt": "red, green, blue, red, green, blue, red,"},
]
MAX_NEW = 32

# ---------------------------------------------------------------- layout, order, config (pure)


@pytest.mark.parametrize(
    "world,rank,workers,groups,expected_group,expected_ranks",
    [
        (6, 4, 3, 2, 1, (3, 4, 5)),  # the docstring's example: rank 4 is in the second group of three
        (2, 0, 1, 2, 0, (0,)),  # D=2 x P=1: every rank its own group
        (2, 1, 1, 2, 1, (1,)),
        (4, 1, 2, 2, 0, (0, 1)),  # contiguous: ranks 0-1 then 2-3, so a group stays on one node
        (4, 2, 2, 2, 1, (2, 3)),
    ],
)
def test_group_layout_contiguous_ranks(world, rank, workers, groups, expected_group, expected_ranks):
    layout = group_layout(world, rank, workers, groups)
    assert (layout.group, layout.ranks) == (expected_group, expected_ranks)


def test_group_layout_world_size_mismatch_is_one_clear_line():
    with pytest.raises(ConfigError) as err:
        group_layout(3, 0, 1, 2)
    message = str(err.value)
    assert "\n" not in message
    assert "parallel.groups=2 x parallel.workers=1 needs 2 processes" in message and "WORLD_SIZE=3" in message


def test_queue_order_longest_first_ties_in_file_order():
    assert queue_order([10, 40, 25, 40]) == [1, 3, 2, 0]
    assert queue_order([]) == []


def test_config_groups_validated():
    assert load_config(None, []).parallel.groups == 1  # default: one group, today's job
    assert load_config(None, ["parallel.groups=3"]).parallel.groups == 3
    with pytest.raises(ConfigError, match="parallel.groups must be >= 1"):
        load_config(None, ["parallel.groups=0"])
    ray = load_config(None, ["parallel.groups=2", "parallel.backend=ray"])  # Ray runs D groups too (test_ray)
    assert ray.parallel.groups == 2


def test_job_line_worked_example():
    records = [
        {"group": 0, "seconds": 2.0, "new_tokens": 20},
        {"group": 1, "seconds": 3.0, "new_tokens": 30},
        {"group": 0, "seconds": 1.0, "new_tokens": 10},
    ]
    assert (
        job_line(records, 4.0, 2)
        == "job 4.00 s  15.00 tokens/s  latency p50 2.00 s  p90 3.00 s  groups 2: busy 75% 75%"
    )
    assert "groups" not in job_line(records, 4.0, 1)
    assert (percentile([4, 1, 3, 2], 0.5), percentile([4, 1, 3, 2], 0.9), percentile([], 0.5)) == (2, 4, 0.0)


# ---------------------------------------------------------------- the queue on a real TCPStore (one process)


@pytest.fixture
def store_env(monkeypatch):
    """A TCPStore server in this process, where ``store_client`` looks for it (MASTER_ADDR / MASTER_PORT)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setattr(groups_mod, "POLL_S", 0.02)
    yield server


def test_queue_hands_each_position_once_and_collects_records_in_posted_order(store_env):
    layout = GroupLayout(groups=2, workers=1, group=0, ranks=(0,))
    got, failures = [], []
    collector = RecordCollector(layout, expected=3, timeout_s=10, on_record=got.append, on_failure=failures.append)
    collector.start()
    q0, q1 = JobQueue(store_client(10), 0), JobQueue(store_client(10), 1)
    assert [q0.claim(), q1.claim(), q1.claim(), q0.claim(), q1.claim()] == [0, 1, 2, 3, 4]  # one counter, no repeats
    q1.post({"id": "b", "group": 1})  # group 1 finished first: written first
    q0.post({"id": "a", "group": 0})
    q1.post({"id": "c", "group": 1})
    q0.finish()
    q1.finish()
    collector.join(timeout=10)
    assert not collector.is_alive() and collector.error is None and failures == []
    assert [r["id"] for r in got] == ["b", "a", "c"]


def test_collector_names_a_failed_group(store_env):
    layout = GroupLayout(groups=2, workers=1, group=0, ranks=(0,))
    failures: list[str] = []
    collector = RecordCollector(layout, expected=2, timeout_s=10, on_record=lambda r: None, on_failure=failures.append)
    collector.start()
    JobQueue(store_client(10), 1).fail("a peer worker died or stalled during a collective (timeout)")
    collector.join(timeout=10)
    assert failures == [collector.error]
    assert collector.error.startswith("group 1 (world ranks 1-1) failed: a peer worker died")


def test_collector_ends_the_job_when_a_heartbeat_stands_still(store_env):
    """Group 0 beats (its Heartbeat thread); group 1 never does: after timeout_s the job fails, naming it."""
    layout = GroupLayout(groups=2, workers=1, group=0, ranks=(0,))
    beat = Heartbeat(0, timeout_s=10, on_failure=lambda m: None)
    beat.start()
    failures: list[str] = []
    start = time.monotonic()
    collector = RecordCollector(layout, expected=1, timeout_s=1.5, on_record=lambda r: None, on_failure=failures.append)
    collector.start()
    collector.join(timeout=10)
    beat.stop()
    assert 1.5 <= time.monotonic() - start < 8
    assert failures and "group 1 (world ranks 1-1) sent no heartbeat for 1.5 s" in failures[0]
    assert store_client(10).add("beat/0", 0) >= 1  # guard: the live group's heartbeat did move


def test_a_silent_group_is_found_while_another_keeps_posting(store_env):
    """Records arriving back to back must not keep the collector from watching the other groups."""
    layout = GroupLayout(groups=2, workers=1, group=0, ranks=(0,))
    failures: list[str] = []
    collector = RecordCollector(layout, expected=10_000, timeout_s=1.0, on_record=lambda r: None)
    collector.on_failure = failures.append
    collector.start()
    queue, beats = JobQueue(store_client(10), 0), store_client(10)
    end = time.monotonic() + 8
    while collector.is_alive() and time.monotonic() < end:
        queue.post({"id": "x", "group": 0})
        beats.add("beat/0", 1)
    collector.join(timeout=5)
    assert failures and "group 1 (world ranks 1-1) sent no heartbeat" in failures[0]


# ---------------------------------------------------------------- idle cores go to the busy groups


@pytest.mark.parametrize(
    "threads,local_ranks,idle_mask,local_rank,expected",
    [
        (1, 2, 0b10, 0, 2),  # D=2 x 1 thread: rank 1 left, rank 0 takes both cores
        (1, 2, 0b00, 0, 1),  # nobody left
        (1, 3, 0b100, 0, 2),  # 3 threads over ranks 0 and 1: the remainder to the lower rank
        (1, 3, 0b100, 1, 1),
        (4, 4, 0b0101, 3, 8),  # 16 threads over ranks 1 and 3
        (2, 2, 0b01, 0, 2),  # a rank that left keeps what it had
        (2, 2, 0b11, 1, 2),
    ],
)
def test_shared_threads(threads, local_ranks, idle_mask, local_rank, expected):
    assert shared_threads(threads, local_ranks, idle_mask, local_rank) == expected


def test_core_share_takes_the_threads_a_leaving_rank_gives_up(store_env):
    """Two ranks of one node on a real TCPStore: rank 1 leaves; rank 0 looks at most every PERIOD_S and then
    runs on both ranks' threads."""
    before = torch.get_num_threads()
    now = [0.0]
    torch.set_num_threads(1)
    try:
        busy = CoreShare(store_client(10), "node0", local_rank=0, local_ranks=2, clock=lambda: now[0])
        idle = CoreShare(store_client(10), "node0", local_rank=1, local_ranks=2, clock=lambda: now[0])
        other_node = CoreShare(store_client(10), "node1", local_rank=1, local_ranks=2, clock=lambda: now[0])
        other_node.leave()  # another node's idle rank frees nothing here
        now[0] = PERIOD_S
        busy([7])
        assert torch.get_num_threads() == 1
        idle.leave()
        now[0] += PERIOD_S / 2
        busy([7])
        assert torch.get_num_threads() == 1  # not looked yet: one store round trip per PERIOD_S at most
        now[0] += PERIOD_S / 2
        busy([7])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- real jobs (gloo)


def _args(model: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return job_args(
        model, prompts, out,
        "--set", "lookahead.window_size=7", "--set", "lookahead.ngram_size=5",
        "--set", "lookahead.verification_set_size=7",
        "--set", "lookahead.preset=off",  # this W/N/G as written, in every group alike
        # per-prompt pool: with the job store a group's proposals depend on the prompts it ran, so forwards differ
        "--set", "lookahead.pool_scope=prompt",
        *extra, max_new_tokens=MAX_NEW,
    )  # fmt: skip


@pytest.mark.slow
def test_groups_match_one_group_and_hf_greedy(tmp_path, tiny_dir):
    """D=1 (one plain process), D=2 x P=1 (self-launched: ``--set parallel.groups=2`` starts the ranks) and
    D=1 x P=2 (torchrun): the same output ids and forwards for every prompt; D=2 records name both groups."""
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    run_job(_args(tiny_dir, prompts, tmp_path / "d1.jsonl"))
    one = read_jsonl(tmp_path / "d1.jsonl")
    d2_args = _args(tiny_dir, prompts, tmp_path / "d2.jsonl", "--set", "parallel.groups=2")
    d2 = run_job(d2_args)
    two = read_jsonl(tmp_path / "d2.jsonl")
    run_job(_args(tiny_dir, prompts, tmp_path / "p2.jsonl"), torchrun=2)
    lp = read_jsonl(tmp_path / "p2.jsonl")
    by_id = {r["id"]: r for r in one}
    for rec in one:
        assert rec["output_ids"] == hf_greedy_of(tiny_dir, rec["prompt_ids"], MAX_NEW), rec["id"]
        assert rec["group"] == 0
    for records, workers in ((two, 1), (lp, 2)):
        assert sorted(r["id"] for r in records) == sorted(by_id)  # every prompt once
        for rec in records:
            assert rec["output_ids"] == by_id[rec["id"]]["output_ids"], rec["id"]
            assert rec["forwards"] == by_id[rec["id"]]["forwards"], rec["id"]
            assert rec["workers"] == workers
    assert {r["group"] for r in two} == {0, 1}  # both groups took prompts from the queue
    assert all(r["dist_backend"] == "none" for r in two)  # a one-rank group exchanges nothing
    assert sum(r["stats"]["accepted_tokens"] for r in two) > 0  # guard: lookahead candidates were accepted
    assert d2.stderr.count("tokens/forward") == 1  # one summary, by world rank 0
    assert "groups 2: busy" in d2.stderr and "latency p50" in d2.stderr


@pytest.mark.slow
def test_a_lone_prompt_takes_the_idle_groups_core_and_keeps_its_tokens(tmp_path, tiny_dir):
    """D=2 with one prompt: one group has nothing to do from the start, so the other takes its thread mid-generation
    (logged) and still generates HF greedy's tokens; with ``advanced.share_cores=false`` it keeps one thread."""
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "long", "prompt": "story 1 story 1 story 1"}])
    runs = {}
    for share in ("true", "false"):
        out = tmp_path / f"{share}.jsonl"
        args = _args(tiny_dir, prompts, out, "--set", "parallel.groups=2", "--set", f"advanced.share_cores={share}")
        args[args.index(f"generation.max_new_tokens={MAX_NEW}")] = "generation.max_new_tokens=2000"  # > PERIOD_S
        runs[share] = (run_job(args).stderr, read_jsonl(out)[0])
    (shared_err, shared), (alone_err, alone) = runs["true"], runs["false"]
    busy = shared["group"]  # whichever group claimed the prompt first; the other is idle from the start
    assert f"local rank {busy}: 1 of 2 ranks on this node have no more work; 2 threads" in shared_err
    assert "no more work" not in alone_err
    assert shared["new_tokens"] > 1000  # guard: a long generation, not an early EOS
    assert shared["output_ids"] == alone["output_ids"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    assert shared["output_ids"] == hf_greedy(model, shared["prompt_ids"], 2000, eos_ids=[2])


@pytest.mark.slow
def test_two_groups_of_two_and_resume_across_groups(tmp_path, tiny_dir):
    """D=2 x P=2 under torchrun (4 ranks on gloo), then ``--resume`` of a file cut to two records."""
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    run_job(_args(tiny_dir, prompts, tmp_path / "d1.jsonl"))
    by_id = {r["id"]: r for r in read_jsonl(tmp_path / "d1.jsonl")}
    out = tmp_path / "d2p2.jsonl"
    run_job(_args(tiny_dir, prompts, out, "--set", "parallel.groups=2", "--set", "parallel.workers=2"), torchrun=4)
    records = read_jsonl(out)
    assert sorted(r["id"] for r in records) == sorted(by_id)
    for rec in records:
        assert rec["output_ids"] == by_id[rec["id"]]["output_ids"], rec["id"]
        assert rec["workers"] == 2 and rec["dist_backend"] == "gloo"
        assert rec["stats"]["collectives"] == rec["stats"]["rounds"]  # one collective per round, in its group
    kept = out.read_text().splitlines()[:2]
    out.write_text("".join(line + "\n" for line in kept))
    run_job(_args(tiny_dir, prompts, out, "--resume", "--set", "parallel.groups=2"))
    resumed = read_jsonl(out)
    assert [r["id"] for r in resumed[:2]] == [r["id"] for r in records[:2]]  # kept as they were
    assert sorted(r["id"] for r in resumed) == sorted(by_id)  # the rest once each
    for rec in resumed:
        assert rec["output_ids"] == by_id[rec["id"]]["output_ids"], rec["id"]


@pytest.mark.slow
def test_world_size_mismatch_is_one_line(tmp_path, tiny_dir):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])
    args = _args(tiny_dir, prompts, tmp_path / "o.jsonl", "--set", "parallel.groups=2")
    proc = subprocess.run(torchrun_cmd(3, *args), env=env_with_repo(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    # every rank finds the mismatch; whichever exits first, torchrun stops the others before they print (seen
    # under load: rank 1's line, ranks 0 and 2 stopped by the launcher), so the line may name any rank
    assert re.search(
        r"error: \[rank [0-2]\] parallel\.groups=2 x parallel\.workers=1 needs 2 processes but the launcher "
        r"started WORLD_SIZE=3; start 2 ranks or change parallel\.groups/workers",
        proc.stderr,
    ), proc.stderr


@pytest.mark.slow
def test_dead_group_ends_the_job_within_the_timeout(tmp_path, tiny_dir):
    """Ranks started by hand (no torchrun agent to stop the others): group 1's only rank is killed mid-job;
    rank 0 must fail with exit 3 within about parallel.timeout_s, naming the group, with its records on disk."""
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": f"story {i} " * 5} for i in range(60)])
    out = tmp_path / "o.jsonl"
    args = _args(tiny_dir, prompts, out, "--set", "parallel.groups=2", "--set", "parallel.timeout_s=5")
    args[args.index(f"generation.max_new_tokens={MAX_NEW}")] = "generation.max_new_tokens=200"
    procs = launch_ranks(2, [args, args])
    try:
        assert wait_for_file_lines(out, 2, timeout=120), procs[0].stderr.read() if procs[0].poll() is not None else ""
        killed = time.monotonic()
        procs[1].kill()
        code = procs[0].wait(timeout=60)
        took = time.monotonic() - killed
        err = procs[0].stderr.read()
    finally:
        stop_all(procs)
    assert code == 3, err[-2000:]
    assert took < 5 + 10, took  # timeout_s, plus a heartbeat period and the collector's polling
    assert "group 1 (world ranks 1-1) sent no heartbeat for 5 s (parallel.timeout_s)" in err
    assert len(read_jsonl(out)) >= 2  # what was written before the loss stays (for --resume)


@pytest.mark.slow
def test_two_groups_sample_as_one_and_write_error_records_once(tmp_path, tiny_dir):
    """Sampling streams are keyed by prompt id, so D=2 samples every prompt as D=1 does whichever group runs it;
    a prompt too long for the model becomes one error record (``run.on_error=skip``), written by rank 0 with no
    group, and no group generates it."""
    prompts = write_prompts(tmp_path / "p.jsonl", [*PROMPTS, {"id": "long", "prompt": "word " * 5000}])
    sampling = ("--set", "generation.do_sample=true", "--set", "generation.seed=5", "--set", "run.on_error=skip")
    run_job(_args(tiny_dir, prompts, tmp_path / "d1.jsonl", *sampling))
    args = _args(tiny_dir, prompts, tmp_path / "d2.jsonl", *sampling, "--set", "parallel.groups=2")
    proc = run_job(args)
    one = {r["id"]: r for r in read_jsonl(tmp_path / "d1.jsonl")}
    two = read_jsonl(tmp_path / "d2.jsonl")
    assert sorted(r["id"] for r in two) == sorted(one)
    assert two[0]["id"] == "long" and two[0]["group"] is None and two[0]["error"] == one["long"]["error"]
    for rec in two[1:]:
        assert rec["do_sample"] and rec["output_ids"] == one[rec["id"]]["output_ids"], rec["id"]
    assert "1 error records (run.on_error=skip)" in proc.stderr

"""Lookahead Parallelism: real torchrun processes on gloo, against P = 1 and HF greedy generate (fp32).

LP changes latency, not the algorithm: for every P the output ids must equal HF greedy, and the number of
target forwards (hence tokens per forward) must equal the single worker's.
"""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import time
from itertools import combinations
from pathlib import Path

import pytest
import torch
from dist_helpers import (
    JOB_PROMPTS,
    LocalGroup,
    env_with_repo,
    hf_greedy_of,
    job_args,
    launch_ranks,
    lp_runner_cmd,
    make_tiny_folder,
    read_jsonl,
    run_job,
    stop_all,
    torchrun_cmd,
    wait_for_file_lines,
    write_prompts,
)
from helpers import random_prompt, tiny_model

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.config import GenerationConfig, LookaheadConfig
from lp_runner.decoding.engine import LookaheadEngine
from lp_runner.decoding.metrics import GenerationStats
from lp_runner.parallel.comm import SoloCommunicator
from lp_runner.parallel.exchange import Entry, agree_batch, pack_values, winner
from lp_runner.parallel.sharding import assign_candidates, column_blocks, lookahead_rows

PROMPTS = JOB_PROMPTS


# ---------------------------------------------------------------- sharding (pure)


def _brute_force_best(w: int, p: int, depth: int) -> int:
    best = None
    for cuts in combinations(range(w + 1), p - 1) if p > 1 else [()]:
        bounds = [0, *cuts, w]
        if any(bounds[i] > bounds[i + 1] for i in range(p)):
            continue
        cost = max(lookahead_rows((bounds[i], bounds[i + 1]), depth) for i in range(p))
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("w,p,depth", [(7, 2, 3), (15, 2, 3), (15, 3, 3), (5, 3, 1), (2, 3, 2), (1, 2, 3), (9, 4, 0)])
def test_column_blocks_cover_window_and_are_optimal(w, p, depth):
    blocks = column_blocks(w, p, depth)
    assert len(blocks) == p
    assert blocks[0][0] == 0 and blocks[-1][1] == w  # contiguous cover of [0, W)
    assert all(blocks[i][1] == blocks[i + 1][0] for i in range(p - 1))
    assert max(lookahead_rows(b, depth) for b in blocks) == _brute_force_best(w, p, depth)


def test_column_blocks_worked_example_and_w_below_p():
    assert column_blocks(7, 2, 3) == ((0, 4), (4, 7))  # 3+12 = 15 rows and 6+9 = 15 rows
    blocks = column_blocks(2, 3, 3)  # W < P: one rank gets no columns
    assert sum(hi > lo for lo, hi in blocks) == 2 and blocks[-1][0] == blocks[-1][1]


def _column_blocks_by_scan(w: int, p: int, depth: int) -> tuple[tuple[int, int], ...]:
    """The earlier column_blocks, which scanned every split point (W^2 per rank): the reference for its choices."""
    inf = float("inf")
    best = [[inf] * (w + 1) for _ in range(p + 1)]
    choice = [[0] * (w + 1) for _ in range(p + 1)]
    best[0][0] = 0
    for r in range(1, p + 1):
        for j in range(w + 1):
            for i in range(j, -1, -1):
                if best[r - 1][i] == inf:
                    continue
                cost = max(best[r - 1][i], lookahead_rows((i, j), depth))
                if cost < best[r][j]:
                    best[r][j], choice[r][j] = cost, i
    blocks, j = [], w
    for r in range(p, 0, -1):
        blocks.append((choice[r][j], j))
        j = choice[r][j]
    return tuple(reversed(blocks))


def test_column_blocks_choose_as_the_full_scan_did():
    """The linear-time programme makes every choice the W^2 scan made, ties included (which ranks get the wider
    blocks decides which rank's rows a round pads), on every W, P and depth of a grid past any setting in use."""
    column_blocks.cache_clear()
    for w in range(0, 41):
        for p in range(1, 10):
            for depth in range(0, 7):
                assert column_blocks(w, p, depth) == _column_blocks_by_scan(w, p, depth), (w, p, depth)
    for w, p, depth in [(64, 3, 4), (97, 5, 2), (128, 8, 3), (200, 2, 0), (150, 16, 1)]:
        assert column_blocks(w, p, depth) == _column_blocks_by_scan(w, p, depth), (w, p, depth)


def test_column_blocks_grow_linearly_with_the_window(monkeypatch):
    """lookahead.window_size=100000 kept the W^2 scan at 100% CPU for minutes before any forward: the programme
    prices O(P x W) blocks (counted, so the bound does not depend on this machine's speed), and W = 100000 over
    4 ranks is answered at once."""
    from lp_runner.parallel import sharding

    calls = [0]

    def counted(block: tuple[int, int], depth: int) -> int:
        calls[0] += 1
        return lookahead_rows(block, depth)

    monkeypatch.setattr(sharding, "lookahead_rows", counted)
    column_blocks.cache_clear()
    for w in (100, 1000, 4000):
        calls[0] = 0
        column_blocks(w, 4, 3)
        assert calls[0] <= 4 * 4 * (w + 1), (w, calls[0])  # the scan: 4 x W^2 / 2
    monkeypatch.undo()
    blocks = column_blocks(100_000, 4, 3)
    assert blocks[0][0] == 0 and blocks[-1][1] == 100_000 and len(blocks) == 4


@pytest.mark.parametrize(
    "lengths,base,expected",
    [
        ([4] * 5, [10, 4], [[2, 4], [0, 1, 3]]),  # docstring example: loads 18 and 16
        ([], [10, 4], [[], []]),  # no candidates: nothing assigned
        ([2], [3, 3, 3], [[0], [], []]),  # fewer candidates than ranks: ties go to the lowest rank
        ([4, 4, 4], [0, 0, 0], [[0], [1], [2]]),
        ([10, 4, 4], [0, 0], [[0], [1, 2]]),  # a long context candidate weighs its length
    ],
)
def test_assign_candidates(lengths, base, expected):
    assert assign_candidates(lengths, base) == expected


def test_assign_candidates_keeps_groups_on_one_rank():
    out = assign_candidates([3] * 4, [0, 0], groups=[7, 8, 7, 8])  # groups by first token
    assert sorted(map(sorted, out)) == [[0, 2], [1, 3]]


def test_exchange_roundtrip_and_winner_ties_to_lowest_rank():
    """Every rank's block read back as it was packed (through the round's agreement), and equal hits go to the
    lowest rank."""

    class Gathered(SoloCommunicator):
        rank = 0

        def __init__(self, *others):
            super().__init__()
            self.others, self.world_size = others, 1 + len(others)

        def all_gather(self, payload):
            return torch.stack([payload, *(torch.tensor(o, dtype=torch.long) for o in self.others)])

    seen = []

    def choose(reports):
        seen.append(reports)
        return winner(reports)

    b = pack_values(2, (5, 6, 8), 99, 3, {2: 13, 3: 14}, max_emit=5, w=4)
    a = Entry(99, 2, (5, 6, 7), 0, {0: 11, 1: 12}, max_emit=5, window_size=4, choose=choose)
    (d,) = agree_batch(Gathered(b), [a])
    reports = seen[-1]
    assert reports[1].emitted == (5, 6, 8) and reports[1].columns == {2: 13, 3: 14}
    assert reports[1].candidate == 3 and reports[0].plan_digest == 99
    assert d.rank == 0 and d.won  # equal hits: lowest rank
    c = pack_values(3, (1, 2, 3, 4), 99, -1, {}, max_emit=5, w=4)
    (d,) = agree_batch(Gathered(b, c), [a])
    assert (d.rank, d.emitted, d.candidate, d.won) == (2, (1, 2, 3, 4), -1, False)


def test_set_rank_rows_sums_each_rank_and_the_busiest_round_by_round():
    """Table of intent: the busiest rank's rows are the largest of each round's, summed, so they exceed every
    rank's total when the busiest rank changes from round to round, and equal the only rank's alone."""
    cases = [
        ([[5, 3, 3], [4, 6, 2]], [11, 12], 14),  # rank 0 busiest in rounds 1 and 3, rank 1 in round 2
        ([[4, 4], [2, 1]], [8, 3], 8),  # rank 0 always the busiest: its own total
        ([[7, 1, 2]], [10], 10),  # one rank: its rows
    ]
    for per_rank, totals, busiest in cases:
        stats = GenerationStats()
        stats.set_rank_rows(per_rank)
        assert (stats.rank_rows, stats.busiest_rows) == (totals, busiest), per_rank


def test_every_ranks_rows_reach_each_generation_once_it_ends():
    """P = 2 ranks on threads (``LocalGroup``), two prompts one after the other, window 7-5-7: on every rank each
    generation's stats carry each rank's rows of its rounds, equal to what that rank recorded itself, and the
    busiest rank's rows round by round, gathered in one all_gather per generation (the rounds' own stay one
    each). Guard: rank 1 ran more rows than rank 0 in some round, so rank 0's rows alone would under-count."""
    stock = tiny_model("llama")
    prompts = [random_prompt(12, 0), random_prompt(30, 1)]
    group = LocalGroup(2)
    la = LookaheadConfig(window_size=7, ngram_size=5, verification_set_size=7)

    def work(rank: int) -> tuple:
        replica = copy.deepcopy(stock)  # each rank its own model, as each process has
        engine = LookaheadEngine(ModelAdapter(replica), la, GenerationConfig(max_new_tokens=32), [], group.comm(rank))
        return [engine.generate(p).stats for p in prompts], engine.comm.collectives

    (stats0, collectives0), (stats1, collectives1) = group.run_ranks(work, timeout=300)
    rounds = sum(s.rounds for s in stats0)
    assert collectives0 == collectives1 == rounds + len(prompts)
    rank1_busier = False
    for s0, s1 in zip(stats0, stats1, strict=True):
        own = [[rec.rows for rec in s.records] for s in (s0, s1)]  # [rank][round], as each rank recorded it
        assert s0.rank_rows == s1.rank_rows == [sum(own[0]), sum(own[1])]
        assert s0.busiest_rows == s1.busiest_rows == sum(max(a, b) for a, b in zip(*own, strict=True))
        assert s0.summary()["mean_busiest_rows"] == round(s0.busiest_rows / s0.rounds, 2)
        rank1_busier |= any(b > a for a, b in zip(*own, strict=True))
    assert rank1_busier


# ---------------------------------------------------------------- real torchrun runs


def _run_torchrun(nproc: int, model: Path, prompts: Path, out: Path, wng, extra=(), timeout=300):
    w, n, g = wng
    wng_args = (
        "--set", f"lookahead.window_size={w}", "--set", f"lookahead.ngram_size={n}",
        "--set", f"lookahead.verification_set_size={g}",
        "--set", "lookahead.preset=off",  # this W/N/G with its window, not what the device's curve would choose
    )  # fmt: skip
    proc = run_job(job_args(model, prompts, out, *wng_args, *extra, max_new_tokens=48), torchrun=nproc, timeout=timeout)
    return read_jsonl(out), proc


@pytest.mark.slow
@pytest.mark.parametrize("wng", [(7, 5, 7), (2, 4, 3), (5, 3, 0)], ids=["W7N5G7", "W2N4G3-W<P", "W5N3G0"])
def test_lp_matches_single_worker_andhf_greedy_of(tmp_path, tiny_dir, wng):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    results = {}
    for nproc in (1, 2, 3):
        records, proc = _run_torchrun(nproc, tiny_dir, prompts, tmp_path / f"out{nproc}.jsonl", wng)
        results[nproc] = records
        assert all(r["workers"] == nproc for r in records)
        assert all(r["dist_backend"] == "gloo" for r in records)  # a launched job forms its group even at P=1
        device = records[0]["run"]["device"]  # model.dtype auto on a CPU; every rank's peak host memory at load
        assert (device["dtype"], device["tf32"], device["dtype_choice"]) == ("float32", False, "auto: float32 on a CPU")
        assert len(device["load_peak_host_mib_ranks"]) == nproc and min(device["load_peak_host_mib_ranks"]) > 0
        assert "tokens/forward" in proc.stderr  # the summary is printed (by rank 0 only)
        assert proc.stderr.count("tokens/forward") == 1
    for rec in results[1]:
        assert rec["output_ids"] == hf_greedy_of(tiny_dir, rec["prompt_ids"], 48), rec["id"]
    for nproc in (2, 3):
        for single, multi in zip(results[1], results[nproc], strict=True):
            assert multi["output_ids"] == single["output_ids"], (nproc, single["id"])
            assert multi["forwards"] == single["forwards"], (nproc, single["id"])  # same tokens per forward
            assert multi["stats"]["collectives"] == multi["stats"]["rounds"]  # one collective per round
    if wng[2] > 0:  # guard: candidates were verified and accepted, so LP's winner selection was exercised
        assert sum(r["stats"]["accepted_tokens"] for r in results[2]) > 0
    if wng == (7, 5, 7):  # (W2N4G3 here: rank 1 never holds a strictly longer hit; ties go to rank 0)
        # ranks other than 0 won rounds and the others adopted their tokens (the outputs above are exact)
        other_wins = sum(n for r in results[2] for rank, n in r["stats"]["wins_by_rank"].items() if rank != "0")
        assert other_wins > 0, [r["stats"]["wins_by_rank"] for r in results[2]]
    assert all(set(r["stats"]["wins_by_rank"]) == {"0"} for r in results[1])  # P = 1: the only rank wins
    for nproc, records in results.items():
        for r in records:  # every rank's rows, gathered once the generation ended (P = 1: the one rank's)
            st = r["stats"]
            assert len(st["rank_rows"]) == nproc and st["rank_rows"][0] == st["rows"], (nproc, r["id"])
            assert max(st["rank_rows"]) <= st["busiest_rows"] <= sum(st["rank_rows"]), (nproc, r["id"])
            assert min(st["rank_rows"]) > 0  # every rank ran rows (each re-feeds or feeds the live key)


@pytest.mark.slow
def test_lp_embedded_model_matcheshf_greedy_of(tmp_path):
    from lp_runner.models.loading import embedded_model_dir, fetch_embedded_model

    fetch_embedded_model()
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        [
            {"id": "fib", "prompt": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'},
            {"id": "chat", "messages": [{"role": "user", "content": "Explain what a hash map is."}]},
        ],
    )
    records, _ = _run_torchrun(2, Path("embedded"), prompts, tmp_path / "o.jsonl", (15, 5, 15))
    for rec in records:
        assert rec["output_ids"] == hf_greedy_of(embedded_model_dir(), rec["prompt_ids"], 48), rec["id"]
    assert sum(r["stats"]["accepted_tokens"] for r in records) > 0


# ---------------------------------------------------------------- failures: never hang


def _many_prompts(tmp_path: Path) -> Path:
    return write_prompts(tmp_path / "many.jsonl", [{"id": str(i), "prompt": f"Item {i}:"} for i in range(400)])


def _worker_pids(torchrun_pid: int) -> dict[int, int]:
    """rank -> pid of the workers that torchrun started."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(torchrun_pid)], capture_output=True, text=True).stdout
    ranks = {}
    for pid in map(int, out.split()):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                ranks[int(item[5:])] = pid
    return ranks


@pytest.mark.slow
def test_killed_worker_ends_job_with_clear_message(tmp_path, tiny_dir):
    out = tmp_path / "o.jsonl"
    args = [
        "--prompts", str(_many_prompts(tmp_path)), "--output", str(out), "--set", f"model.path={tiny_dir}",
        "--set", "generation.max_new_tokens=200", "--set", "model.threads=1", "--set", "parallel.timeout_s=20",
        "--set", "advanced.progress=false",
    ]  # fmt: skip
    proc = subprocess.Popen(torchrun_cmd(2, *args), env=env_with_repo(), stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for_file_lines(out, 2, timeout=120), "generation never started"
        os.kill(_worker_pids(proc.pid)[1], signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        stop_all([proc])
    assert proc.returncode != 0
    assert elapsed < 30  # loose bound: within the 20 s collective timeout plus launcher teardown
    # Either rank 0's next collective finds the peer gone and says so, or torchrun's agent, which polls its
    # ranks, stops rank 0 first (SIGTERM between two collectives) and names the dead rank as the root cause.
    rank0_saw_it = "error: [rank 0] a peer worker died or stalled during a collective" in err
    launcher_saw_it = "Root Cause (first observed failure)" in err and re.search(
        r"rank\s*: 1 \(local_rank: 1\)\s*\n\s*exitcode\s*: -9", err
    )
    assert rank0_saw_it or launcher_saw_it, err[-3000:]
    assert len(read_jsonl(out)) >= 2  # records written before the failure are kept


@pytest.mark.slow
def test_stalled_worker_fails_within_timeout(tmp_path, tiny_dir):
    out = tmp_path / "o.jsonl"
    common = [
        "--prompts", str(_many_prompts(tmp_path)), "--set", f"model.path={tiny_dir}",
        "--set", "generation.max_new_tokens=200", "--set", "model.threads=1", "--set", "parallel.timeout_s=8",
        "--set", "advanced.progress=false",
    ]  # fmt: skip
    procs = launch_ranks(2, [[*common, "--output", str(out)], common])
    try:
        assert wait_for_file_lines(out, 2, timeout=120), "generation never started"
        procs[1].send_signal(signal.SIGSTOP)  # alive but silent: only the collective timeout can catch it
        stopped_at = time.monotonic()
        _, err = procs[0].communicate(timeout=60)
        elapsed = time.monotonic() - stopped_at
    finally:
        stop_all(procs)
    assert procs[0].returncode == 3
    assert 6 < elapsed < 30  # the configured 8 s timeout, loosely
    assert "error: [rank 0] a peer worker died or stalled during a collective" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_config_mismatch_between_ranks_is_detected(tmp_path, tiny_dir):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])
    base = ["--prompts", str(prompts), "--set", f"model.path={tiny_dir}", "--set", "parallel.timeout_s=60"]
    procs = launch_ranks(2, [[*base, "--set", "lookahead.window_size=7"], [*base, "--set", "lookahead.window_size=8"]])
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        stop_all(procs)
    assert all(p.returncode == 3 for p in procs)
    assert "config mismatch between ranks: ranks [1] differ from rank 0" in errs[0]


@pytest.mark.slow
def test_weights_mismatch_between_ranks_is_detected(tmp_path, tiny_dir):
    other = make_tiny_folder(tmp_path / "other", "llama", seed=4)
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])
    base = ["--prompts", str(prompts), "--set", "parallel.timeout_s=60"]
    # Same config text on both ranks (model.path=model), resolved in each rank's own folder to other weights.
    procs_args = []
    for rank, target in enumerate((tiny_dir, other)):
        d = tmp_path / f"rank{rank}"
        d.mkdir()
        (d / "model").symlink_to(target)
        procs_args.append([*base, "--set", "model.path=model"])
    procs = [
        subprocess.Popen(
            lp_runner_cmd(*args),
            cwd=tmp_path / f"rank{r}",
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, (args, env) in enumerate(zip(procs_args, _rank_envs(2), strict=True))
    ]
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        stop_all(procs)
    assert all(p.returncode == 3 for p in procs)
    assert "model weights differ between ranks: ranks [1] differ from rank 0" in errs[0]


def _rank_envs(world: int) -> list[dict[str, str]]:
    from dist_helpers import free_port

    port = free_port()
    return [
        env_with_repo(
            RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
        for r in range(world)
    ]

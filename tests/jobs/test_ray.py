"""Ray backend on a REAL local Ray cluster: same outputs as the single worker and HF greedy, and it survives a lost
worker.

The module fixture starts a head (`ray start --head --block`, loopback dashboard, 2 CPUs, no GPU) in its own
process session and stops exactly that session afterwards. Jobs go through Ray's job submission API with the
repo as working_dir; the head runs without the repo on its PYTHONPATH, so actors import lp_runner only from what
the job (or the driver's py_modules) ships, as on a remote cluster.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("ray") is None:  # not imported here: the cluster fixture sets Ray's auth env first
    pytest.skip("ray is not installed: pip install 'lp_runner[ray]'", allow_module_level=True)

from dist_helpers import (
    JOB_PROMPTS,
    REPO,
    default_sigint,
    env_with_repo,
    free_port,
    hf_greedy_of,
    job_args,
    lp_runner_cmd,  # noqa: E402
    read_jsonl,
    run_job,
    write_prompts,
)

from lp_runner.config import load_config  # noqa: E402
from lp_runner.jobs.ray import parse_resources, placeable, shortfall, worker_bundle  # noqa: E402

PROMPTS = JOB_PROMPTS
# The kill tests: enough work that a kill after the second record lands mid-run (seconds of it remain).
# long enough that a job of MANY prompts is still running when a test's kill lands (the state API takes a moment to
# list the actors; a 48-token job of the tiny model finished in 1.9 s once the native kernels ran it)
MANY, MANY_TOKENS = 40, 160
# Fields that measure time or placement rather than what was generated.
TIMING = {"seconds", "tokens_per_s", "stats", "workers", "recovery", "dist_backend"}  # timing and placement
# The setting that ran: the auto preset chooses it from each process's own device calibration and adapts it from
# prompt to prompt, so it may differ between runs and processes; the tokens may not.
TIMING |= {"policy", "window_size", "ngram_size", "verification_set_size", "pool_from_prompt"}
TIMING |= {"run"}  # the run's whole config (backend, workers), versions and device: not what it generated
RAY_PORT_FLAGS = (
    "port", "dashboard-port", "node-manager-port", "object-manager-port", "ray-client-server-port",
    "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
)  # fmt: skip


# ---------------------------------------------------------------- fixtures

CLUSTER_TOKEN = secrets.token_hex(32)  # this test process's clusters' token


@pytest.fixture(scope="module")
def cluster():
    """A one-node Ray cluster on loopback; token auth with a secret of this test run only (not ~/.ray). Every
    cluster of one process takes the same secret (``CLUSTER_TOKEN``): Ray's client reads the token once per process,
    so a second module's cluster with a new one refused this process's calls."""
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": CLUSTER_TOKEN, "RAY_USAGE_STATS_ENABLED": "0"}
    saved = {k: os.environ.get(k) for k in auth}
    os.environ.update(auth)  # this process's clients (job submission, state API) and every child
    if "ray" in sys.modules:  # imported before the auth env was set: refresh the cached mode, as Ray itself does
        with contextlib.suppress(Exception):
            from ray._raylet import Config

            Config.initialize("")
    from ray.job_submission import JobSubmissionClient

    ports = {flag: free_port() for flag in RAY_PORT_FLAGS}
    temp = tempfile.mkdtemp(prefix="lpray", dir="/tmp")  # short: Ray's socket paths live under it
    head_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no lp_runner unless shipped
    cmd = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--num-cpus=2", "--num-gpus=0",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--temp-dir={temp}", "--disable-usage-stats",
        *(f"--{flag}={port}" for flag, port in ports.items()),
    ]  # fmt: skip
    log = open(Path(temp) / "head.log", "w")  # noqa: SIM115 - closed in the finalizer
    head = subprocess.Popen(cmd, env=head_env, cwd=temp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                client = JobSubmissionClient(url)
                client.list_jobs()
                break
            except Exception as exc:
                if head.poll() is not None or time.monotonic() > deadline:
                    log_text = (Path(temp) / "head.log").read_text()[-1500:]
                    raise RuntimeError(f"Ray head did not answer ({str(exc)[:500]}): {log_text}") from None
                time.sleep(0.5)
        yield SimpleNamespace(client=client, url=url, gcs=f"127.0.0.1:{ports['port']}")
    finally:
        _stop_session(head)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _stop_session(head: subprocess.Popen) -> None:
    """Stop the head's process session (gcs, raylet, dashboard, workers) by its id: not `ray stop`, which would
    stop every Ray process on this shared machine."""
    for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, sig)
        end = time.monotonic() + wait
        while time.monotonic() < end and _session_alive(head.pid):
            time.sleep(0.2)
        if not _session_alive(head.pid):
            break
    head.wait(timeout=10)


def _session_alive(sid: int) -> bool:
    out = subprocess.run(["ps", "-o", "stat=", "-s", str(sid)], capture_output=True, text=True).stdout.split()
    return any(not stat.startswith("Z") for stat in out)


# ---------------------------------------------------------------- helpers


# The setting as written (no auto preset): each process would otherwise choose its own from its own calibration,
# and Ray's P ranks and the single worker must run the same setting for their forwards to be compared.
AS_WRITTEN = "lookahead.preset=off"


def _args(model: Path | str, prompts: Path, out: Path, max_new: int = 48, *extra: str) -> list[str]:
    return job_args(model, prompts, out, "--set", AS_WRITTEN, *extra, max_new_tokens=max_new)


def _ray_args(workers: int) -> list[str]:
    return ["--set", "parallel.backend=ray", "--set", f"parallel.workers={workers}", "--set", "parallel.timeout_s=30"]


def _cli(args: list[str], timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return run_job(args, timeout=timeout, check=False, **env)


def _start_cli(cluster, args: list[str]) -> subprocess.Popen:
    """``python -m lp_runner ARGS`` against the cluster, in the background (a test acts on it while it runs)."""
    return subprocess.Popen(
        lp_runner_cmd(*args),
        env=env_with_repo(RAY_ADDRESS=cluster.gcs),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _submit(cluster, args: list[str], timeout: float = 240) -> str:
    """Submit ``python -m lp_runner ARGS`` as a Ray job with the repo as working_dir; returns the job's logs."""
    from ray.job_submission import JobStatus

    entrypoint = " ".join([sys.executable, "-m", "lp_runner", *(shlex.quote(a) for a in args)])
    job = cluster.client.submit_job(entrypoint=entrypoint, runtime_env={"working_dir": str(REPO)})
    deadline = time.monotonic() + timeout
    while (status := cluster.client.get_job_status(job)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED}:
        assert status != JobStatus.STOPPED and time.monotonic() < deadline, f"job {job}: {status}"
        time.sleep(0.5)
    logs = cluster.client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    return logs


def _same_generation(a: list[dict], b: list[dict], ignore: frozenset[str] = frozenset()) -> None:
    """Same JSONL records, timing and placement aside (``ignore``: more fields to leave out)."""
    assert len(a) == len(b)
    skip = TIMING | ignore
    for x, y in zip(a, b, strict=True):
        assert {k: v for k, v in x.items() if k not in skip} == {k: v for k, v in y.items() if k not in skip}


def _uninterrupted(model: Path, specs_path: Path, max_new: int) -> list[dict]:
    """The single-worker records, computed in this process (what an uninterrupted run writes)."""
    from lp_runner.jobs.prompts import read_prompts
    from lp_runner.jobs.worker import run_prompts, start_worker

    cfg = load_config(
        None, [f"model.path={model}", f"generation.max_new_tokens={max_new}", "model.threads=1", AS_WRITTEN]
    )
    worker = start_worker(cfg)
    return run_prompts(worker, worker.prepare(read_prompts(specs_path)))


# ---------------------------------------------------------------- pure parts


def test_resources_bundle_and_capacity():
    par = load_config(None, ["advanced.resources_per_worker=accel=0.5, mem=2"]).parallel
    assert parse_resources(par.resources_per_worker) == {"accel": 0.5, "mem": 2.0}
    assert worker_bundle(par, cluster_gpus=0, device="auto") == {"CPU": 1.0, "accel": 0.5, "mem": 2.0}
    assert worker_bundle(par, cluster_gpus=8, device="auto")["GPU"] == 1.0  # auto: one GPU each on a GPU cluster
    assert "GPU" not in worker_bundle(par, cluster_gpus=8, device="cpu")  # a CPU model reserves no GPU
    nodes = [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 2.0}]
    assert placeable(nodes, {"CPU": 1.0, "GPU": 1.0}) == 2  # the second node has no GPU
    assert placeable(nodes, {"CPU": 3.0}) == 2  # 2 on the first node, none on the second
    assert shortfall(nodes, {"CPU": 1.0, "GPU": 1.0}, 3) == "GPU: 3 needed (1 per worker), 2 in the cluster"
    assert "no node holds a whole worker" in shortfall([{"CPU": 1.0}, {"GPU": 1.0}], {"CPU": 1.0, "GPU": 1.0}, 1)
    with pytest.raises(Exception, match="name=amount"):
        parse_resources("accel")


def _driver(overrides: list[str], prompts: int, order: list[int]):
    """A driver's bookkeeping without a cluster: the job's queue is the queue actor's own class, held in this
    process, and ``order`` the queue order a started group would have reported."""
    from lp_runner.jobs.prompts import PromptSpec
    from lp_runner.jobs.ray import _Driver, _Queue

    specs = [PromptSpec(id=f"p{i}", prompt="x") for i in range(prompts)]
    # no progress bar: its line reads a whole record's figures, and these records are the bookkeeping's alone
    cfg = load_config(None, [*overrides, "advanced.progress=false"])
    driver = _Driver(None, cfg, specs, None, single=False)
    driver.queue, driver.order = _Queue(), order
    return driver


def test_a_loss_after_the_lanes_claims_were_written_is_still_a_recovery(caplog):
    """The race the killed-group test can land in: the actor dies after rank 0 reported every record it claimed
    (between its last poll and the end of ``run``). The lane rebuilds its group all the same, so the loss counts
    against ``advanced.max_restarts`` and is reported on the next prompt the lane claims (from token 0); with the
    queue empty it is only a warning. ``group=None``: nothing to drain."""
    from lp_runner.errors import DistributedError

    driver = _driver(["parallel.groups=2", "advanced.max_restarts=1"], 3, order=[2, 0, 1])  # p2 the longest
    assert driver._claim(0) == 0 and driver._claim(1) == 1  # lane 0 holds p2, lane 1 p0
    driver.progress.committed[2] = [5, 6]
    driver.progress.records[0] = {"id": "p0"}  # lane 1's prompt was written before its actor died
    loss = driver._recover(None, 1, "worker rank 0 was lost", 1)
    assert driver._in_flight(1) == [1] and driver.recoveries == [loss]  # the lane's next prompt: p1
    (event,) = driver.progress.recovery[1]
    assert loss == [event] and event["lost"] == "group 1: worker rank 0 was lost" and event["resumed_at_token"] == 0
    assert "its claim was written; starting prompt 'p1' at token 0 (recovery 1/1)" in caplog.text
    with pytest.raises(DistributedError, match="gave up after 1 recoveries .* group 0: worker rank 0 was lost"):
        driver._recover(None, 0, "worker rank 0 was lost", 1)  # a held prompt, over the bound
    driver.progress.records[1] = {"id": "p1"}
    assert driver._recover(None, 1, "worker rank 0 was lost", 1) is None  # written, queue empty
    assert len(driver.recoveries) == 1 and "nothing left to run" in caplog.text


def test_a_lost_group_resumes_each_prompt_it_had_in_flight(caplog):
    """A lane whose group keeps several prompts in flight (``run.batch`` 3) when the group is lost: the prompts
    already written stay written, every other one the lane claimed is run again by the rebuilt group, and each that
    had committed a round gets its own recovery event at its own prefix, all of one loss (one recovery counted).
    The other lane's claims are not touched. The bookkeeping alone, as if rank 0's messages had been taken."""
    from lp_runner.jobs.report import resumed_prompts

    driver = _driver(["parallel.groups=2", "run.batch=3", "advanced.max_restarts=2"], 6, order=[0, 1, 2, 3, 4, 5])
    claims = [driver._claim(lane) for lane in (0, 0, 1, 0)]  # lane 0: p0 p1 p3; lane 1: p2
    assert claims == [0, 1, 2, 3]
    driver._take([("tokens", 0, [7, 8]), ("tokens", 1, [9]), ("record", 1, {"id": "p1", "prompt_ids": [1],
                  "output_ids": [9]}), ("tokens", 0, [6])], 0)  # fmt: skip
    # p3 joined the batch but committed no round before the loss
    loss = driver._recover(None, 0, "worker rank 1 was lost", 2)
    assert driver._in_flight(0) == [0, 3] and driver._in_flight(1) == [2]  # p1 is written: not run again
    assert [(e["prompt"], e["resumed_at_token"], e["rounds_before"]) for e in loss] == [("p0", 3, 2)]
    assert driver.recoveries == [loss] and driver.progress.recovery == {0: loss}
    assert driver.lane_finished[0] == [([1], [9])]  # the rebuilt group's store starts from the lane's records
    assert "group 0: worker rank 1 was lost; resuming prompt 'p0' at token 3 (recovery 1/2)" in caplog.text
    # a second loss splits both: one recovery, two events
    driver._take([("tokens", 0, [5]), ("tokens", 3, [4, 3])], 0)
    loss = driver._recover(None, 0, "worker rank 0 was lost", 2)
    assert driver._in_flight(0) == [0, 3] and len(driver.recoveries) == 2 and len(loss) == 2
    assert resumed_prompts(loss) == "prompts 'p0' at token 4, 'p3' at token 2"
    assert [len(driver.progress.recovery[i]) for i in (0, 3)] == [2, 1]


def test_missing_ray_is_a_clear_error(monkeypatch, capsys, tmp_path):
    from lp_runner.cli.main import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError, as when not installed
    assert main(["--prompt", "hi", "--set", "parallel.backend=ray", "--output", str(tmp_path / "o.jsonl")]) == 2
    assert capsys.readouterr().err == "error: parallel.backend=ray needs ray: pip install 'lp_runner[ray]'\n"


def test_resume_from_committed_prefix_gives_the_same_record(tiny_dir):
    """What recovery relies on: a generation resumed from any committed prefix ends exactly as the uninterrupted
    one, and its streamed text continues where the shown text stopped."""
    from lp_runner.jobs.prompts import PromptSpec
    from lp_runner.jobs.worker import run_prompts, start_worker

    # the lookahead shape as configured, not the auto preset's: that follows this machine's measured cost curve,
    # which for a tiny model's sub-millisecond forwards is noise and may choose no candidates at all (G=0)
    overrides = [f"model.path={tiny_dir}", "generation.max_new_tokens=40", "model.threads=1", "lookahead.preset=off"]
    worker = start_worker(load_config(None, overrides))
    specs = [PromptSpec(id="a", prompt=PROMPTS[0]["prompt"]), PromptSpec(id="b", prompt=PROMPTS[1]["prompt"])]
    full = run_prompts(worker, worker.prepare(specs[:1]))[0]
    assert full["stats"]["accepted_tokens"] > 0  # lookahead was exercised, not only one token per round
    out = full["output_ids"]
    for cut in (1, 7, len(out) - 1):
        commits: list[tuple[int, list[int]]] = []
        made = run_prompts(
            worker,
            worker.prepare(specs),
            committed=[out[:cut], []],
            on_commit=lambda i, toks, log=commits: log.append((i, [*toks])),
        )
        resumed = {rec["id"]: rec for rec in made}  # in the order they finished: the longer prompt first
        assert resumed["a"]["output_ids"] == out and resumed["a"]["text"] == full["text"]
        assert resumed["a"]["new_tokens"] == full["new_tokens"]
        assert [t for i, toks in commits if i == 0 for t in toks] == out[cut:]  # on_commit: only the new tokens
        assert [t for i, toks in commits if i == 1 for t in toks] == resumed["b"]["output_ids"]
        shown: list[str] = []
        run_prompts(worker, worker.prepare(specs[:1]), stream=shown.append, committed=[out[:cut]])
        head = worker.tokenizer.decode(out[:cut], skip_special_tokens=True).rstrip("\ufffd")
        assert head + "".join(shown) == full["text"]  # continues where the shown text stopped, no repeat


# ---------------------------------------------------------------- real cluster


@pytest.mark.slow
def test_job_p2_matches_single_worker_andhf_greedy_of(cluster, tiny_dir, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    single = subprocess.Popen(  # the single worker without Ray, while the job runs
        lp_runner_cmd(*_args(tiny_dir, prompts, tmp_path / "single.jsonl")),
        env=env_with_repo(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        logs = _submit(cluster, _args(tiny_dir, prompts, tmp_path / "ray.jsonl", 48, *_ray_args(2)))
        _, err = single.communicate(timeout=240)
    finally:
        if single.poll() is None:
            single.kill()
            single.wait()
    assert single.returncode == 0, err[-2000:]
    ray_records, single_records = read_jsonl(tmp_path / "ray.jsonl"), read_jsonl(tmp_path / "single.jsonl")
    _same_generation(ray_records, single_records)  # same JSONL fields and values, timing aside
    assert all(r["workers"] == 2 and r["dist_backend"] == "gloo" and "recovery" not in r for r in ray_records)
    for ray_rec, single_rec in zip(ray_records, single_records, strict=True):
        assert ray_rec["forwards"] == single_rec["forwards"]  # LP: same tokens per forward as one worker
        assert ray_rec["stats"]["collectives"] == ray_rec["stats"]["rounds"]  # a real 2-rank group
        assert ray_rec["output_ids"] == hf_greedy_of(tiny_dir, ray_rec["prompt_ids"], 48), ray_rec["id"]
    assert sum(r["stats"]["accepted_tokens"] for r in ray_records) > 0  # candidates were verified and accepted
    assert logs.count("  new tokens ") == 1 and "workers=2" in logs  # rank 0's summary, printed once
    from ray.util.state import list_actors

    ours = [a for a in list_actors(address=cluster.url, limit=1000) if (a.name or "").startswith("lp_runner-")]
    assert len(ours) >= 2  # the job's actors ran on this cluster, not on a private local instance


@pytest.mark.slow
def test_job_embedded_model_matcheshf_greedy_of(cluster, tmp_path):
    from lp_runner.models.loading import embedded_model_dir, fetch_embedded_model

    fetch_embedded_model()
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        [
            {"id": "fib", "prompt": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'},
            {"id": "chat", "messages": [{"role": "user", "content": "What is a hash map?"}]},
        ],
    )
    extra = ("--set", "lookahead.window_size=15", "--set", "lookahead.verification_set_size=15",
             "--set", "lookahead.preset=off", *_ray_args(2))  # the window, as written  # fmt: skip
    _submit(cluster, _args("embedded", prompts, tmp_path / "o.jsonl", 24, *extra))
    records = read_jsonl(tmp_path / "o.jsonl")
    for rec in records:
        assert rec["output_ids"] == hf_greedy_of(embedded_model_dir(), rec["prompt_ids"], 24), rec["id"]


@pytest.mark.slow
def test_group_runs_its_batch_together_and_matches_hf_greedy(cluster, tmp_path):
    """run.batch=3 on a P = 2 group of the embedded model: up to three prompts share each forward of the Ray
    actors (``run_prompts``' in-flight loop, as under torchrun), and every output is HF greedy's token for token.

    Keywords: ``preset=off`` runs the window as written on both ranks (no per-process calibration);
    ``rounds / forward_share`` is the generations a prompt's forwards held on average (1.0 one at a time), so it
    fails if the group ran one prompt per forward; the summary's ``batch 3:`` line says the same from the job's side.
    """
    from lp_runner.models.loading import embedded_model_dir, fetch_embedded_model

    fetch_embedded_model()
    texts = ["def fibonacci(n):\n", "The capital of France is", "Once upon a time,", "import numpy as np\n"]
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": t} for i, t in enumerate(texts)])
    extra = ("--set", "run.batch=3", *_ray_args(2))
    proc = _cli(_args("embedded", prompts, tmp_path / "o.jsonl", 24, *extra), 400, RAY_ADDRESS=cluster.gcs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "runs as 1" not in proc.stderr and "batch 3: " in proc.stderr, proc.stderr[-3000:]
    records = read_jsonl(tmp_path / "o.jsonl")
    assert sorted(r["id"] for r in records) == [f"p{i}" for i in range(len(texts))]
    assert all(r["workers"] == 2 and r["stats"]["collectives"] == r["stats"]["rounds"] for r in records)
    ran = [r["stats"] for r in records if r["stats"]["rounds"]]  # a prompt resumed whole from its prefix runs none
    assert all(s["forward_share"] > 0 for s in ran)
    assert max(s["rounds"] / s["forward_share"] for s in ran) > 1.5  # forwards were shared
    for rec in records:
        assert rec["output_ids"] == hf_greedy_of(embedded_model_dir(), rec["prompt_ids"], 24), rec["id"]


def _run_and_kill_rank1(
    cluster, tiny_dir: Path, prompts: Path, out: Path, *extra: str, sig: int = signal.SIGKILL, rank: int = 1
) -> tuple[int, str]:
    """Run the CLI against the cluster; once 2 records are written, send ``sig`` to the rank-``rank`` actor
    (SIGKILL: as an OOM kill or a lost node would; SIGSTOP: a stalled worker). Returns (exit code, stderr)."""
    from ray.util.state import list_actors

    proc = _start_cli(cluster, _args(tiny_dir, prompts, out, MANY_TOKENS, *_ray_args(2), *extra))
    try:
        deadline = time.monotonic() + 150
        while not (out.exists() and len(out.read_text().splitlines()) >= 2):  # generation is under way
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        rank1 = [
            a
            for a in list_actors(address=cluster.url, filters=[("state", "=", "ALIVE")], limit=1000)
            if a.name and a.name.endswith(f"-g0-rank{rank}")  # lp_runner-<run>-g<group generation>-rank<r>
        ]
        assert len(rank1) == 1, rank1
        os.kill(rank1[0].pid, sig)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def _many_prompts(tmp_path: Path) -> Path:
    return write_prompts(tmp_path / "many.jsonl", [{"id": str(i), "prompt": f"Item {i}:"} for i in range(MANY)])


@pytest.mark.slow
def test_killed_actor_is_replaced_and_output_is_identical(cluster, tiny_dir, tmp_path):
    prompts, out = _many_prompts(tmp_path), tmp_path / "o.jsonl"
    rc, err = _run_and_kill_rank1(cluster, tiny_dir, prompts, out)
    assert rc == 0, err[-3000:]
    records, expected = read_jsonl(out), _uninterrupted(tiny_dir, prompts, MANY_TOKENS)
    hit = [r for r in records if "recovery" in r]
    assert len(hit) == 1, [r["id"] for r in hit]
    # nothing lost, nothing repeated; the resumed record's forwards differ (the lookahead state restarts)
    _same_generation(records, expected, frozenset({"forwards", "tokens_per_forward"}))
    # ... but they count the whole generation, before and after the loss, as its tokens do
    rec, event = hit[0], hit[0]["recovery"][0]
    assert rec["stats"]["new_tokens"] == rec["new_tokens"] == len(rec["output_ids"])
    assert rec["forwards"] == rec["stats"]["forwards"] > event["rounds_before"]
    assert rec["tokens_per_forward"] == round(rec["new_tokens"] / rec["forwards"], 4)
    total = re.search(r"prompts (\d+)  new tokens (\d+)", err)
    assert total and int(total[2]) == sum(r["new_tokens"] for r in records), err[-2000:]
    _same_generation([r for r in records if r is not hit[0]], [e for e in expected if e["id"] != hit[0]["id"]])
    assert len(hit[0]["recovery"]) == 1
    event = hit[0]["recovery"][0]
    assert "rank 1" in event["lost"] and event["workers_before"] == 2 and event["workers_after"] == 2
    assert 0 < event["seconds"] < 120
    assert records.index(hit[0]) >= 2  # finished prompts were not re-run
    assert "warning: worker rank 1 was lost" in err and "recoveries 1 (lost workers" in err


@pytest.mark.slow
def test_killed_actor_of_a_batched_group_resumes_every_prompt_in_flight(cluster, tiny_dir, tmp_path):
    """D = 1, P = 2 with run.batch=2: the group keeps two prompts in flight over the whole job. Rank 1 is killed
    mid-job: the rebuilt group resumes each prompt the loss split from its own prefix (one recovery, an event on
    each), and the records equal the uninterrupted single worker's, none repeated."""
    prompts, out = _many_prompts(tmp_path), tmp_path / "o.jsonl"
    rc, err = _run_and_kill_rank1(cluster, tiny_dir, prompts, out, "--set", "run.batch=2")
    assert rc == 0, err[-3000:]
    records, expected = read_jsonl(out), {r["id"]: r for r in _uninterrupted(tiny_dir, prompts, MANY_TOKENS)}
    assert sorted(r["id"] for r in records) == sorted(expected)  # every prompt exactly once
    ran = [r["stats"] for r in records if r["stats"]["rounds"]]  # a prompt resumed whole from its prefix runs none
    assert all(s["forward_share"] > 0 for s in ran)
    assert max(s["rounds"] / s["forward_share"] for s in ran) > 1.5  # forwards were shared
    hit = [r for r in records if "recovery" in r]
    assert 1 <= len(hit) <= 2 and len({r["recovery"][0]["lost"] for r in hit}) == 1, [r["id"] for r in hit]
    for rec in records:
        _same_generation([rec], [expected[rec["id"]]], frozenset({"forwards", "tokens_per_forward"}))
    for rec in hit:
        assert rec["output_ids"] == hf_greedy_of(tiny_dir, rec["prompt_ids"], MANY_TOKENS), rec["id"]
        assert rec["stats"]["new_tokens"] == rec["new_tokens"] == len(rec["output_ids"])
    assert "warning: worker rank 1 was lost" in err and "recoveries 1 (lost workers" in err


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_stalled_actor_is_one_warning_line(cluster, tiny_dir, tmp_path, rank):
    """A stopped (SIGSTOP) actor: the other rank's collective times out after parallel.timeout_s (and, for rank 0,
    the driver's poll of it), the group is rebuilt and the output is identical. The user sees one warning line
    for it: no "Unhandled error" dump of a failed task's traceback (Ray prints one for a failed object ref nobody
    read: the surviving rank's run, when the driver gave up on the stopped rank 0 first)."""
    prompts, out = _many_prompts(tmp_path), tmp_path / "o.jsonl"
    extra = ("--set", "parallel.timeout_s=20")
    rc, err = _run_and_kill_rank1(cluster, tiny_dir, prompts, out, *extra, sig=signal.SIGSTOP, rank=rank)
    assert rc == 0, err[-3000:]
    records, expected = read_jsonl(out), _uninterrupted(tiny_dir, prompts, MANY_TOKENS)
    _same_generation(records, expected, frozenset({"forwards", "tokens_per_forward"}))
    assert sum("recovery" in r for r in records) == 1
    noise = [line for line in err.splitlines() if not line.startswith(("warning: ", "skipped", "prompts ", "  "))]
    assert "Traceback" not in err and "Unhandled error" not in err, err[-3000:]
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "(recovery 1/2)" in warnings[0], err[-3000:]
    assert not [line for line in noise if "ERROR" in line or "error" in line], err[-3000:]


@pytest.mark.slow
def test_recoveries_are_bounded(cluster, tiny_dir, tmp_path):
    prompts, out = _many_prompts(tmp_path), tmp_path / "o.jsonl"
    rc, err = _run_and_kill_rank1(cluster, tiny_dir, prompts, out, "--set", "advanced.max_restarts=0")
    assert rc == 3, err[-3000:]
    assert "error: gave up after 0 recoveries (advanced.max_restarts=0); last failure: worker rank 1 was lost" in err
    assert 2 <= len(read_jsonl(out)) < MANY  # records finished before the loss are kept
    assert "Traceback" not in err


def _run_two_groups_and_kill_group1(cluster, tiny_dir: Path, prompts: Path, out: Path, *extra: str):
    """parallel.groups=2 x workers=1 through the CLI; once 2 records are written, SIGKILL group 1's actor.
    Returns (exit code, stderr, the run's id in the actor names)."""
    from ray.util.state import list_actors

    args = _args(tiny_dir, prompts, out, MANY_TOKENS, *_ray_args(1), "--set", "parallel.groups=2", *extra)
    proc = _start_cli(cluster, args)
    try:
        deadline = time.monotonic() + 150
        while not (out.exists() and len(out.read_text().splitlines()) >= 2):  # both groups are generating
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        alive = list_actors(address=cluster.url, filters=[("state", "=", "ALIVE")], limit=1000)
        victim = [a for a in alive if (a.name or "").endswith("-d1-g0-rank0")]  # lp_runner-<run>-d<group>-g<gen>
        assert len(victim) == 1, [a.name for a in alive]
        os.kill(victim[0].pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err, victim[0].name.split("-")[1]


@pytest.mark.slow
def test_two_groups_one_killed_resumes_alone_and_output_is_identical(cluster, tiny_dir, tmp_path):
    """parallel.groups=2 x workers=1: two placement groups, prompts to whichever group is free. The
    group-1 actor is SIGKILLed mid-job: group 1 alone is rebuilt and resumes its prompt from the committed prefix,
    group 0 runs on untouched; every record equals the uninterrupted single worker's and HF greedy."""
    from ray.util.state import list_actors

    prompts, out = _many_prompts(tmp_path), tmp_path / "o.jsonl"
    rc, err, run_id = _run_two_groups_and_kill_group1(cluster, tiny_dir, prompts, out)
    assert rc == 0, err[-3000:]
    records = read_jsonl(out)
    expected = {r["id"]: r for r in _uninterrupted(tiny_dir, prompts, MANY_TOKENS)}
    assert sorted(r["id"] for r in records) == sorted(expected)  # nothing lost, nothing repeated
    assert {r["group"] for r in records} == {0, 1}  # the queue fed both groups
    hit = [r for r in records if "recovery" in r]
    assert len(hit) == 1 and hit[0]["group"] == 1, [(r["id"], r["group"]) for r in hit]
    assert hit[0]["recovery"][0]["lost"].startswith("group 1: worker rank 0 was lost")
    # forwards may differ: each group's job store (pool_scope=job) holds the prompts that group ran, and the
    # resumed prompt's lookahead state restarts; the tokens may not
    ignore = frozenset({"group", "forwards", "tokens_per_forward"})
    for rec in records:
        _same_generation([rec], [expected[rec["id"]]], ignore)
    for rec in records[::8] + hit:  # the single worker is HF greedy (tests above); a direct look at some
        assert rec["output_ids"] == hf_greedy_of(tiny_dir, rec["prompt_ids"], MANY_TOKENS), rec["id"]
    # group 0 was never rebuilt: its first actor is its only one
    ours = [a.name for a in list_actors(address=cluster.url, limit=1000) if run_id in (a.name or "")]
    assert [n for n in ours if "-d0-" in n] == [f"lp_runner-{run_id}-d0-g0-rank0"], ours
    assert "warning: group 1: worker rank 0 was lost" in err and "recoveries 1 (lost workers" in err
    assert "groups 2: busy" in err  # the job line's per-group utilisation


def _kill_group1_mid_claim(cluster, args: list[str], out: Path) -> tuple[int, str, bool]:
    """Run the CLI (``args``: D = 2 lanes of P = 1) against the cluster; once group 1's actor is inside its first
    ``Replica.run`` (Ray's state API lists the task as running), let it commit CLAIM_RUN_S of rounds, then SIGKILL
    it: the loss lands in the middle of a claim, with every prompt of it part-generated. Returns (exit code,
    stderr, whether the kill found the actor: on a loaded machine the state API can report the task after the
    actor's process has ended, and then nothing was lost)."""
    from ray.util.state import list_actors, list_tasks

    proc = _start_cli(cluster, args)
    try:
        deadline, victim = time.monotonic() + 150, []
        while not victim:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            alive = list_actors(address=cluster.url, filters=[("state", "=", "ALIVE")], limit=1000)
            actor = [a for a in alive if (a.name or "").endswith("-d1-g0-rank0")]  # lp_runner-<run>-d<group>-g<gen>
            if actor:
                running = list_tasks(address=cluster.url, filters=[("state", "=", "RUNNING")], limit=1000)
                runs = {t.actor_id for t in running if t.name == "Replica.run"}
                victim = [a for a in actor if a.actor_id in runs]
            time.sleep(0.05)
        time.sleep(CLAIM_RUN_S)
        try:
            os.kill(victim[0].pid, signal.SIGKILL)
            killed = True
        except ProcessLookupError:
            killed = False
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err, killed


# The mid-claim kill: generations long enough (about 2.5 s a claim of two on this machine's tiny model, more under
# load) that CLAIM_RUN_S after its run started, both prompts of the claim have committed rounds and neither is done.
CLAIM_TOKENS, CLAIM_RUN_S = 1500, 0.5


@pytest.mark.slow
def test_two_groups_of_three_refill_a_slot_as_its_generation_ends(cluster, tiny_dir, tmp_path):
    """parallel.groups=2 x workers=1 with run.batch=3: a group's slot takes the next prompt of the queue as soon as
    its generation ends, not once the whole batch is done. Read from the actors' own debug lines ("start 'ID' after
    N finished", one per start, prefixed by Ray with the actor's pid): in each group the first three start before
    anything finished (in one round); a group's fourth start comes when its first generations end, i.e. after as
    many finishes as its first batch has generations of the fewest forwards (waiting for a batch to drain would
    start it after 3). Eight prompts for six slots: some group runs a fourth.

    Which prompts a group gets depends on which claims first, so the prompts are chosen for the tiny model's
    forwards at this budget (``lookahead.pool_scope=prompt``: a generation's forwards depend on its prompt alone,
    not on what its group ran before): at most two prompts share a count, so no first batch ends in one round
    whatever the claims. The test states that precondition from the records before it relies on it. Every prompt
    starts once and its output is HF greedy's."""
    texts = [  # forwards at MANY_TOKENS, as measured: two of each of four counts
        "a b c d e f g h i j k l",
        "def f(x):\n    return",
        "x",
        "class sun alpha if one",
        "red green blue red green",
        "alpha class else z delta green",
        "import os\nimport sys\n",
        "z dog three for dog def",
    ]
    ids = [f"p{i}" for i in range(len(texts))]
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": i, "prompt": t} for i, t in zip(ids, texts, strict=True)])
    out, new = tmp_path / "o.jsonl", MANY_TOKENS
    extra = (*_ray_args(1), "--set", "parallel.groups=2", "--set", "run.batch=3", "--log-level", "debug")
    extra += ("--set", "lookahead.pool_scope=prompt")
    proc = _cli(_args(tiny_dir, prompts, out, new, *extra), 400, RAY_ADDRESS=cluster.gcs, RAY_DEDUP_LOGS="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(out)
    assert sorted(r["id"] for r in records) == sorted(ids)
    assert {r["group"] for r in records} == {0, 1}
    for rec in records:
        assert rec["output_ids"] == hf_greedy_of(tiny_dir, rec["prompt_ids"], new), rec["id"]
    forwards = {r["id"]: r["forwards"] for r in records}
    counts = collections.Counter(forwards.values())
    assert max(counts.values()) <= 2, f"the precondition: at most two prompts of one forwards count, {forwards}"

    starts: dict[str, list[tuple[str, int]]] = {}
    for pid, prompt, after in re.findall(r"pid=(\d+)[^)]*\).*?start '(p\d+)' after (\d+) finished", proc.stderr):
        starts.setdefault(pid, []).append((prompt, int(after)))
    assert sorted(p for group in starts.values() for p, _ in group) == sorted(ids)  # each prompt started once
    assert len(starts) == 2, starts  # both groups ran prompts
    fourth = [group for group in starts.values() if len(group) > 3]
    assert fourth, starts
    for group in starts.values():
        afters = [after for _, after in group]
        # a full batch first (a group that started late may find fewer than three left), then refills in order
        assert afters[:3] == [0] * min(3, len(afters)) and afters == sorted(afters), starts
    for group in fourth:
        first = [forwards[p] for p, _ in group[:3]]
        assert group[3][1] == first.count(min(first)), (starts, forwards)  # refilled as its first ones ended


@pytest.mark.slow
def test_two_groups_of_three_one_killed_mid_run_resume_every_prompt_once(cluster, tiny_dir, tmp_path):
    """parallel.groups=2 x workers=1 with run.batch=3: each group keeps three prompts in flight, claimed from the
    driver's queue as slots free. Group 1's actor is SIGKILLed in the middle of its first run: its rebuilt group
    resumes every prompt it had in flight, each from its own committed prefix (one recovery, an event on each),
    nothing is run twice or lost, and every record equals the uninterrupted single worker's and HF greedy."""
    specs = [{"id": str(i), "prompt": f"story {i} story {i} story {i}"} for i in range(6)]
    prompts = write_prompts(tmp_path / "p.jsonl", specs)
    extra = (*_ray_args(1), "--set", "parallel.groups=2", "--set", "run.batch=3")
    for attempt in range(3):  # a kill that found no actor (the state API lagged past its end) lost nothing: again
        out = tmp_path / f"o{attempt}.jsonl"
        rc, err, killed = _kill_group1_mid_claim(cluster, _args(tiny_dir, prompts, out, CLAIM_TOKENS, *extra), out)
        if killed:
            break
    assert killed, "group 1's actor was never caught inside a claim"
    assert rc == 0, err[-3000:]
    records = read_jsonl(out)
    expected = {r["id"]: r for r in _uninterrupted(tiny_dir, prompts, CLAIM_TOKENS)}
    assert sorted(r["id"] for r in records) == sorted(expected)  # every prompt exactly once
    assert {r["group"] for r in records} == {0, 1}
    assert max(r["stats"]["rounds"] / r["stats"]["forward_share"] for r in records) > 1.5  # claims ran together
    hit = [r for r in records if "recovery" in r]
    assert len(hit) == 3 and all(r["group"] == 1 for r in hit), [(r["id"], r["group"]) for r in hit]
    events = [r["recovery"][0] for r in hit]
    assert len({e["lost"] for e in events}) == 1 and all(len(r["recovery"]) == 1 for r in hit)  # one loss
    assert all(0 < e["resumed_at_token"] < CLAIM_TOKENS and e["rounds_before"] > 0 for e in events), events
    ignore = frozenset({"group", "forwards", "tokens_per_forward"})
    for rec in records:
        _same_generation([rec], [expected[rec["id"]]], ignore)
    assert records[0]["new_tokens"] == CLAIM_TOKENS  # guard: long generations, not an early EOS
    for rec in hit:  # the resumed ones against the oracle itself; the whole generation is counted
        assert rec["output_ids"] == hf_greedy_of(tiny_dir, rec["prompt_ids"], CLAIM_TOKENS), rec["id"]
        assert rec["stats"]["new_tokens"] == rec["new_tokens"] == len(rec["output_ids"])
        assert rec["forwards"] == rec["stats"]["forwards"] > rec["recovery"][0]["rounds_before"]
    warning = [line for line in err.splitlines() if line.startswith("warning: group 1: worker rank 0 was lost")]
    assert len(warning) == 1 and "resuming prompts " in warning[0] and "(recovery 1/2)" in warning[0], err[-3000:]
    assert "recoveries 1 (lost workers" in err


@pytest.mark.slow
def test_two_groups_share_the_cores_a_finished_group_frees(cluster, tiny_dir, tmp_path):
    """parallel.groups=2 x 1 thread, three long prompts: the group that finds the queue empty leaves while the other
    runs the third prompt, whose actor then takes both threads mid-generation (its log line reaches the driver) and
    still writes HF greedy's tokens (``advanced.share_cores``, as under torchrun)."""
    long = 1500
    specs = [{"id": str(i), "prompt": "story 1 story 1 story 1"} for i in range(3)]
    prompts = write_prompts(tmp_path / "p.jsonl", specs)
    out = tmp_path / "o.jsonl"
    args = _args(tiny_dir, prompts, out, long, *_ray_args(1), "--set", "parallel.groups=2")
    proc = _cli(args, timeout=400, RAY_ADDRESS=cluster.gcs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "a group on this node has no more work: 2 threads" in proc.stderr, proc.stderr[-3000:]
    records = read_jsonl(out)
    assert sorted(r["id"] for r in records) == ["0", "1", "2"] and {r["group"] for r in records} == {0, 1}
    assert records[0]["new_tokens"] > 1000  # guard: long generations, not an early EOS
    want = hf_greedy_of(tiny_dir, records[0]["prompt_ids"], long)
    assert all(r["output_ids"] == want for r in records)


@pytest.mark.slow
def test_two_groups_out_of_restarts_stop_every_group(cluster, tiny_dir, tmp_path):
    """advanced.max_restarts=0: group 1's loss is fatal; group 0 is stopped too (its actor torn down), exit 3."""
    from ray.util.state import list_actors

    prompts, out = _many_prompts(tmp_path), tmp_path / "o.jsonl"
    no_restarts = ("--set", "advanced.max_restarts=0")
    rc, err, run_id = _run_two_groups_and_kill_group1(cluster, tiny_dir, prompts, out, *no_restarts)
    assert rc == 3, err[-3000:]
    assert "error: gave up after 0 recoveries (advanced.max_restarts=0); last failure: group 1: worker rank 0" in err
    assert 2 <= len(read_jsonl(out)) < MANY and "Traceback" not in err  # records written before the loss stay
    deadline, ours = time.monotonic() + 15, ["?"]
    while ours and time.monotonic() < deadline:  # the state API may report a killed actor a moment late
        alive = list_actors(address=cluster.url, filters=[("state", "=", "ALIVE")], limit=1000)
        ours = [a.name for a in alive if run_id in (a.name or "")]
        time.sleep(0.5)
    assert not ours  # group 0's actor went with the run


@pytest.mark.slow
def test_more_gpus_than_the_cluster_has_fails_fast(cluster, tiny_dir, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])
    start = time.monotonic()
    gpus = ("--set", "advanced.gpus_per_worker=1", "--set", f"parallel.ray_address={cluster.gcs}")  # config key
    proc = _cli(_args(tiny_dir, prompts, tmp_path / "o.jsonl", 8, *_ray_args(2), *gpus), timeout=60)
    assert time.monotonic() - start < 30
    assert proc.returncode == 2
    assert "error: the Ray cluster cannot hold 2 workers with CPU=1, GPU=1 each: GPU: 2 needed" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_unreachable_cluster_and_invisible_model_are_clear_errors(cluster, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])
    proc = _cli(_args("embedded", prompts, tmp_path / "o.jsonl", 8, *_ray_args(1)), 60, RAY_ADDRESS="127.0.0.1:9")
    assert proc.returncode == 2
    assert "error: cannot reach the Ray cluster at 127.0.0.1:9" in proc.stderr
    missing = tmp_path / "not-on-the-workers"
    proc = _cli(_args(missing, prompts, tmp_path / "o.jsonl", 8, *_ray_args(2)), 120, RAY_ADDRESS=cluster.gcs)
    assert proc.returncode == 2
    assert re.search(
        rf"error: worker rank \d on node \S+ \(.*\): model path not found: {re.escape(str(missing))}\n", proc.stderr
    )


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_interrupted_driver_cleans_up_and_resumes(cluster, tiny_dir, tmp_path, sig):
    """SIGTERM / Ctrl-C to the driver: one `error: interrupted` line, exit 130, the run's actors gone; a kill -9
    leaves them to Ray (their owner died). Either way --resume ends with the uninterrupted records."""
    from ray.util.state import list_actors

    prompts, out = _many_prompts(tmp_path), tmp_path / "o.jsonl"
    cmd = lp_runner_cmd(*_args(tiny_dir, prompts, out, MANY_TOKENS, *_ray_args(2)))
    env = env_with_repo(RAY_ADDRESS=cluster.gcs)
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint
    )
    try:
        deadline = time.monotonic() + 150
        while not (out.exists() and len(out.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        actors = list_actors(address=cluster.url, filters=[("state", "=", "ALIVE")], limit=1000)
        run = {a.name.split("-")[1] for a in actors if (a.name or "").startswith("lp_runner-")}  # lp_runner-<run>-..
        assert len(run) == 1, run
        second = _cli([*_args(tiny_dir, prompts, out, MANY_TOKENS), "--resume"])  # the driver holds the lock
        assert second.returncode == 2 and f"another lp_runner run (pid {proc.pid})" in second.stderr, second.stderr
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 130, err[-3000:]
        assert err.strip().splitlines()[-1] == "error: interrupted", err[-3000:]
        assert "Traceback" not in err and "SIGTERM received" not in err, err[-3000:]

    def ours_alive() -> list:
        actors = list_actors(address=cluster.url, filters=[("state", "=", "ALIVE")], limit=1000)
        return [a for a in actors if (a.name or "").startswith("lp_runner-") and a.name.split("-")[1] in run]

    deadline = time.monotonic() + 60
    while ours_alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ours_alive()
    kept = len(out.read_bytes().split(b"\n")) - 1
    assert 2 <= kept < MANY
    resumed = _cli([*_args(tiny_dir, prompts, out, MANY_TOKENS, *_ray_args(2)), "--resume"], RAY_ADDRESS=cluster.gcs)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = read_jsonl(out)
    expected = {r["id"]: r for r in _uninterrupted(tiny_dir, prompts, MANY_TOKENS)}
    assert sorted(r["id"] for r in records) == sorted(expected)
    _same_generation(records, [expected[r["id"]] for r in records], frozenset({"forwards", "tokens_per_forward"}))


@pytest.mark.slow
def test_missing_auth_token_is_named(cluster, tiny_dir, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])
    env = env_with_repo(RAY_ADDRESS=cluster.gcs)
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        env.pop(key, None)
    cmd = lp_runner_cmd(*_args(tiny_dir, prompts, tmp_path / "o.jsonl", 8, *_ray_args(1)))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: the Ray cluster at {cluster.gcs} requires an authentication token: set RAY_AUTH_MODE=token and "
        "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token"
    )


@pytest.mark.slow
def test_local_instance_declares_the_real_cores(tiny_dir, tmp_path):
    """More CPUs per worker than this machine has: a clear error, not an oversubscribed local instance."""
    cores = len(os.sched_getaffinity(0))
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])
    cpus = ("--set", f"advanced.cpus_per_worker={cores + 1}")
    env = env_with_repo()
    env.pop("RAY_ADDRESS", None)
    cmd = lp_runner_cmd(*_args(tiny_dir, prompts, tmp_path / "o.jsonl", 8, *_ray_args(1), *cpus))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        f"error: the Ray cluster cannot hold 1 workers with CPU={cores + 1} each: CPU: {cores + 1} needed "
        f"({cores + 1} per worker), {cores} in the cluster" in proc.stderr
    )


@pytest.mark.slow
def test_single_prompt_streams_on_a_local_instance(tiny_dir, tmp_path):
    """No address: the backend starts a local Ray instance, streams the text like the torchrun path, stops it.
    A job of one prompt runs one generation at a time whatever ``run.batch`` says (the actors are told the job's
    prompt count), as it does under torchrun."""
    args = [
        "--prompt", PROMPTS[0]["prompt"], "--output", str(tmp_path / "o.jsonl"), "--set", f"model.path={tiny_dir}",
        "--set", "model.threads=1", "--set", "generation.max_new_tokens=40", "--set", "run.batch=3", *_ray_args(2),
    ]  # fmt: skip
    env = env_with_repo()
    env.pop("RAY_ADDRESS", None)
    cmd = lp_runner_cmd(*args)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = read_jsonl(tmp_path / "o.jsonl")
    assert proc.stdout == record["text"] + "\n"
    assert record["workers"] == 2 and proc.stderr.count("  new tokens ") == 1
    assert record["policy"]["batch"] == 1


@pytest.mark.slow
def test_resume_rebuilds_the_job_store(cluster, tiny_dir, tmp_path):
    """Under Ray, --resume starts the job store from the records already written (pool_scope: job): the resumed
    job saves the generations of the uninterrupted one. In another order: a job runs its prompts longest first, so
    the two prompts the interrupted job ran went first whatever their length."""
    import json

    everything = write_prompts(tmp_path / "all.jsonl", PROMPTS)
    first_two = write_prompts(tmp_path / "two.jsonl", PROMPTS[:2])
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    ray = [*_ray_args(1), "--set", "lookahead.pool_scope=job"]
    runs = [
        [*_args(tiny_dir, everything, whole, 16, *ray), "--pool-out", str(tmp_path / "w.json")],
        _args(tiny_dir, first_two, resumed, 16, *ray),  # the "interrupted" job
        [*_args(tiny_dir, everything, resumed, 16, *ray), "--resume", "--pool-out", str(tmp_path / "r.json")],
    ]
    for args in runs:
        proc = _cli(args, RAY_ADDRESS=cluster.gcs)
        assert proc.returncode == 0, proc.stderr[-3000:]
    store_whole, store_resumed = (json.loads((tmp_path / f).read_text()) for f in ("w.json", "r.json"))
    assert store_whole["generations"] == len(PROMPTS)
    assert sorted(store_resumed["sequences"]) == sorted(store_whole["sequences"])
    assert store_resumed["generations"] == store_whole["generations"]


_SIGTERM_IN_A_WEAKREF_CALLBACK = """
import gc, signal, sys, weakref
if sys.argv[1] == "replica":
    from lp_runner.jobs.ray import Replica
    Replica()  # as Ray constructs the actor: on the worker's main thread
else:  # what Ray's worker handler does
    def raise_exit(signum, frame):
        raise SystemExit(1)
    signal.signal(signal.SIGTERM, raise_exit)
class Target:
    pass
target = Target()
ref = weakref.ref(target, lambda _: signal.raise_signal(signal.SIGTERM))  # the signal lands inside the callback
del target
gc.collect()
print("still running")
"""


@pytest.mark.parametrize("handler", ["replica", "raise"])
def test_replica_exits_silently_on_sigterm_inside_a_weakref_callback(handler):
    """The race behind a stray "Traceback ... SystemExit: 1" after a clean error: Ray kills the surviving ranks
    with SIGTERM, and a SystemExit raised inside a weakref callback is printed as ignored (and the process even
    runs on). The replica's own handler exits at once and silently; "raise" reproduces the old behaviour."""
    proc = subprocess.run(
        [sys.executable, "-c", _SIGTERM_IN_A_WEAKREF_CALLBACK, handler],
        env=env_with_repo(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if handler == "replica":
        assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", "")
    else:
        assert "Traceback" in proc.stderr and "still running" in proc.stdout

"""``model.threads: 0``: the process's available cores divided among the ranks on its node."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_helpers import REPO

from lp_runner.device import available_cores, local_world_size, resolve_threads

REPO_ROOT = REPO


@pytest.mark.parametrize(
    "threads, cores, local_ranks, expected",
    [
        (0, 64, 8, 8),  # a 64-core node, torchrun --nproc-per-node=8: 8 threads per rank
        (0, 64, 1, 64),  # one process: every core it may run on
        (0, 10, 3, 3),  # uneven: rounded down, so the ranks never oversubscribe the node
        (0, 2, 3, 1),  # more ranks than cores: still one thread each, never 0
        (6, 64, 8, 6),  # an explicit setting wins
    ],
)
def test_resolve_threads_divides_cores_among_local_ranks(threads, cores, local_ranks, expected) -> None:
    assert resolve_threads(threads, cores=cores, local_ranks=local_ranks) == expected


def test_defaults_read_affinity_and_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_world_size() == 1
    assert resolve_threads(0) == available_cores() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_threads(0) == max(1, len(os.sched_getaffinity(0)) // 2)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_affinity_narrower_than_the_machine_is_honoured() -> None:
    """A process pinned to one core (as taskset or a batch scheduler's cgroup does) gets one thread, whatever
    ``os.cpu_count()`` says."""
    code = (
        "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
        "from lp_runner.device import resolve_threads; print(resolve_threads(0), os.cpu_count())"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("LOCAL_WORLD_SIZE", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    threads, cpu_count = map(int, out.split())
    assert threads == 1
    assert cpu_count >= 1


def test_start_worker_applies_the_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner sets torch's intra-op threads from the resolved value (here: 2 local ranks, no process group).

    Threads are set before the model is resolved and loaded (loading runs on them), so a missing model path stops
    the worker right after, with nothing loaded or calibrated: the test reads the setting there.
    """
    import torch

    from lp_runner.config import load_config
    from lp_runner.jobs.worker import start_worker
    from lp_runner.models.loading import ModelError

    missing = tmp_path / "no-model"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(5)  # neither value expected below: start_worker must set it
        with pytest.raises(ModelError, match="not found"):
            start_worker(load_config(None, [f"model.path={missing}", "model.device=cpu"]))
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
        with pytest.raises(ModelError, match="not found"):
            start_worker(load_config(None, [f"model.path={missing}", "model.device=cpu", "model.threads=3"]))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)

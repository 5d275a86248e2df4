"""Host resources a worker may use: how many intra-op threads ``model.threads: 0`` means.

torch's own default (every core of the machine, or ``OMP_NUM_THREADS``, which torchrun sets to 1 for several
ranks) is wrong both ways on a shared node: a 64-core node running 8 ranks would give each rank 64 threads (they
fight over the cores), or 1 thread each under torchrun (7/8 of each rank's share stays idle). The cores this
process may run on (its CPU affinity: a batch scheduler's cgroup or ``taskset`` narrows it) split evenly among
the ranks of this node is what each rank can use without stepping on the others.
"""

from __future__ import annotations

import os


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS has one, else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 1


def local_world_size() -> int:
    """Ranks sharing this node: ``LOCAL_WORLD_SIZE`` (torchrun; the Ray backend sets it for its actors), else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def resolve_threads(threads: int, cores: int | None = None, local_ranks: int | None = None) -> int:
    """``model.threads`` as a thread count: itself when set (> 0), else this rank's share of the node's cores.

    Worked example: 64 available cores, torchrun with 8 ranks per node (LOCAL_WORLD_SIZE=8) -> 8 threads per rank;
    2 cores and 3 ranks -> 1 (never 0); one plain process on 16 cores -> 16.
    """
    if threads > 0:
        return threads
    cores = available_cores() if cores is None else cores
    local_ranks = local_world_size() if local_ranks is None else local_ranks
    return max(1, cores // max(1, local_ranks))

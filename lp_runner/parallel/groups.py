"""``parallel.groups = D``: D independent LP groups of P ranks in one job, fed from one work queue.

Every group is exactly the P = workers LP group of a one-group job (same engine, same one collective per round),
on its own ``torch.distributed`` sub-group; groups never wait for each other. Around them, three small pieces:

- ``group_layout`` (pure): contiguous world ranks form a group, so a group stays inside a node whenever
  ``--nproc-per-node`` is a multiple of P. World 6, P 3, D 2: ranks 0-2 are group 0, ranks 3-5 group 1; world
  rank 4 is rank 1 of group 1, whose leader is world rank 3.
- ``JobQueue``: the queue lives in the launcher's TCP store (MASTER_ADDR:MASTER_PORT, the store the process
  group was formed through), so it works beside gloo and NCCL alike and needs no server of its own. Every rank
  computes the same ordered list of prompts (``jobs.prompts.JobPrompts.order``: longest first); whenever a slot
  of its batch frees, a group's leader claims the next entry with one atomic ``add`` on a counter (whichever
  group is free takes it) and tells its P - 1 peers with one int64 all_gather on the group.
  Finished records go back through the store, numbered by a second counter.
- ``RecordCollector``: a thread of world rank 0 (itself the leader of group 0) takes the numbered records in
  order and hands them to the one writer (``report.Report``: output file, bar) as they finish. It also watches
  every group: each leader bumps a heartbeat counter once a second from a thread of its own (``Heartbeat``) and
  leaves ``failed/G`` when it fails, so a dead or stalled group ends the job within ``parallel.timeout_s``.

Worked example (D 2, P 1, prompts a (40 tokens), b (10), c (25)): order [a, c, b]. Group 0 claims 0 (a),
group 1 claims 1 (c); group 1 finishes first, posts record #0 (c) and claims 2 (b); group 0 posts #1 (a),
claims 3 (past the end) and leaves ``done/0``; group 1 posts #2 (b), claims 4, leaves ``done/1``. Rank 0 writes
c, a, b in that order, then sees both ``done`` keys and returns.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from lp_runner.errors import EXIT_PEER_FAILURE, EXIT_USER_ERROR, ConfigError, DistributedError, LPError, first_line
from lp_runner.logs import log, tell_launcher

STORE_PREFIX = "lp_runner/jobs/"  # keys of the work queue in the launcher's store
HEARTBEAT_S = 1.0  # a leader's heartbeat period
POLL_S = 0.25  # how often rank 0's collector looks for records, heartbeats and failures


@dataclass(frozen=True)
class GroupLayout:
    groups: int  # D
    workers: int  # P
    group: int  # this rank's group
    ranks: tuple[int, ...]  # world ranks of this group; ranks[0] is its leader

    def describe(self, group: int) -> str:
        first = group * self.workers
        return f"group {group} (world ranks {first}-{first + self.workers - 1})"


def group_layout(world: int, rank: int, workers: int, groups: int) -> GroupLayout:
    """Contiguous ranks per group; WORLD_SIZE must be D x P.

    ``group_layout(6, 4, 3, 2)`` -> GroupLayout(groups=2, workers=3, group=1, ranks=(3, 4, 5))."""
    if world != workers * groups:
        raise ConfigError(
            f"parallel.groups={groups} x parallel.workers={workers} needs {workers * groups} processes but the "
            f"launcher started WORLD_SIZE={world}; start {workers * groups} ranks or change parallel.groups/workers"
        )
    group = rank // workers
    return GroupLayout(groups, workers, group, tuple(range(group * workers, (group + 1) * workers)))


@dataclass(frozen=True)
class GroupHandles:
    """The process groups of one rank in a D-group job (``form_groups``)."""

    group: dist.ProcessGroup  # this rank's LP group: the round exchange (the world's backend)
    group_strings: dist.ProcessGroup | None  # the same ranks on gloo for start-up strings (None: group is gloo)
    control: dist.ProcessGroup | None  # the whole world on gloo, start-up messages (None: the world is gloo)


def form_groups(layout: GroupLayout, timeout_s: float) -> GroupHandles:
    """This rank's LP group, its gloo twin for strings and a gloo group of the whole world, as needed.

    Every rank creates every group, in the same order (``new_group`` is collective over the world)."""
    timeout = timedelta(seconds=timeout_s)
    gloo = dist.get_backend() == "gloo"
    mine, mine_strings = None, None
    for g in range(layout.groups):
        ranks = list(range(g * layout.workers, (g + 1) * layout.workers))
        pg = dist.new_group(ranks, timeout=timeout)
        strings = None if gloo else dist.new_group(ranks, backend="gloo", timeout=timeout)
        if g == layout.group:
            mine, mine_strings = pg, strings
    control = None if gloo else dist.new_group(backend="gloo", timeout=timeout)
    return GroupHandles(mine, mine_strings, control)


def store_client(timeout_s: float) -> dist.Store:
    """A fresh client of the launcher's store (one per thread: the collector and heartbeat threads do not share
    the main thread's connection), under the queue's key prefix."""
    try:
        client = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
    except Exception as exc:
        raise DistributedError(f"cannot reach the job's store for the work queue ({first_line(exc)})") from None
    return dist.PrefixStore(STORE_PREFIX, client)


class JobQueue:
    """A leader's side of the queue: claim the next prompt, post a record, say done or failed. A lost store
    (world rank 0 is gone) is a ``DistributedError``."""

    def __init__(self, store: dist.Store, group: int) -> None:
        self.store = store
        self.group = group

    def claim(self) -> int:
        """The next position in the shared order (past the end: nothing left)."""
        return self._call(lambda: self.store.add("next", 1) - 1)

    def post(self, rec: dict) -> None:
        blob = json.dumps(rec)
        seq = self._call(lambda: self.store.add("posted", 1) - 1)
        self._call(lambda: self.store.set(f"rec/{seq}", blob))

    def finish(self) -> None:
        self._call(lambda: self.store.set(f"done/{self.group}", "1"))

    def fail(self, message: str) -> None:
        self._call(lambda: self.store.set(f"failed/{self.group}", message))

    @staticmethod
    def _call(op: Callable[[], Any]) -> Any:
        return store_call(op, "work queue")


def store_call(op: Callable[[], Any], what: str) -> Any:
    """``op()`` on the launcher's store; a lost store (world rank 0 is gone) is a ``DistributedError`` naming
    ``what`` the caller used it for."""
    try:
        return op()
    except Exception as exc:
        raise DistributedError(f"lost the job's {what} ({first_line(exc)}): world rank 0 is gone") from None


class Claims(Protocol):
    """A leader's side of a job queue: the launcher's store (``JobQueue``) or the Ray driver's queue."""

    def claim(self) -> int: ...


def claim_for_group(queue: Claims | None, comm) -> int:
    """The leader claims (``queue``: None on its peers); its peers take the leader's answer from one int64
    all_gather on the group."""
    mine = queue.claim() if queue is not None else -1
    if comm.world_size == 1:
        return mine
    return int(comm.all_gather(torch.tensor([mine], dtype=torch.int64))[0, 0])


def abort(message: str, code: int = EXIT_PEER_FAILURE) -> None:
    """A background thread found the job broken: say so and leave at once (the main thread may sit in a
    generation or a collective). Records already written are on disk; the kernel drops the output lock."""
    log.error("%s", message)
    tell_launcher(f"error: {message}")
    os._exit(code)


class Heartbeat(threading.Thread):
    """A leader's heartbeat: ``beat/G`` += 1 every HEARTBEAT_S, from the moment its group is formed (so model
    loading and calibration count as alive). Losing the store (rank 0's node is gone) ends this process."""

    def __init__(self, group: int, timeout_s: float, on_failure: Callable[[str], None] = abort) -> None:
        super().__init__(name=f"lp-heartbeat-{group}", daemon=True)
        self.group = group
        self.timeout_s = timeout_s
        self.on_failure = on_failure
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            store = store_client(self.timeout_s)
            while not self.stopped.is_set():
                store.add(f"beat/{self.group}", 1)
                self.stopped.wait(HEARTBEAT_S)
        except Exception as exc:
            if not self.stopped.is_set():
                self.on_failure(f"group {self.group} lost the job's store ({first_line(exc)}): rank 0 is gone")

    def stop(self) -> None:
        self.stopped.set()


class RecordCollector(threading.Thread):
    """World rank 0's writer thread: records in the order they were posted, every group watched.

    ``on_record`` runs on this thread only (the one writer). It ends when ``expected`` records are in and every
    group left ``done``; a group that failed, or whose heartbeat stood still for ``timeout_s``, ends it with
    ``error`` set and ``on_failure`` called (default: ``abort``)."""

    def __init__(
        self,
        layout: GroupLayout,
        expected: int,
        timeout_s: float,
        on_record: Callable[[dict], None],
        on_failure: Callable[[str], None] = abort,
    ) -> None:
        super().__init__(name="lp-records", daemon=True)
        self.layout = layout
        self.expected = expected
        self.timeout_s = timeout_s
        self.on_record = on_record
        self.on_failure = on_failure
        self.error: str | None = None

    def run(self) -> None:
        try:
            self._collect(store_client(self.timeout_s))
        except LPError as exc:  # on_record's own one-line error (e.g. the disk is full): the user's, exit 2
            abort(str(exc), EXIT_USER_ERROR)
        except Exception as exc:  # the store is gone, or on_record failed otherwise
            self.error = f"the job's record collector failed ({first_line(exc)})"
        if self.error is not None:
            self.on_failure(self.error)

    def _collect(self, store: dist.Store) -> None:
        seq = 0
        now = time.monotonic()
        beats = {g: (-1, now) for g in range(self.layout.groups)}  # last heartbeat value, when it last moved
        done: set[int] = set()
        checked = now
        while seq < self.expected or len(done) < self.layout.groups:
            arrived = seq < self.expected and store.check([f"rec/{seq}"])  # check, not wait: a timed-out wait logs
            if arrived:
                self.on_record(json.loads(store.get(f"rec/{seq}")))
                store.delete_key(f"rec/{seq}")
                seq += 1
            if arrived and time.monotonic() - checked < POLL_S:
                continue  # more records may be waiting; the groups are looked at every POLL_S all the same
            if not arrived:
                time.sleep(POLL_S)
            checked = time.monotonic()
            self.error = self._check_groups(store, beats, done)
            if self.error is not None:
                return

    def _check_groups(self, store: dist.Store, beats: dict[int, tuple[int, float]], done: set[int]) -> str | None:
        """Updates ``beats`` and ``done``; what is wrong with the first failed or silent group, else None."""
        for g in range(self.layout.groups):
            if g in done:
                continue
            if store.check([f"failed/{g}"]):
                return f"{self.layout.describe(g)} failed: {store.get(f'failed/{g}').decode()}"
            if store.check([f"done/{g}"]):
                done.add(g)
                continue
            value, since = beats[g]
            beat = store.add(f"beat/{g}", 0)
            if beat != value:
                beats[g] = (beat, time.monotonic())
            elif time.monotonic() - since > self.timeout_s:
                return (
                    f"{self.layout.describe(g)} sent no heartbeat for {self.timeout_s:g} s (parallel.timeout_s): a "
                    "worker died or stalled"
                )
        return None

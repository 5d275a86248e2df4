"""Ray backend: P actors hold full replicas, form ONE torch.distributed group and run the torchrun worker code.

Each actor is one rank: the driver sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in its
environment (the rendezvous is the first actor's node IP and a free port it picks) and calls the same
``worker.start_worker`` (which tokenizes the job's prompts once) and ``worker.run_jobs`` as a torchrun worker, so
there is one round protocol and one job loop. The job's queue is a small actor of the driver's (``_Queue``):
whenever a slot of a group's batch frees, its rank 0 claims the next position of the queue order (longest prompt
first, ``JobPrompts.order``) and its peers take the answer, as torchrun groups claim through the launcher's store.
Rank 0 queues its per-round committed tokens, streamed text and per-prompt records (made by
``worker.make_record``); the driver polls them and writes, streams and summarises exactly as the torchrun path
does.

One elastic loop for D = 1 and D > 1 (``parallel.groups``): the driver runs one lane per LP group, each a thread
with its own placement group, actors and torch group. Worked example (D = 2, P = 1, B = 2, prompts a b c d e f in
queue order): lane 0 claims a, lane 1 b before starting (a lane that finds the queue empty starts nothing); once
started, lane 0 claims c and lane 1 d to fill their batches; lane 1's d finishes first and it claims e at once,
then lane 0's a and it claims f. Records are written as they finish, each with its ``group`` (D > 1).

Recovery, worked example (the same job, lane 1's actor is killed while b and e are generating): the driver
drains rank 0's last messages (b's first 37 committed tokens, e's 12), tears the group down and rebuilds lane 1
alone (generation 1, as many workers as the cluster now holds); the new group runs the prompts lane 1 claimed and
has not written, b from its 37 tokens and e from its 12, then claims from the queue again; lane 0 goes on
meanwhile. Greedy output is a function of the prefix, so b's and e's records equal the uninterrupted ones; each
gains a ``recovery`` list and the summary counts the events and seconds. At most ``advanced.max_restarts``
recoveries, then the run fails with the last cause.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lp_runner.config import Config, ParallelConfig, config_from_dict
from lp_runner.errors import ConfigError, DistributedError, LPError, first_line
from lp_runner.jobs.output import OutputFile
from lp_runner.jobs.prompts import PromptSpec
from lp_runner.jobs.report import Report, resumed_prompts
from lp_runner.logs import LEVEL_ENV, level_name, log, setup_logging
from lp_runner.outfiles import write_stdout

RAY_MISSING = "parallel.backend=ray needs ray: pip install 'lp_runner[ray]'"
POLL_S = 0.1  # how often the driver collects rank 0's tokens and records
CONNECT_TIMEOUT_S = 10.0  # TCP check of a cluster address: ray.init itself retries an unreachable one for minutes
START_GRACE_S = 5.0  # after a rank fails, how long the others get to report theirs (the root cause wins)
UNREAD_WAIT_S = 5.0  # at teardown, how long the calls of killed actors get to end so that their failure is read


class RayClusterError(LPError):
    """The Ray cluster is unreachable, or cannot place the requested workers."""


class _WorkerLost(Exception):
    """Internal: an actor died, stalled, or a surviving rank saw its peer fail; the group is rebuilt."""


class _Stopped(Exception):
    """Internal: another lane failed or the run was interrupted; this lane ends quietly (D > 1)."""


# ---------------------------------------------------------------- resources (pure)


def parse_resources(text: str) -> dict[str, float]:
    """``"accel=1,mem_gb=16"`` -> {"accel": 1.0, "mem_gb": 16.0} (advanced.resources_per_worker)."""
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, amount = item.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not sep or not name.strip() or value < 0:
            raise ConfigError(f"advanced.resources_per_worker expects name=amount[,name=amount], got {item!r}")
        out[name.strip()] = value
    return out


def worker_bundle(par: ParallelConfig, cluster_gpus: float, device: str) -> dict[str, float]:
    """One actor's resources: CPUs, GPUs (auto: 1 when the cluster has GPUs and the model may use them), custom."""
    gpus = par.gpus_per_worker
    if gpus < 0:
        gpus = 1.0 if cluster_gpus > 0 and device != "cpu" else 0.0
    bundle = {"CPU": par.cpus_per_worker, "GPU": gpus, **parse_resources(par.resources_per_worker)}
    bundle = {name: amount for name, amount in bundle.items() if amount > 0}
    if not bundle:
        raise ConfigError("a Ray worker must reserve something: set advanced.cpus_per_worker or gpus_per_worker > 0")
    return bundle


def actor_threads(threads: int, bundle: dict[str, float]) -> int:
    """``model.threads`` for an actor: a GPU actor's host threads are its CPU reservation (at least one), not the
    node's cores, which the other actors' reservations share; a CPU actor keeps its share of the node's cores
    (``device.resolve_threads``, 0 here). ``actor_threads(0, {"CPU": 4, "GPU": 1})`` -> 4."""
    if threads > 0 or not bundle.get("GPU"):
        return threads
    return max(1, int(bundle.get("CPU", 1.0)))


def placeable(nodes: Sequence[dict[str, float]], bundle: dict[str, float]) -> int:
    """How many ``bundle``s the nodes (total resources of each alive node) hold, each bundle on one node.

    Example: nodes [{CPU: 8, GPU: 2}, {CPU: 2}] and bundle {CPU: 1, GPU: 1} -> 2 (the second node has no GPU).
    """
    return sum(min(int(res.get(name, 0.0) / amount + 1e-9) for name, amount in bundle.items()) for res in nodes)


def shortfall(nodes: Sequence[dict[str, float]], bundle: dict[str, float], workers: int) -> str:
    """Names the resources that keep ``workers`` bundles from fitting, e.g. 'GPU: 2 needed (1 per worker), 0 in
    the cluster'."""
    missing = []
    for name, amount in bundle.items():
        if placeable(nodes, {name: amount}) < workers:
            total = sum(res.get(name, 0.0) for res in nodes)
            missing.append(f"{name}: {amount * workers:g} needed ({amount:g} per worker), {total:g} in the cluster")
    if missing:
        return "; ".join(missing)
    return f"no node holds a whole worker ({_fmt(bundle)}) often enough for {workers} workers"


def _fmt(bundle: dict[str, float]) -> str:
    return ", ".join(f"{name}={amount:g}" for name, amount in bundle.items())


# ---------------------------------------------------------------- the actor: one rank


def exit_quietly_on_sigterm() -> None:
    """Replace Ray's worker SIGTERM handler with an immediate, silent exit (status 1, as Ray's).

    Ray sends SIGTERM to the surviving ranks when the driver kills them after a loss or at the end of a job.
    Its own handler raises ``SystemExit``; when the signal lands while the main thread runs a weakref or GC
    callback, Python prints that exception as an "ignored" traceback, which Ray forwards to the user's
    terminal after the run's clean error message. A replica holds nothing to flush (records are the driver's),
    so exiting at once loses nothing. Call on the main thread."""

    def handler(signum: int, frame: object) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)

    signal.signal(signal.SIGTERM, handler)


class Replica:
    """One Ray actor = one rank with a full model replica. Threaded (max_concurrency=2): ``poll`` answers while
    ``run`` generates. Only rank 0 queues messages; they are drained by the driver in order."""

    def __init__(self) -> None:
        exit_quietly_on_sigterm()  # the constructor runs on the actor's main thread, where handlers are set
        self.worker: Any = None
        self.outbox: list[tuple] = []
        self.lock = threading.Lock()
        self.threads = 0  # this rank's own thread count (model.threads resolved at start)
        self.shared = 0  # its share of its node's threads once other groups there left (``share_threads``)

    def node(self) -> dict[str, Any]:
        import ray

        return {"ip": ray.util.get_node_ip_address(), "host": socket.gethostname(), "pid": os.getpid()}

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def check_model(self, path: str, cache_dir: str, rank: int) -> None:
        """Before loading anything: is the model path visible on this node? Names the node when it is not."""
        from lp_runner.models.loading import ModelError, resolve_model_path

        try:
            resolve_model_path(path, cache_dir or None)
        except ModelError as exc:
            info = self.node()
            raise ModelError(f"worker rank {rank} on node {info['ip']} ({info['host']}): {exc}") from None

    def start(
        self, cfg_data: dict, env: dict[str, str], specs: list[PromptSpec]
    ) -> tuple[float, int, list[int], list[tuple[int, dict]]]:
        """Join the group, load the replica and tokenize the job's ``specs`` once: exactly what a torchrun worker
        does. Returns the load seconds, the generations its policy keeps in flight (``run.batch``, never more
        than the job's prompts), the job's queue order (``JobPrompts.order``, the same on every rank) and, on
        rank 0, the error records of the prompts that cannot run (``run.on_error=skip``)."""
        from lp_runner.collector import worker_start_up
        from lp_runner.jobs.worker import error_records, start_worker

        os.environ.update(env)
        setup_logging(env.get(LEVEL_ENV, "INFO"))  # the driver's --log-level; lines reach the driver's stderr
        with worker_start_up():  # the actor's one worker: its start-up's objects out of later collections
            self.worker = start_worker(config_from_dict(cfg_data), specs)
        import torch

        self.threads = torch.get_num_threads()
        errors = error_records(self.worker.prompts, self.worker.error_record) if self.worker.is_main else []
        return self.worker.load_s, self.worker.policy.batch, self.worker.prompts.order(), errors

    def share_threads(self, node_ranks: int, idle_mask: int, index: int) -> None:
        """Groups of this job on this node have no more work (the driver's ``_share_cores``): from the next round
        on, run on this rank's share of the threads all ``node_ranks`` ranks had (``shared_threads``; bit i of
        ``idle_mask`` set: slot i left; this rank is slot ``index``). Called while ``run`` generates (the actor is
        threaded); ``run``'s own thread applies it, since a forward uses its calling thread's count."""
        from lp_runner.parallel.cores import shared_threads

        self.shared = shared_threads(self.threads, node_ranks, idle_mask, index)

    def fingerprint(self) -> str:
        """The loaded model's weights checksum (what ``--resume`` compares with the output's records)."""
        from lp_runner.jobs.worker import model_checksum

        return model_checksum(self.worker.adapter.model)

    def run(
        self,
        queue: Any,
        lane: int,
        groups: int,
        resume: list[tuple[int, list[int], int]],
        finished: Sequence[tuple[list[int], list[int]]],
        stream: bool,
    ) -> None:
        """The job loop (``worker.run_jobs``) on this rank, fed by the driver's queue (``_Queue``) as a torchrun
        group is fed by the store: a slot that frees claims the next prompt of the queue order for ``lane``
        (rank 0 asks, its group takes its answer). ``resume``: (index, committed tokens, characters streamed) of
        the prompts this lane's lost group had in flight, run first from their prefixes. ``finished``: (prompt
        ids, output ids) of the records this lane wrote, in order: a rebuilt group's job store (``pool_scope:
        job``) starts from them, as the lost group's held them. ``groups``: lanes sharing the queue.

        Rank 0 queues ("tokens", i, ids), ("text", i, str) and ("record", i, rec), i the prompt's index in the
        driver's list; the driver polls them."""
        from lp_runner.jobs.worker import PromptFeed, TextStreamer, run_jobs
        from lp_runner.parallel.groups import claim_for_group

        worker = self.worker
        if worker.store is not None:
            for prompt_ids, output_ids in finished:
                worker.store.add(prompt_ids, output_ids)
        main = worker.comm.rank == 0
        prefixes = {i: committed for i, committed, _ in resume}
        printed = {i: chars for i, _, chars in resume}
        streamers: dict[int, TextStreamer] = {}

        def on_commit(i: int, tokens: Sequence[int]) -> None:
            self._take_shared_threads()
            if not main:
                return
            self._send(("tokens", i, list(tokens)))
            if stream:
                if i not in streamers:  # resumed: continue after the text the driver already printed

                    def write(text: str, at: int = i) -> None:
                        if text:
                            self._send(("text", at, text))

                    streamers[i] = TextStreamer(worker.tokenizer, write, prefixes.get(i, ()), printed.get(i, 0))
                streamers[i](tokens)

        claims = _LaneClaims(queue, lane) if main else None
        post = (lambda i, rec: self._send(("record", i, rec))) if main else None
        first = [i for i, _, _ in resume]
        feed = PromptFeed(worker.prompts.order(), lambda: claim_for_group(claims, worker.comm), post, groups, 0, first)
        policy = worker.policy
        self._take_shared_threads()
        run_jobs(worker.engine(policy), policy, worker.prompts, feed, worker.record, on_commit, prefixes)

    def _take_shared_threads(self) -> None:
        import torch

        if self.shared and self.shared != torch.get_num_threads():
            log.info("a group on this node has no more work: %d threads", self.shared)
            torch.set_num_threads(self.shared)

    def save_store(self, path: str) -> None:
        """``advanced.pool_out`` with D > 1 groups: lane 0's store, saved once after the job (as torchrun saves group
        0's)."""
        from lp_runner.jobs.worker import save_store

        save_store(self.worker.store, path, self.worker.tokenizer)

    def poll(self) -> list[tuple]:
        with self.lock:
            out, self.outbox = self.outbox, []
        return out

    def _send(self, message: tuple) -> None:
        with self.lock:
            self.outbox.append(message)


class _Queue:
    """The job's queue on Ray, a small actor of the driver's: positions of the queue order (``JobPrompts.order``)
    handed out one claim at a time, as the launcher's store hands them to torchrun groups (``JobQueue``), and
    which lane claimed each, so the driver knows what a lost group had in flight (claimed, no record yet)."""

    def __init__(self) -> None:
        self.next = 0
        self.claims: dict[int, list[int]] = {}

    def claim(self, lane: int) -> int:
        """The next position (past the end of the order: nothing left), remembered as ``lane``'s."""
        k, self.next = self.next, self.next + 1
        self.claims.setdefault(lane, []).append(k)
        return k

    def claimed(self, lane: int) -> list[int]:
        return list(self.claims.get(lane, []))


class _LaneClaims:
    """A group leader's side of the driver's queue (``claim_for_group`` asks it; its peers take its answer)."""

    def __init__(self, queue: Any, lane: int) -> None:
        self.queue = queue
        self.lane = lane

    def claim(self) -> int:
        import ray

        return ray.get(self.queue.claim.remote(self.lane))


class _RemoteQueue:
    """The driver's handle on the ``_Queue`` actor: the same two calls, answered."""

    def __init__(self, ray: Any, actor: Any) -> None:
        self.ray = ray
        self.actor = actor

    def claim(self, lane: int) -> int:
        return self.ray.get(self.actor.claim.remote(lane))

    def claimed(self, lane: int) -> list[int]:
        return self.ray.get(self.actor.claimed.remote(lane))


# ---------------------------------------------------------------- driver side


@dataclass
class _Group:
    """One generation of actors: a placement group and P ranks in one torch.distributed group."""

    ray: Any
    pg: Any
    actors: list[Any]
    load_s: float = 0.0
    batch: int = 1  # generations in flight (its policy's ``run.batch``)
    order: list[int] = field(default_factory=list)  # the job's queue order, as its ranks computed it
    errors: list[tuple[int, dict]] = field(default_factory=list)  # (index, error record) of the unusable prompts
    ips: list[str] = field(default_factory=list)  # each rank's node
    unread: list[Any] = field(default_factory=list)  # calls given up on before they answered (read at teardown)

    @property
    def size(self) -> int:
        return len(self.actors)

    def get(self, ref: Any, timeout: float) -> Any:
        """``ray.get`` of one call to this group; a call given up on (timed out) is read at teardown."""
        try:
            return self.ray.get(ref, timeout=timeout)
        except self.ray.exceptions.GetTimeoutError:
            self.unread.append(ref)
            raise

    def teardown(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):  # already dead
                self.ray.kill(actor, no_restart=True)
        self.actors = []
        self._read_unread()
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None

    def _read_unread(self) -> None:
        """Read the calls the driver gave up on, now that their actors are gone (they end within moments).

        Why: Ray prints an "Unhandled error" dump, the remote traceback included, for every failed call whose
        result nobody read, when its ref is freed; e.g. the surviving rank's ``run`` (DistributedError) after the
        driver gave up on a stopped rank 0. The failure is reported already (one warning or error line); reading
        the result marks it handled. A call still unfinished after UNREAD_WAIT_S goes to Ray's log filter
        (``_UnhandledToFile``)."""
        refs, self.unread = self.unread, []
        if not refs:
            return
        with contextlib.suppress(Exception):
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=UNREAD_WAIT_S)
            for ref in ready:
                with contextlib.suppress(Exception):
                    self.ray.get(ref, timeout=0)


@dataclass
class _Progress:
    """What the driver knows from rank 0: finished prompts and the committed prefix of unfinished ones."""

    total: int
    records: dict[int, dict] = field(default_factory=dict)
    committed: dict[int, list[int]] = field(default_factory=dict)
    printed: dict[int, int] = field(default_factory=dict)  # characters of streamed text per prompt
    rounds: dict[int, int] = field(default_factory=dict)  # rounds (forwards) seen per prompt since its start
    recovery: dict[int, list[dict]] = field(default_factory=dict)  # per prompt: the recoveries it went through

    def todo(self) -> list[int]:
        return [i for i in range(self.total) if i not in self.records]


def run_on_ray(
    cfg: Config, specs: list[PromptSpec], output: OutputFile | str | None, single: bool | None = None
) -> int:
    """``parallel.backend=ray``: run the prompts on P Ray actors; same outputs, stream and summary as torchrun.

    ``output``: the CLI's opened (locked, checked) output file, or a path to a new one. ``single`` (stream the
    text) defaults to "one prompt given with --prompt" (the CLI names it 'prompt'). SIGTERM to the driver ends
    the run like Ctrl-C (KeyboardInterrupt): the actors are killed and a local instance is stopped."""
    ray = _import_ray()
    if single is None:
        single = len(specs) == 1 and specs[0].id == "prompt"
    opened = isinstance(output, (str, Path))
    sink = OutputFile.open(output, "new", cfg) if opened else output
    connected = ray.is_initialized()  # an embedding program's own connection: reused, left open
    previous = signal.getsignal(signal.SIGTERM)
    code = 1
    unhandled = _UnhandledToFile(Path(tempfile.gettempdir()) / f"lp_runner-ray-{os.getpid()}.log")
    try:
        with unhandled:  # until the refs are freed (ray.shutdown)
            try:
                if not connected:
                    _connect(ray, cfg)
                # after ray.init, which installs its own SIGTERM handler (a C++ stack dump and no message)
                signal.signal(signal.SIGTERM, _interrupt)
                code = _Driver(ray, cfg, specs, sink, single).run()
                return code
            finally:
                if not connected and ray.is_initialized():
                    ray.shutdown()  # stops the local instance we started; only disconnects from a cluster
    finally:
        if opened and sink is not None:
            sink.close(complete=code == 0)
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class _UnhandledToFile(logging.Filter):
    """Ray's "Unhandled error" reports (a failed call's result freed unread, with the remote traceback) go to a
    log file instead of the terminal, for the run's life.

    The driver reads every failed call it can (``_Group.unread``), but a call of a stopped actor may end only
    after its group's teardown gave up waiting; its failure was already reported in one line (a recovery warning
    or the run's error). Ray logs the report on ``ray._private.worker``; other records pass unchanged."""

    LOGGER = "ray._private.worker"
    PREFIX = "Unhandled error"

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.written = 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.PREFIX):
            return True
        with contextlib.suppress(OSError), open(self.path, "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")
            self.written += 1
        return False

    def __enter__(self) -> _UnhandledToFile:
        logging.getLogger(self.LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(self.LOGGER).removeFilter(self)
        if self.written:
            log.debug("Ray's reports of %d failed calls read after their failure: %s", self.written, self.path)


class _Driver:
    def __init__(self, ray: Any, cfg: Config, specs: list[PromptSpec], output: OutputFile | None, single: bool):
        self.ray = ray
        self.load_s = 0.0
        self.cfg = cfg
        done = output.done if output is not None else set()
        self.output = output
        self.specs = [s for s in specs if s.id not in done]  # --resume: only what the output lacks
        # --resume under pool_scope: job: every lane's store starts from the records already written, in job order
        self.resumed = output.finished_outputs([s.id for s in specs]) if output is not None else []
        self.stream = single and cfg.run.stream
        self.progress = _Progress(len(self.specs))
        self.recoveries: list[list[dict]] = []  # per lost group: the recovery events of the prompts it split
        self.run_id = uuid.uuid4().hex[:8]
        self.groups = cfg.parallel.groups
        # one driver thread per lane (LP group); progress, the report and the queue order under one lock
        self.lock = threading.RLock()
        self.queue: Any = None  # the job's queue (``_Queue``): made by ``run``
        self.order: list[int] | None = None  # the queue order, as the first group to start computed it
        self.lanes: dict[int, _Group] = {}  # the lanes' current groups (torn down by the main thread on a stop)
        self.lane_finished: dict[int, list[tuple[list[int], list[int]]]] = {}  # per lane: its store's content
        self.node_slots: dict[str, list[tuple[int, int]]] = {}  # per node: (lane, rank) of every actor placed there
        self.idle_lanes: set[int] = set()  # lanes whose groups finished with the queue empty (their cores freed)
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.weights_checked = False
        self.report = Report(cfg, output, len(specs), len(specs) - len(self.specs), progress=not single)

    # -- the elastic loop

    def run(self) -> int:
        par = self.cfg.parallel
        self.bundle = worker_bundle(par, self.ray.cluster_resources().get("GPU", 0.0), self.cfg.model.device)
        nodes, needed = self._nodes(), par.workers * par.groups
        if placeable(nodes, self.bundle) < needed:
            raise RayClusterError(
                f"the Ray cluster cannot hold {needed} workers with {_fmt(self.bundle)} each: "
                f"{shortfall(nodes, self.bundle, needed)}; lower parallel.workers, parallel.groups or the "
                "per-worker resources"
            )
        actor = self.ray.remote(_Queue).options(name=f"lp_runner-{self.run_id}-queue", num_cpus=0).remote()
        self.queue = _RemoteQueue(self.ray, actor)
        try:
            self._run_lanes()
        finally:
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
        self._finish()
        return 0

    def _run_lanes(self) -> None:
        """Run the D lanes at once (D = 1: one); the first fatal error (or Ctrl-C) stops them all and tears down
        their actors."""
        threads = [
            threading.Thread(target=self._lane_main, args=(lane,), name=f"lp_runner-lane{lane}", daemon=True)
            for lane in range(self.groups)
        ]
        for thread in threads:
            thread.start()
        try:
            while any(t.is_alive() for t in threads):
                if self.errors:
                    self._stop_lanes()
                for thread in threads:
                    thread.join(POLL_S)
        except BaseException:
            self._stop_lanes()
            raise
        if self.errors:
            raise self.errors[0]

    def _stop_lanes(self) -> None:
        self.stop.set()
        with self.lock:
            groups = list(self.lanes.values())
        for group in groups:
            group.teardown()

    def _lane_main(self, lane: int) -> None:
        try:
            self._lane(lane)
        except _Stopped:
            pass
        except BaseException as exc:
            with self.lock:
                self.errors.append(exc)
            self.stop.set()

    def _lane(self, lane: int) -> None:
        """One LP group's elastic loop, the same for D = 1 and D > 1: start a group, run the job loop on it (each
        slot claims the next prompt from the driver's queue as its generation ends), leave when the queue is
        empty. A lost actor rebuilds this lane's group only (the other lanes go on), which resumes every prompt
        the lane had claimed and not written, each from its committed prefix.

        The lane's first claim is taken before its group starts: a lane that finds the queue empty starts
        nothing (two lanes, one prompt: one group loads the model)."""
        if self._claim(lane) >= len(self.specs):
            return
        workers, generation, lost_at, loss = self.cfg.parallel.workers, 0, None, []
        self.lane_finished[lane] = list(self.resumed)
        while True:
            group = None
            try:
                group = self._start_group(workers, generation, shrink=generation > 0, lane=lane)
                with self.lock:
                    if self.stop.is_set():
                        raise _Stopped
                    self.lanes[lane] = group
                    self._place(lane, group)
                    self._started(group)
                    check = not self.weights_checked and self.output is not None and bool(self.output.done)
                    self.weights_checked = True
                    if lost_at is not None:
                        _rebuilt(loss, lost_at, group.size)
                        lost_at = None
                if check:
                    self.output.check_weights(self.ray.get(group.actors[0].fingerprint.remote()))
                self._share_cores()  # a rebuilt group on a node that other lanes have left
                self._run_group(group, lane)
                if lane == 0 and self.cfg.run.pool_out:
                    self.ray.get(group.actors[0].save_store.remote(self.cfg.run.pool_out))
                with self.lock:
                    self.idle_lanes.add(lane)
                self._share_cores()
                return
            except _WorkerLost as lost:
                if self.stop.is_set():
                    raise _Stopped from None
                lost_at = time.monotonic()
                loss = self._recover(group, lane, str(lost), workers)
                if loss is None:  # the lost group had written every claim and the queue is empty
                    return
                workers = max(1, min(self.cfg.parallel.workers, placeable(self._nodes(), self.bundle)))
            finally:
                with self.lock:
                    self.lanes.pop(lane, None)
                if group is not None:
                    group.teardown()
            generation += 1

    def _claim(self, lane: int) -> int:
        """A position of the queue order claimed by the driver for ``lane`` (past ``len(self.specs)``: none left;
        none once the run is stopping)."""
        if self.stop.is_set():
            return len(self.specs)
        return self.queue.claim(lane)

    def _started(self, group: _Group) -> None:
        """A group started: the job's queue order (every group computes the same) and the error records of the
        prompts that cannot run, written once (D > 1: with no group, as torchrun's). Under the lock."""
        if self.order is None:
            self.order = group.order
        elif group.order != self.order:
            raise DistributedError("the groups ordered the job's prompts differently: is the tokenizer the same?")
        for i, rec in group.errors:
            if i not in self.progress.records:
                if self.groups > 1:
                    rec["group"] = None
                self._write(i, rec)

    def _in_flight(self, lane: int) -> list[int]:
        """The prompts ``lane`` claimed and has not written, in claim order: what its next group runs first. Before
        any group of the job started (no order known), no prompt has begun: the first unwritten one stands for
        the lane's claim."""
        claimed = self.queue.claimed(lane)
        with self.lock:
            if self.order is None:
                return self.progress.todo()[:1] if claimed else []
            order, records = self.order, self.progress.records
            return [order[k] for k in claimed if k < len(order) and order[k] not in records]

    def _place(self, lane: int, group: _Group) -> None:
        """Record where ``lane``'s (new) group runs: one slot per rank on its node (under the lock)."""
        for slots in self.node_slots.values():
            slots[:] = [slot for slot in slots if slot[0] != lane]
        for rank, ip in enumerate(group.ips):
            self.node_slots.setdefault(ip, []).append((lane, rank))

    def _share_cores(self) -> None:
        """``advanced.share_cores`` on Ray (CPU, D > 1): the threads of the lanes that have left a node go to the
        busy ranks still on it, as torchrun ranks share them through the store (``parallel/cores.py``). Only the
        cores this job held are shared: a lane that never started frees no reservation of its own. Each busy
        rank is told its node's slots and which left; it takes its share from its next round."""
        if not self.cfg.parallel.share_cores or self.bundle.get("GPU") or self.groups < 2:
            return
        calls = []
        with self.lock:
            for slots in self.node_slots.values():
                idle = sum(1 << i for i, (lane, _) in enumerate(slots) if lane in self.idle_lanes)
                if not idle:
                    continue
                for i, (lane, rank) in enumerate(slots):
                    group = self.lanes.get(lane)
                    if lane not in self.idle_lanes and group is not None and rank < group.size:
                        calls.append((group, group.actors[rank].share_threads.remote(len(slots), idle, i)))
        for group, ref in calls:
            with contextlib.suppress(Exception):  # a rank lost meanwhile: its lane's recovery deals with it
                group.get(ref, self.cfg.parallel.timeout_s)

    def _run_group(self, group: _Group, lane: int) -> None:
        """The job loop on the lane's group until the queue is empty: first the prompts the lane claimed and has
        not written (its lost group's, from their committed prefixes; a new lane's first claim), then a claim per
        generation that ends. Records come in the order they finish.

        The rebuilt store takes the lane's written outputs in the order they were written, as the lost group's
        store took them."""
        held = self._in_flight(lane)
        with self.lock:
            resume = [(i, list(self.progress.committed.get(i, [])), self.progress.printed.get(i, 0)) for i in held]
            finished = list(self.lane_finished[lane])
        refs = [a.run.remote(self.queue.actor, lane, self.groups, resume, finished, self.stream) for a in group.actors]

        def tick() -> None:
            if self.stop.is_set():
                raise _Stopped
            self._take(self._poll(group, self.cfg.parallel.timeout_s), lane)

        self._gather(group, refs, "the run", None, tick=tick)

    def _recover(self, group: _Group | None, lane: int, reason: str, workers: int) -> list[dict] | None:
        """Account for the loss of ``lane``'s group before it is rebuilt; returns the loss's recovery events, or
        None when nothing is left to run (no rebuild). The rebuilt group resumes every prompt the lane had claimed
        and not written (``_in_flight``), each from its committed prefix; when the loss came after every record
        of the lane was written (the actor died between its last poll and the end of its run), the lane claims
        the next prompt, from token 0: the group is rebuilt all the same, so the loss is counted and reported on
        the prompt that paid for it."""
        self._drain(group, lane)
        held = self._in_flight(lane)
        written = not held
        if written:
            self._claim(lane)
            held = self._in_flight(lane)
            if not held:
                log.warning("%s after its claim was written; nothing left to run", self._lost(lane, reason))
                return None
        with self.lock:
            loss = self._note_loss(group, held, self._lost(lane, reason), workers)
        self._warn_loss(loss, "its claim was written; starting" if written else "resuming")
        return loss

    def _lost(self, lane: int, reason: str) -> str:
        return f"group {lane}: {reason}" if self.groups > 1 else reason

    def _drain(self, group: _Group | None, lane: int) -> None:
        """Rank 0's messages sent after the driver's last poll: the tokens it committed before the loss (it cannot
        pass the round its peer failed in), and records it finished."""
        if group is not None and group.actors:
            with contextlib.suppress(Exception):
                self._take(group.get(group.actors[0].poll.remote(), min(5.0, self.cfg.parallel.timeout_s)), lane)

    def _note_loss(self, group: _Group | None, todo: list[int], lost: str, workers: int) -> list[dict]:
        """Count a lost group against ``advanced.max_restarts`` and return its recovery events: one per prompt of
        ``todo`` (the unfinished prompts the rebuilt group runs, in order) whose generation it split, i.e. that
        had committed a round; the first of ``todo`` when none had (a loss between prompts or before the first
        round). Each event goes on its prompt's record (``_write``).

        Example: a batch-3 group had [a, b, c] in flight, a written, b at 37 tokens, c not started (the group lost
        before c's first round): events for b only (``resumed_at_token`` 37); c starts over from token 0, losing
        nothing it had committed. Call under the lock."""
        limit = self.cfg.parallel.max_restarts
        if len(self.recoveries) >= limit:
            raise DistributedError(
                f"gave up after {len(self.recoveries)} recoveries (advanced.max_restarts={limit}); last failure: {lost}"
            )
        progress = self.progress
        split = [i for i in todo if progress.rounds.get(i, 0)] or todo[:1]
        loss = [
            {
                "lost": lost,
                "prompt": self.specs[i].id,
                "resumed_at_token": len(progress.committed.get(i, [])),
                "rounds_before": progress.rounds.get(i, 0),
                "workers_before": group.size if group is not None else workers,
                "workers_after": None,
                "seconds": None,
            }
            for i in split
        ]
        self.recoveries.append(loss)
        for i, event in zip(split, loss, strict=True):
            progress.recovery.setdefault(i, []).append(event)
        return loss

    def _warn_loss(self, loss: list[dict], say: str) -> None:
        log.warning(
            "%s; %s %s (recovery %d/%d)",
            loss[0]["lost"],
            say,
            resumed_prompts(loss),
            len(self.recoveries),
            self.cfg.parallel.max_restarts,
        )

    # -- one group

    def _start_group(self, workers: int, generation: int, shrink: bool, lane: int) -> _Group:
        """Place ``workers`` actors (fewer, down to 1, when ``shrink`` and the cluster lost capacity), check the
        model path on each, then start them together: they rendezvous, load their replicas and tokenize the job's
        prompts.

        ``lane``: which of the ``parallel.groups`` LP groups this is: its own placement group, actor names
        ``lp_runner-<run>-d<lane>-g<generation>-rank<r>`` (D = 1: ``lp_runner-<run>-g<generation>-rank<r>``) and
        rendezvous; each actor sees a one-group job (``parallel.groups = 1``) and saves no store itself (the
        driver asks lane 0's rank 0 at the end)."""
        ray, par = self.ray, self.cfg.parallel
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        while True:
            pg = placement_group([dict(self.bundle) for _ in range(workers)], strategy="PACK")
            ready, _ = ray.wait([pg.ready()], timeout=par.placement_timeout_s)
            if ready:
                break
            remove_placement_group(pg)
            if not shrink or workers == 1:
                avail = ray.available_resources()
                have = _fmt({k: avail.get(k, 0.0) for k in self.bundle})
                raise RayClusterError(
                    f"the Ray cluster did not free {workers} x ({_fmt(self.bundle)}) within "
                    f"advanced.placement_timeout_s={par.placement_timeout_s:g} s (available now: {have})"
                )
            workers -= 1
        group = _Group(ray, pg, [])
        custom = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        actor_cls = ray.remote(Replica)
        for rank in range(workers):
            options = dict(
                num_cpus=self.bundle.get("CPU", 0.0),
                num_gpus=self.bundle.get("GPU", 0.0),
                resources=custom,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
                name=f"lp_runner-{self.run_id}{'' if self.groups == 1 else f'-d{lane}'}-g{generation}-rank{rank}",
                max_restarts=0,
                max_concurrency=2,
            )
            group.actors.append(actor_cls.options(**options).remote())
        try:
            infos = self._gather(group, [a.node.remote() for a in group.actors], "start", par.placement_timeout_s)
            self._gather(
                group,
                [
                    a.check_model.remote(self.cfg.model.path, self.cfg.model.cache_dir, rank)
                    for rank, a in enumerate(group.actors)
                ],
                "model check",
                par.placement_timeout_s,
            )
            port = self._gather(group, [group.actors[0].free_port.remote()], "start", par.timeout_s)[0]
            cfg_data = self.cfg.to_dict()
            cfg_data["parallel"]["workers"] = workers
            cfg_data["model"]["threads"] = actor_threads(self.cfg.model.threads, self.bundle)
            cfg_data["parallel"]["groups"] = 1
            cfg_data["run"]["pool_out"] = ""  # the driver has lane 0's rank 0 save it after the job
            refs = []
            for rank, actor in enumerate(group.actors):
                same_node = [r for r, info in enumerate(infos) if info["ip"] == infos[rank]["ip"]]
                env = {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(workers),
                    # a GPU actor sees only its own GPU(s) (CUDA_VISIBLE_DEVICES), so its device index is 0
                    "LOCAL_RANK": "0" if self.bundle.get("GPU") else str(same_node.index(rank)),
                    "LOCAL_WORLD_SIZE": "1" if self.bundle.get("GPU") else str(len(same_node)),
                    "MASTER_ADDR": infos[0]["ip"],
                    "MASTER_PORT": str(port),
                    LEVEL_ENV: level_name(),
                }
                refs.append(actor.start.remote(cfg_data, env, self.specs))
            group.load_s, group.batch, group.order, group.errors = self._gather(group, refs, "start", None)[0]
            group.ips = [info["ip"] for info in infos]
        except BaseException:
            group.teardown()
            raise
        return group

    def _gather(
        self,
        group: _Group,
        refs: list,
        phase: str,
        timeout: float | None,
        tick: Callable[[], None] | None = None,
    ) -> list:
        """Every ref's result (calls to ``group``'s actors), calling ``tick`` every POLL_S while waiting (rank 0's
        messages during a run). Refs not read when it raises are left to the group's teardown (``_Group.unread``).

        Failures: an actor that died, or did not answer within ``timeout``, raises _WorkerLost. After the first
        failure the other ranks get START_GRACE_S to report theirs, so the root cause wins over its echo: rank 1
        killed -> rank 0 raises DistributedError at once, and the driver still reports "rank 1 was lost". A
        rank's own LPError (model not visible, bad prompt) is fatal; a DistributedError (a rank saw its peer
        fail) means a lost worker during a run, and is fatal during start-up (config or weights mismatch).
        """
        read: set[Any] = set()
        try:
            return self._gather_refs(refs, phase, timeout, tick, read)
        except BaseException:
            group.unread.extend(ref for ref in refs if ref not in read)
            raise

    def _gather_refs(
        self, refs: list, phase: str, timeout: float | None, tick: Callable[[], None] | None, read: set[Any]
    ) -> list:
        """``_gather``'s loop; ``read`` collects the refs whose result (or failure) it took."""
        ray = self.ray
        pending, results, failures, grace_started = list(refs), {}, [], False
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            wait_s = POLL_S if tick is not None else None
            if deadline is not None:
                wait_s = max(0.0, min(math.inf if wait_s is None else wait_s, deadline - time.monotonic()))
            ready, pending = ray.wait(pending, num_returns=len(pending) if tick else 1, timeout=wait_s)
            if tick is not None and not failures:
                tick()
            for ref in ready:
                read.add(ref)
                try:
                    results[ref] = ray.get(ref)
                except Exception as exc:
                    failures.append((refs.index(ref), self._classify(exc, refs.index(ref))))
            if failures and not grace_started:
                grace_started = True
                grace = time.monotonic() + START_GRACE_S
                deadline = grace if deadline is None else min(deadline, grace)
            if pending and deadline is not None and time.monotonic() >= deadline:
                break
        if failures:
            raise self._root_cause(failures, during_run=tick is not None)
        if pending:
            raise _WorkerLost(f"a worker did not answer during {phase} within {timeout:g} s")
        if tick is not None:
            tick()
        return [results[r] for r in refs]

    @staticmethod
    def _root_cause(failures: list[tuple[int, BaseException]], during_run: bool) -> BaseException:
        failures = sorted(failures, key=lambda f: f[0])  # the lowest rank's report when several ranks failed
        for _, exc in failures:
            if isinstance(exc, _WorkerLost):
                return exc
        for _, exc in failures:
            if not isinstance(exc, DistributedError):
                return exc
        rank, exc = failures[0]
        return _WorkerLost(f"worker rank {rank} reported: {exc}") if during_run else exc

    def _classify(self, exc: BaseException, rank: int) -> BaseException:
        """A Ray failure -> _WorkerLost (recoverable) or the LPError to show (fatal); other errors are bugs."""
        ex = self.ray.exceptions
        if isinstance(exc, ex.RuntimeEnvSetupError):
            return RayClusterError(f"the Ray workers' environment could not be set up: {first_line(exc)}")
        lost_types = (ex.RayActorError, ex.WorkerCrashedError, ex.NodeDiedError, ex.OutOfMemoryError)
        if isinstance(exc, lost_types):
            return _WorkerLost(f"worker rank {rank} was lost ({first_line(exc)})")
        if isinstance(exc, ex.RayTaskError):
            cause = exc.cause
            if isinstance(cause, LPError):
                return cause
            if isinstance(cause, lost_types):
                return _WorkerLost(f"worker rank {rank} was lost ({first_line(cause)})")
        raise exc

    def _poll(self, group: _Group, timeout: float) -> list[tuple]:
        try:
            return group.get(group.actors[0].poll.remote(), timeout)
        except self.ray.exceptions.GetTimeoutError:
            raise _WorkerLost(f"worker rank 0 did not answer within parallel.timeout_s={timeout:g} s") from None
        except Exception as exc:
            kind = self._classify(exc, 0)
            raise kind from None

    # -- results

    def _take(self, messages: list[tuple], lane: int) -> None:
        """Rank 0's messages into the progress; ``lane``: the group that sent them, for the records (D > 1) and
        the store a rebuilt group of the lane starts from."""
        progress = self.progress
        with self.lock:
            for kind, i, payload in messages:
                if i in progress.records:
                    continue
                if kind == "tokens":
                    progress.committed.setdefault(i, []).extend(payload)
                    progress.rounds[i] = progress.rounds.get(i, 0) + 1
                elif kind == "text":
                    write_stdout(payload)
                    progress.printed[i] = progress.printed.get(i, 0) + len(payload)
                elif kind == "record":
                    if self.groups > 1:
                        payload["group"] = lane
                    self.lane_finished.setdefault(lane, []).append((payload["prompt_ids"], payload["output_ids"]))
                    self._write(i, payload)

    def _write(self, i: int, rec: dict) -> None:
        if i in self.progress.recovery and "error" not in rec:
            rec["recovery"] = self.progress.recovery[i]
            whole_generation(rec, self.progress.recovery[i][-1]["rounds_before"])
        self.progress.records[i] = rec
        self.progress.committed.pop(i, None)
        self.report.record(rec)

    def _finish(self) -> None:
        self.report.close_bar()
        if self.stream:
            write_stdout("\n")
        records = [self.progress.records[i] for i in range(len(self.specs))]
        workers = next((r["workers"] for r in reversed(records) if "workers" in r), self.cfg.parallel.workers)
        self.report.finish(self.load_s, workers, self.recoveries, self.cfg.parallel.groups)

    # -- cluster queries

    def _nodes(self) -> list[dict[str, float]]:
        return [n["Resources"] for n in self.ray.nodes() if n.get("Alive")]


def _rebuilt(loss: list[dict], lost_at: float, workers: int) -> None:
    """The rebuilt group started: every event of its loss gains the seconds it took and its size (mutates)."""
    for event in loss:
        event.update(seconds=round(time.monotonic() - lost_at, 3), workers_after=workers)


def whole_generation(rec: dict, rounds_before: int) -> None:
    """A record resumed after a lost worker counts the whole generation (mutates ``rec``).

    The resumed group's record counts only its own forwards and tokens; ``rounds_before``: the forwards the
    lost group(s) ran for this prompt (one per committed round the driver saw). Example: 3 rounds (20 tokens)
    before the loss, 13 forwards for the remaining 76 tokens -> forwards 16, new tokens 96 in record and stats.
    ``seconds`` stays the resumed part's (the lost part's time is not known exactly)."""
    stats = rec["stats"]
    stats["forwards"] += rounds_before
    stats["rounds"] += rounds_before
    stats["new_tokens"] = rec["new_tokens"]
    rec["forwards"] = stats["forwards"]
    tpf = round(rec["new_tokens"] / rec["forwards"], 4) if rec["forwards"] else 0.0
    rec["tokens_per_forward"] = stats["tokens_per_forward"] = tpf


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(RAY_MISSING) from None
    return ray


def _connect(ray: Any, cfg: Config) -> None:
    """Connect to parallel.ray_address or $RAY_ADDRESS; with neither, start a local instance (stopped at exit)."""
    par = cfg.parallel
    address = par.ray_address or os.environ.get("RAY_ADDRESS", "")
    if not address or address == "local":
        # the machine's real cores: workers that need more fail the capacity check instead of oversubscribing
        ray.init(address="local", num_cpus=local_cpus(), include_dashboard=False, logging_level=logging.WARNING)
        return
    if address.startswith(("http://", "https://")):
        raise RayClusterError(
            f"Ray address {address} is a dashboard (job submission) address: submit with `ray job submit` "
            "(launch/ray_submit.sh), or give the cluster's GCS address host:port (usually port 6379)"
        )
    _check_reachable(address)
    failure, log = _init_quietly(ray, address=address, logging_level=logging.WARNING, runtime_env=_code_runtime_env())
    if failure is None:
        sys.stderr.write(log)
        return
    if "InvalidAuthToken" in log or "Unauthenticated" in log:
        raise RayClusterError(
            f"the Ray cluster at {address} requires an authentication token: set RAY_AUTH_MODE=token and "
            "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token"
        )
    raise RayClusterError(f"cannot connect to the Ray cluster at {address}: {first_line(failure)}")


def _init_quietly(ray: Any, **kwargs: Any) -> tuple[Exception | None, str]:
    """``ray.init(**kwargs)`` with file descriptor 2 in a temporary file: while Ray's C++ client connects, its
    retries print one warning a second, and the only word on a missing auth token is in them. Returns (the
    failure or None, what was printed)."""
    failure = None
    with tempfile.TemporaryFile() as sink:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            ray.init(**kwargs)
        except Exception as exc:  # ConnectionError, RuntimeError: no cluster there, or a version mismatch
            failure = exc
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        sink.seek(0)
        return failure, sink.read().decode(errors="replace")


def local_cpus() -> int:
    """Cores this process may run on (its affinity mask, e.g. a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _code_runtime_env() -> dict | None:
    """Ship this lp_runner package to the cluster's workers, unless the job already carries the code: a job
    submitted with a working_dir or py_modules (``ray job submit --working-dir .``). A local instance needs
    nothing: its workers inherit this process's environment."""
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    job_env = job.get("runtime_env") or {}
    if job_env.get("working_dir") or job_env.get("py_modules"):
        return None
    return {"py_modules": [str(Path(__file__).resolve().parents[1])]}  # the lp_runner package


def _check_reachable(address: str) -> None:
    """A TCP connect to host:port first: ray.init retries an unreachable GCS for minutes before giving up."""
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto" and friends: ray.init resolves them and fails fast itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise RayClusterError(
            f"cannot reach the Ray cluster at {address} ({exc.strerror or exc}); check parallel.ray_address / "
            "RAY_ADDRESS, or start a cluster with `ray start --head`"
        ) from None

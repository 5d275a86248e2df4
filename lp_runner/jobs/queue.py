"""One job over D LP groups (``parallel.groups = D > 1``): each group runs the one job loop (``worker.run_jobs``)
fed from the job's queue in the launcher's store.

Every rank holds the job's prompts, tokenized and checked at start-up (``Worker.prompts``, the same everywhere);
each group takes the next prompt of the one queue order (``JobPrompts.order``: longest first) whenever a slot of
its batch frees, whichever group is free (``worker.PromptFeed`` over ``JobQueue``). The engine, the round protocol
and the policy are those of a one-group job, so every prompt's greedy output is the one D = 1 gives (sampling
streams are keyed by prompt id, not by order). World rank 0 writes every record, in the order they finish, each
with its ``group``; a bad prompt's error record (``run.on_error=skip``) comes first and carries no group (no
group ran it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from lp_runner.config import ParallelConfig
from lp_runner.errors import DistributedError, first_line
from lp_runner.jobs.prompts import JobPrompts
from lp_runner.jobs.worker import (
    PromptFeed,
    TextStreamer,
    Worker,
    error_records,
    run_jobs,
    save_store,
)
from lp_runner.parallel.cores import CoreShare
from lp_runner.parallel.groups import JobQueue, RecordCollector, claim_for_group, store_client
from lp_runner.tuning.policy import RoundPolicy


def run_queued(
    worker: Worker,
    prompts: JobPrompts,
    on_record: Callable[[dict], None] | None = None,
    stream: Callable[[str], None] | None = None,
) -> list[dict]:
    """Generate ``prompts`` across the job's groups; on world rank 0, every record (also passed to ``on_record``,
    from its collector thread) in the order they finished; elsewhere [].

    ``stream`` (world rank 0, a single prompt): the text as group 0 commits it, or the whole text when another
    group ran the prompt."""
    layout = worker.layout
    if layout is None:
        raise ValueError("run_queued needs a worker started with parallel.groups > 1")
    timeout_s = worker.cfg.parallel.timeout_s
    policy = worker.policy or RoundPolicy.fixed(worker.cfg.lookahead)
    engine = worker.engine(policy)  # its store is this group's own (pool_scope=job): fed by the prompts it ran
    order = prompts.order()
    records: list[dict] = []

    def deliver(rec: dict) -> None:  # world rank 0 only: the one writer
        records.append(rec)
        if stream is not None and rec.get("group") != worker.group:
            stream(rec.get("text", ""))
        if on_record is not None:
            on_record(rec)

    collector = None
    if worker.is_main:
        for _, rec in error_records(prompts, worker.error_record):
            rec["group"] = None
            deliver(rec)
        collector = RecordCollector(layout, len(order), timeout_s, deliver)
        collector.start()
    queue = JobQueue(store_client(timeout_s), worker.group) if worker.comm.rank == 0 else None
    cores = share_cores(worker.device, worker.cfg.parallel)
    streamer = TextStreamer(worker.tokenizer, stream) if stream is not None and worker.is_main else None

    def on_commit(i: int, tokens: Sequence[int]) -> None:
        for hook in (streamer, cores):
            if hook is not None:
                hook(tokens)

    post = None if queue is None else lambda i, rec: queue.post(rec)
    # a claim whenever a slot of the group frees: every rank of it takes the leader's
    feed = PromptFeed(order, lambda: claim_for_group(queue, worker.comm), post, groups=layout.groups)
    try:
        run_jobs(engine, policy, prompts, feed, worker.record, on_commit if streamer or cores else None)
        if cores is not None:
            cores.leave()
        if queue is not None:
            queue.finish()
    except BaseException as exc:
        if queue is not None:  # rank 0 names the failed group at once instead of waiting out its heartbeat
            with contextlib.suppress(Exception):
                queue.fail(first_line(exc))
        raise
    finally:
        if worker.heartbeat is not None:
            worker.heartbeat.stop()
    if collector is not None:
        collector.join()
        if collector.error is not None:
            raise DistributedError(collector.error)
    if worker.is_main:  # world rank 0: group 0's store (each group keeps its own)
        save_store(worker.store, worker.cfg.run.pool_out, worker.tokenizer)
    return records


def share_cores(device: torch.device, parallel: ParallelConfig) -> CoreShare | None:
    """This rank's part in giving an idle group's cores to the busy ones (``parallel/cores.py``): CPU ranks with
    ``advanced.share_cores`` that share their node with other ranks; None elsewhere (a GPU's speed does not come
    from the host's threads)."""
    if device.type != "cpu" or not parallel.share_cores:
        return None
    return CoreShare.from_env(lambda: store_client(parallel.timeout_s))

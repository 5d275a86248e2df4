"""The round loop of one rank: which generations are in flight, one forward and one exchange per round for all
of them, and a new prompt joining as soon as one finishes (in-flight refill).

    refill   while fewer than ``batch`` generations are in flight, the next job joins (its prompt is its first
             round's ordinary rows: its prefill rides in the same forward as the others' rounds)
    round    every generation plans and lays out its rows; ONE forward over all of them (``ModelAdapter.run``); ONE
             read-back; each verifies its candidates; ONE exchange for all of them (``exchange.agree_batch``:
             under LP one all_gather per round whatever the batch); each commits its decision; each records the
             round (the forward's time, rows and generations are the round's, shared)
    retire   generations that hit EOS or their budget close (their output joins the job store, in the order they
             sit in the batch) and are handed to ``on_done`` (records are written as each finishes)

Every rank of an LP group runs the same generations in the same order, so their decisions, their finishing
rounds, the store and the refills agree without another message. A generation's tokens are a function of its own
prompt and rounds: greedy output is the model's whatever runs beside it, and sampling draws from streams named
by the generation's own key and round (``generation_key``), not by its neighbours.

Example (batch 2, three prompts A, B, C): rounds 1-3 run A and B; B ends in round 3, so round 4 runs A and C (C's
prefill with A's round 4); A ends in round 5, C runs alone from round 6.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.backends.buckets import MAX_BUCKET_ROWS
from lp_runner.backends.kv_cache import KVArena, KVRegion
from lp_runner.config import GenerationConfig, LookaheadConfig
from lp_runner.decoding.batch_round import batch_support
from lp_runner.decoding.generation import Generation, OnCommit
from lp_runner.decoding.job_store import JobPool
from lp_runner.decoding.layout import RowCounts
from lp_runner.decoding.metrics import GenerationStats
from lp_runner.decoding.verify.verifier import make_verifier
from lp_runner.parallel.comm import Communicator
from lp_runner.parallel.exchange import agree_batch

# A prompt's rows beyond this many are cached in forwards of their own before its first round (the largest
# bucketed round: on a GPU every chunk replays a captured graph; everywhere, no round's structures grow with the
# square of the prompt's length).
PREFILL_CHUNK_ROWS = MAX_BUCKET_ROWS


class EngineSetting(Protocol):
    """What the round loop reads of the engine that runs it (``engine.LookaheadEngine``): the job's setting, its
    model, its ranks and its store."""

    adapter: ModelAdapter
    la: LookaheadConfig
    gen: GenerationConfig
    eos_ids: frozenset[int]
    comm: Communicator
    row_plan: RowCounts | None

    def job_store(self) -> JobPool | None: ...

    def exchange_comm(self) -> Communicator | None: ...

    def capacity(self, start_len: int) -> int: ...

    def next_generation_key(self, sample_key: str | None) -> int | str: ...


@dataclass
class GenerationResult:
    output_ids: list[int]  # generated tokens only, the EOS included when produced
    stats: GenerationStats
    lookahead: LookaheadConfig | None = None  # the setting it ran with (None: it needed no round)


@dataclass(frozen=True)
class Job:
    """One prompt for ``LookaheadEngine.run``: its tokens, a committed prefix to resume from, the name of its
    sampling streams, a callback for each round's tokens, and the caller's handle (e.g. its index)."""

    prompt_ids: Sequence[int]
    committed: Sequence[int] = ()
    sample_key: str | None = None
    on_commit: OnCommit | None = None
    tag: object = None


class RoundLoop:
    """Up to ``batch`` generations of ``engine``'s setting in flight (see the module docstring)."""

    def __init__(self, engine: EngineSetting, batch: int) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.engine = engine
        self.adapter = engine.adapter
        self.batch = batch
        self.arena: KVArena | None = None  # the adapter's job arena, claimed at the first generation
        self.verifier = make_verifier(engine.gen, engine.adapter.device)  # reads back every generation at once
        self.comm = engine.exchange_comm()

    def run(self, next_job: Callable[[], Job | None], on_done: Callable[[Job, GenerationResult], None]) -> None:
        # the job arena is lent at the first generation (``_kv_for``) and handed back when the loop ends, also
        # when a round failed (its generations' regions freed with it)
        with contextlib.ExitStack() as self._lent:
            try:
                self._run(next_job, on_done)
            finally:
                self.arena = None

    def _kv_for(self, need: int) -> KVRegion:
        """A new generation's region of the job's arena (lent at the first: room for ``batch`` of them)."""
        if self.arena is None:
            self.arena = self._lent.enter_context(self.adapter.arena([need] * self.batch))
        return self.arena.region(need)

    def _run(self, next_job: Callable[[], Job | None], on_done: Callable[[Job, GenerationResult], None]) -> None:
        active: list[tuple[Job, Generation]] = []
        more = True
        while True:
            while more and len(active) < self.batch:
                job = next_job()
                if job is None:
                    more = False
                elif (gen := self._start(job, on_done)) is not None:
                    active.append((job, gen))
            if not active:
                return
            self._round([gen for _, gen in active])
            still = []
            for job, gen in active:
                if gen.finished:
                    gen.close(self.comm)
                    self.arena.release(gen.state.kv)
                    on_done(job, GenerationResult(gen.output_ids, gen.stats, gen.la))
                else:
                    still.append((job, gen))
            active = still

    def _start(self, job: Job, on_done: Callable[[Job, GenerationResult], None]) -> Generation | None:
        """The job's generation, or None when its committed prefix is already complete (handed to ``on_done`` at
        once; its output still joins the job store, where an uninterrupted run's would be)."""
        eng = self.engine
        store = eng.job_store()
        committed = list(job.committed)
        if len(committed) >= eng.gen.max_new_tokens or (set(committed[-1:]) & eng.eos_ids):
            if store is not None:
                store.add(job.prompt_ids, committed)
            on_done(job, GenerationResult(committed, GenerationStats()))
            return None
        start_len = len(job.prompt_ids) + len(committed)
        comm = eng.comm
        gen = Generation(
            job.prompt_ids,
            committed,
            eng.la,
            eng.gen,
            eng.eos_ids,
            comm.rank,
            comm.world_size,
            store,
            self._kv_for(eng.capacity(start_len)),
            eng.next_generation_key(job.sample_key),
            self.verifier,
            job.on_commit,
        )
        self._prefill_chunks(gen)
        return gen

    def _prefill_chunks(self, gen: Generation) -> None:
        """Cache a long prompt's leading rows in forwards of at most ``PREFILL_CHUNK_ROWS`` (``Generation
        .prefill_chunk``), before its first round; the rest of the prompt rides in that round as before."""
        while (layout := gen.prefill_chunk(PREFILL_CHUNK_ROWS)) is not None:
            t = time.perf_counter()
            self.adapter.run([layout], [gen.state.kv])  # its one logit row is not read; a failure ends the loop
            gen.prefill_chunk_done(layout, time.perf_counter() - t)

    def _round(self, gens: list[Generation]) -> None:
        """One round of every generation in flight: one forward, one read-back, one exchange."""
        start = time.perf_counter()
        row_plan = self.engine.row_plan if len(gens) == 1 else None  # several generations: rows past the humps
        layouts = [gen.lay_out(row_plan) for gen in gens]
        prepared = [self.verifier.prepare(*gen.verify_inputs()) for gen in gens]  # sampling: its trees, before
        past_lens = [gen.state.past_len for gen in gens]
        kvs = [gen.state.kv for gen in gens]
        t = time.perf_counter()
        try:
            logits = self.adapter.run(layouts, kvs)
            for gen in gens:  # while the forward runs (asynchronous on a GPU): pool insertions the plans did not read
                gen.coord.flush()
            readbacks = self.verifier.read_back_many(logits, layouts, prepared)  # the round's one device->host read
        except BaseException:
            for kv, past in zip(kvs, past_lens, strict=True):
                kv.crop(past)  # a failed round publishes nothing
            raise
        forward_s = time.perf_counter() - t
        entries = [gen.verdict(rb) for gen, rb in zip(gens, readbacks, strict=True)]
        decisions = agree_batch(self.comm, entries)
        comm_s = decisions[0].comm_s
        for gen, decision in zip(gens, decisions, strict=True):
            gen.commit(decision)
        host_s = time.perf_counter() - start - forward_s - comm_s
        rows = sum(layout.num_rows for layout in layouts)
        for gen in gens:
            gen.record(forward_s, comm_s, host_s, rows, len(gens), self.comm is not None)


def batch_for(requested: int, adapter, prompts: int = 0) -> tuple[int, str | None]:
    """The batch a job runs (``run.batch``) on ``adapter``, and why it is less than asked.

    Never more than the job's ``prompts`` (when known, > 0): a job of one prompt runs one at a time, on the
    plain forward and with the setting the auto preset chooses for one prompt. A model whose layers cannot run a
    batched round exactly (``batch_round.batch_support``) runs one prompt at a time, and says why."""
    batch = min(requested, prompts) if prompts > 0 else requested
    if batch <= 1:
        return 1, None
    reason = batch_support(adapter)
    if reason:
        return 1, f"run.batch={requested} needs a batched forward: {reason}; one prompt at a time"
    return batch, None

"""The generation loop of one rank. P = 1 is the same loop with a one-rank exchange: there is one engine.

A round reads as the algorithm, for each generation in flight (one, or up to ``run.batch`` sharing the forward):
    plan     the coordinator picks candidates for the live key and this rank's columns (identical on all ranks)
    round    one packed target call: [ordinary / re-fed rows | lookahead rows | verification rows] of every
             generation, and this rank's verdict per generation (``generation.Generation``; the verifier, greedy
             or sampling, is chosen once)
    agree    the ranks exchange verdicts and window columns (``exchange.agree_batch``: one all_gather under LP for
             every generation of the round, nothing at P = 1) and every rank holds the same decisions
    publish  the winner's tokens are committed by every rank; K/V: the winner copies its accepted rows into the
             committed frontier, the other ranks crop and re-feed the emitted tokens next round (no K/V crosses
             devices); the window advances and the coordinator takes the new n-grams (``round.publish``)
Nothing is published before every rank's verification is complete. The loop itself (which generations are in
flight, refilled as they finish) is ``scheduler.RoundLoop``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.config import GenerationConfig, LookaheadConfig, check_lookahead
from lp_runner.decoding.generation import OnCommit
from lp_runner.decoding.job_store import JobPool
from lp_runner.decoding.layout import RowCounts, longest_candidate, max_round_rows
from lp_runner.decoding.round import CommitPlan, kv_commit_plan
from lp_runner.decoding.scheduler import GenerationResult, Job, RoundLoop
from lp_runner.errors import InputError
from lp_runner.parallel.comm import Communicator, SoloCommunicator

__all__ = ["CommitPlan", "GenerationResult", "Job", "LookaheadEngine", "OnCommit", "kv_commit_plan"]


class LookaheadEngine:
    def __init__(
        self,
        adapter: ModelAdapter,
        lookahead: LookaheadConfig,
        generation: GenerationConfig,
        eos_ids: Sequence[int],
        comm: Communicator | None = None,
        row_plan: RowCounts | None = None,
        store: JobPool | None = None,
    ) -> None:
        """``row_plan``: the row count each round runs at (padding to a cheaper count: ``layout.RowCounts``, e.g.
        the tuner's measured ``costmodel.RowPlan``); None runs every round at its own row count. ``store``: the
        job's store (``lookahead.pool_scope: job``), e.g. loaded by ``--pool-in``; None: one is made at the first
        generation that needs it. The engine feeds it every finished generation, so it outlives each generation's
        coordinator."""
        check_lookahead(lookahead)  # before anything is allocated
        self.adapter = adapter
        self.la = lookahead
        self.gen = generation
        self.eos_ids = frozenset(eos_ids) if generation.stop_on_eos else frozenset()
        self.comm = comm or SoloCommunicator()
        self.row_plan = row_plan
        self.store = store
        self._generations = 0  # seeds each generation's verifier streams: same seed and prompt order, same samples

    def set_lookahead(self, lookahead: LookaheadConfig) -> None:
        """Use another setting from the next generation on (the auto preset adapts between prompts; every
        setting is exact, so only speed changes). Under LP every rank must make the same call."""
        check_lookahead(lookahead)
        self.la = lookahead

    def job_store(self) -> JobPool | None:
        """The store the next generation reads (made on first use), or None under ``pool_scope: prompt`` and when
        sampling: a sampled prompt's tokens are a function of its prompt, seed and id (``sample_key``), whichever
        prompts ran before it (``--resume``, D groups); proposals from earlier outputs would change which draws
        decide them (every sample would still be exact, but not the one the uninterrupted run drew)."""
        if self.la.pool_scope != "job" or self.gen.do_sample:
            return None
        if self.store is None:
            self.store = JobPool(self.la.pool_max_tokens)
        return self.store

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        if not prompt_ids:
            raise InputError("empty prompt: at least one token is needed")
        limit = self.adapter.max_positions
        if limit is not None and len(prompt_ids) + self.gen.max_new_tokens > limit:
            raise InputError(
                f"prompt of {len(prompt_ids)} tokens plus max_new_tokens={self.gen.max_new_tokens} exceeds the "
                f"model's context of {limit} positions"
            )

    def generate(
        self,
        prompt_ids: Sequence[int],
        on_commit: OnCommit | None = None,
        committed: Sequence[int] = (),
        sample_key: str | None = None,
    ) -> GenerationResult:
        """Generate after ``prompt_ids``; ``committed`` resumes a generation whose first tokens are already known
        (e.g. after a lost worker): they are re-prefilled with the prompt and returned as the output's start.
        Greedy output is a function of the prefix alone, so a resumed run ends exactly as an uninterrupted one.

        ``sample_key`` names this generation's random streams when sampling (a job passes the prompt's id, so a
        prompt samples the same tokens whichever prompts ran before it: ``--resume`` skips some); without one,
        the engine's own count of generations names them."""
        self.check_prompt(prompt_ids)
        results: list[GenerationResult] = []
        jobs = iter([Job(prompt_ids, committed, sample_key, on_commit)])
        self.run(lambda: next(jobs, None), lambda job, result: results.append(result))
        return results[0]

    def run(
        self,
        next_job: Callable[[], Job | None],
        on_done: Callable[[Job, GenerationResult], None],
        batch: int = 1,
    ) -> None:
        """Generate for every job ``next_job`` hands out (None: no more), up to ``batch`` at a time in one forward
        per round, each joining as soon as a generation finishes; ``on_done`` gets each as it finishes (on every
        rank, in the same order). Every round is one ``ModelAdapter.run`` over the generations in flight, each on its
        region of the adapter's job arena (``batch`` 1: one segment). Every rank of an LP group must hand out the
        same jobs in the same order."""
        RoundLoop(self, batch).run(next_job, on_done)

    def exchange_comm(self) -> Communicator | None:
        """The communicator a round's verdicts are exchanged over: None for a process alone (its verdict is the
        decision; no collective), else the group's, even one rank under a launcher."""
        return None if isinstance(self.comm, SoloCommunicator) else self.comm

    def next_generation_key(self, sample_key: str | None) -> int | str:
        """What names a generation's sampling streams: its ``sample_key``, else this engine's count."""
        key = self._generations if sample_key is None else sample_key
        self._generations += 1
        return key

    def capacity(self, start_len: int) -> int:
        """The most K/V positions a generation can hold: every token it can commit, plus one round's rows (the
        cache holds a round's rows until it is published). The cache is allocated once at this size."""
        round_rows = max_round_rows(self.la) + longest_candidate(self.la)  # + re-fed tokens of the last round
        if self.row_plan is not None:
            round_rows = max(round_rows, self.row_plan.max_rows)
        return start_len + self.gen.max_new_tokens + round_rows

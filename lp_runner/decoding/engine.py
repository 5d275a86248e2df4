"""The generation loop of one rank. P = 1 is the same loop with a one-rank exchange: there is one engine.

A round reads as the algorithm:
    plan     the coordinator picks candidates for the live key and this rank's columns (identical on all ranks)
    round    one packed target call: [ordinary / re-fed rows | lookahead rows | verification rows], and this
             rank's verdict (``round.run_round``; the verifier, greedy or sampling, is chosen once)
    agree    the ranks exchange verdicts and window columns (``Exchange.agree``: one all_gather under LP, nothing
             at P = 1) and every rank holds the same decision
    publish  the winner's tokens are committed by every rank; K/V: the winner copies its accepted rows into the
             committed frontier, the other ranks crop and re-feed the emitted tokens next round (no K/V crosses
             devices); the window advances and the coordinator takes the new n-grams (``round.publish``)
Nothing is published before every rank's verification is complete.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.config import GenerationConfig, LookaheadConfig, check_lookahead
from lp_runner.decoding.coordinator import Coordinator, RoundPlan
from lp_runner.decoding.job_store import JobPool
from lp_runner.decoding.layout import RowCounts, longest_candidate, max_round_rows
from lp_runner.decoding.metrics import GenerationStats, RoundRecord
from lp_runner.decoding.round import CommitPlan, RoundResult, RoundState, kv_commit_plan, publish, run_round
from lp_runner.decoding.verify.greedy import cut_emitted
from lp_runner.decoding.verify.verifier import Verifier, make_verifier
from lp_runner.decoding.window import JacobiWindow
from lp_runner.errors import InputError
from lp_runner.parallel.comm import Communicator, SoloCommunicator
from lp_runner.parallel.exchange import Decision, Exchange, GatherExchange, SoloExchange

__all__ = ["CommitPlan", "GenerationResult", "LookaheadEngine", "kv_commit_plan"]

OnCommit = Callable[[Sequence[int]], None]


@dataclass
class GenerationResult:
    output_ids: list[int]  # generated tokens only, the EOS included when produced
    stats: GenerationStats


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
        store = self.job_store()
        if len(committed) >= self.gen.max_new_tokens or (set(committed[-1:]) & self.eos_ids):
            if store is not None:
                store.add(prompt_ids, committed)
            return GenerationResult(list(committed), GenerationStats())
        la, comm = self.la, self.comm
        coord = Coordinator(la, comm.world_size, prompt_ids, group_by_first_token=self.gen.do_sample, store=store)
        verifier = make_verifier(self.gen)
        exchange = self._exchange(verifier)
        generation_key = self._generations if sample_key is None else sample_key
        self._generations += 1
        state = RoundState(
            history=[*prompt_ids, *committed],
            pending=[*prompt_ids, *committed],
            past_len=0,
            window=JacobiWindow(la.window_size, la.ngram_size, [*prompt_ids, *committed]),
            cache=self.adapter.new_cache(self._capacity(len(prompt_ids) + len(committed))),
        )
        if committed:
            coord.observe((), state.history, len(committed))
        stats = GenerationStats()
        start = time.perf_counter()
        collectives_before = comm.collectives

        while True:
            t_round = time.perf_counter()
            live, past_len = state.live, state.past_len
            depth = state.window.depth if la.lookahead_branch else None
            plan = coord.plan(state.history, depth)
            result = run_round(
                state, plan, comm.rank, self.adapter, verifier, self.row_plan, (generation_key, stats.rounds)
            )
            decision = exchange.agree(
                plan.digest, result.verdict.hits, result.verdict.emitted, result.candidate, result.columns
            )
            budget = self.gen.max_new_tokens - (len(state.history) - len(prompt_ids))
            emitted, finished = cut_emitted(decision.emitted, self.eos_ids, budget)
            state.history.extend(emitted)
            if not finished:
                ngrams = publish(state, result, decision, live, la.lookahead_branch)
                coord.feedback(plan, decision.candidate, decision.hits)
                coord.observe(ngrams, state.history, len(emitted))
            host_s = time.perf_counter() - t_round - result.forward_s - decision.comm_s
            stats.add(self._record(plan, result, decision, len(emitted), past_len, depth, host_s))
            if on_commit is not None:  # after timing: streaming is the caller's cost, not the engine's
                on_commit(emitted)
            if finished:
                break

        stats.seconds = time.perf_counter() - start
        stats.collectives = comm.collectives - collectives_before
        if store is not None:  # between generations, identically on every rank
            store.add(prompt_ids, state.history[len(prompt_ids) :])
        return GenerationResult(state.history[len(prompt_ids) :], stats)

    def _capacity(self, start_len: int) -> int:
        """The most K/V positions a generation can hold: every token it can commit, plus one round's rows (the
        cache holds a round's rows until it is published). The cache is allocated once at this size."""
        round_rows = max_round_rows(self.la) + longest_candidate(self.la)  # + re-fed tokens of the last round
        if self.row_plan is not None:
            round_rows = max(round_rows, self.row_plan.max_rows)
        return start_len + self.gen.max_new_tokens + round_rows

    def _exchange(self, verifier: Verifier) -> Exchange:
        """Alone (no launcher): the one-rank exchange. Under a launcher, even with one rank, the collective one."""
        if isinstance(self.comm, SoloCommunicator):
            return SoloExchange()
        la = self.la
        max_emit = longest_candidate(la) + 1
        return GatherExchange(self.comm, max_emit, la.window_size, verifier.choose)

    def _record(
        self,
        plan: RoundPlan,
        result: RoundResult,
        decision: Decision,
        emitted: int,
        past_len: int,
        depth: int | None,
        host_s: float,
    ) -> RoundRecord:
        """The round's one immutable event (stats, the cost model's replay and the tuner read it)."""
        layout = result.layout
        return RoundRecord(
            rows=layout.num_rows - layout.num_padding,
            padded_rows=layout.num_padding,
            logit_rows=len(layout.logit_rows),
            candidates=len(plan.assignment[self.comm.rank]),
            hits=decision.hits,
            emitted=emitted,
            forward_s=result.forward_s,
            comm_s=decision.comm_s,
            host_s=host_s,
            past_len=past_len,
            ordinary=layout.num_ordinary,
            depth=-1 if depth is None else depth,
            plan_candidates=tuple(len(c) for c in plan.candidates),
            winner_candidate=decision.candidate,
            winner_rank=decision.rank,
            plan_sources=plan.sources,
            proposed=plan.proposed,
        )

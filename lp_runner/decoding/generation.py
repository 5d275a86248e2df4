"""One generation's part of each round: its state, coordinator, verifier and statistics.

The round loop (``scheduler.RoundLoop``) runs one generation or a batch of them through the same steps; what a
generation does in a round is here, so a generation behaves the same alone and beside others:

    lay_out   the coordinator plans (candidates, this rank's columns) and this rank's rows are laid out
    (forward: the loop's, for every generation of the round at once)
    verdict   this rank's verification of its candidates from the round's read-back
    (agree: the loop's, one exchange for every generation of the round)
    commit    the decision's tokens are committed (EOS and budget cut), K/V kept or cropped, window advanced,
              the coordinator fed; the round's record, then the caller's ``on_commit``

Nothing here knows how many generations share a forward: the K/V is a ``round.KVStore`` (the generation's region
of the adapter's job arena, alone or beside others'), and the round's timing and size come in with ``record``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from lp_runner.config import GenerationConfig, LookaheadConfig
from lp_runner.decoding.coordinator import Coordinator, RoundPlan
from lp_runner.decoding.job_store import JobPool
from lp_runner.decoding.layout import RoundLayout, RowCounts, compile_round, longest_candidate
from lp_runner.decoding.metrics import GenerationStats, RoundRecord
from lp_runner.decoding.round import KVStore, RoundResult, RoundState, lay_out, publish, take_verdict
from lp_runner.decoding.verify.greedy import cut_emitted
from lp_runner.decoding.verify.verifier import ReadBack, Verifier
from lp_runner.decoding.window import JacobiWindow
from lp_runner.parallel.comm import Communicator
from lp_runner.parallel.exchange import Decision, Entry

OnCommit = Callable[[Sequence[int]], None]


class Generation:
    """A generation in flight on one rank (``scheduler.RoundLoop`` drives it, alone or in a batch)."""

    def __init__(
        self,
        prompt_ids: Sequence[int],
        committed: Sequence[int],
        la: LookaheadConfig,
        gen: GenerationConfig,
        eos_ids: frozenset[int],
        rank: int,
        world_size: int,
        store: JobPool | None,
        kv: KVStore,
        generation_key: int | str,
        verifier: Verifier,
        on_commit: OnCommit | None = None,
    ) -> None:
        """``committed``: tokens already generated (a resumed generation), re-prefilled with the prompt.
        ``generation_key`` names the sampling streams (``verifier.SamplingVerifier``). ``verifier``: the round
        loop's, which reads back every generation of a round at once; it holds no state of a generation (its
        streams are named by ``generation_key`` and the round), so one serves them all."""
        self.prompt_ids = list(prompt_ids)
        self.la, self.gen, self.eos_ids, self.rank = la, gen, eos_ids, rank
        self.store = store
        self.coord = Coordinator(la, world_size, prompt_ids, group_by_first_token=gen.do_sample, store=store)
        self.verifier = verifier
        self.generation_key = generation_key
        self.on_commit = on_commit
        start = [*prompt_ids, *committed]
        self.state = RoundState(
            history=list(start),
            pending=list(start),
            past_len=0,
            window=JacobiWindow(la.window_size, la.ngram_size, start),
            kv=kv,
        )
        if committed:
            self.coord.observe((), self.state.history, len(committed))
        self.stats = GenerationStats()
        self.started = time.perf_counter()
        self.finished = False
        self.max_emit = longest_candidate(la) + 1  # the exchange's block: the longest emitted run of this setting
        self._plan: RoundPlan | None = None
        self._layout: RoundLayout | None = None
        self._result: RoundResult | None = None
        self._decision: Decision | None = None
        self._emitted: list[int] = []
        self._depth: int | None = None
        self._past = 0

    @property
    def output_ids(self) -> list[int]:
        return self.state.history[len(self.prompt_ids) :]

    def lay_out(self, row_plan: RowCounts | None) -> RoundLayout:
        """Plan this round (identically on every rank) and lay out this rank's rows."""
        state = self.state
        self._past = state.past_len
        self._depth = state.window.depth if self.la.lookahead_branch else None
        self._plan = self.coord.plan(state.history, self._depth)
        self._layout = lay_out(state, self._plan, self.rank, row_plan)
        return self._layout

    def prefill_chunk(self, max_rows: int) -> RoundLayout | None:
        """The next chunk of a prompt longer than ``max_rows`` rows, or None once what is left fits one round.

        A chunk is a round of ordinary rows only (no window, no candidates): the committed tokens at the front of
        ``pending``, causal among themselves over the cached prefix, exactly the rows a whole-prompt prefill
        would give them, since in a round every later row sees the ordinary block whole. So a prompt of any
        length runs as rounds of at most ``max_rows`` rows, and nothing a round builds (its visibility, its mask,
        its logits) grows with the square of the prompt. Every rank of an LP group cuts the same chunks."""
        state = self.state
        if len(state.pending) <= max_rows:
            return None
        return compile_round(state.pending[:max_rows], state.past_len, state.window.levels, (0, 0), ())

    def prefill_chunk_done(self, layout: RoundLayout, forward_s: float) -> None:
        """``layout``'s rows are cached: they leave ``pending`` (its K/V length is the forward's to set)."""
        state = self.state
        state.past_len += layout.num_ordinary
        state.pending = state.pending[layout.num_ordinary :]
        self.stats.add_prefill_chunk(layout.num_ordinary, forward_s)

    def verify_inputs(self) -> tuple[Sequence, Sequence, tuple[int | str, int]]:
        """What this round's verification is built from before the forward (``Verifier.prepare``): the plan's
        candidates (all ranks'), this rank's, and the round's key (names its sampling streams)."""
        _, candidates = self._plan.for_rank(self.rank)
        return self._plan.candidates, candidates, (self.generation_key, self.stats.rounds)

    def verdict(self, readback: ReadBack) -> Entry:
        """This rank's verdict from the round's read-back, as its entry in the round's exchange."""
        result = take_verdict(
            readback, self._layout, self._plan, self.rank, self.verifier, (self.generation_key, self.stats.rounds)
        )
        self._result = result
        v = result.verdict
        # the digest proves replicas of the coordinator agree; one rank has no other replica to check
        digest = self._plan.digest if self.coord.world_size > 1 else 0
        return Entry(
            digest,
            v.hits,
            tuple(v.emitted),
            result.candidate,
            result.columns,
            self.max_emit,
            self.la.window_size,
            self.verifier.choose,
        )

    def commit(self, decision: Decision) -> None:
        """The decision's tokens become this generation's (cut at EOS or the budget); unless that ends it, its K/V
        is kept or cropped for re-feeding, its window advances and its coordinator is fed."""
        state = self.state
        live = state.live
        budget = self.gen.max_new_tokens - (len(state.history) - len(self.prompt_ids))
        emitted, finished = cut_emitted(decision.emitted, self.eos_ids, budget)
        state.history.extend(emitted)
        if not finished:
            ngrams = publish(state, self._result, decision, live, self.la.lookahead_branch)
            self.coord.feedback(self._plan, decision.candidate, decision.hits)
            self.coord.observe(ngrams, state.history, len(emitted))
        self._decision, self._emitted, self.finished = decision, emitted, finished

    def record(self, forward_s: float, comm_s: float, host_s: float, batch_rows: int, batch_size: int, gathered: bool):
        """The round's record (``batch_rows`` / ``batch_size``: the forward's rows and generations on this rank),
        then the caller's ``on_commit`` (after timing: streaming is the caller's cost, not the round's)."""
        plan, layout, decision = self._plan, self._layout, self._decision
        self.stats.add(
            RoundRecord(
                rows=layout.num_rows - layout.num_padding,
                padded_rows=layout.num_padding,
                logit_rows=layout.num_logit_rows,
                candidates=len(plan.assignment[self.rank]),
                hits=decision.hits,
                emitted=len(self._emitted),
                forward_s=forward_s,
                comm_s=comm_s,
                host_s=host_s,
                past_len=self._past,
                ordinary=layout.num_ordinary,
                depth=-1 if self._depth is None else self._depth,
                plan_candidates=tuple(len(c) for c in plan.candidates),
                winner_candidate=decision.candidate,
                winner_rank=decision.rank,
                plan_sources=plan.sources,
                proposed=plan.proposed,
                batch_rows=batch_rows,
                batch_size=batch_size,
            )
        )
        self.stats.collectives += int(gathered)
        if self.on_commit is not None:
            self.on_commit(self._emitted)

    def close(self, comm: Communicator | None) -> None:
        """The generation is over: its wall time, every rank's rows of its rounds (``GenerationStats
        .set_rank_rows``), and (``pool_scope: job``) its output joins the job's store (identically on every rank,
        in the same order).

        Under LP the rows come from one all_gather per generation, not per round: every rank of the group closes
        the same generations in the same order, after the same number of rounds, so the payloads are of one
        length. It is not a round's collective (``stats.collectives`` counts those)."""
        self.stats.seconds = time.perf_counter() - self.started
        own = [rec.rows for rec in self.stats.records]  # [rounds]
        if comm is None or not own:
            self.stats.set_rank_rows([own])
        else:
            self.stats.set_rank_rows(comm.all_gather(torch.tensor(own, dtype=torch.long)).tolist())  # [P, rounds]
        if self.store is not None:
            self.store.add(self.prompt_ids, self.output_ids)

"""The round loop for one rank. P = 1 is the same loop with a no-op communicator: there is one engine.

A round has four stages (nothing is published before verification is complete):
    plan     the coordinator picks candidates for the live key and this rank's columns (identical on all ranks)
    forward  one packed target call: [ordinary / re-fed rows | lookahead rows | verification rows]
    verify   this rank's best candidate -> (hits, emitted tokens); one all_gather of a fixed-size payload
    publish  the winner's tokens are committed by every rank; K/V: the winner copies its accepted rows into the
             committed frontier, the other ranks crop and re-feed the emitted tokens next round (no K/V crosses
             devices); the window advances and the coordinator's pool takes the new n-grams.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lp_runner.config import GenerationConfig, LookaheadConfig, check_lookahead
from lp_runner.costmodel import RowPlan
from lp_runner.errors import DistributedError, InputError
from lp_runner.layout import RoundLayout, compile_round, pad_layout
from lp_runner.metrics import GenerationStats, RoundRecord
from lp_runner.model import ModelAdapter, crop, move_rows
from lp_runner.parallel.comm import Communicator, SoloCommunicator
from lp_runner.parallel.coordinator import Coordinator
from lp_runner.parallel.exchange import pack, sampling_winner, unpack, winner
from lp_runner.sampling import NO_CANDIDATE, sample_first, sample_verify, warp_logits
from lp_runner.verify import Verdict, cut_emitted, greedy_verify
from lp_runner.window import JacobiWindow

OnCommit = Callable[[Sequence[int]], None]


@dataclass(frozen=True)
class CommitPlan:
    """How the winner's K/V becomes committed: copy ``src`` rows to ``dst``, then keep ``length`` positions."""

    src: tuple[int, ...]
    dst: tuple[int, ...]
    length: int


def kv_commit_plan(past_len: int, layout: RoundLayout, candidate: int, hits: int) -> CommitPlan:
    """K/V rows belong to their input token: the ordinary rows stay, then the winner's first ``hits`` rows.

    Worked trace: past_len=128, one ordinary row (committed length 129), 14 lookahead rows (Q=21 with two
    candidates of suffix length 3; the cache holds 149), winner 1 with 2 hits -> copy 146->129, 147->130, keep 131;
    the third emitted token is the next round's input.
    """
    frontier = past_len + layout.num_ordinary
    src = tuple(past_len + layout.verify_row(candidate, s) for s in range(hits))
    dst = tuple(frontier + s for s in range(hits))
    return CommitPlan(src, dst, frontier + hits)


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
        row_plan: RowPlan | None = None,
    ) -> None:
        """``row_plan``: the row count each round runs at (padding to a cheaper count, ``costmodel.RowPlan``);
        None runs every round at its own row count."""
        check_lookahead(lookahead)  # before anything is allocated
        self.adapter = adapter
        self.la = lookahead
        self.gen = generation
        self.eos_ids = frozenset(eos_ids) if generation.stop_on_eos else frozenset()
        self.comm = comm or SoloCommunicator()
        self.row_plan = row_plan
        self._generations = 0  # seeds each generation's verifier streams: same seed and prompt order, same samples

    def set_lookahead(self, lookahead: LookaheadConfig) -> None:
        """Use another setting from the next generation on (the auto preset adapts between prompts; every
        setting is exact, so only speed changes). Under LP every rank must make the same call."""
        check_lookahead(lookahead)
        self.la = lookahead

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        if not prompt_ids:
            raise InputError("empty prompt: at least one token is needed")
        limit = self.adapter.max_positions
        if limit is not None and len(prompt_ids) + self.gen.max_new_tokens > limit:
            raise InputError(
                f"prompt of {len(prompt_ids)} tokens plus max_new_tokens={self.gen.max_new_tokens} exceeds the "
                f"model's context of {limit} positions"
            )

    def max_round_rows(self) -> int:
        """An upper bound on the rows one round appends to the cache (window rows + verification rows, or the
        row plan's largest padded count)."""
        rows = self.max_round_rows_for(self.la)
        return max(rows, self.row_plan.max_rows) if self.row_plan is not None else rows

    @staticmethod
    def max_round_rows_for(la: LookaheadConfig) -> int:
        window_rows = (la.window_size - 1) + la.window_size * (la.ngram_size - 2) if la.lookahead_branch else 0
        longest = max(la.ngram_size - 1, la.context_tokens if la.context_lookup else 0)
        return 1 + window_rows + la.verification_set_size * longest

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
        if len(committed) >= self.gen.max_new_tokens or (set(committed[-1:]) & self.eos_ids):
            return GenerationResult(list(committed), GenerationStats())
        la, comm = self.la, self.comm
        n, w = la.ngram_size, la.window_size
        max_emit = max(n - 1, la.context_tokens if la.context_lookup else 0) + 1  # longest candidate + 1
        coord = Coordinator(la, comm.world_size, prompt_ids, group_by_first_token=self.gen.do_sample)
        generation_index = self._generations if sample_key is None else sample_key
        self._generations += 1
        window = JacobiWindow(w, n, [*prompt_ids, *committed])
        cache = self.adapter.new_cache()
        past_len = 0
        history: list[int] = [*prompt_ids, *committed]  # every committed token: prompt, then output
        pending: list[int] = list(history)  # committed tokens not yet in this rank's cache; last = live key
        if committed:
            coord.observe((), history, len(committed))
        stats = GenerationStats()
        start = time.perf_counter()
        collectives_before = comm.collectives

        while True:
            t_round = time.perf_counter()
            live = pending[-1]
            plan = coord.plan(history, window.depth if la.lookahead_branch else None)
            columns, candidates = plan.for_rank(comm.rank)
            layout = compile_round(pending, past_len, window.levels, columns, candidates)
            if self.row_plan is not None:
                layout = pad_layout(layout, self.row_plan.rows_for(layout.num_rows, past_len))

            t_fwd = time.perf_counter()
            try:
                logits = self.adapter.forward(
                    layout.input_ids, layout.position_ids, layout.visibility, cache, layout.logit_rows
                )
                preds = logits.argmax(-1).tolist()  # the round's one device->host read-back
            except BaseException:
                crop(cache, past_len)  # a failed round publishes nothing
                raise
            forward_s = time.perf_counter() - t_fwd

            if self.gen.do_sample:
                verdict = self._sample(logits, layout, plan, candidates, (generation_index, stats.rounds))
            else:
                verdict = greedy_verify(
                    preds[layout.ordinary_logit],
                    candidates,
                    [[preds[i] for i in rows] for rows in layout.verify_logits],
                )
            global_candidate = plan.assignment[comm.rank][verdict.candidate] if verdict.candidate >= 0 else -1
            own_columns = dict(zip(range(*columns), (preds[i] for i in layout.column_logits), strict=True))
            payload = pack(verdict.hits, verdict.emitted, plan.digest, global_candidate, own_columns, max_emit, w)

            t_comm = time.perf_counter()
            reports = unpack(comm.all_gather(payload), max_emit, w)
            comm_s = time.perf_counter() - t_comm
            if any(r.plan_digest != plan.digest for r in reports):
                raise DistributedError(f"rank {comm.rank}: coordinator replicas disagree on the round plan")
            win = sampling_winner(reports) if self.gen.do_sample else winner(reports)
            budget = self.gen.max_new_tokens - (len(history) - len(prompt_ids))
            emitted, finished = cut_emitted(reports[win].emitted, self.eos_ids, budget)

            # publish
            history.extend(emitted)
            self._count(stats, plan, reports[win], layout, len(candidates), len(emitted), forward_s, comm_s, win)
            rec = stats.records[-1]
            rec.past_len, rec.ordinary = past_len, layout.num_ordinary
            rec.depth = window.depth if la.lookahead_branch else -1
            if not finished:
                past_len, pending = self._publish_kv(cache, past_len, layout, verdict, win, reports[win].emitted)
                ngrams = []
                if la.lookahead_branch:
                    new_row = [tok for _, tok in sorted(_merge_columns(reports).items())]
                    ngrams = window.step(live, new_row)
                coord.feedback(plan, reports[win].candidate, reports[win].hits)
                coord.observe(ngrams, history, len(emitted))
            stats.records[-1].host_s = time.perf_counter() - t_round - forward_s - comm_s
            if on_commit is not None:  # after timing: streaming is the caller's cost, not the engine's
                on_commit(emitted)
            if finished:
                break

        stats.seconds = time.perf_counter() - start
        stats.collectives = comm.collectives - collectives_before
        stats.host_s = sum(r.host_s for r in stats.records)
        return GenerationResult(history[len(prompt_ids) :], stats)

    def _sample(self, logits, layout: RoundLayout, plan, candidates, round_key: tuple[int | str, int]) -> Verdict:
        """Exact sampling verification (see ``sampling.py``), split so that LP needs no extra collective.

        The first token is decided on every rank from a stream shared by all ranks (seed, generation, round) over
        the round's distinct first tokens; the continuation uses a second stream and only the local candidates that
        start with that token (grouping puts them all on one rank). The lookahead rows stay greedy proposals.
        """
        gen = self.gen
        shared = random.Random(f"{gen.seed}:{round_key[0]}:{round_key[1]}:first")
        local = random.Random(f"{gen.seed}:{round_key[0]}:{round_key[1]}:rest")
        rows = [layout.ordinary_logit, *(i for r in layout.verify_logits for i in r)]
        probs = warp_logits(logits[rows], gen.temperature, gen.top_k, gen.top_p)  # [1 + verify rows, V]
        first = sample_first(probs[0], [c[0] for c in plan.candidates], shared.random)
        survivors = [c for c, cand in enumerate(candidates) if cand[0] == first]
        if not survivors:
            return Verdict(NO_CANDIDATE, 0, (first,))
        offsets = [1 + sum(len(candidates[k]) for k in range(c)) for c in survivors]  # row of each survivor's g[0]
        cont = sample_verify(
            probs[offsets[0]],  # the distribution after reading ``first`` (same on every survivor)
            [candidates[c][1:] for c in survivors],
            [probs[o + 1 : o + len(candidates[c])] for c, o in zip(survivors, offsets, strict=True)],
            local.random,
        )
        winner_local = survivors[cont.candidate] if cont.candidate >= 0 else survivors[0]
        return Verdict(winner_local, 1 + cont.hits, (first, *cont.emitted))

    @staticmethod
    def _count(stats, plan, win_report, layout, num_local, num_emitted, forward_s, comm_s, win_rank) -> None:
        stats.add(
            RoundRecord(
                rows=layout.num_rows - layout.num_padding,
                padded_rows=layout.num_padding,
                logit_rows=len(layout.logit_rows),
                candidates=num_local,
                hits=win_report.hits,
                emitted=num_emitted,
                forward_s=forward_s,
                comm_s=comm_s,
                host_s=0.0,
                plan_candidates=tuple(len(c) for c in plan.candidates),
                winner_candidate=win_report.candidate,
                winner_rank=win_rank,
            ),
            verified_anywhere=bool(plan.candidates),
        )
        for name, count in plan.proposed:
            stats.count_source(name, "proposed", count)
        for name in plan.sources:
            stats.count_source(name, "verified", 1)
        if win_report.candidate >= 0:
            stats.count_source(plan.sources[win_report.candidate], "accepted", win_report.hits)

    def _publish_kv(
        self,
        cache,
        past_len: int,
        layout: RoundLayout,
        verdict: Verdict,
        win: int,
        emitted: Sequence[int],
    ) -> tuple[int, list[int]]:
        """Commit K/V for the emitted run; returns (new cached length, next round's ordinary tokens)."""
        if win == self.comm.rank:
            plan = kv_commit_plan(past_len, layout, verdict.candidate, verdict.hits)
            move_rows(cache, plan.src, plan.dst)
            crop(cache, plan.length)
            return plan.length, [emitted[-1]]
        frontier = past_len + layout.num_ordinary
        crop(cache, frontier)
        return frontier, list(emitted)


def _merge_columns(reports) -> dict[int, int]:
    merged: dict[int, int] = {}
    for r in reports:
        merged.update(r.columns)
    return merged

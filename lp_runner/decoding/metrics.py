"""Per-round telemetry and run summaries: where the time goes (forward / host / communication) and what a
forward buys (tokens per forward, hits, packed rows)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class RoundRecord:
    """One round, as it happened: made once at the round's end and read by the stats, the cost model's replay
    (``costmodel.shapes_from_records``) and the tuner."""

    rows: int  # packed rows on this rank (the round's own, without padding)
    logit_rows: int
    candidates: int  # candidates verified on this rank
    hits: int  # winner's accepted suffix tokens
    emitted: int  # tokens committed this round
    forward_s: float
    comm_s: float
    host_s: float
    # the round's plan, the same on every rank (what ``costmodel.RoundShape`` replays at other P):
    past_len: int = 0  # cached positions before the round on this rank
    ordinary: int = 1  # ordinary (uncached / re-fed) rows on this rank
    depth: int = -1  # window depth, -1 when the lookahead branch is off
    plan_candidates: tuple[int, ...] = ()  # length of every candidate of the round, all ranks
    winner_candidate: int = -1  # global index of the winning candidate, -1 if none held
    padded_rows: int = 0  # filler rows that made the round a cheaper row count (``layout.compile_round``'s padding)
    winner_rank: int = 0  # the rank whose verdict was published (LP: the others re-feed its tokens)
    plan_sources: tuple[str, ...] = ()  # the source of every candidate of the round
    proposed: tuple[tuple[str, int], ...] = ()  # per source: suffixes it proposed (before dedup and budget)
    batch_rows: int = 0  # rows of the whole forward on this rank, every generation's (``run.batch``), padding included
    batch_size: int = 1  # generations in that forward


@dataclass
class GenerationStats:
    """Totals for one generation on one rank."""

    rounds: int = 0
    forwards: int = 0  # target forward calls, the prefill included (it is the first round)
    new_tokens: int = 0
    rows: int = 0
    padded_rows: int = 0
    logit_rows: int = 0
    verified_rounds: int = 0  # rounds that verified at least one candidate (on any rank)
    accepted_tokens: int = 0  # suffix tokens accepted by verification (excludes the ordinary token)
    collectives: int = 0
    forward_s: float = 0.0
    comm_s: float = 0.0
    host_s: float = 0.0
    seconds: float = 0.0
    records: list[RoundRecord] = field(default_factory=list)
    # per candidate source: {"proposed": n, "verified": n, "accepted": tokens accepted from its winning candidates}
    sources: dict[str, dict[str, int]] = field(default_factory=dict)
    wins_by_rank: dict[str, int] = field(default_factory=dict)  # rounds each rank's verdict was published ("0": ...)
    # this generation's share of the batched forwards it took part in (1 / generations per forward, summed) and of
    # their rows (rows / generations, summed): over a job, forwards = sum of shares, rows per forward = rows / that
    forward_share: float = 0.0
    batch_rows_share: float = 0.0
    prefill_chunks: int = 0  # forwards that cached a long prompt's leading rows before its first round
    # every rank's rows over the rounds (rank order) and the busiest rank's, round by round (``set_rank_rows``,
    # at the generation's end): what a round costs under LP is its busiest rank's forward, not rank 0's
    rank_rows: list[int] = field(default_factory=list)
    busiest_rows: int = 0

    def add_prefill_chunk(self, rows: int, forward_s: float) -> None:
        """A forward of a long prompt's leading rows alone (``Generation.prefill_chunk``): a forward and its rows,
        not a round (it verifies and emits nothing; the records, which the cost model replays, stay rounds)."""
        self.prefill_chunks += 1
        self.forwards += 1
        self.rows += rows
        self.forward_share += 1.0
        self.batch_rows_share += rows
        self.forward_s += forward_s

    def count_source(self, name: str, key: str, value: int) -> None:
        entry = self.sources.get(name)
        if entry is None:  # a source's first count (setdefault would build this dict on every call)
            entry = self.sources[name] = {"proposed": 0, "verified": 0, "accepted": 0}
        entry[key] += value

    def add(self, rec: RoundRecord) -> None:
        self.rounds += 1
        self.forwards += 1
        self.new_tokens += rec.emitted
        self.rows += rec.rows
        self.padded_rows += rec.padded_rows
        self.wins_by_rank[str(rec.winner_rank)] = self.wins_by_rank.get(str(rec.winner_rank), 0) + 1
        self.logit_rows += rec.logit_rows
        self.verified_rounds += int(bool(rec.plan_candidates))  # verified on some rank
        self.accepted_tokens += rec.hits
        self.forward_share += 1.0 / rec.batch_size
        self.batch_rows_share += (rec.batch_rows or rec.rows + rec.padded_rows) / rec.batch_size
        self.forward_s += rec.forward_s
        self.comm_s += rec.comm_s
        self.host_s += rec.host_s
        self.records.append(rec)
        for name, count in rec.proposed:
            self.count_source(name, "proposed", count)
        for name in rec.plan_sources:
            self.count_source(name, "verified", 1)
        if rec.winner_candidate >= 0:
            self.count_source(rec.plan_sources[rec.winner_candidate], "accepted", rec.hits)

    def set_rank_rows(self, per_rank: Sequence[Sequence[int]]) -> None:
        """Every rank's rows of every round (``per_rank[r][i]``: rank r's rows in round i, ``RoundRecord.rows``)
        summed per rank, and the busiest rank's rows summed over the rounds (the largest of each round's).

        Example: rank 0 ran 5, 3, 3 rows and rank 1 ran 4, 6, 2 -> rank_rows [11, 12], busiest_rows 5 + 6 + 3 =
        14 (no one rank was the busiest in every round, so it exceeds both totals)."""
        self.rank_rows = [sum(rows) for rows in per_rank]
        self.busiest_rows = sum(max(column) for column in zip(*per_rank, strict=True))

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.forwards if self.forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_rows(self) -> float:
        return self.rows / self.rounds if self.rounds else 0.0

    @property
    def mean_busiest_rows(self) -> float:
        return self.busiest_rows / self.rounds if self.rounds else 0.0

    def summary(self) -> dict[str, float | int]:
        d = {k: v for k, v in asdict(self).items() if k != "records"}  # sources included
        d.update(
            tokens_per_forward=round(self.tokens_per_forward, 4),
            tokens_per_s=round(self.tokens_per_s, 3),
            mean_rows=round(self.mean_rows, 2),
            mean_busiest_rows=round(self.mean_busiest_rows, 2),
        )
        for k in ("forward_s", "comm_s", "host_s", "seconds", "forward_share", "batch_rows_share"):
            d[k] = round(d[k], 6)
        return d


def combine(stats: Iterable[GenerationStats]) -> dict[str, float | int]:
    """Totals over several generations (a prompts file) with derived ratios and the time split."""
    keys = (
        "rounds",
        "forwards",
        "new_tokens",
        "rows",
        "padded_rows",
        "logit_rows",
        "verified_rounds",
        "accepted_tokens",
        "collectives",
        "busiest_rows",
    )
    tot: dict[str, float] = {k: 0 for k in keys}
    times = {"forward_s": 0.0, "comm_s": 0.0, "host_s": 0.0, "seconds": 0.0}
    n = 0
    stats_list = list(stats)
    for s in stats_list:
        n += 1
        for k in keys:
            tot[k] += getattr(s, k, 0)  # records written before a counter existed lack it
        for k in times:
            times[k] += getattr(s, k)
    out: dict[str, float | int] = {"generations": n, **tot, **{k: round(v, 4) for k, v in times.items()}}
    secs = times["seconds"]
    out["tokens_per_forward"] = round(tot["new_tokens"] / tot["forwards"], 4) if tot["forwards"] else 0.0
    out["tokens_per_s"] = round(tot["new_tokens"] / secs, 3) if secs else 0.0
    out["mean_rows"] = round(tot["rows"] / tot["rounds"], 2) if tot["rounds"] else 0.0
    out["mean_busiest_rows"] = round(tot["busiest_rows"] / tot["rounds"], 2) if tot["rounds"] else 0.0
    out["mean_padded_rows"] = round(tot["padded_rows"] / tot["rounds"], 2) if tot["rounds"] else 0.0
    for k in ("forward_s", "comm_s", "host_s"):
        out[k.replace("_s", "_share")] = round(times[k] / secs, 4) if secs else 0.0
    out["comm_us_per_round"] = round(1e6 * times["comm_s"] / tot["rounds"], 1) if tot["rounds"] else 0.0
    out.update(batch_figures(stats_list, tot))
    return out


def batch_figures(stats: Sequence, totals: dict) -> dict[str, float]:
    """What the job's forwards held when generations shared them (``run.batch``): forwards (each counted once),
    generations and rows per forward, tokens per forward (the job's) and per generation per forward. Records made
    before batching existed count as forwards of one generation.

    Example: two generations of 10 rounds each, always together in forwards of 8 rows, 30 tokens in all ->
    forwards 10, generations/forward 2.0, rows/forward 8.0, tokens/forward 3.0, per generation 1.5."""
    forwards = sum(getattr(s, "forward_share", 0.0) or getattr(s, "forwards", 0) for s in stats)
    rows = sum(getattr(s, "batch_rows_share", 0.0) or getattr(s, "rows", 0) for s in stats)
    rounds = totals["rounds"]
    return {
        "batched_forwards": round(forwards, 3),
        "generations_per_forward": round(rounds / forwards, 3) if forwards else 0.0,
        "rows_per_forward": round(rows / forwards, 2) if forwards else 0.0,
        "job_tokens_per_forward": round(totals["new_tokens"] / forwards, 4) if forwards else 0.0,
    }

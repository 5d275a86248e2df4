"""The per-round payload every rank contributes to the one all_gather: fixed-size int64, no pickling.

Layout (length 4 + E + W, E = the longest possible emitted run: longest candidate + 1):
    [hits, num_emitted, plan_digest, candidate (global index, -1 if none), emitted[0..E-1] (padded),
     column_tokens[0..W-1] (global column positions; -1 where another rank owns the column)]
The plan digest lets every rank check, at no extra collective, that all replicas of the coordinator planned the
same round (same live key, same candidates); a mismatch is a bug and stops the run.

``Exchange.agree`` is the whole of LP's per-round protocol as the engine sees it: this rank's outcome in, the
round's ``Decision`` out. ``SoloExchange`` is one rank alone (nothing to agree on); ``GatherExchange`` is any
number of ranks behind a communicator (the one all_gather, the digest check, the winner choice, the merged
window columns). The engine's loop is the same for both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from lp_runner.errors import DistributedError

PAD = -1
HEADER = 4


@dataclass(frozen=True)
class RankReport:
    hits: int
    emitted: tuple[int, ...]
    plan_digest: int
    candidate: int  # global index of this rank's best candidate, -1 if none
    columns: dict[int, int]  # global column -> new trajectory token


def pack_values(
    hits: int,
    emitted: Sequence[int],
    plan_digest: int,
    candidate: int,
    columns: dict[int, int],
    max_emit: int,
    w: int,
) -> list[int]:
    """One rank's block of the payload (the module doc's layout) as host integers: the round's payload is built
    from these blocks and written into a tensor once (``agree_batch``), not field by field.

    Example: hits 1, emitted (7, 8), digest 5, candidate 0, columns {1: 9}, E = 3, W = 2 ->
    [1, 2, 5, 0, 7, 8, -1, -1, 9]."""
    block = [hits, len(emitted), plan_digest, candidate, *emitted, *[PAD] * (max_emit - len(emitted))]
    cols = [PAD] * w
    for col, tok in columns.items():
        cols[col] = tok
    return block + cols


def pack(
    hits: int,
    emitted: Sequence[int],
    plan_digest: int,
    candidate: int,
    columns: dict[int, int],
    max_emit: int,
    w: int,
) -> torch.Tensor:
    """``pack_values`` as a [L] int64 tensor."""
    return torch.tensor(pack_values(hits, emitted, plan_digest, candidate, columns, max_emit, w), dtype=torch.long)


def unpack(gathered: torch.Tensor, max_emit: int, w: int) -> list[RankReport]:
    """[P, L] -> one report per rank (the round's single host read-back of the exchange)."""
    return _reports(gathered.tolist(), max_emit, w)


def _reports(rows: list[list[int]], max_emit: int, w: int) -> list[RankReport]:
    """One report per rank from its payload block (host values)."""
    reports = []
    for row in rows:
        hits, num_emitted, digest, candidate = row[:HEADER]
        cols = row[HEADER + max_emit : HEADER + max_emit + w]
        reports.append(
            RankReport(
                hits=hits,
                emitted=tuple(row[HEADER : HEADER + num_emitted]),
                plan_digest=digest,
                candidate=candidate,
                columns={j: t for j, t in enumerate(cols) if t != PAD},
            )
        )
    return reports


def winner(reports: Sequence[RankReport]) -> int:
    """Longest hit wins; ties go to the lowest rank (so P = 1 and P > 1 agree when hits tie)."""
    return max(range(len(reports)), key=lambda r: (reports[r].hits, -r))


def sampling_winner(reports: Sequence[RankReport]) -> int:
    """Under sampling, rank 0's first token is the authority; the rank that continued from that same token (it
    holds every candidate starting with it) wins, else rank 0 (its first token alone is an exact sample)."""
    first = reports[0].emitted[0]
    for r, rep in enumerate(reports):
        if rep.hits > 0 and rep.emitted[0] == first:
            return r
    return 0


@dataclass(frozen=True)
class Decision:
    """What every rank publishes after a round: the winning rank's verdict and the round's new window columns."""

    rank: int  # the winning rank
    hits: int  # the winner's accepted suffix tokens
    emitted: tuple[int, ...]  # the winner's emitted run (before EOS / budget cuts)
    candidate: int  # global index of the winning candidate, -1 if none held
    columns: dict[int, int]  # global column -> new trajectory token, every rank's merged
    won: bool  # this rank's verdict is the published one (it keeps its K/V; the others re-feed)
    comm_s: float  # seconds in the collective


class Exchange(Protocol):
    def agree(self, plan_digest: int, hits: int, emitted: Sequence[int], candidate: int, columns: dict[int, int]):
        """This rank's verdict (global candidate index) and window columns in, the round's ``Decision`` out."""
        ...


class SoloExchange:
    """One rank (P = 1 without a launcher): its verdict is the decision; no collective, nothing to check."""

    def agree(self, plan_digest: int, hits: int, emitted: Sequence[int], candidate: int, columns: dict[int, int]):
        return Decision(0, hits, tuple(emitted), candidate, dict(columns), True, 0.0)


class GatherExchange:
    """Ranks behind a communicator: one all_gather of fixed-size payloads per round (``pack`` / ``unpack``).

    ``choose`` picks the winning rank from the reports (greedy: longest hit; sampling: rank 0's first token's
    continuation; see ``verifier``). Every rank gathers the same reports, so every rank decides alike.
    """

    def __init__(self, comm, max_emit: int, window_size: int, choose: Callable[[Sequence[RankReport]], int]) -> None:
        self.comm, self.max_emit, self.w, self.choose = comm, max_emit, window_size, choose

    def agree(self, plan_digest: int, hits: int, emitted: Sequence[int], candidate: int, columns: dict[int, int]):
        entry = Entry(plan_digest, hits, tuple(emitted), candidate, columns, self.max_emit, self.w, self.choose)
        return agree_batch(self.comm, [entry])[0]


@dataclass(frozen=True)
class Entry:
    """One generation's part of a round's agreement: this rank's verdict and columns, and how its payload block is
    sized and its winner chosen (from its own setting and verifier)."""

    plan_digest: int
    hits: int
    emitted: tuple[int, ...]
    candidate: int  # global index, -1 if none
    columns: dict[int, int]
    max_emit: int  # longest emitted run of its setting
    window_size: int
    choose: Callable[[Sequence[RankReport]], int]


def agree_batch(comm, entries: Sequence[Entry]) -> list[Decision]:
    """The round's decisions for every generation of a batch, from ONE all_gather: the payload is one block per
    generation, each of ``pack``'s layout at the batch's longest emitted run and widest window (so its size is
    fixed for the round and the same on every rank, which run the same generations in the same order).
    ``comm`` None: one rank alone, each verdict is its decision (no collective). One entry is
    ``GatherExchange``'s round exactly (the same payload). The payload is one host tensor written once
    (``Communicator.host_payload``), copied to the collective's device once, and read back once.

    Example: two generations with E = 4, W = 3 and 6: blocks of 4 + 4 + 6 = 14, a payload of 28 int64."""
    if comm is None:
        return [Decision(0, e.hits, e.emitted, e.candidate, dict(e.columns), True, 0.0) for e in entries]
    max_emit = max(e.max_emit for e in entries)
    w = max(e.window_size for e in entries)
    block = HEADER + max_emit + w
    values = [
        v for e in entries for v in pack_values(e.hits, e.emitted, e.plan_digest, e.candidate, e.columns, max_emit, w)
    ]
    payload = comm.host_payload(values)  # [n * block]: written once (pinned for a GPU's collective)
    t = time.perf_counter()
    rows = comm.all_gather(payload).tolist()  # [P][n * block]: the round's one host read-back of the exchange
    comm_s = time.perf_counter() - t
    decisions = []
    for k, e in enumerate(entries):
        reports = _reports([row[k * block : (k + 1) * block] for row in rows], max_emit, w)
        if any(r.plan_digest != e.plan_digest for r in reports):
            raise DistributedError(f"rank {comm.rank}: coordinator replicas disagree on the round plan")
        win = e.choose(reports)
        merged: dict[int, int] = {}
        for r in reports:
            merged.update(r.columns)
        chosen = reports[win]
        decisions.append(Decision(win, chosen.hits, chosen.emitted, chosen.candidate, merged, win == comm.rank, comm_s))
    return decisions

"""The per-round payload every rank contributes to the one all_gather: fixed-size int64, no pickling.

Layout of one generation's block (length 4 + E + W, E = the longest possible emitted run: longest candidate + 1):
    [hits, num_emitted, plan_digest, candidate (global index, -1 if none), emitted[0..E-1] (padded),
     column_tokens[0..W-1] (global column positions; -1 where another rank owns the column)]
The plan digest lets every rank check, at no extra collective, that all replicas of the coordinator planned the
same round (same live key, same candidates); a mismatch is a bug and stops the run.

``agree_batch`` is LP's per-round protocol as the round loop sees it: every generation's verdict and window
columns in (one ``Entry`` each), one ``Decision`` each out, from one all_gather of one block per generation (the
digest check, the winner choice, the merged window columns). With no communicator (one rank alone) each verdict
is its decision and nothing is gathered; the loop is the same for both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    generation, each of the module doc's layout at the batch's longest emitted run and widest window (so its size
    is fixed for the round and the same on every rank, which run the same generations in the same order).
    ``comm`` None: one rank alone, each verdict is its decision (no collective). The payload is one host tensor
    written once (``Communicator.host_payload``), copied to the collective's device once, and read back once.

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

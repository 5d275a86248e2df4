"""The per-round payload every rank contributes to the one all_gather: fixed-size int64, no pickling.

Layout (length 4 + E + W, E = the longest possible emitted run: longest candidate + 1):
    [hits, num_emitted, plan_digest, candidate (global index, -1 if none), emitted[0..E-1] (padded),
     column_tokens[0..W-1] (global column positions; -1 where another rank owns the column)]
The plan digest lets every rank check, at no extra collective, that all replicas of the coordinator planned the
same round (same live key, same candidates); a mismatch is a bug and stops the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PAD = -1
HEADER = 4


@dataclass(frozen=True)
class RankReport:
    hits: int
    emitted: tuple[int, ...]
    plan_digest: int
    candidate: int  # global index of this rank's best candidate, -1 if none
    columns: dict[int, int]  # global column -> new trajectory token


def pack(
    hits: int,
    emitted: Sequence[int],
    plan_digest: int,
    candidate: int,
    columns: dict[int, int],
    max_emit: int,
    w: int,
) -> torch.Tensor:
    payload = torch.full((HEADER + max_emit + w,), PAD, dtype=torch.long)  # [L]
    payload[0], payload[1], payload[2], payload[3] = hits, len(emitted), plan_digest, candidate
    payload[HEADER : HEADER + len(emitted)] = torch.tensor(list(emitted), dtype=torch.long)
    for col, tok in columns.items():
        payload[HEADER + max_emit + col] = tok
    return payload


def unpack(gathered: torch.Tensor, max_emit: int, w: int) -> list[RankReport]:
    """[P, L] -> one report per rank (the round's single host read-back of the exchange)."""
    reports = []
    for row in gathered.tolist():
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

"""Choosing D and P for N devices: every split D x P = N, priced from one group's predicted latency.

A job on N devices runs D independent groups of P Lookahead-Parallel ranks (``parallel.groups`` x
``parallel.workers``). For one split:

* per-token latency of one prompt = the predicted seconds per token of one group of P ranks (the cost model's
  ``predict`` of the best lookahead setting at that P: the busiest rank's forward, the all_gather, host time);
  D does not enter, since groups never wait for each other;
* job throughput = D x the tokens per second of one group (D prompts at once, each at that latency).

The assumption, stated wherever a split is printed: **each device runs its own forward at the measured curve**,
independently of the others (GPU-like devices, one process each). Every split of N runs N processes, so on a CPU
(where a "device" is a share of the cores) every split has the same threads per process, cores / N, and the
curve must be measured at that thread count; two processes on one core, or groups contending for memory
bandwidth, are not modelled. ``split_table`` takes the latency as a function of (D, P) so a caller that has a
curve per split (measured at each split's threads, say) can price each split with its own.

Worked example (``CostCurve.linear(0.010, 0.001)``: one row 10 ms, each further row 1 ms; rounds of 8 candidates
of 4 rows, 2 tokens each; the busiest rank runs 33 rows at P = 1, 18 at P = 2 and 10 at P = 4 (its candidates,
plus the last round's 2 tokens that a rank which did not own the winner re-feeds); all_gather 0.5 ms at 2
ranks, 1.5 ms at 4), N = 4::

    D x P   round ms           ms/token   job tokens/s
    4 x 1   42                 21.00      4 x 1000 / 21.00 = 190.5   <- highest throughput
    2 x 2   27 + 0.5 = 27.5    13.75      2 x 1000 / 13.75 = 145.5
    1 x 4   19 + 1.5 = 20.5    10.25      1 x 1000 / 10.25 =  97.6   <- lowest latency

Ties go to the smaller P (fewer collectives, more groups) for both winners.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

ASSUMPTION = (
    "each device runs its own forward at the measured curve, independently of the others (GPU-like devices); "
    "on a CPU every split of N runs N processes, so the curve must be measured at cores / N threads"
)


@dataclass(frozen=True)
class Split:
    """One way to use the devices: D groups of P ranks, with its predicted latency and job throughput."""

    groups: int  # D
    workers: int  # P, LP ranks per group
    ms_per_token: float  # one prompt's predicted per-token latency on one group
    tokens_per_s: float  # the job's: D x 1000 / ms_per_token

    @property
    def devices(self) -> int:
        return self.groups * self.workers

    @property
    def label(self) -> str:
        return f"D={self.groups} x P={self.workers}"

    def to_dict(self) -> dict:
        return {
            "groups": self.groups,
            "workers": self.workers,
            "devices": self.devices,
            "ms_per_token": round(self.ms_per_token, 3),
            "tokens_per_s": round(self.tokens_per_s, 3),
        }


def splits_of(devices: int) -> list[tuple[int, int]]:
    """Every (D, P) with D x P = ``devices``, P ascending: ``splits_of(4) == [(4, 1), (2, 2), (1, 4)]``."""
    if devices < 1:
        raise ValueError(f"the number of devices must be >= 1, got {devices}")
    return [(devices // p, p) for p in range(1, devices + 1) if devices % p == 0]


def split_table(devices: int, ms_per_token: Callable[[int, int], float]) -> list[Split]:
    """Every split of ``devices``, P ascending; ``ms_per_token(D, P)`` is one group's predicted latency per
    token at that split (the same for every D under the module's assumption; a function of both so a caller can
    price each split with its own curve). Throughput is D x 1000 / ms_per_token."""
    table = []
    for d, p in splits_of(devices):
        ms = ms_per_token(d, p)
        table.append(Split(d, p, ms, d * 1e3 / ms if ms > 0 else float("inf")))
    return table


def lowest_latency(table: Sequence[Split]) -> Split:
    """The split with the lowest per-token latency (ties: the smaller P)."""
    return min(table, key=lambda s: (s.ms_per_token, s.workers))


def highest_throughput(table: Sequence[Split]) -> Split:
    """The split with the highest job tokens/s (ties: the smaller P)."""
    return min(table, key=lambda s: (-s.tokens_per_s, s.workers))

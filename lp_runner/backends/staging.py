"""The contract of a round between the decoding loop and the backends, and its one stager.

Every round the adapter runs (``ModelAdapter.run``) is one or more generations' rows in one forward: a lookahead
round of one generation, a batch of generations, a prefill chunk. Each generation (a *segment*) brings its rows
(``RoundRows``: a ``decoding.layout.RoundLayout`` or ``Rows``) and its region of the K/V arena. ``stage`` writes
all of it, once, into one host tensor (``StagedInputs``' layout): every row's token, position and write slot, the
bounds of the cached prefix it sees, the logit rows, and the [B, B] in-round visibility. From those few vectors the
round builds its mask (``round_mask``, the one mask builder) and runs (``rounds.Rounds``, the one round function),
eager on a CPU, compiled and captured on a GPU: the same inputs either way.

Worked example: generation A (past 5, 2 rows: live key and one candidate token) in a region at slot 0,
generation B (past 3, 1 row) in a region at slot 64, a round of 3 rows (no bucket):

    row  segment  token  position  write slot  cached from .. to   sees in-round rows
    0    A        a0     5         5           0 .. 5              0
    1    A        a1     6         6           0 .. 5              0, 1
    2    B        b0     3         67          64 .. 67            2

Row 1 then sees slots 0..4 (A's prefix), 5 and 6 (A's rows) and nothing of B; row 2 sees slots 64..67. A round at
a bucket of 4 rows adds a filler row: it repeats row 2's token and position, writes slot 68 (after B's rows, in
B's region), sees only itself and is seen by no one, so every real row computes what it would without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

_INT_FIELDS = 5  # int64 vectors of B rows in the staging buffer: ids, positions, write slots, cached from, cached to


class RoundRows(Protocol):
    """One segment's rows of a round (``decoding.layout.RoundLayout`` is one): host values, staged once for every
    segment of the round (``stage``)."""

    tokens: Sequence[int]  # [q] each row's input token
    positions: Sequence[int]  # [q] each row's position
    visibility: torch.Tensor  # [q, q] bool, host, read only: in-round row i attends to in-round row j
    logit_rows: Sequence[int]  # [r] into the q rows


@dataclass(frozen=True)
class Rows:
    """``RoundRows`` from plain values (probes, measurements, tests)."""

    tokens: Sequence[int]
    positions: Sequence[int]
    visibility: torch.Tensor
    logit_rows: Sequence[int]

    @classmethod
    def of(cls, input_ids, position_ids, visibility: torch.Tensor, logit_rows) -> Rows:
        """From tensors on any device or integer sequences: [q], [q], [q, q] bool, [r]."""
        ints = (x.tolist() if isinstance(x, torch.Tensor) else x for x in (input_ids, position_ids, logit_rows))
        tokens, positions, logits = ints
        return cls(tokens, positions, visibility.cpu(), logits)


@dataclass(frozen=True)
class StagedInputs:
    """A round's inputs as views of one buffer (host, or the device buffer one copy fills).

    Byte layout for B rows and L logit rows: int64 [ids | positions | write slots | cached from | cached to] (B
    each), int64 [logit rows] (L), then the [B, B] visibility as bytes (bool). Row i sees the cached slots
    ``cached_from[i]`` .. ``cached_to[i] - 1`` (its generation's region's cached prefix) and the in-round rows its
    visibility row names. Example, B = 2, L = 2: 8 x 12 = 96 bytes of integers, 4 of visibility, 100 in all."""

    buffer: torch.Tensor  # [nbytes] uint8
    input_ids: torch.Tensor  # [B] int64
    position_ids: torch.Tensor  # [B] int64
    write_slots: torch.Tensor  # [B] int64
    cached_from: torch.Tensor  # [B] int64: the first slot of the row's region
    cached_to: torch.Tensor  # [B] int64: past its cached prefix
    logit_rows: torch.Tensor  # [L] int64
    visibility: torch.Tensor  # [B, B] bool

    @staticmethod
    def nbytes(rows: int, logits: int) -> int:
        return 8 * (_INT_FIELDS * rows + logits) + rows * rows

    @property
    def round_inputs(self) -> tuple[torch.Tensor, ...]:
        """The views the round function reads, in its parameters' order (``rounds.Rounds._round``)."""
        return (
            self.input_ids,
            self.position_ids,
            self.logit_rows,
            self.write_slots,
            self.cached_from,
            self.cached_to,
            self.visibility,
        )

    @classmethod
    def views(cls, buffer: torch.Tensor, rows: int, logits: int) -> StagedInputs:
        ints = buffer[: 8 * (_INT_FIELDS * rows + logits)].view(torch.int64)  # [5B + L]
        vis = buffer[8 * (_INT_FIELDS * rows + logits) :].view(torch.bool).view(rows, rows)  # [B, B]
        fields = ints.split([rows] * _INT_FIELDS + [logits])
        return cls(buffer, *fields, vis)


def stage(
    rows: int,
    logits: int,
    segments: Sequence[tuple[RoundRows, int, int]],  # each segment's rows, its region's first slot, cached positions
    pin: bool = False,
) -> torch.Tensor:  # [StagedInputs.nbytes(rows, logits)] uint8, host (pinned when ``pin``)
    """The round's inputs, segment after segment, padded to ``rows`` rows and ``logits`` logit rows, written once
    into one host tensor (``StagedInputs``' layout; the module doc's example).

    Filler rows (a round at a bucket larger than its rows) repeat the last row's token and position, see only
    themselves and are seen by no one; their K/V goes to the slots after the last segment's rows, in its region
    (its arena's ``region_extra`` leaves room there), past anything the round commits. Filler logit rows read row 0
    and are dropped. A fresh host tensor per round: torch's pinned-memory allocator keeps a block from reuse until
    the copy that reads it has run.

    Why numpy writes into one tensor: a round's host work runs right after a forward that has streamed the weights
    through every cache, so each torch operation before the next forward costs far more than its arithmetic."""
    host = torch.empty(StagedInputs.nbytes(rows, logits), dtype=torch.uint8, pin_memory=pin)
    raw = host.numpy()
    ints = raw[: 8 * (_INT_FIELDS * rows + logits)].view(np.int64)  # [5B + L]
    ids, pos, writes, first, end = ints[: _INT_FIELDS * rows].reshape(_INT_FIELDS, rows)
    out = ints[_INT_FIELDS * rows :]  # [L]
    vis = raw[8 * (_INT_FIELDS * rows + logits) :].reshape(rows, rows)  # [B, B]
    vis[:] = 0
    r = n = 0  # rows and logit rows so far
    for seg, base, past in segments:
        q, k = len(seg.tokens), len(seg.logit_rows)
        ids[r : r + q], pos[r : r + q] = seg.tokens, seg.positions
        out[n : n + k] = seg.logit_rows
        out[n : n + k] += r
        writes[r : r + q] = np.arange(base + past, base + past + q)
        first[r : r + q], end[r : r + q] = base, base + past
        vis[r : r + q, r : r + q] = seg.visibility.numpy()
        r, n = r + q, n + k
    if r < rows:
        ids[r:], pos[r:] = ids[r - 1], pos[r - 1]
        writes[r:] = np.arange(writes[r - 1] + 1, writes[r - 1] + 1 + rows - r)
        first[r:] = end[r:] = 0  # no cached key
        vis[np.arange(r, rows), np.arange(r, rows)] = 1  # a filler sees itself only
    out[n:] = 0
    return host

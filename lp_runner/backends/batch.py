"""The contract of a round between the decoding loop and a backend: one or more generations' rows in one
forward, each generation (a *segment*) reading its own region of the K/V arena only.

Every round the adapter runs is one of these (``ModelAdapter.run``): a lookahead round of one generation is a
batch of one segment, a batch of generations is several, a prefill chunk is one segment of ordinary rows.
``pack_round`` builds it from each segment's rows (a ``decoding.layout.RoundLayout`` or any ``RoundRows``) and
region; the adapter and the kernels (the native layers, ``attention.batched_attention``, ``round_mask``) consume
it. The packing concatenates the rows, so the linear layers read each weight once for every generation's rows
(what batching buys: a forward of a few rows streams the weights, and more rows cost little more), while
attention stays per segment: each row reads its own region only, through its segment's mask of ``past + rows``
keys (the cached prefix, then the round's own rows as its layout's visibility says). No row sees another
generation's keys, and a row's attention costs its own generation's length.

Worked example: generation A (past 5, 2 rows: live key and one candidate token) in slots 0.., generation B
(past 3, 1 row) in slots 64..:

    row  segment  position  slot  keys it may see (slots)        mask row (width)
    0    A        5         5     0..4, 5                        [0 0 0 0 0 | 0 -]      (7)
    1    A        6         6     0..4, 5, 6                     [0 0 0 0 0 | 0 0]      (7)
    2    B        3         67    64..66, 67                     [0 0 0 | 0]            (4)

The flat mask is A's 2 x 7 floats, then B's 1 x 4 (``Segments``: start (0, 2, 3), base (0, 64), width (7, 4),
offsets (0, 14)); logit rows are each segment's own, shifted by its first row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Segments:
    """The generations of a batched round as the native calls take them (``csrc/lp_native.h``'s ``struct segments``):
    segment b holds round rows ``start[b]`` .. ``start[b + 1] - 1``, its key j is buffer slot ``base[b] + j`` for j
    below ``width[b]``, and its mask rows (``width[b]`` floats each) start at float ``moff[b]`` of the flat mask.

    Example: two generations of 2 and 3 rows, regions at slots 0 and 512, 100 and 40 keys visible ->
    start (0, 2, 5), base (0, 512), width (100, 40), moff (0, 200); the flat mask holds 2 x 100 + 3 x 40 floats."""

    start: torch.Tensor  # [n + 1] int64
    base: torch.Tensor  # [n] int64
    width: torch.Tensor  # [n] int64
    moff: torch.Tensor  # [n] int64

    @classmethod
    def of(cls, rows: Sequence[int], base: Sequence[int], width: Sequence[int]) -> Segments:
        """From each segment's row count, first slot and key count (the mask's rows packed in segment order)."""
        start = [0]
        moff = []
        offset = 0
        for r, w in zip(rows, width, strict=True):
            start.append(start[-1] + r)
            moff.append(offset)
            offset += r * w
        return cls(*(torch.tensor(list(x), dtype=torch.long) for x in (start, base, width, moff)))

    @property
    def count(self) -> int:
        return self.base.shape[0]

    @property
    def mask_size(self) -> int:
        """Floats of the flat mask."""
        rows = self.start[1:] - self.start[:-1]
        return int((rows * self.width).sum())

    def pointers(self) -> tuple[int, int, int, int, int]:
        return (self.count, *(t.data_ptr() for t in (self.start, self.base, self.width, self.moff)))


@dataclass(frozen=True)
class BatchRound:
    """Flat tensors of one batched forward; ``masks`` per sliding window (None: full attention)."""

    input_ids: torch.Tensor  # [R] int64, every segment's rows in segment order
    position_ids: torch.Tensor  # [R] int64
    slots: torch.Tensor  # [R] int64: the buffer slot each row's K/V is written to (inside its own region)
    segments: Segments
    masks: Mapping[int | None, torch.Tensor]  # window -> [mask_size] flat additive masks, segment after segment
    logit_rows: torch.Tensor  # [L] int64 into the R rows: each segment's logit rows, in segment order
    logit_counts: tuple[int, ...]  # logit rows per segment (to split the logits)
    past: tuple[int, ...]  # cached positions of each segment before the round

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def segment_mask(self, window: int | None, b: int) -> torch.Tensor:
        """Segment ``b``'s [rows, width] mask (a view)."""
        start, stop = int(self.segments.start[b]), int(self.segments.start[b + 1])
        width, offset = int(self.segments.width[b]), int(self.segments.moff[b])
        return self.masks[window][offset : offset + (stop - start) * width].view(stop - start, width)


class RoundRows(Protocol):
    """One segment's rows of a round (``decoding.layout.RoundLayout`` is one)."""

    input_ids: torch.Tensor  # [q] int64
    position_ids: torch.Tensor  # [q] int64
    visibility: torch.Tensor  # [q, q] bool: in-round row i attends to in-round row j
    logit_rows: torch.Tensor  # [r] int64 into the q rows


@dataclass(frozen=True)
class Rows:
    """``RoundRows`` from plain tensors (tests, probes, scratch measurements)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    visibility: torch.Tensor
    logit_rows: torch.Tensor


def pack_round(
    rounds: Sequence[RoundRows],
    bases: Sequence[int],  # first slot of each segment's region
    past_lens: Sequence[int],  # cached positions of each segment before the round
    windows: Sequence[int | None],  # the model's sliding windows (None: full attention), ``ModelAdapter.mask_windows``
    dtype: torch.dtype,
) -> BatchRound:
    """The round of these segments (see the module docstring's example). Host tensors; no structure is larger
    than a segment's rows times its keys (a long prompt's chunk: chunk rows x (past + chunk rows))."""
    hidden = torch.finfo(dtype).min
    ids, positions, slots, logit_rows, counts, masks = [], [], [], [], [], {w: [] for w in set(windows)}
    row = 0
    for rows, base, past in zip(rounds, bases, past_lens, strict=True):
        q = rows.input_ids.shape[0]
        ids.append(rows.input_ids)
        positions.append(rows.position_ids)
        slots.append(torch.arange(base + past, base + past + q))
        logit_rows.append(rows.logit_rows + row)
        counts.append(rows.logit_rows.shape[0])
        full = torch.zeros(q, past + q, dtype=dtype)  # [q, past + q]: the cached prefix visible
        full[:, past:].masked_fill_(~rows.visibility, hidden)  # the round's own rows as the layout says
        for window in masks:
            m = full
            if window is not None:  # transformers' rule: the query at p sees keys at p - window < k <= p
                keys = torch.cat([torch.arange(past), rows.position_ids])  # [past + q] cached slot j is position j
                m = full.masked_fill(rows.position_ids[:, None] - keys[None, :] >= window, hidden)
            masks[window].append(m.reshape(-1))
        row += q
    return BatchRound(
        input_ids=torch.cat(ids),
        position_ids=torch.cat(positions),
        slots=torch.cat(slots),
        segments=Segments.of(
            [r.input_ids.shape[0] for r in rounds],
            bases,
            [p + r.input_ids.shape[0] for p, r in zip(past_lens, rounds, strict=True)],
        ),
        masks={w: torch.cat(parts) for w, parts in masks.items()},
        logit_rows=torch.cat(logit_rows),
        logit_counts=tuple(counts),
        past=tuple(past_lens),
    )

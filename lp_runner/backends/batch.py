"""The contract of a round between the decoding loop and a backend: one or more generations' rows in one
forward, each generation (a *segment*) reading its own region of the K/V arena only.

Every round the adapter runs is one of these (``ModelAdapter.run``): a lookahead round of one generation is a
batch of one segment, a batch of generations is several, a prefill chunk is one segment of ordinary rows.
``pack_round`` builds it from each segment's rows (a ``decoding.layout.RoundLayout`` or any ``RoundRows``) and
region; the adapter and the kernels (the native layers, ``attention.batched_attention``) consume it (a static
round builds its mask on the device from the layout instead: ``round_mask``). The packing concatenates the
rows, so the linear layers read each weight once for every generation's rows (what batching buys: a forward of
a few rows streams the weights, and more rows cost little more), while
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

import numpy as np
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
    mask_size: int  # floats of the flat mask: sum of rows x width

    @classmethod
    def of(cls, rows: Sequence[int], base: Sequence[int], width: Sequence[int]) -> Segments:
        """From each segment's row count, first slot and key count (the mask's rows packed in segment order)."""
        lists = _segment_lists(rows, base, width)
        fields = torch.tensor([v for x in lists for v in x], dtype=torch.long).split([len(x) for x in lists])
        return cls(*fields, _mask_size(rows, width))

    @property
    def count(self) -> int:
        return self.base.shape[0]

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
    """One segment's rows of a round (``decoding.layout.RoundLayout`` is one): host values, which the backend stages
    once for every segment of the round (``pack_round`` here, ``static_rounds.stage`` for bucketed rounds)."""

    tokens: Sequence[int]  # [q] each row's input token
    positions: Sequence[int]  # [q] each row's position
    visibility: torch.Tensor  # [q, q] bool, host, read only: in-round row i attends to in-round row j
    logit_rows: Sequence[int]  # [r] into the q rows


@dataclass(frozen=True)
class Rows:
    """``RoundRows`` from plain values (tests, probes, scratch measurements)."""

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


def _segment_lists(
    rows: Sequence[int], base: Sequence[int], width: Sequence[int]
) -> tuple[list[int], list[int], list[int], list[int]]:
    """``Segments``' start, base, width and mask offsets, as lists."""
    start, moff, offset = [0], [], 0
    for r, w in zip(rows, width, strict=True):
        start.append(start[-1] + r)
        moff.append(offset)
        offset += r * w
    return start, list(base), list(width), moff


def _mask_size(rows: Sequence[int], width: Sequence[int]) -> int:
    return sum(r * w for r, w in zip(rows, width, strict=True))


def pack_round(
    rounds: Sequence[RoundRows],
    bases: Sequence[int],  # first slot of each segment's region
    past_lens: Sequence[int],  # cached positions of each segment before the round
    windows: Sequence[int | None],  # the model's sliding windows (None: full attention), ``ModelAdapter.mask_windows``
    dtype: torch.dtype,
) -> BatchRound:
    """The round of these segments (see the module docstring's example). Host tensors, made in two steps: every
    integer of the round in one tensor (its fields are views of it) and each window's flat mask written in one
    array; no structure is larger than a segment's rows times its keys (a long prompt's chunk: chunk rows x
    (past + chunk rows)).

    Why so few tensors: a round's host work runs right after a forward that has streamed the weights through
    every cache, so each torch operation before the next forward costs far more than its arithmetic; the round's
    values are Python integers already, and a mask is written fastest in place."""
    qs = [len(r.tokens) for r in rounds]
    widths = [p + q for p, q in zip(past_lens, qs, strict=True)]
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logit_rows: list[int] = []
    row = 0
    for rows, base, past, q in zip(rounds, bases, past_lens, qs, strict=True):
        ids.extend(rows.tokens)
        positions.extend(rows.positions)
        slots.extend(range(base + past, base + past + q))
        logit_rows.extend([r + row for r in rows.logit_rows] if row else rows.logit_rows)
        row += q
    seg = _segment_lists(qs, bases, widths)
    fields = (ids, positions, slots, logit_rows, *seg)
    ints = torch.tensor([v for field in fields for v in field], dtype=torch.long)  # the round's one int tensor
    input_ids, position_ids, slot_ids, logit_ids, *segments = ints.split([len(f) for f in fields])
    return BatchRound(
        input_ids=input_ids,
        position_ids=position_ids,
        slots=slot_ids,
        segments=Segments(*segments, _mask_size(qs, widths)),
        masks=_masks(rounds, past_lens, qs, widths, set(windows), dtype),
        logit_rows=logit_ids,
        logit_counts=tuple(len(r.logit_rows) for r in rounds),
        past=tuple(past_lens),
    )


def _masks(
    rounds: Sequence[RoundRows],
    past_lens: Sequence[int],
    qs: Sequence[int],
    widths: Sequence[int],
    windows: set[int | None],
    dtype: torch.dtype,
) -> dict[int | None, torch.Tensor]:
    """Each window's flat additive mask ([mask_size], segment after segment): a segment's [q, past + q] block sees
    its cached prefix and its own rows as its layout's visibility says; a sliding window (transformers' rule: the
    query at p sees keys at p - window < k <= p) hides the keys more than ``window - 1`` positions back. Written in
    a host array (float32, float64 for a float64 model: every half type's ``finfo.min`` is a float32 exactly) and
    made the model's dtype once."""
    hidden = _HIDDEN.get(dtype) or _HIDDEN.setdefault(dtype, torch.finfo(dtype).min)
    full = np.zeros(_mask_size(qs, widths), _HOST_DTYPE.get(dtype, np.float32))
    at = 0
    for rows, past, q, w in zip(rounds, past_lens, qs, widths, strict=True):
        np.copyto(full[at : at + q * w].reshape(q, w)[:, past:], hidden, where=~rows.visibility.numpy())
        at += q * w
    out = {}
    for window in windows:
        m = full
        if window is not None:
            m, at = full.copy(), 0
            for rows, past, q, w in zip(rounds, past_lens, qs, widths, strict=True):
                pos = np.asarray(rows.positions)  # [q]
                keys = np.concatenate([np.arange(past), pos])  # [past + q]: cached slot j is position j
                m[at : at + q * w].reshape(q, w)[pos[:, None] - keys[None, :] >= window] = hidden
                at += q * w
        out[window] = torch.from_numpy(m) if dtype in _HOST_DTYPE else torch.from_numpy(m).to(dtype)
    return out


_HOST_DTYPE = {torch.float32: np.float32, torch.float64: np.float64}  # masks a host array holds in their dtype
_HIDDEN: dict[torch.dtype, float] = {}  # dtype -> its finfo.min, the additive mask's hidden value

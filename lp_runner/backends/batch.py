"""The contract of a batched round between the decoding loop and a backend: several generations' rows in one
forward, each generation (a *segment*) reading its own region of the K/V buffer only.

``decoding.batch_round.pack_round`` builds a ``BatchRound`` from the generations' layouts; the adapter
(``ModelAdapter.forward_batch``) and the kernels (the native layers, ``attention.batched_attention``) consume it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def segment_mask(self, window: int | None, b: int) -> torch.Tensor:
        """Segment ``b``'s [rows, width] mask (a view)."""
        start, stop = int(self.segments.start[b]), int(self.segments.start[b + 1])
        width, offset = int(self.segments.width[b]), int(self.segments.moff[b])
        return self.masks[window][offset : offset + (stop - start) * width].view(stop - start, width)

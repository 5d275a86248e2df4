"""The few shapes a round runs at on a GPU: row buckets and live K/V widths, each shape one captured graph.

A CUDA graph replays fixed shapes at fixed addresses, so a round of any row count must run at one of a few row
counts (vLLM pads its token counts to its captured sizes, ``pad_for_cudagraph``), and its attention must read one
of a few K/V widths. Here both ladders are powers of two:

* rows: 2, 4, 8, ..., ``MAX_BUCKET_ROWS``. Padding costs little where this matters: on a GPU a forward of 1 to ~100
  rows costs about what one row does (the weights are read once either way), and a power-of-two ladder pads a round by
  less than 2x. The ladder starts at 2, not 1: a compiled graph is specialised to size-1 dimensions, so a one-row
  bucket would be a second compilation. A round of more rows than the ladder's top (a long prompt's prefill) runs at
  its own count, eager.
* K/V width: the smallest power of two from ``MIN_CAPACITY`` that holds the cached positions and the round's
  rows, never past the buffer's capacity: attention reads that much of the buffer, not all of it, and a job's
  rounds take a handful of widths (log2 of capacity / 256).

Example: a 5-row round after 300 cached positions on a 2048-slot buffer runs at 8 rows and reads 512 slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from lp_runner.backends.kv_cache import MIN_CAPACITY

MIN_BUCKET_ROWS = 2  # size-1 dimensions specialise a compiled graph: one-row rounds run as two
MAX_BUCKET_ROWS = 512  # the largest captured round; rounds beyond (prefills) run eager at their own count


@dataclass(frozen=True)
class BucketLadder:
    """Row buckets (``RowCounts``-shaped: ``rows_for``, ``max_rows``) and live K/V widths."""

    rows: tuple[int, ...] = tuple(2**k for k in range(1, MAX_BUCKET_ROWS.bit_length()))

    def __post_init__(self) -> None:
        if not self.rows or list(self.rows) != sorted(set(self.rows)) or self.rows[0] < MIN_BUCKET_ROWS:
            raise ValueError(f"row buckets must be increasing and start at {MIN_BUCKET_ROWS} or more: {self.rows}")

    def rows_for(self, rows: int, kv_len: int = 0) -> int:
        """The row count a round of ``rows`` runs at: the smallest bucket that holds it, else its own count (a
        round past the ladder, run eager). ``kv_len`` is unused: the ladder is the same at every length."""
        return next((b for b in self.rows if b >= rows), rows)

    @property
    def max_rows(self) -> int:
        return self.rows[-1]

    def captured(self, rows: int) -> bool:
        """True when a round of exactly ``rows`` rows (already padded) is one of the ladder's shapes."""
        return rows in self.rows

    def kv_width(self, length: int, capacity: int) -> int:
        """The K/V slots a round reads when ``length`` positions (cached + the round's rows) are live in a buffer
        of ``capacity`` slots: the smallest power of two >= max(length, MIN_CAPACITY), at most ``capacity``.
        Examples: (300, 2048) -> 512, (5, 2048) -> 256, (1500, 1024) -> ValueError (the round does not fit)."""
        if length > capacity:
            raise ValueError(f"{length} live positions do not fit a buffer of {capacity} slots")
        width = MIN_CAPACITY
        while width < length:
            width *= 2
        return min(width, capacity)

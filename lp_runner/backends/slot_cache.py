"""K/V of a batch of generations: one buffer per layer, a region of slots per generation.

A batched round (``batch_forward.py``) runs the rows of several generations in one forward. Their K/V lives in
one static buffer per layer (``kv_cache.StaticBufferLayer``, [1, H_kv, capacity, D]); each generation owns a
contiguous region of slots (``SlotRegion``: slots base .. base + size - 1, position j of the generation in slot
base + j), sized when it joins (its prompt, its budget and one round's rows) and freed when it finishes. A row
attends to its own region only: the native layers and the batched attention read each region by its base and
width (``backends.batch.Segments``), so a row's attention costs its own generation's length, not the batch's.

Why one buffer rather than a cache per generation: the native layers run every layer of a round in one C call
over one table of buffer addresses (``native.LayerStack``), and K/V moves of several generations become one
index copy per layer (``flush``).

Regions are placed first fit. When no gap is large enough the live regions are slid to the front (``compact``:
a copy of their cached slots, rare) and, if the buffer is still too small, it grows (a larger buffer holding the
old one; the native layers bind to the new one). Example (capacity 128): regions of 48 and 32 at 0 and 48; the
first finishes; a region of 64 fits neither the gap of 48 nor the 48 slots after 80, so the second slides to 0
and the new one takes 32..95; a region of 64 more fits nowhere (32 free), so the buffer grows to 256 and it takes
96..159.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from lp_runner.backends.kv_cache import StaticBufferLayer, copy_slots

ALIGN = 16  # region sizes round up to this many slots (the native attention scores 16 keys at a time)


@dataclass(eq=False)
class SlotRegion:
    """One generation's slots: ``crop`` and ``move`` are what a round's publication needs (``round.publish``)."""

    owner: SlotCache
    base: int
    size: int
    length: int = 0  # cached positions (committed, plus a round's rows until it is published)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (nothing is erased: the next round overwrites the rest)."""
        if length > self.length:
            raise ValueError(f"cannot crop a region of {self.length} positions to {length}")
        self.length = length

    def move(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy positions ``src`` to ``dst`` (all sources read before any write); applied with every other
        region's moves before the next forward (``SlotCache.flush``)."""
        self.owner.queue_moves(self, src, dst)


@dataclass(eq=False)
class SlotCache:
    """The batch's buffers (``cache``, what the adapter's batched forward takes) and its regions."""

    cache: DynamicCache
    capacity: int
    regions: list[SlotRegion] = field(default_factory=list)  # live, by base
    _moves: list[tuple[int, int]] = field(default_factory=list)  # pending (source slot, destination slot)
    compactions: int = 0
    growths: int = 0

    @classmethod
    def allocate(cls, model, kv_shape: tuple[int, int], dtype: torch.dtype, device, capacity: int) -> SlotCache:
        """Buffers of ``capacity`` slots for every attention layer of ``model`` (``kv_shape``: K/V heads, head
        dim), allocated now."""
        cache = DynamicCache(config=model.config)
        cache.layers = [StaticBufferLayer(capacity) for _ in cache.layers]
        for layer in cache.layers:
            layer.allocate(*kv_shape, dtype, device)
        return cls(cache, capacity)

    def layers(self) -> list[StaticBufferLayer]:
        return self.cache.layers

    def region(self, size: int) -> SlotRegion:
        """A region of at least ``size`` slots (first fit; compacting, then growing, when none is free)."""
        size = -(-size // ALIGN) * ALIGN
        self.flush()
        base = self._first_fit(size)
        if base is None and self.capacity - sum(r.size for r in self.regions) >= size:
            self.compact()
            base = self._first_fit(size)
        if base is None:
            self._grow(max(2 * self.capacity, sum(r.size for r in self.regions) + size))
            base = self._first_fit(size)
        region = SlotRegion(self, base, size)
        self.regions.append(region)
        self.regions.sort(key=lambda r: r.base)
        return region

    def release(self, region: SlotRegion) -> None:
        """The region's slots are free again (its generation finished)."""
        self._moves = [(s, d) for s, d in self._moves if not region.base <= d < region.base + region.size]
        self.regions.remove(region)

    def _first_fit(self, size: int) -> int | None:
        at = 0
        for r in self.regions:
            if r.base - at >= size:
                return at
            at = r.base + r.size
        return at if self.capacity - at >= size else None

    def queue_moves(self, region: SlotRegion, src: Sequence[int], dst: Sequence[int]) -> None:
        if len(src) != len(dst):
            raise ValueError("src and dst must have equal length")
        for s, d in zip(src, dst, strict=True):
            if not (0 <= s < region.size and 0 <= d < region.size):
                raise ValueError(f"move {s}->{d} outside a region of {region.size} slots")
            if s != d:  # a position moved onto itself stays (model.move_rows says why)
                self._moves.append((region.base + s, region.base + d))

    @torch.inference_mode()
    def flush(self) -> None:
        """Apply every queued move for the whole batch at once (``kv_cache.copy_slots``: a slice copy per run of
        consecutive moves per layer; regions are disjoint, so no move reads a slot another region writes)."""
        if not self._moves:
            return
        src, dst = zip(*self._moves, strict=True)
        self._moves = []
        copy_slots([t for layer in self.layers() for t in (layer.keys, layer.values)], src, dst)

    @torch.inference_mode()
    def compact(self) -> None:
        """Slide every live region to the front, in order, carrying its cached positions."""
        self.flush()
        at = 0
        for r in self.regions:
            if r.base != at and r.length:
                for layer in self.layers():
                    for buf in (layer.keys, layer.values):
                        buf[:, :, at : at + r.length] = buf[:, :, r.base : r.base + r.length].clone()
            r.base = at
            at += r.size
        self.compactions += 1

    def _grow(self, needed: int) -> None:
        for layer in self.layers():
            layer.reserve(needed)  # a larger buffer holding the old one at its start
        self.capacity = self.layers()[0].capacity
        self.growths += 1

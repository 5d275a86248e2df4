"""The K/V arena: one tensor per job holding every generation's K/V, written by position.

One layout serves every round the adapter runs (one generation or a batch of them, eager or compiled, a prefill
chunk or a lookahead round), as gpt-fast's KVCache.update and vLLM's slot mapping do:

* ``KVArena.tensor`` is [layers, 2, 1, H_kv, capacity, D]; layer i's keys are ``[i, 0]`` and its values ``[i, 1]``,
  each a contiguous [1, H_kv, capacity, D] view held by an ``ArenaLayer`` (transformers' cache-layer contract).
  The native layers read the same views; a commit's row moves are one slice copy per run over every layer at once
  (``copy_slots`` on the whole tensor).
* A generation owns a contiguous ``KVRegion`` of slots (position j in slot ``base + j``), sized when it starts (its
  prompt, its budget and one round's rows, plus the arena's ``region_extra``: the room a bucketed round's filler
  rows write past its real rows) and freed when it ends. A round writes its rows at explicit slots
  (``ArenaLayer.write_slots``, set by the adapter before the forward) and attention reads each region's live
  slots only (the round's mask, ``round_mask``); nothing is erased: a crop shortens the region's
  length and the next round overwrites the tail.
* The arena is allocated once, at the job's need, and grows (a larger tensor holding the old one, every view
  re-made) only when a region no longer fits; ``allocations`` counts the tensors made, since a captured graph
  reads the arena at fixed addresses (``rounds``: a new tensor means graphs recorded again).

Regions are placed first fit. When no gap is large enough the live regions are slid to the front (``compact``:
a copy of their cached slots, rare) and, if the arena is still too small, it grows. Example (capacity 256):
regions of 96 and 64 at 0 and 96; the first ends; a region of 128 fits neither the gap of 96 nor the 96 slots
after 160, so the second slides to 0 and the new one takes 64..191; a region of 128 more fits nowhere (64 free),
so the arena grows to 512 and it takes 192..319.

``tests/backends/test_kv_arena.py`` checks the arena against transformers' own DynamicCache, bit for bit, across
rounds, crops, moves, compaction and growth.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 256  # the smallest arena; capacities are powers of two from here (few compiled shapes)
ALIGN = 16  # region sizes round up to this many slots (the native attention scores 16 keys at a time)


def region_slots(needs: Sequence[int], extra: int = 0) -> int:
    """The slots regions for ``needs`` positions each take in an arena whose regions hold ``extra`` slots more
    (``KVArena.region_extra``), all alive at once: each rounded up to ``ALIGN``.

    Example: needs (100, 40) with extra 64 -> 176 + 112 = 288 slots."""
    return sum(-(-max(need + extra, 1) // ALIGN) * ALIGN for need in needs)


def static_capacity(needed: int) -> int:
    """The arena for ``needed`` slots: the next power of two from ``MIN_CAPACITY`` (a compiled round is
    specialised to the arena's capacity, so nearby jobs share one)."""
    capacity = MIN_CAPACITY
    while capacity < needed:
        capacity *= 2
    return capacity


def _static_buffer(buffer: torch.Tensor) -> torch.Tensor:
    """``buffer`` [batch, heads, capacity, head dim] with every dimension but the capacity marked static for
    ``torch.compile``: under ``dynamic=True`` each would otherwise be a symbol, and dynamo's duck sizing gives
    equal sizes one symbol, so a round of as many rows as there are K/V heads would tie the row count to the
    head count (a graph fixed to that row count; the next round recompiles)."""
    for dim in (0, 1, 3):
        torch._dynamo.mark_static(buffer, dim)
    return buffer


class KVCapacityError(RuntimeError):
    """A round would outrun its generation's region: the caller sized the generation too small (a bug)."""


class ArenaLayer(DynamicLayer):
    """One attention layer's K/V in transformers' cache-layer contract: views of the arena, written at
    ``write_slots`` and read over slots ``read_slots`` = (first, stop) (None: the whole capacity).

    The adapter sets both before each forward, outside any traced code, so a compiled round reads no Python
    length. ``update`` returns the slots attention may read; the round's mask (or its segments) hides the ones a
    row must not see. ``length``: the slots before the round's first row where one generation runs (what
    transformers may ask through ``get_seq_length``; a batched round's segments carry their own)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.bind(keys, values)
        self.write_slots: torch.Tensor | None = None  # [rows] int64 on the device
        self.read_slots: tuple[int, int] | None = None
        self.length = 0

    def bind(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold ``keys`` / ``values`` ([1, H_kv, capacity, D] views of the arena) as the buffers."""
        self.dtype, self.device = keys.dtype, keys.device
        self.keys, self.values = _static_buffer(keys), _static_buffer(values)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("an arena layer is bound to its arena when it is made")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.index_copy_(2, self.write_slots, key_states)
        self.values.index_copy_(2, self.write_slots, value_states)
        if self.read_slots is None:
            return self.keys, self.values
        first, stop = self.read_slots
        return self.keys[:, :, first:stop], self.values[:, :, first:stop]

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.length

    def get_max_cache_shape(self) -> int:
        return self.capacity

    def crop(self, max_length: int) -> None:
        raise RuntimeError("an arena layer is cropped through its generation's region (KVRegion.crop)")


@dataclass(eq=False)
class KVRegion:
    """One generation's slots of an arena: what a round's publication needs (``decoding.round.publish``)."""

    arena: KVArena
    base: int
    size: int
    length: int = 0  # cached positions (committed, plus a round's rows until it is published)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (nothing is erased: the next round overwrites the rest)."""
        if length > self.length:
            raise ValueError(f"cannot crop a region of {self.length} positions to {length}")
        self.length = length

    def move(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy positions ``src`` to ``dst`` (every source read before any write); applied with every other
        region's moves before the next forward (``KVArena.flush``)."""
        self.arena.queue_moves(self, src, dst)

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` positions: the region grows in place where it is the arena's last and the arena
        may grow (scratch arenas: calibration, probes); otherwise a round past its size is a ``KVCapacityError``
        (a generation's region is sized once, at its start)."""
        if needed <= self.size:
            return
        arena = self.arena
        if not arena.growable or arena.regions[-1] is not self:
            raise KVCapacityError(f"a round needs {needed} K/V slots, past its generation's region of {self.size}")
        size = -(-needed // ALIGN) * ALIGN
        if self.base + size > arena.capacity:
            arena.grow(self.base + size)
        self.size = size

    def keys(self, layer: int) -> torch.Tensor:  # [1, H_kv, length, D]
        """Layer ``layer``'s cached keys (a view; queued moves applied first)."""
        self.arena.flush()
        return self.arena.layers()[layer].keys[:, :, self.base : self.base + self.length]

    def values(self, layer: int) -> torch.Tensor:  # [1, H_kv, length, D]
        """Layer ``layer``'s cached values (a view; queued moves applied first)."""
        self.arena.flush()
        return self.arena.layers()[layer].values[:, :, self.base : self.base + self.length]


class KVArena:
    """Every generation's K/V in one tensor (see the module doc): ``cache`` is what the model's forward takes."""

    def __init__(
        self,
        config,
        kv_shape: tuple[int, int],
        dtype: torch.dtype,
        device: torch.device | str,
        capacity: int,
        *,
        attention_layer: Callable[[object], bool] = lambda layer: True,
        growable: bool = True,
        spare: int = 0,
        region_extra: int = 0,
    ) -> None:
        """``config``: the model's (its cache's layer kinds); ``kv_shape``: (K/V heads, head dim);
        ``attention_layer``: which of a fresh DynamicCache's layers hold K/V here (others are kept as they are);
        ``growable``: a region of the arena may outgrow it (scratch arenas), else only new regions grow it;
        ``spare``: slots past the power of two of every capacity it takes (``ModelAdapter.arena`` says why);
        ``region_extra``: slots every region holds past the positions asked for (``region``): the room a bucketed
        round's fillers write after its rows, so a caller asks for the positions its generation needs."""
        self.cache = DynamicCache(config=config)
        self._kv = [i for i, layer in enumerate(self.cache.layers) if attention_layer(layer)]
        self.kv_shape, self.dtype, self.device = kv_shape, dtype, torch.device(device)
        self.growable, self.spare, self.region_extra = growable, spare, region_extra
        self.regions: list[KVRegion] = []  # live, by base
        self._moves: list[tuple[int, int]] = []  # pending (source slot, destination slot)
        self.allocations = self.compactions = self.growths = 0
        self.tensor = self._allocate(static_capacity(capacity) + spare)
        self._bind(fresh=True)

    @torch.inference_mode()  # the arena is an inference tensor wherever it is made (a compiled graph guards on it)
    def _allocate(self, capacity: int) -> torch.Tensor:  # [L, 2, 1, H_kv, capacity, D]
        self.allocations += 1
        heads, head_dim = self.kv_shape
        return torch.zeros(len(self._kv), 2, 1, heads, capacity, head_dim, dtype=self.dtype, device=self.device)

    def _bind(self, fresh: bool = False) -> None:
        for k, i in enumerate(self._kv):
            keys, values = self.tensor[k, 0], self.tensor[k, 1]
            if fresh:
                self.cache.layers[i] = ArenaLayer(keys, values)
            else:
                self.cache.layers[i].bind(keys, values)

    @property
    def capacity(self) -> int:
        return self.tensor.shape[4]

    def layers(self) -> list[ArenaLayer]:
        """The arena's attention layers, in the model's order."""
        return [self.cache.layers[i] for i in self._kv]

    def slots(self, needs: Sequence[int]) -> int:
        """The slots regions for ``needs`` positions each take (``region``), all alive at once."""
        return region_slots(needs, self.region_extra)

    def region(self, need: int) -> KVRegion:
        """A region for a generation of at most ``need`` positions: ``need`` plus ``region_extra`` slots, rounded
        up to ``ALIGN`` (first fit; compacting, then growing, when none is free)."""
        size = self.slots([need])
        self.flush()
        base = self._first_fit(size)
        if base is None and self.capacity - sum(r.size for r in self.regions) >= size:
            self.compact()
            base = self._first_fit(size)
        if base is None:
            self.grow(max(2 * self.capacity, sum(r.size for r in self.regions) + size))
            base = self._first_fit(size)
        region = KVRegion(self, base, size)
        self.regions.append(region)
        self.regions.sort(key=lambda r: r.base)
        return region

    def release(self, region: KVRegion) -> None:
        """The region's slots are free again (its generation ended)."""
        self._moves = [(s, d) for s, d in self._moves if not region.base <= d < region.base + region.size]
        self.regions.remove(region)

    def _first_fit(self, size: int) -> int | None:
        at = 0
        for r in self.regions:
            if r.base - at >= size:
                return at
            at = r.base + r.size
        return at if self.capacity - at >= size else None

    def queue_moves(self, region: KVRegion, src: Sequence[int], dst: Sequence[int]) -> None:
        if len(src) != len(dst):
            raise ValueError("src and dst must have equal length")
        for s, d in zip(src, dst, strict=True):
            if not (0 <= s < region.size and 0 <= d < region.size):
                raise ValueError(f"move {s}->{d} outside a region of {region.size} slots")
            if s != d:  # a position moved onto itself stays: the winner's rows often follow the ordinary rows
                self._moves.append((region.base + s, region.base + d))

    def flush(self) -> None:
        """Apply every queued move, every region's at once (``copy_slots`` over the whole arena: one slice copy
        per run of consecutive moves; regions are disjoint, so no move reads a slot another region writes)."""
        if not self._moves:
            return
        src, dst = zip(*self._moves, strict=True)
        self._moves = []
        copy_slots([self.tensor], src, dst)

    @torch.inference_mode()
    def compact(self) -> None:
        """Slide every live region to the front, in order, carrying its cached positions."""
        self.flush()
        at = 0
        for r in self.regions:
            if r.base != at and r.length:
                self.tensor[..., at : at + r.length, :] = self.tensor[..., r.base : r.base + r.length, :].clone()
            r.base = at
            at += r.size
        self.compactions += 1

    @torch.inference_mode()
    def grow(self, needed: int) -> None:
        """A larger arena (a power of two of at least ``needed`` slots) holding the old one at its start; every
        layer's views re-made (the native layers and captured graphs bind to the new addresses)."""
        self.flush()
        old = self.tensor
        self.tensor = self._allocate(static_capacity(needed) + self.spare)
        self.tensor[..., : old.shape[4], :] = old
        self._bind()
        self.growths += 1


def runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``src[i] -> dst[i]`` as runs ``(src_start, dst_start, length)`` in which both sides advance by one.

    A commit moves the winning candidate's consecutive rows to the consecutive slots after the frontier
    (``round.kv_commit_plan``), so its moves are one run. Example: (7, 8, 9, 3) -> (2, 3, 4, 5) is
    [(7, 2, 3), (3, 5, 1)]."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and s == out[-1][0] + out[-1][2] and d == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


@torch.inference_mode()  # K/V buffers are inference tensors: in-place writes must happen in this mode
def copy_slots(buffers: Sequence[torch.Tensor], src: Sequence[int], dst: Sequence[int]) -> None:
    """Copy slots ``src`` to ``dst`` (distinct) along the slot dimension (-2) of every buffer, every source read
    before any write: an arena [L, 2, 1, H_kv, capacity, D] or a layer's keys / values [1, H_kv, capacity, D].

    Each run of consecutive moves (``runs``) is one slice copy per buffer; a run whose slots overlap its sources
    reads a copy of them first. Why not ``index_select`` + ``index_copy_`` along the slot dimension: for a few
    rows they run a parallel region over every other dimension, measured at 0.7 to 24 ms for three rows of the
    embedded model's arena on a busy 2-core CPU, against about 11 us for the slice copy (the same bits). Where a
    slot is written by one run before a later run reads it, the moves gather and scatter instead."""
    if any(dst.index(p) < src.index(p) for p in set(src) & set(dst)):  # a slot written before it is read
        indices: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # made once per device, not per buffer
        for t in buffers:
            if t.device not in indices:
                indices[t.device] = torch.tensor(src, device=t.device), torch.tensor(dst, device=t.device)
            index_src, index_dst = indices[t.device]
            t.index_copy_(t.dim() - 2, index_dst, t.index_select(t.dim() - 2, index_src))
        return
    for s, d, n in runs(src, dst):
        for t in buffers:
            part = t.narrow(-2, s, n)
            if s < d + n and d < s + n:  # overlapping slices: copy_ could read what it already wrote
                part = part.clone()
            t.narrow(-2, d, n).copy_(part)

"""The adapter's K/V cache layers: transformers' ``DynamicLayer`` contract, without its copies.

Two layouts of the same cached values:

* ``AppendBufferLayer`` (eager rounds): ``keys`` / ``values`` are views of the first positions of a buffer that
  doubles when full, so a round writes only its own rows and attention reads exactly the cached positions.
* ``StaticBufferLayer`` (static-shape rounds, ``model.compile``): one buffer of a fixed capacity per generation,
  written at explicit slots (``write_slots``, a device tensor the adapter sets before each forward), and returned
  whole: attention reads every slot and the round's mask hides the ones past the round. The shapes a forward sees
  are then the row bucket and the capacity, never the K/V length, so a compiled forward (or a CUDA graph) is
  reused round after round; the length is host bookkeeping (``length``) that no traced code reads.

Both keep a rejected tail in place (``crop`` only shortens the length; the next round overwrites it) and let
``model.move_rows`` copy committed rows within the buffer. ``tests/backends/test_model_adapter.py`` checks both against
transformers' own DynamicCache, bit for bit, across growth, crops and row moves.

A generation's static buffers are one tensor (``allocate_arena``: [layers, 2, 1, H_kv, capacity, D], every
layer's keys and values are views of it), allocated once at the generation's capacity and never reallocated
while it runs (``fixed``: a round that would outrun it is an error, not a new buffer). Two reasons: a captured
graph reads the buffers at fixed addresses, so a reallocation would silently need every graph recorded again;
and a commit's row moves are one gather and one scatter over every layer at once (``move_rows``) instead of
two small kernels per layer and tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 256  # the smallest static buffer; capacities are powers of two from here (few compiled shapes)


class AppendBufferLayer(DynamicLayer):
    """A DynamicLayer that writes new K/V into spare capacity instead of concatenating.

    ``DynamicLayer.update`` builds a new tensor with ``torch.cat`` every forward, copying the whole cached context
    per layer per round, a cost that grows with the context (``benchmarks/forward_paths.py`` times both). Here
    ``keys`` / ``values`` are views of the first positions of a buffer that doubles when full, so a round writes
    only its own rows. ``crop`` (inherited) narrows the view, and the next update overwrites the rejected rows in
    place. The cached values are the same bits either way; only the copy is gone. Sliding-window layers use it too
    (their window is applied by the mask, see ``ModelAdapter.new_cache``). ``capacity``: the positions the first
    buffer holds (the engine passes the generation's longest possible length, so it is allocated once).
    """

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.reserved = capacity

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._key_buffer = self._value_buffer = None
        cached = self.get_seq_length()
        total = cached + key_states.shape[-2]
        # A method inherited from DynamicLayer that rebinds keys (reorder, batch select, offload) detaches them
        # from the buffer: start a new buffer from them rather than write into a stale one.
        stale = self._key_buffer is None or self.keys.data_ptr() != self._key_buffer.data_ptr()
        if stale or total > self._key_buffer.shape[-2]:
            first = self._key_buffer is None and self.reserved
            size = max(total, self.reserved) if first else max(2 * total, MIN_CAPACITY)
            self._key_buffer = _grown(self.keys, key_states, size)
            self._value_buffer = _grown(self.values, value_states, size)
        self._key_buffer[..., cached:total, :] = key_states
        self._value_buffer[..., cached:total, :] = value_states
        self.keys = self._key_buffer[..., :total, :]
        self.values = self._value_buffer[..., :total, :]
        return self.keys, self.values


def _grown(cached: torch.Tensor, new: torch.Tensor, size: int) -> torch.Tensor:
    """A buffer of ``size`` positions holding ``cached`` at its start (doubling sizes: amortised O(1) appends)."""
    shape = list(new.shape)
    shape[-2] = size
    grown = new.new_empty(shape)
    if cached.numel():
        grown[..., : cached.shape[-2], :] = cached
    return grown


def kv_head_shape(text_config) -> tuple[int, int]:
    """(K/V heads, head dim) of a decoder's attention layers, from its (text) config."""
    heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return heads, head_dim


def static_capacity(needed: int) -> int:
    """The static buffer for ``needed`` positions: the next power of two from ``MIN_CAPACITY`` (a compiled forward
    is specialised to its capacity, so nearby generations share one)."""
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
    """A round would outrun a fixed K/V buffer: the caller sized the generation's capacity too small (a bug)."""


class StaticBufferLayer(DynamicLayer):
    """K/V slots of a fixed capacity, written at ``write_slots``; ``update`` returns the whole buffer.

    The adapter sets ``write_slots`` (the round's slots, past_len .. past_len + Q - 1, on the device) before the
    forward and ``length`` after it, outside any compiled region, so traced code reads no Python length (a
    compiled forward would otherwise be specialised to every K/V length). Slots at or past ``length`` hold stale
    or zero values that the mask hides. ``reserve`` grows the buffer between forwards should a scratch cache
    (calibration, probes) outrun its estimate (a new capacity: one more compiled shape, the same values); a
    ``fixed`` layer (a generation's, see the module doc) refuses to: its buffer's address is part of the round.
    ``arena``: the tensor of every layer's buffers this layer's keys and values are views of (``allocate_arena``),
    None once a growth gave it buffers of its own.
    """

    def __init__(self, capacity: int, fixed: bool = False) -> None:
        super().__init__()
        self.capacity = capacity
        self.fixed = fixed
        self.length = 0  # cached positions (committed, plus the current round's rows until it is published)
        self.write_slots: torch.Tensor | None = None
        self.arena: torch.Tensor | None = None

    def bind(self, keys: torch.Tensor, values: torch.Tensor, arena: torch.Tensor | None = None) -> None:
        """Hold ``keys`` / ``values`` ([1, H_kv, capacity, D] each, e.g. views of ``arena``) as the buffers."""
        self.dtype, self.device = keys.dtype, keys.device
        self.keys, self.values = _static_buffer(keys), _static_buffer(values)
        self.arena = arena
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = _static_buffer(key_states.new_zeros((*key_states.shape[:2], self.capacity, key_states.shape[-1])))
        self.values = _static_buffer(
            value_states.new_zeros((*value_states.shape[:2], self.capacity, value_states.shape[-1]))
        )
        self.is_initialized = True

    def allocate(self, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """The buffers now, before the first forward (batch 1). A compiled forward then never traces the
        allocation: it would be guarded on ``is_initialized``, which the next call fails (a second compilation)."""
        empty = torch.empty(1, heads, 0, head_dim, dtype=dtype, device=device)
        self.lazy_initialization(empty, empty)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys.index_copy_(2, self.write_slots, key_states)
        self.values.index_copy_(2, self.write_slots, value_states)
        return self.keys, self.values

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` slots (a larger power-of-two buffer holding the current one at its start); a
        ``fixed`` layer raises ``KVCapacityError`` instead."""
        if needed <= self.capacity:
            return
        if self.fixed:
            raise KVCapacityError(
                f"a round needs {needed} K/V slots, past the generation's fixed capacity of {self.capacity}"
            )
        self.capacity = static_capacity(needed)
        if self.is_initialized:
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros((*old.shape[:2], self.capacity, old.shape[-1]))
                new[:, :, : old.shape[-2]] = old
                setattr(self, name, _static_buffer(new))
            self.arena = None  # its own buffers now: row moves go layer by layer

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.length

    def get_max_cache_shape(self) -> int:
        return self.capacity

    def crop(self, max_length: int) -> None:
        """DynamicLayer's contract: a negative count removes that many positions, a positive one keeps that many.
        Nothing is erased: the mask hides slots past ``length`` and the next round overwrites them."""
        keep = self.length + max_length if max_length < 0 else max_length
        self.length = max(0, min(self.length, keep))


@torch.inference_mode()  # the buffers are inference tensors wherever they are made (a compiled graph guards on it)
def allocate_arena(
    layers: list[StaticBufferLayer], heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """One zeroed tensor [len(layers), 2, 1, H_kv, capacity, D] holding every layer's keys ([i, 0]) and values
    ([i, 1]), bound to the layers as views (each contiguous: the native layers and sdpa read them as before).
    The layers must share one capacity."""
    capacity = layers[0].capacity
    if any(layer.capacity != capacity for layer in layers):
        raise ValueError("the layers of one arena must have one capacity")
    arena = torch.zeros(len(layers), 2, 1, heads, capacity, head_dim, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.bind(arena[i, 0], arena[i, 1], arena)
    return arena


def shared_arena(layers) -> torch.Tensor | None:
    """The arena every one of ``layers`` still views (``allocate_arena``), or None (another kind of layer, a
    layer that grew out of it, layers of two arenas)."""
    arenas = {id(getattr(layer, "arena", None)) for layer in layers}
    arena = getattr(layers[0], "arena", None) if layers else None
    if arena is None or len(arenas) != 1 or arena.shape[0] != len(layers):
        return None
    return arena


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

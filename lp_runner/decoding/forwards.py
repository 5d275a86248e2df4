"""How a round's generations reach the model: each on its own cache, or all of them in one batched forward.

``OwnCacheForward`` (``run.batch`` 1, and ``lp_runner.generate``): one generation per round, on a cache of its own
(``ModelAdapter.new_cache``) through the adapter's plain forward, compiled where the adapter is: the path every
round ran before batching, unchanged. ``BatchedForward`` (``run.batch`` > 1): the generations' K/V in regions of
one buffer (``slot_cache.SlotCache``) and one forward over all their rows (``ModelAdapter.forward_batch``).
The round loop (``scheduler.RoundLoop``) asks either for a new generation's K/V, runs rounds, and releases it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Protocol

import torch

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.backends.slot_cache import SlotCache, SlotRegion
from lp_runner.decoding.batch_round import pack_round, probe
from lp_runner.decoding.layout import RoundLayout
from lp_runner.decoding.round import CacheKV, KVStore


class RoundForward(Protocol):
    def kv_for(self, need: int) -> KVStore:
        """K/V for a new generation of at most ``need`` positions (its prompt, its budget and one round)."""
        ...

    def run(self, layouts: Sequence[RoundLayout], kvs: Sequence[KVStore], past_lens: Sequence[int]) -> torch.Tensor:
        """The round's one forward: every layout's logit rows, in order ([sum of logit rows, vocab])."""
        ...

    def release(self, kv: KVStore) -> None:
        """The generation is over: its K/V may go."""
        ...


class OwnCacheForward:
    """One generation per round, on its own cache: the adapter's plain forward."""

    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter

    def kv_for(self, need: int) -> CacheKV:
        return CacheKV(self.adapter.new_cache(need, fixed=True))  # allocated once: never moves mid-generation

    def run(self, layouts, kvs, past_lens) -> torch.Tensor:
        (layout,), (kv,) = layouts, kvs
        return self.adapter.forward(
            layout.input_ids, layout.position_ids, layout.visibility, kv.cache, layout.logit_rows
        )

    def release(self, kv: CacheKV) -> None:
        self.adapter.release_cache(kv.cache)  # bucketed rounds reuse its buffers; otherwise it goes with the generation


class BatchedForward:
    """Every generation of the round in one forward, each on its region of one K/V buffer.

    The buffer is made at the first generation's arrival, its size, and grows (doubling) or is compacted as the
    generations that follow need room (``SlotCache.region``): a job of one prompt holds one generation's K/V."""

    def __init__(self, adapter: ModelAdapter, batch: int) -> None:
        self.adapter, self.batch = adapter, batch
        self.slots: SlotCache | None = None
        self.windows = list(adapter.mask_windows.values())

    def kv_for(self, need: int) -> SlotRegion:
        if self.slots is None:
            a = self.adapter
            self.slots = SlotCache.allocate(a.model, a.kv_shape, a.dtype, a.device, need)
        return self.slots.region(need)

    def run(self, layouts, kvs, past_lens) -> torch.Tensor:
        for kv, layout, past in zip(kvs, layouts, past_lens, strict=True):
            if past + layout.num_rows > kv.size:
                raise ValueError(f"a round of {layout.num_rows} rows after {past} positions overflows its region")
        self.slots.flush()  # last round's K/V moves, all generations' at once
        batch = pack_round(layouts, [kv.base for kv in kvs], past_lens, self.windows, self.adapter.dtype)
        logits = self.adapter.forward_batch(batch, self.slots.cache)
        for kv, layout, past in zip(kvs, layouts, past_lens, strict=True):
            kv.length = past + layout.num_rows  # the round's rows, until publication keeps or crops them
        return logits

    def release(self, kv: SlotRegion) -> None:
        self.slots.release(kv)


_SUPPORT: weakref.WeakKeyDictionary[ModelAdapter, str | None] = weakref.WeakKeyDictionary()


def batch_support(adapter: ModelAdapter) -> str | None:
    """Why ``adapter`` cannot run batched rounds exactly (one line), or None. Found out once per adapter: its
    layers' structure (``ModelAdapter.batch_structure``), then a probe of two generations batched against their
    separate forwards (``batch_round.probe``)."""
    if adapter not in _SUPPORT:
        _SUPPORT[adapter] = adapter.batch_structure() or probe(adapter)
    return _SUPPORT[adapter]

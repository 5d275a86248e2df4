"""The only place that talks to a Hugging Face causal LM's forward and K/V cache.

transformers 5.x keeps moving: the cache keyword is ``past_key_values`` up to 5.23 and ``cache`` from 5.24 (the
old name still works there, with a deprecation); ``DynamicCache.crop`` takes only negative counts from 5.20 on
(negative counts work in every 5.x); ``cache_position`` left Llama's forward in 5.4. This adapter resolves those
once, from the model's own signature (no class-name sniffing), and ``tests/test_model_adapter.py`` checks each
operation on every supported model family and on the oldest supported transformers.

Two of transformers' defaults are replaced for the adapter's own forwards, to save copies, not arithmetic: the
cache appends into a growing buffer instead of concatenating (``AppendBufferLayer``; the same bits), and
grouped-query attention over a packed round reads K/V heads in place instead of repeating them
(``lp_runner.attention``; the same kernel and dot products, equal to fp32 rounding).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from lp_runner.attention import packed_gqa, supports_packed_gqa
from lp_runner.layout import additive_mask


class ModelAdapter:
    """forward(ids, positions, visibility, cache, logit_rows) -> logits of those rows only."""

    def __init__(self, model: PreTrainedModel, *, append_buffer: bool = True, packed_gqa: bool = True) -> None:
        """``append_buffer`` / ``packed_gqa`` off: transformers' own DynamicLayer / sdpa path (benchmarks A/B them)."""
        self.model = model
        self.append_buffer = append_buffer
        self.packed_gqa = packed_gqa
        params = inspect.signature(model.forward).parameters
        if "cache" in params:
            self._cache_kw = "cache"
        elif "past_key_values" in params:
            self._cache_kw = "past_key_values"
        else:
            raise TypeError(f"{type(model).__name__}.forward takes neither 'cache' nor 'past_key_values'")
        if "logits_to_keep" not in params:
            raise TypeError(f"{type(model).__name__}.forward has no 'logits_to_keep'; lp_runner needs it")
        # Sliding-window layers drop positions the packed mask assumes visible, and cannot be cropped once full:
        # runs are exact only while everything fits in the window (checked per prompt by the engine).
        windows = [getattr(layer, "sliding_window", None) for layer in self.new_cache().layers if layer.is_sliding]
        self.sliding_window: int | None = min((w for w in windows if w), default=None)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.config.get_text_config().vocab_size
        self.max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)

    def new_cache(self) -> DynamicCache:
        """A DynamicCache whose full-attention layers append into a growing buffer (see ``AppendBufferLayer``)."""
        cache = DynamicCache(config=self.model.config)
        if self.append_buffer:
            cache.layers = [AppendBufferLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
        return cache

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [Q]
        position_ids: torch.Tensor,  # [Q]
        visibility: torch.Tensor,  # [Q, Q] bool, in-round rows only; the cached prefix is always visible
        cache: DynamicCache,
        logit_rows: torch.Tensor,  # [R]
    ) -> torch.Tensor:  # [R, vocab]
        past = cache_length(cache)
        mask = additive_mask(visibility, past, self.dtype).to(self.device)  # [1, 1, Q, past + Q]
        switch = self.packed_gqa and supports_packed_gqa(self.model.config)
        attention = packed_gqa(self.model.config) if switch else nullcontext()
        with attention:
            out = self.model(
                input_ids=input_ids.to(self.device).unsqueeze(0),
                position_ids=position_ids.to(self.device).unsqueeze(0),
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=logit_rows.to(self.device),
                **{self._cache_kw: cache},
            )
        return out.logits[0]  # [R, vocab]


class AppendBufferLayer(DynamicLayer):
    """A DynamicLayer that writes new K/V into spare capacity instead of concatenating.

    ``DynamicLayer.update`` builds a new tensor with ``torch.cat`` every forward, copying the whole cached context
    per layer per round, a cost that grows with the context (``benchmarks/forward_paths.py`` times both). Here
    ``keys`` / ``values`` are views of the first positions of a buffer that doubles when full, so a round writes
    only its own rows. ``crop`` (inherited) narrows the view, and the next update overwrites the rejected rows in
    place. The cached values are the same bits either way; only the copy is gone. Sliding-window layers keep their
    own class (they roll their buffer).
    """

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
            self._key_buffer = _grown(self.keys, key_states, total)
            self._value_buffer = _grown(self.values, value_states, total)
        self._key_buffer[..., cached:total, :] = key_states
        self._value_buffer[..., cached:total, :] = value_states
        self.keys = self._key_buffer[..., :total, :]
        self.values = self._value_buffer[..., :total, :]
        return self.keys, self.values


def _grown(cached: torch.Tensor, new: torch.Tensor, needed: int) -> torch.Tensor:
    """A buffer of at least twice ``needed`` positions holding ``cached`` at its start (amortised O(1) appends)."""
    shape = list(new.shape)
    shape[-2] = max(2 * needed, 256)
    grown = new.new_empty(shape)
    if cached.numel():
        grown[..., : cached.shape[-2], :] = cached
    return grown


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` cached positions of every layer (negative-count crop: valid on every 5.x).

    Each layer is cropped by its own length: after a forward that failed part-way, the layers before the failure
    hold this round's K/V and the later ones do not, so one count for all layers would cut committed positions.
    """
    for layer in cache.layers:
        remove = layer.get_seq_length() - length
        if remove < 0:
            raise ValueError(f"cannot crop a cache of {layer.get_seq_length()} positions to {length}")
        if remove:
            layer.crop(-remove)


@torch.inference_mode()  # cache tensors are inference tensors: in-place writes must happen in this mode
def move_rows(cache: DynamicCache, src: Sequence[int], dst: Sequence[int]) -> None:
    """Copy the K/V of cache positions ``src`` to ``dst`` in every layer (sources are read before writing)."""
    if len(src) != len(dst):
        raise ValueError("src and dst must have equal length")
    if not src:
        return
    for layer in cache.layers:
        keys, values = layer.keys, layer.values  # (B, H, T, D)
        src_t = torch.tensor(src, device=keys.device)
        dst_t = torch.tensor(dst, device=keys.device)
        keys.index_copy_(2, dst_t, keys.index_select(2, src_t))
        values.index_copy_(2, dst_t, values.index_select(2, src_t))

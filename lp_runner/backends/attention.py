"""Grouped-query sdpa for packed rounds: cached K/V heads are read in place, not repeated per query head.

transformers' sdpa path (``transformers.integrations.sdpa_attention``) serves a model whose query heads share K/V heads
(GQA; SmolLM2 has 9 query heads on 3 K/V heads) in one of three ways: ``enable_gqa`` when no mask is given,
packing the query heads onto their K/V head when one row is queried (``generate``'s decode steps), and otherwise
``repeat_kv``, which copies every cached K and V head ``groups`` times, in every layer, on every forward. A
packed round always passes a mask and queries several rows, so it always took the copying path, a cost that
grows with the context. ``packed_gqa_sdpa`` extends the one-row packing to Q rows: the ``groups`` query heads of
a K/V head become ``groups * Q`` rows of that head and the mask is tiled to match, so the same kernel computes
the same per-row dot products without the copy.

It is the attention each segment of a round runs on transformers' layers where the backend has no kernel of its
own (``torch_backend.TorchBackend.segment_attention``, under ``batched_attention``). A round names its attention in
its own forward call (the ``lp_attention`` keyword, which transformers' layers hand down to the attention function
with the forward's other keywords), through one dispatch registered as transformers' ``sdpa`` at the adapter's
construction (``install_round_dispatch``): the model's config is never switched, so every other caller of the same
model object (HF ``generate`` on another thread, the tests' oracles) runs transformers' own sdpa, unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def special_attention(kwargs: dict) -> bool:
    """Attention with a softcap or a position bias: transformers' own function only."""
    return kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None


def pack_heads(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, Q, D] -> [B, H_kv, groups * Q, D]: head h = kv * groups + g becomes row g*Q + i of its K/V head, so
    packed row r reads the mask of query row r % Q."""
    batch, heads, rows, dim = query.shape
    return query.reshape(batch, kv_heads, heads // kv_heads * rows, dim)


def unpack_heads(out: torch.Tensor, query_shape: torch.Size) -> torch.Tensor:
    """The packed rows' outputs back in transformers' layout: [B, Q, H, D], contiguous."""
    return out.reshape(query_shape).transpose(1, 2).contiguous()


def packed_gqa_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, H_kv, K, D]
    value: torch.Tensor,  # [B, H_kv, K, D]
    attention_mask: torch.Tensor | None,  # [B or 1, 1, Q, K]
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # ([B, Q, H, D], no weights)
    """transformers' sdpa attention, minus the K/V repeat for a masked multi-row query (see the module doc)."""
    groups = query.shape[1] // key.shape[1]  # query heads per K/V head, read from the tensors themselves
    rows = query.shape[2]
    if groups == 1 or rows == 1 or attention_mask is None or attention_mask.shape[1] != 1 or special_attention(kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    packed_mask = attention_mask.repeat(1, 1, groups, 1)  # row g*Q + i reads the mask of query row i
    out = torch.nn.functional.scaled_dot_product_attention(
        pack_heads(query, key.shape[1]), key, value, attn_mask=packed_mask, dropout_p=dropout, scale=scaling
    )  # [B, H_kv, groups * Q, D]
    return unpack_heads(out, query.shape), None


@dataclass(frozen=True)
class SegmentedRound:
    """What ``batched_attention`` needs of a round (``batch.BatchRound``) besides the tensors:
    each segment's rows and keys, its masks per sliding window (on the model's device), and each layer's window."""

    rows: tuple[tuple[int, int], ...]  # per segment: [first, stop) round rows
    keys: tuple[tuple[int, int], ...]  # per segment: [base, base + width) buffer slots
    masks: Mapping[int | None, tuple[torch.Tensor, ...]]  # window -> per segment [1, 1, rows, width] additive
    layer_windows: tuple[int | None, ...]  # per decoder layer (``layer_idx``): the window its mask has
    inner: Callable  # one segment's attention: the backend's (``ForwardBackend.segment_attention``)


def batched_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, R, D]: every segment's rows
    key: torch.Tensor,  # [1, H_kv, C, D]: the whole arena layer (``kv_cache.ArenaLayer``)
    value: torch.Tensor,  # [1, H_kv, C, D]
    attention_mask,  # a placeholder: the masks are the segments' own (``lp_batch``)
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    lp_batch: SegmentedRound | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # ([1, R, H, D], no weights)
    """A batched round's attention on transformers' layers: each segment's rows attend to its own region of the
    buffer only, through its own mask, with the attention a round of that generation alone runs (``inner``), one
    call per segment. The model's forward hands ``lp_batch`` down to here as a keyword; a model whose layers do
    not (or that calls another attention) fails loudly instead, on the placeholder mask's width (the adapter's
    construction probe finds out, and takes a 4-D mask instead). It runs where the round passes it as
    ``lp_attention``, with its segments as ``lp_batch``."""
    if lp_batch is None:
        raise RuntimeError("batched attention called without its round (the model did not pass lp_batch down)")
    masks = lp_batch.masks[lp_batch.layer_windows[module.layer_idx]]
    outs = []
    for (first, stop), (base, end), mask in zip(lp_batch.rows, lp_batch.keys, masks, strict=True):
        out, _ = lp_batch.inner(
            module,
            query[:, :, first:stop],
            key[:, :, base:end],
            value[:, :, base:end],
            mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
        outs.append(out)  # [1, rows, H, D]
    return torch.cat(outs, dim=1), None


ROUND_KEYWORD = "lp_attention"  # the forward keyword that carries a round's attention down to its layers


def supports_round_attention(config) -> bool:
    """True where a round may hand its attention down by keyword: plain sdpa (the implementation the dispatch sits
    under) on a config without sub-configs (a composite model's sub-models would receive the keyword too)."""
    return getattr(config, "_attn_implementation", None) == "sdpa" and not getattr(config, "sub_configs", None)


def _sdpa_or_round(fallback: Callable) -> Callable:
    """transformers' ``sdpa`` entry as the dispatch: the attention a round passes as ``lp_attention``, else
    ``fallback`` (the function registered as ``sdpa`` before, transformers' own), called exactly as transformers
    calls it."""

    def sdpa_or_round(module, query, key, value, attention_mask, *args, lp_attention=None, **kwargs):
        attend = fallback if lp_attention is None else lp_attention
        return attend(module, query, key, value, attention_mask, *args, **kwargs)

    sdpa_or_round.fallback = fallback
    return sdpa_or_round


_INSTALL = threading.Lock()  # two adapters built at once must not wrap the dispatch twice


def install_round_dispatch() -> Callable:
    """Register the dispatch (``_sdpa_or_round``) as transformers' ``sdpa`` attention, once per process (the
    adapter's construction calls it); returns the function a forward without the keyword runs.

    transformers picks a layer's attention by name from the config's ``_attn_implementation`` on every forward, and
    the config is shared by whoever holds the model: LP ranks on threads over one model, a thread calling the
    model's own ``generate`` beside a job. Switching that name for a round's forward made every other caller of the
    model run the round's attention while it lasted. Here the name never changes: each round names its attention in its
    own call (``lp_attention``, handed down through the forward's keywords as ``lp_batch`` is), and a call without
    it runs the ``sdpa`` function registered before, unchanged. Nothing is written per forward and nothing is
    locked."""
    with _INSTALL:
        current = AttentionInterface()["sdpa"]  # a new interface reads the class-wide mapping only
        if getattr(current, "fallback", None) is None:
            current = _sdpa_or_round(current)
            AttentionInterface.register("sdpa", current)
        return current.fallback


def reaches_attention(forward: Callable[..., object], layers: int) -> bool:
    """True where ``forward(lp_attention=...)`` (a small forward of the model) hands the keyword down to the
    attention of each of its ``layers`` attention layers: the round's attention then runs in every layer. A model
    whose layers drop the forward's keywords (StableLM, Falcon) or call another attention runs transformers' own
    under a 4-D mask instead; which one is decided here, once, not per round."""
    fallback = install_round_dispatch()
    seen: list[torch.nn.Module] = []

    def probe(module, *args, **kwargs):
        seen.append(module)
        return fallback(module, *args, **kwargs)

    try:
        forward(**{ROUND_KEYWORD: probe})
    except Exception:  # noqa: BLE001 - a forward that refuses the keyword: the model's own attention serves it
        return False
    return len(seen) == layers

"""How a round names its attention in its own forward, and the head packing its attentions share.

A round's attention (``round_mask.round_attention``, or the CPU backend's native one) reads the round's one mask
over the live part of the K/V arena. It reaches transformers' layers by keyword: the round passes it as
``lp_attention``, which transformers' layers hand down to the attention function with the forward's other keywords,
through one dispatch registered as transformers' ``sdpa`` at the adapter's construction (``install_round_dispatch``).
The model's config is never switched, so every other caller of the same model object (HF ``generate`` on another
thread, the tests' oracles) runs transformers' own sdpa, unchanged. A model whose layers drop the keyword runs its
own attention under the round's mask as a 4-D mask (``reaches_attention`` decides, once).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from transformers import AttentionInterface


def special_attention(kwargs: dict) -> bool:
    """Attention with a softcap, a position bias or attention sinks: transformers' own function only."""
    return any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux"))


def pack_heads(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, Q, D] -> [B, H_kv, groups * Q, D]: head h = kv * groups + g becomes row g*Q + i of its K/V head, so
    packed row r reads the mask of query row r % Q."""
    batch, heads, rows, dim = query.shape
    return query.reshape(batch, kv_heads, heads // kv_heads * rows, dim)


def unpack_heads(out: torch.Tensor, query_shape: torch.Size) -> torch.Tensor:
    """The packed rows' outputs back in transformers' layout: [B, Q, H, D], contiguous."""
    return out.reshape(query_shape).transpose(1, 2).contiguous()


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
    own call (``lp_attention``, handed down through the forward's other keywords), and a call without
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

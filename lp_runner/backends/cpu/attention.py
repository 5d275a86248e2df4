"""The native attention of a round on transformers' layers: what the CPU backend's models on native products
attend with where their decoder layers are not native (``backend.CpuBackend.round_attention``).

It packs the query heads per K/V head as ``round_mask.round_attention`` does and calls the native loop
(``native.attention``, ``csrc/attention.c``) instead of sdpa, up to ``NATIVE_MAX_ROWS`` packed rows.
"""

from __future__ import annotations

import torch

from lp_runner.backends.attention import pack_heads, special_attention, unpack_heads
from lp_runner.backends.cpu import native

# packed rows (query heads per K/V head x round rows) up to which the native loop runs. Call by call against torch's
# sdpa on the embedded model's heads (benchmarks/attention_kernels.py; 2 threads) the loop took 0.42-0.87x
# sdpa's time up to 24 packed rows with 300 and with 1,000 keys, 0.90x and 0.99x at 48, 1.08x at 96 with 1,000 keys;
# a whole compiled forward of 16 rows (48 packed) took 41.4 ms with it against 42.4 ms with sdpa inlined in the
# graph, while sdpa through the op (what rounds beyond the bound run) took 45.2 ms (docs/results.md, "Faster native
# attention").
NATIVE_MAX_ROWS = 48


def packed_attention(
    query: torch.Tensor,  # [H_kv, M, D]: M = groups x Q packed rows per K/V head (``pack_heads``)
    key: torch.Tensor,  # [H_kv, K, D]
    value: torch.Tensor,  # [H_kv, K, D]
    mask: torch.Tensor,  # [Q, K] additive; packed row r reads row r % Q
    scale: float,
) -> torch.Tensor:  # [H_kv, M, D]
    """The packed rows' attention, its kernel chosen by their number: the native loop up to ``NATIVE_MAX_ROWS``
    packed rows, torch's sdpa beyond (the mask tiled per query head)."""
    if query.shape[1] <= NATIVE_MAX_ROWS:
        return native.attention(query, key, value, mask, scale)
    tiled = mask.repeat(query.shape[1] // mask.shape[0], 1)  # [M, K]
    return torch.nn.functional.scaled_dot_product_attention(
        query[None], key[None], value[None], attn_mask=tiled[None, None], scale=scale
    )[0]


def native_round_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, B, D]
    key: torch.Tensor,  # [1, H_kv, capacity, D]: the whole arena layer
    value: torch.Tensor,  # [1, H_kv, capacity, D]
    attention_mask: torch.Tensor,  # [1, 1, B, K]: the round's mask (``round_mask``), not tiled
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # ([1, B, H, D], no weights)
    """``round_mask.round_attention`` with lp_runner's native attention (``native.attention``) for rounds of a
    few rows: the same packing of query heads onto their K/V head, over the first K slots of the buffer (K: the
    mask's width), softmax over the visible keys only; rounds of more than ``NATIVE_MAX_ROWS`` packed rows run
    torch's sdpa (``packed_attention`` chooses). The mask arrives untiled (packed row r reads row r % B): what the
    CPU backend asks of the round (``CpuBackend.tiled_mask``)."""
    if special_attention(kwargs) or dropout:
        raise ValueError("round attention is plain attention: no softcap, position bias, sinks or dropout")
    dim, width = query.shape[-1], attention_mask.shape[-1]
    scale = scaling if scaling is not None else dim**-0.5
    packed = pack_heads(query, key.shape[1])[0]  # [H_kv, groups * B, D]
    out = packed_attention(packed, key[0, :, :width], value[0, :, :width], attention_mask[0, 0], scale)
    return unpack_heads(out[None], query.shape), None

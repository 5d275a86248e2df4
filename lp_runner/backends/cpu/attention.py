"""The native attention for a round's segments on transformers' layers: what the CPU backend's models on native
products attend with (``backend.CpuBackend.segment_attention``, under ``attention.batched_attention``).

It packs the query heads per K/V head as ``backends.attention.packed_gqa_sdpa`` does and calls the native loop
(``native.attention``, ``csrc/attention.c``) instead of sdpa, up to ``NATIVE_MAX_ROWS`` packed rows.
"""

from __future__ import annotations

import torch

from lp_runner.backends.attention import pack_heads, packed_gqa_sdpa, special_attention, unpack_heads
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
    packed rows, torch's sdpa beyond, on the same inputs ``packed_gqa_sdpa`` gives it (the mask tiled per query
    head)."""
    if query.shape[1] <= NATIVE_MAX_ROWS:
        return native.attention(query, key, value, mask, scale)
    tiled = mask.repeat(query.shape[1] // mask.shape[0], 1)  # [M, K]
    return torch.nn.functional.scaled_dot_product_attention(
        query[None], key[None], value[None], attn_mask=tiled[None, None], scale=scale
    )[0]


def native_gqa_attention(
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
    """``packed_gqa_sdpa`` with lp_runner's native attention (``native.attention``) for rounds of a few rows: the
    same packing, the same mask, softmax over the visible keys only. Models whose products are native use it for
    each segment of a round on transformers' layers (the CPU backend's ``segment_attention``: the library is then
    built and probed). Rounds of more than ``NATIVE_MAX_ROWS``
    packed rows run torch's sdpa (``packed_attention`` chooses); batches, other dtypes and special attention
    (softcap, position bias) keep ``packed_gqa_sdpa``."""
    batch, _, _, dim = query.shape
    if (
        batch != 1
        or attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.shape[:2] != (1, 1)
        or special_attention(kwargs)
        or dropout
        or query.dtype != torch.float32
        or query.device.type != "cpu"
    ):
        return packed_gqa_sdpa(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    scale = scaling if scaling is not None else dim**-0.5
    out = packed_attention(pack_heads(query, key.shape[1])[0], key[0], value[0], attention_mask[0, 0], scale)
    return unpack_heads(out, query.shape), None

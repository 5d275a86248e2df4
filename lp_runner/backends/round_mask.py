"""A static round's attention mask, built once per round on the device, and the attention that reads it.

The eager path builds each segment's [Q, past + Q] float mask on the host (``batch.pack_round``) and every layer's
attention tiles it for its packed query heads (``packed_gqa_sdpa``). A round at a fixed shape (``static_rounds``)
instead builds its mask inside the round's own (compiled, captured) function from a few small device tensors: the
[B, B] in-round visibility (the layout's row roles, already reduced to who sees whom), the cached length and the rows'
positions. It is built once, already tiled for the packed heads, only as wide as the round's live K/V width
(``buckets.BucketLadder.kv_width``), and every layer reads that one tensor: ``round_attention`` cuts the K/V buffer to
the mask's width, so attention reads the live part of the capacity, not all of it.

Slot k of the arena, for a round of B rows of a generation whose region starts at slot ``lo`` and caches
``past`` positions (slots lo .. lo + past - 1; e = lo + past), is seen by row i when
    lo <= k < e                                  (the cached prefix; every row sees all of it)
    e <= k < e + B and visibility[i, k - e]      (the round's own rows, as its layout says)
and, for a layer with a sliding window w, when also position[i] - position(k) < w, where position(k) is k - lo
for a cached slot and the row's position for an in-round one (transformers' rule, per row, as ``batch.
pack_round`` cuts it). Other generations' slots and slots past the round are hidden. This is the segment mask
of ``batch.pack_round`` (and its sliding overlay) placed at the region's slots and cut to the live width, the
same values slot for slot.

Example: lo = 0, past = 2, B = 2 rows at positions [2, 3] with visibility [[1, 0], [1, 1]], width 4:
    row 0 sees slots 0, 1, 2      -> [0, 0, 0, min]
    row 1 sees slots 0, 1, 2, 3   -> [0, 0, 0, 0]
The same round in a region at lo = 1 reads width 5 and hides slot 0 in both rows.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ROUND_ATTENTION = "lp_runner_round_sdpa"


def round_mask(
    visibility: torch.Tensor,  # [B, B] bool: in-round row i attends to in-round row j
    region: torch.Tensor,  # [2] int64: the region's first slot lo, and its cached positions (slots lo .. lo+past-1)
    positions: torch.Tensor,  # [B] int64: each row's position
    key_slots: torch.Tensor,  # [K] int64: 0 .. K-1, the slots the round reads (its live width)
    window: int | None,  # a sliding window's size, None for full attention
    dtype: torch.dtype,
    groups: int = 1,  # query heads per K/V head packed onto one K/V head (``round_attention``): rows tiled
) -> torch.Tensor:  # [1, 1, groups * B, K] additive: 0 where seen, dtype's min where hidden
    """The round's mask for one window (see the module doc), tiled ``groups`` times along the rows (packed row
    g * B + i reads row i). Pure tensor ops on the inputs' device, no host read: it runs inside a captured graph."""
    rows = visibility.shape[0]
    lo = region[:1]  # [1]
    rel = key_slots - (lo + region[1:])  # [K]: the in-round row a slot holds (negative: cached; >= B: past the round)
    in_round = (rel >= 0) & (rel < rows)  # [K]
    row_of_slot = rel.clamp(0, rows - 1)  # [K]
    seen = visibility.index_select(1, row_of_slot) & in_round  # [B, K]
    visible = seen | ((rel < 0) & (key_slots >= lo))  # [B, K]
    if window is not None:
        key_positions = torch.where(in_round, positions.index_select(0, row_of_slot), key_slots - lo)  # [K]
        visible = visible & (positions[:, None] - key_positions[None, :] < window)  # [B, K]
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, torch.finfo(dtype).min
    )  # [B, K]
    if groups > 1:
        mask = mask.repeat(groups, 1)  # [groups * B, K]
    return mask[None, None]  # [1, 1, groups * B, K]


def round_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, B, D]
    key: torch.Tensor,  # [1, H_kv, capacity, D]: the whole static buffer
    value: torch.Tensor,  # [1, H_kv, capacity, D]
    attention_mask: torch.Tensor,  # [1, 1, groups * B, K]: ``round_mask``, tiled for H / H_kv groups
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # ([1, B, H, D], no weights)
    """sdpa over the first K slots of the buffer (K: the mask's width), the ``groups`` query heads of each K/V
    head packed as rows of that head (``attention.packed_gqa_sdpa``'s layout: head h = kv * groups + g becomes
    row g * B + i), with the round's one mask as built, no per-layer tiling or repeat of K/V heads."""
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None:
        raise ValueError("round attention is plain sdpa: no softcap, position bias or attention sinks")
    batch, heads, rows, dim = query.shape
    kv_heads, width = key.shape[1], attention_mask.shape[-1]
    packed = query.reshape(batch, kv_heads, heads // kv_heads * rows, dim)  # [1, H_kv, groups * B, D]
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key[:, :, :width], value[:, :, :width], attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )  # [1, H_kv, groups * B, D]
    return out.reshape(query.shape).transpose(1, 2).contiguous(), None  # [1, B, H, D]


def register_round_attention() -> str:
    """Make ``round_attention`` selectable by name (transformers' registry; idempotent). Returns the name."""
    AttentionInterface.register(ROUND_ATTENTION, round_attention)
    AttentionMaskInterface.register(ROUND_ATTENTION, sdpa_mask)  # never used: the round passes its own mask
    return ROUND_ATTENTION

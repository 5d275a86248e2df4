"""Every round's attention mask, built once per round from its staged inputs, and the attention that reads it.

The one mask builder of the package. A round (``rounds.Rounds``) builds its mask from a few small tensors of its
staged inputs (``staging.StagedInputs``): the [B, B] in-round visibility (the layout's row roles, already reduced to
who sees whom), each row's cached prefix and the rows' positions; on a GPU inside the round's own compiled,
captured function. It is built once, only as wide as the round's live K/V width (the ladder's power of two on a
bucketed round, the live end on an eager one), tiled for the packed query heads where the attention wants it, and
every layer of one window reads that one tensor: ``round_attention`` cuts the K/V buffer to the mask's width, so
attention reads the live part of the capacity, not all of it. The native layers read the same mask, cut to each
generation's keys (``cpu.native_layers``).

Slot k of the arena is seen by row i, whose generation's region caches its prefix in slots first[i] .. end[i] - 1
(its cached positions 0 .. end[i] - first[i] - 1), when
    first[i] <= k < end[i]                           (its cached prefix; every row of the generation sees all of it)
    k = write_slot[j] and visibility[i, j]           (a row of the round, as the round's visibility says)
and, for a layer with a sliding window w, when also position[i] - position(k) < w, where position(k) is k - first[i]
for a cached slot and row j's position for the slot row j writes (transformers' rule, per row, as one-row
decoding applies it). Other generations' slots and slots past the round are hidden: the visibility is
block-diagonal, one block per generation.

Example: one generation, first = 0, past = 2, B = 2 rows at positions [2, 3] writing slots [2, 3] with visibility
[[1, 0], [1, 1]], width 4:
    row 0 sees slots 0, 1, 2      -> [0, 0, 0, min]
    row 1 sees slots 0, 1, 2, 3   -> [0, 0, 0, 0]
The same round in a region at slot 1 reads width 5 and hides slot 0 in both rows; beside it, a second
generation's rows see their own region's slots and none of these.
"""

from __future__ import annotations

import torch

from lp_runner.backends.attention import pack_heads, special_attention, unpack_heads


def round_mask(
    visibility: torch.Tensor,  # [B, B] bool: in-round row i attends to in-round row j
    cached_from: torch.Tensor,  # [B] int64: the first slot of row i's region
    cached_to: torch.Tensor,  # [B] int64: past its cached prefix
    positions: torch.Tensor,  # [B] int64: each row's position
    write_slots: torch.Tensor,  # [B] int64: the slot each row's K/V is written to (all below K)
    key_slots: torch.Tensor,  # [K] int64: 0 .. K-1, the slots the round reads (its live width)
    window: int | None,  # a sliding window's size, None for full attention
    dtype: torch.dtype,
    groups: int = 1,  # query heads per K/V head packed onto one K/V head (``round_attention``): rows tiled
) -> torch.Tensor:  # [1, 1, groups * B, K] additive: 0 where seen, dtype's min where hidden
    """The round's mask for one window (see the module doc), tiled ``groups`` times along the rows (packed row
    g * B + i reads row i). Pure tensor ops on the inputs' device, no host read: it runs inside a captured graph."""
    rows = visibility.shape[0]
    visible = (key_slots >= cached_from[:, None]) & (key_slots < cached_to[:, None])  # [B, K]: the cached prefix
    visible.index_copy_(1, write_slots, visibility)  # the round's own slots, as its visibility says
    if window is not None:
        key_positions = (key_slots - cached_from[:, None]).index_copy_(
            1, write_slots, positions.expand(rows, rows)
        )  # [B, K]: a cached slot's position in the row's region, a round row's own position
        visible &= positions[:, None] - key_positions < window
    zero = torch.zeros((), dtype=dtype, device=visible.device)  # the mask's dtype: the hidden value is its min
    mask = torch.where(visible, zero, torch.finfo(dtype).min)  # [B, K]
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
    head packed as rows of that head (``attention.pack_heads``: head h = kv * groups + g becomes row g * B + i),
    with the round's one mask as built, no per-layer tiling or repeat of K/V heads.

    Why packed: transformers' sdpa path serves grouped-query attention with a mask and several rows by
    ``repeat_kv``, which copies every cached K and V head ``groups`` times, in every layer, on every forward; the
    packing computes the same per-row dot products on the heads in place."""
    if special_attention(kwargs):
        raise ValueError("round attention is plain sdpa: no softcap, position bias or attention sinks")
    kv_heads, width = key.shape[1], attention_mask.shape[-1]
    out = torch.nn.functional.scaled_dot_product_attention(
        pack_heads(query, kv_heads),
        key[:, :, :width],
        value[:, :, :width],
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
    )  # [1, H_kv, groups * B, D]
    return unpack_heads(out, query.shape), None  # [1, B, H, D]

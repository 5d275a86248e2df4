"""packed_gqa_sdpa against transformers' own sdpa attention, and the adapter's switch to it and back.

The engine-level oracle (HF greedy on every family and the embedded model, whose 9 query heads share 3 K/V
heads) runs through this path in the other test files; here the attention function itself is compared with
transformers' on masked multi-row queries, where transformers repeats K/V and the packed path does not.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import FAMILIES, additive_mask, random_prompt
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.backends.attention import (
    BATCHED,
    packed_gqa_sdpa,
    supports_packed_gqa,
)
from lp_runner.backends.cpu.attention import native_gqa_attention
from lp_runner.backends.cpu.prepack import native_unavailable_reason
from lp_runner.models.loading import default_cache_dir


class _Attention(torch.nn.Module):
    """The two attributes the attention functions read from a model's attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("kv_heads", [1, 2, 3, 6])
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_packed_gqa_equals_transformers_sdpa(kv_heads: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(10 * kv_heads + rows)
    heads, past, dim = 6, 11, 8
    query = torch.randn(1, heads, rows, dim, generator=gen)
    key = torch.randn(1, kv_heads, past + rows, dim, generator=gen)
    value = torch.randn(1, kv_heads, past + rows, dim, generator=gen)
    visibility = torch.rand(rows, rows, generator=gen) < 0.5
    visibility |= torch.eye(rows, dtype=torch.bool)  # every row sees itself, as in every round layout
    mask = additive_mask(visibility, past, torch.float32)  # [1, 1, Q, past + Q]
    module = _Attention(heads // kv_heads)
    got, _ = packed_gqa_sdpa(module, query, key, value, mask, scaling=dim**-0.5)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    assert got.shape == want.shape == (1, rows, heads, dim)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # and the reference itself: a masked softmax per query head over its K/V head, written out
    group = heads // kv_heads
    k, v = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    ref = torch.softmax(query @ k.transpose(-1, -2) * dim**-0.5 + mask, dim=-1) @ v  # [1, H, Q, D]
    torch.testing.assert_close(got, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


def _native_or_skip():
    if native_unavailable_reason(torch.nn.Linear(2, 2), default_cache_dir()) is not None:
        pytest.skip("no native kernel here")
    from lp_runner.backends.cpu import native

    return native


@pytest.mark.parametrize("dim", [16, 256, 12])  # the vector path (shortest and widest head) and the scalar one
@pytest.mark.parametrize("kv_heads,rows", [(1, 1), (2, 1), (2, 2), (3, 2), (6, 3), (1, 9)])
def test_native_attention_equals_transformers_sdpa(kv_heads: int, rows: int, dim: int) -> None:
    """native_gqa_attention (the native loop up to NATIVE_MAX_ROWS packed rows, packed_gqa_sdpa beyond) against
    transformers' sdpa, on a static cache's buffer: slots past the round hidden by the mask, heads strided (a
    buffer's first slots, as the append-buffer cache passes them)."""
    _native_or_skip()
    gen = torch.Generator().manual_seed(7 * kv_heads + rows + dim)
    heads, past, capacity = 6, 13, 40
    query = torch.randn(1, heads, rows, dim, generator=gen)
    buffers = [torch.randn(1, kv_heads, capacity + 8, dim, generator=gen) for _ in range(2)]
    key, value = (b[:, :, :capacity] for b in buffers)  # strided over heads
    visibility = (torch.rand(rows, rows, generator=gen) < 0.5) | torch.eye(rows, dtype=torch.bool)
    mask = additive_mask(visibility, past, torch.float32, width=capacity)  # [1, 1, Q, capacity]
    module = _Attention(heads // kv_heads)
    with torch.inference_mode():
        got, _ = native_gqa_attention(module, query, key, value, mask, scaling=dim**-0.5)
        want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    assert got.shape == want.shape == (1, rows, heads, dim)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert not torch.equal(mask[..., past + rows :], torch.zeros_like(mask[..., past + rows :]))  # guard: hidden


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_uses_packed_gqa_for_its_own_forwards_only(tiny, family: str) -> None:
    model = tiny(family)
    assert supports_packed_gqa(model.config)
    adapter = ModelAdapter(model)
    seen: list[str] = []
    attention = model.model.layers[0].self_attn
    hook = attention.register_forward_pre_hook(lambda module, args: seen.append(module.config._attn_implementation))
    try:
        tokens = random_prompt(6, seed=1)
        adapter.forward(torch.tensor(tokens), torch.arange(6), torch.ones(6, 6).bool().tril(), adapter.new_cache(),
                        torch.tensor([5]))  # fmt: skip
        assert seen == [BATCHED]  # the round's segments, each attended with packed GQA (the backend's)
        assert model.config._attn_implementation == "sdpa"  # restored: HF generate on this model is untouched
        with torch.inference_mode():
            model(input_ids=torch.tensor([tokens]))
        assert seen == [BATCHED, "sdpa"]
    finally:
        hook.remove()


def test_switch_is_undone_when_the_forward_fails(tiny) -> None:
    model = tiny("llama")
    adapter = ModelAdapter(model)

    def fail(module, args):
        raise RuntimeError("injected")

    hook = model.model.layers[1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            adapter.forward(torch.tensor([1, 2]), torch.arange(2), torch.ones(2, 2).bool().tril(),
                            adapter.new_cache(), torch.tensor([1]))  # fmt: skip
    finally:
        hook.remove()
    assert model.config._attn_implementation == "sdpa"


def test_other_implementations_are_left_alone(tiny) -> None:
    model = tiny("qwen2")
    model.config._attn_implementation = "eager"
    try:
        assert not supports_packed_gqa(model.config)
        adapter = ModelAdapter(model)
        seen: list[str] = []
        attention = model.model.layers[0].self_attn
        hook = attention.register_forward_pre_hook(lambda m, a: seen.append(m.config._attn_implementation))
        try:
            adapter.forward(torch.tensor([3]), torch.arange(1), torch.ones(1, 1).bool(), adapter.new_cache(),
                            torch.tensor([0]))  # fmt: skip
        finally:
            hook.remove()
        assert seen == ["eager"]
    finally:
        model.config._attn_implementation = "sdpa"


def test_native_attention_frees_its_scratch() -> None:
    """Each call allocates per-thread score buffers in C; 2,000 calls over 16,384 keys would keep 256 MB resident
    if they were not freed (a leak a long job would find): the process's resident memory must stay flat."""
    native = _native_or_skip()

    def resident_mb() -> float:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    q, k, v = torch.randn(1, 1, 64), torch.randn(1, 16384, 64), torch.randn(1, 16384, 64)
    mask = torch.zeros(1, 16384)  # every key visible: the working thread writes its whole scratch (128 KB)
    native.attention(q, k, v, mask, 0.125)
    before = resident_mb()
    for _ in range(2_000):
        native.attention(q, k, v, mask, 0.125)
    assert resident_mb() - before < 64


def _static_round(heads: int, rows: int, dim: int, seed: int):
    """Packed queries [heads, groups 3 x rows, dim] over a static buffer of 40 slots: 13 cached, the round's rows
    under a random visibility (each row sees itself), the rest spare."""
    gen = torch.Generator().manual_seed(seed)
    past, capacity = 13, 40
    q = torch.randn(heads, 3 * rows, dim, generator=gen)
    k, v = (torch.randn(heads, capacity, dim, generator=gen) for _ in range(2))
    visibility = (torch.rand(rows, rows, generator=gen) < 0.5) | torch.eye(rows, dtype=torch.bool)
    mask = additive_mask(visibility, past, torch.float32, width=capacity)[0, 0]  # [rows, capacity]
    return q, k, v, mask, past + rows


@pytest.mark.parametrize("dim", [64, 12])  # the vector path and the scalar one
def test_native_attention_rows_do_not_depend_on_their_neighbours(dim: int) -> None:
    """Each packed row's output is bit for bit what it gets alone (the product's guarantee, kept by the attention
    loop): a round's verified row then equals the one-row decode of the same token at the same place."""
    native = _native_or_skip()
    q, k, v, mask, _ = _static_round(2, 3, dim, seed=dim)  # 9 packed rows: more than one task of rows per head
    together = native.attention(q, k, v, mask, dim**-0.5)
    for r in range(q.shape[1]):
        alone = native.attention(q[:, r : r + 1], k, v, mask[r % 3 : r % 3 + 1], dim**-0.5)
        assert torch.equal(alone[:, 0], together[:, r]), r


def test_native_attention_never_reads_hidden_slots() -> None:
    """A static buffer's spare slots hold whatever an earlier round left there, NaN included: a hidden key must
    not be read at all (a masked NaN score is still NaN), so the output is the same bits as with zeros there."""
    native = _native_or_skip()
    q, k, v, mask, used = _static_round(2, 2, 64, seed=3)
    clean = native.attention(q, k, v, mask, 0.125)
    k[:, used:], v[:, used:] = float("nan"), float("nan")
    hidden = mask == torch.finfo(torch.float32).min
    k[:, 13:used][:, hidden[0, 13:used]] = float("nan")  # a round key that row 0 does not see: hidden from it
    assert torch.equal(native.attention(q[:, :1], k, v, mask[:1], 0.125), clean[:, :1])
    assert torch.isfinite(clean).all()
    assert torch.equal(
        native.attention(q, k[:, :used].contiguous(), v[:, :used].contiguous(), mask[:, :used], 0.125)[:, :1],
        clean[:, :1],
    )


@pytest.mark.parametrize("dim", [64, 128, 32])  # the specialised vector paths and the generic one
def test_native_attention_with_keys_every_row_sees(dim: int) -> None:
    """Keys that every row of a task sees (a round's cached prefix) are scored and weighed without mask reads;
    rows whose visible prefixes end at different keys (inside a 16-key group, at its edge, at key 0) and hide keys
    after it, as a packed round's branches do: sdpa's output to fp32 rounding, each row bit for bit its output
    alone, and a NaN in a key hidden from a row after its prefix never reaches that row."""
    native = _native_or_skip()
    gen = torch.Generator().manual_seed(dim)
    heads, groups, keys = 2, 3, 100
    prefixes = [64, 0, 17, 48, 100, 33, 80, 64]  # rows of one task share the smallest
    rows = len(prefixes)
    q = torch.randn(heads, groups * rows, dim, generator=gen)
    k, v = (torch.randn(heads, keys, dim, generator=gen) for _ in range(2))
    hidden = torch.finfo(torch.float32).min
    mask = torch.zeros(rows, keys).masked_fill(torch.rand(rows, keys, generator=gen) < 0.4, hidden)
    for r, p in enumerate(prefixes):
        mask[r, :p] = 0.0
        if p < keys:
            mask[r, p] = hidden  # the prefix ends here
    mask[1, 5] = 0.0  # row 1 sees keys after its empty prefix
    got = native.attention(q, k, v, mask, dim**-0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(groups, 1), scale=dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for r in range(groups * rows):
        alone = native.attention(q[:, r : r + 1], k, v, mask[r % rows : r % rows + 1], dim**-0.5)
        assert torch.equal(alone[:, 0], got[:, r]), r
    k[:, 17], v[:, 17] = float("nan"), float("nan")  # hidden from row 2 (its prefix ends there) and others
    blind = [r for r in range(groups * rows) if mask[r % rows, 17] == hidden]
    assert 2 in blind and 0 not in blind  # row 0 (prefix 64) sees key 17 and shares a task with row 2
    again = native.attention(q, k, v, mask, dim**-0.5)  # row 2 shares its task with rows that see key 17
    assert torch.equal(again[:, blind], got[:, blind])

"""ModelAdapter and the cache helpers on every tiny family, version-agnostic (transformers 5.17 .. 5.24).

Nothing here names a transformers keyword or class: the adapter must find its way from the model's signature,
and the checks are behavioural (the cache we pass really receives the rows, no deprecated keyword is used).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import transformers
from helpers import FAMILIES, TINY_VOCAB, plain_cache, random_prompt

from lp_runner.backends.adapter import (
    AppendBufferLayer,
    ModelAdapter,
    UnsupportedModelError,
    attention_windows,
    cache_length,
    crop,
    move_rows,
)

VERSION = transformers.__version__
# the installed transformers version is part of every test id, so a CI log says which version passed
FAMILY_IDS = [f"{f}-transformers{VERSION}" for f in FAMILIES]


def causal(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).tril()  # [T, T]


def prefill(adapter: ModelAdapter, tokens: list[int], logit_rows: list[int] | None = None):
    cache = adapter.new_cache()
    t = len(tokens)
    rows = torch.tensor(logit_rows if logit_rows is not None else list(range(t)))
    logits = adapter.forward(torch.tensor(tokens), torch.arange(t), causal(t), cache, rows)
    return cache, logits


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
def test_adapter_reads_the_model(tiny, family: str) -> None:
    model = tiny(family)
    adapter = ModelAdapter(model)
    assert adapter.vocab_size == TINY_VOCAB
    assert adapter.max_positions == 512
    assert adapter.dtype == torch.float32
    assert adapter.device == torch.device("cpu")


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
def test_forward_matches_plain_forward_and_fills_our_cache(tiny, family: str) -> None:
    model = tiny(family)
    adapter = ModelAdapter(model)
    tokens = random_prompt(14, seed=3)
    with warnings.catch_warnings():
        # a deprecated keyword (e.g. past_key_values on 5.24) would warn with a FutureWarning: fail on it
        warnings.simplefilter("error", FutureWarning)
        cache, logits = prefill(adapter, tokens)
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([tokens])).logits[0]  # [T, vocab]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    assert cache_length(cache) == len(tokens), f"transformers {VERSION}: the adapter's cache was not filled"

    # decoding on from that cache equals a plain forward of the longer sequence: the cache really is used
    nxt = int(ref[-1].argmax())
    t = len(tokens)
    step = adapter.forward(torch.tensor([nxt]), torch.tensor([t]), causal(1), cache, torch.tensor([0]))
    with torch.inference_mode():
        ref2 = model(input_ids=torch.tensor([[*tokens, nxt]])).logits[0, -1]
    torch.testing.assert_close(step[0], ref2, atol=1e-5, rtol=1e-5)
    assert cache_length(cache) == t + 1


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
def test_logit_rows_select_exactly_those_rows(tiny, family: str) -> None:
    model = tiny(family)
    adapter = ModelAdapter(model)
    tokens = random_prompt(10, seed=4)
    _, full = prefill(adapter, tokens)  # [T, vocab]
    for rows in ([9], [0, 4, 9], [2, 3, 5, 7], [6, 1, 3]):  # the last one out of order
        _, some = prefill(adapter, tokens, rows)
        assert some.shape == (len(rows), TINY_VOCAB)
        torch.testing.assert_close(some, full[rows], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
def test_crop(tiny, family: str) -> None:
    model = tiny(family)
    adapter = ModelAdapter(model)
    tokens = random_prompt(12, seed=5)
    cache, _ = prefill(adapter, tokens, [11])
    ref = plain_cache(model, tokens[:7])
    crop(cache, 12)  # no-op
    assert cache_length(cache) == 12
    crop(cache, 7)
    assert cache_length(cache) == 7
    for layer, ref_layer in zip(cache.layers, ref.layers, strict=True):
        torch.testing.assert_close(layer.keys, ref_layer.keys, atol=1e-5, rtol=0)  # (B, H, 7, D)
        torch.testing.assert_close(layer.values, ref_layer.values, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="cannot crop a cache of 7 positions to 9"):
        crop(cache, 9)
    crop(cache, 0)
    assert cache_length(cache) == 0


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
def test_move_rows(tiny, family: str) -> None:
    model = tiny(family)
    cache = plain_cache(model, random_prompt(9, seed=6))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    move_rows(cache, [7, 8], [3, 4])
    for layer, (k0, v0) in zip(cache.layers, before, strict=True):
        torch.testing.assert_close(layer.keys[:, :, [3, 4]], k0[:, :, [7, 8]], atol=0, rtol=0)
        torch.testing.assert_close(layer.values[:, :, [3, 4]], v0[:, :, [7, 8]], atol=0, rtol=0)
        untouched = [0, 1, 2, 5, 6, 7, 8]
        torch.testing.assert_close(layer.keys[:, :, untouched], k0[:, :, untouched], atol=0, rtol=0)
    move_rows(cache, [], [])  # nothing to copy is fine
    with pytest.raises(ValueError, match="equal length"):
        move_rows(cache, [1, 2], [3])
    # positions moved onto themselves stay, beside a real move: the same as that move alone
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    move_rows(cache, [5, 2, 6], [5, 0, 6])
    for layer, (k0, v0) in zip(cache.layers, before, strict=True):
        expected_k, expected_v = k0.clone(), v0.clone()
        expected_k[:, :, 0], expected_v[:, :, 0] = k0[:, :, 2], v0[:, :, 2]
        assert torch.equal(layer.keys, expected_k) and torch.equal(layer.values, expected_v)


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
def test_append_buffer_cache_holds_the_bits_a_dynamic_cache_holds(tiny, family: str) -> None:
    """The adapter's cache against transformers' own DynamicCache, round by round, past a buffer growth.

    Rounds of 3 rows are cropped back by 0-2 rows (a rejected tail that the next round overwrites in place) and
    K/V rows are moved (the commit of a verified branch); logits and every cached tensor must stay bit-equal.
    """
    from transformers import DynamicCache

    model = tiny(family)
    adapter = ModelAdapter(model)
    ours = adapter.new_cache()
    ref = DynamicCache(config=model.config)
    full = ours.layers  # sliding layers too: their window is a mask, not a rolling buffer
    assert all(isinstance(layer, AppendBufferLayer) for layer in full)
    tokens = random_prompt(200, seed=8)
    for cache in (ours, ref):
        adapter.forward(torch.tensor(tokens), torch.arange(200), causal(200), cache, torch.tensor([199]))
    capacity = {id(layer): layer._key_buffer.shape[-2] for layer in full}
    gen = torch.Generator().manual_seed(9)
    for step in range(120):
        t = cache_length(ref)
        ids = torch.randint(0, TINY_VOCAB, (3,), generator=gen)
        got = adapter.forward(ids, torch.arange(t, t + 3), causal(3), ours, torch.arange(3))
        want = adapter.forward(ids, torch.arange(t, t + 3), causal(3), ref, torch.arange(3))
        assert torch.equal(got, want), f"round {step}: logits differ"
        if step % 5 == 0:
            for cache in (ours, ref):
                move_rows(cache, [t + 2], [t + 1])
        keep = t + 3 - step % 3
        for cache in (ours, ref):
            crop(cache, keep)
        assert cache_length(ours) == keep
        for layer, ref_layer in zip(ours.layers, ref.layers, strict=True):
            assert torch.equal(layer.keys, ref_layer.keys) and torch.equal(layer.values, ref_layer.values), step
    assert cache_length(ours) > 400
    assert all(layer._key_buffer.shape[-2] > capacity[id(layer)] for layer in full), "the buffer never grew"


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
def test_static_cache_holds_the_bits_a_dynamic_cache_holds(tiny, family: str) -> None:
    """Static-shape rounds (a fixed buffer written at slots, attention over every slot, the spare ones masked)
    against transformers' DynamicCache: the same logits and cached K/V to fp32 rounding (attention sums over the
    whole capacity, masked slots adding exact zeros in another order: not bit-equal, see ``kv_cache``), round by
    round, through crops, row moves and a growth of the buffer past its first capacity; one-row rounds included
    (they take a mask too). The engine's token identity with HF greedy on static rounds is tested end to end.
    """
    from transformers import DynamicCache

    from lp_runner.backends.kv_cache import MIN_CAPACITY, StaticBufferLayer

    model = tiny(family)
    adapter = ModelAdapter(model, static_cache=True)
    ours = adapter.new_cache(capacity=40)
    ref = DynamicCache(config=model.config)
    assert all(isinstance(layer, StaticBufferLayer) for layer in ours.layers)
    tokens = random_prompt(200, seed=8)
    for cache in (ours, ref):
        adapter.forward(torch.tensor(tokens), torch.arange(200), causal(200), cache, torch.tensor([199]))
    gen = torch.Generator().manual_seed(9)
    for step in range(90):
        t = cache_length(ref)
        rows = 1 + step % 4
        ids = torch.randint(0, TINY_VOCAB, (rows,), generator=gen)
        got = adapter.forward(ids, torch.arange(t, t + rows), causal(rows), ours, torch.arange(rows))
        want = adapter.forward(ids, torch.arange(t, t + rows), causal(rows), ref, torch.arange(rows))
        torch.testing.assert_close(got, want, msg=f"round {step}: logits differ")
        if step % 5 == 0 and rows > 1:
            for cache in (ours, ref):
                move_rows(cache, [t + rows - 1], [t])
        keep = t + rows - step % rows
        for cache in (ours, ref):
            crop(cache, keep)
        assert cache_length(ours) == keep
        for layer, ref_layer in zip(ours.layers, ref.layers, strict=True):
            torch.testing.assert_close(layer.keys[:, :, :keep], ref_layer.keys, msg=f"round {step}")
            torch.testing.assert_close(layer.values[:, :, :keep], ref_layer.values, msg=f"round {step}")
    assert cache_length(ours) > MIN_CAPACITY, "the buffer never grew"
    assert all(layer.capacity == 2 * MIN_CAPACITY for layer in ours.layers)


def test_append_buffer_survives_a_rebound_tensor(tiny) -> None:
    """Inherited DynamicLayer methods (beam reorder, batch select, offload) rebind keys to a new tensor."""
    from transformers import DynamicCache

    model = tiny("llama")
    adapter = ModelAdapter(model)
    ours, ref = adapter.new_cache(), DynamicCache(config=model.config)
    tokens = torch.tensor(random_prompt(9, seed=2))
    for cache in (ours, ref):
        adapter.forward(tokens, torch.arange(9), causal(9), cache, torch.tensor([8]))
        for layer in cache.layers:
            layer.batch_select_indices(torch.tensor([0]))  # same contents, a new tensor
        move_rows(cache, [8], [2])  # written into the new tensor only
        crop(cache, 7)
    nxt = torch.tensor([5, 6])
    got = adapter.forward(nxt, torch.arange(7, 9), causal(2), ours, torch.arange(2))
    want = adapter.forward(nxt, torch.arange(7, 9), causal(2), ref, torch.arange(2))
    assert torch.equal(got, want)
    for layer, ref_layer in zip(ours.layers, ref.layers, strict=True):
        assert torch.equal(layer.keys, ref_layer.keys) and torch.equal(layer.values, ref_layer.values)


def test_model_without_a_cache_keyword_is_refused() -> None:
    # A real forward signature that no supported transformers version has; nothing else of the model is used.
    class NoCache(torch.nn.Module):
        def forward(self, input_ids, logits_to_keep=0):
            return input_ids

    with pytest.raises(TypeError, match="neither 'cache' nor 'past_key_values'"):
        ModelAdapter(NoCache())


def test_installed_transformers_is_supported() -> None:
    # pyproject pins transformers>=5.17,<5.25; this suite is meant to pass on both ends
    major, minor = (int(x) for x in VERSION.split(".")[:2])
    assert (major, minor) >= (5, 17) and (major, minor) < (5, 25), VERSION


def _layout(windows: list[int | None], layer_types: list[str] | None):
    """A config and a cache as attention_windows reads them: layer types, and which cache layers slide by how much."""
    from types import SimpleNamespace

    text = SimpleNamespace(layer_types=layer_types)
    config = SimpleNamespace(get_text_config=lambda: text)
    layers = [SimpleNamespace(is_sliding=w is not None, sliding_window=w) for w in windows]
    return config, SimpleNamespace(layers=layers)


S, F = "sliding_attention", "full_attention"


@pytest.mark.parametrize(
    ("windows", "layer_types", "expected"),
    [
        ([None, None], None, ({"": None}, False)),  # Llama: one plain mask
        ([None, None], [F, F], ({"": None}, False)),  # Qwen2 without sliding layers: still one plain mask
        ([8, 8], None, ({"": 8}, False)),  # Mistral v0.1: one windowed mask for every layer
        ([8, None, 8], [S, F, S], ({S: 8, F: None}, True)),  # Gemma 2/3: one mask per layer type
        ([None, 8], [F, S], ({F: None, S: 8}, True)),  # Qwen2 with max_window_layers=1
    ],
)
def test_attention_windows(windows, layer_types, expected) -> None:
    assert attention_windows(*_layout(windows, layer_types)) == expected


@pytest.mark.parametrize(
    ("windows", "layer_types", "message"),
    [
        ([8, 16], None, "different sliding windows [16, 8]"),  # no layer types to key two masks by
        ([8, 16], [S, S], "layer type 'sliding_attention' with window 16"),  # two windows, one layer type
        ([8, None], ["chunked_attention", F], "layer type 'chunked_attention' with window 8"),  # chunks, not windows
        ([8, None], [S], "1 layer_types for 2 cache layers"),
    ],
)
def test_attention_layout_no_mask_can_express_is_refused(windows, layer_types, message) -> None:
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        attention_windows(*_layout(windows, layer_types))

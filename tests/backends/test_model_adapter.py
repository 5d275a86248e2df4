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
from helpers import FAMILIES, TINY_VOCAB, one_round, plain_cache, random_prompt, scratch_region

from lp_runner.backends.adapter import ModelAdapter, UnsupportedModelError, attention_windows

VERSION = transformers.__version__
# the installed transformers version is part of every test id, so a CI log says which version passed
FAMILY_IDS = [f"{f}-transformers{VERSION}" for f in FAMILIES]


def causal(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).tril()  # [T, T]


def prefill(adapter: ModelAdapter, tokens: list[int], logit_rows: list[int] | None = None):
    cache = scratch_region(adapter)
    t = len(tokens)
    rows = torch.tensor(logit_rows if logit_rows is not None else list(range(t)))
    logits = one_round(adapter, torch.tensor(tokens), torch.arange(t), causal(t), cache, rows)
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
    assert cache.length == len(tokens), f"transformers {VERSION}: the adapter's cache was not filled"

    # decoding on from that cache equals a plain forward of the longer sequence: the cache really is used
    nxt = int(ref[-1].argmax())
    t = len(tokens)
    step = one_round(adapter, torch.tensor([nxt]), torch.tensor([t]), causal(1), cache, torch.tensor([0]))
    with torch.inference_mode():
        ref2 = model(input_ids=torch.tensor([[*tokens, nxt]])).logits[0, -1]
    torch.testing.assert_close(step[0], ref2, atol=1e-5, rtol=1e-5)
    assert cache.length == t + 1


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


def _hf_round(adapter: ModelAdapter, cache, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A causal continuation through the model's own forward on transformers' own cache: logits of every row."""
    with torch.inference_mode():
        out = adapter.model(
            input_ids=ids[None], position_ids=positions[None], use_cache=True, **{adapter._cache_kw: cache}
        )
    return out.logits[0]  # [Q, vocab]


def _hf_move(cache, src: list[int], dst: list[int]) -> None:
    """Copy positions ``src`` to ``dst`` in every layer of transformers' cache, every source read first."""
    with torch.inference_mode():
        for layer in cache.layers:
            layer.keys[:, :, dst], layer.values[:, :, dst] = (
                layer.keys[:, :, src].clone(),
                layer.values[:, :, src].clone(),
            )


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
def test_crop(tiny, family: str) -> None:
    model = tiny(family)
    adapter = ModelAdapter(model)
    tokens = random_prompt(12, seed=5)
    cache, _ = prefill(adapter, tokens, [11])
    ref = plain_cache(model, tokens[:7])
    cache.crop(12)  # no-op
    assert cache.length == 12
    cache.crop(7)
    assert cache.length == 7
    for i, ref_layer in enumerate(ref.layers):
        torch.testing.assert_close(cache.keys(i), ref_layer.keys, atol=1e-5, rtol=0)  # (B, H, 7, D)
        torch.testing.assert_close(cache.values(i), ref_layer.values, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="cannot crop a region of 7 positions to 9"):
        cache.crop(9)
    cache.crop(0)
    assert cache.length == 0


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
def test_move_rows(tiny, family: str) -> None:
    model = tiny(family)
    adapter = ModelAdapter(model)
    cache, _ = prefill(adapter, random_prompt(9, seed=6), [8])
    layers = range(len(cache.arena.layers()))
    before = [(cache.keys(i).clone(), cache.values(i).clone()) for i in layers]
    cache.move([7, 8], [3, 4])
    for i, (k0, v0) in zip(layers, before, strict=True):
        torch.testing.assert_close(cache.keys(i)[:, :, [3, 4]], k0[:, :, [7, 8]], atol=0, rtol=0)
        torch.testing.assert_close(cache.values(i)[:, :, [3, 4]], v0[:, :, [7, 8]], atol=0, rtol=0)
        untouched = [0, 1, 2, 5, 6, 7, 8]
        torch.testing.assert_close(cache.keys(i)[:, :, untouched], k0[:, :, untouched], atol=0, rtol=0)
    cache.move([], [])  # nothing to copy is fine
    with pytest.raises(ValueError, match="equal length"):
        cache.move([1, 2], [3])
    # positions moved onto themselves stay, beside a real move: the same as that move alone
    before = [(cache.keys(i).clone(), cache.values(i).clone()) for i in layers]
    cache.move([5, 2, 6], [5, 0, 6])
    for i, (k0, v0) in zip(layers, before, strict=True):
        expected_k, expected_v = k0.clone(), v0.clone()
        expected_k[:, :, 0], expected_v[:, :, 0] = k0[:, :, 2], v0[:, :, 2]
        assert torch.equal(cache.keys(i), expected_k) and torch.equal(cache.values(i), expected_v)


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
def test_the_arena_holds_what_a_dynamic_cache_holds(tiny, family: str) -> None:
    """A region of the arena against transformers' own forward on its own DynamicCache: the same logits and
    cached K/V to fp32 rounding (another attention call: not bit-equal), round by round, through crops (a
    rejected tail that the next round overwrites in place), row moves (the commit of a verified branch) and a
    growth of the arena past its first capacity; one-row rounds included (they take a mask too). The engine's
    token identity with HF greedy is tested end to end."""
    from transformers import DynamicCache

    from lp_runner.backends.kv_cache import MIN_CAPACITY

    model = tiny(family)
    adapter = ModelAdapter(model)
    ours = scratch_region(adapter, 40)
    ref = DynamicCache(config=model.config)
    tokens = torch.tensor(random_prompt(200, seed=8))
    one_round(adapter, tokens, torch.arange(200), causal(200), ours, torch.tensor([199]))
    _hf_round(adapter, ref, tokens, torch.arange(200))
    gen = torch.Generator().manual_seed(9)
    for step in range(90):
        t = ref.get_seq_length()
        rows = 1 + step % 4
        ids = torch.randint(0, TINY_VOCAB, (rows,), generator=gen)
        got = one_round(adapter, ids, torch.arange(t, t + rows), causal(rows), ours, torch.arange(rows))
        want = _hf_round(adapter, ref, ids, torch.arange(t, t + rows))
        torch.testing.assert_close(got, want, msg=f"round {step}: logits differ")
        if step % 5 == 0 and rows > 1:
            ours.move([t + rows - 1], [t])
            _hf_move(ref, [t + rows - 1], [t])
        keep = t + rows - step % rows
        ours.crop(keep)
        if keep < t + rows:
            ref.crop(keep - (t + rows))  # a negative count: valid on every 5.x
        assert ours.length == keep == ref.get_seq_length()
        for i, ref_layer in enumerate(ref.layers):
            torch.testing.assert_close(ours.keys(i), ref_layer.keys, msg=f"round {step}")
            torch.testing.assert_close(ours.values(i), ref_layer.values, msg=f"round {step}")
    assert ours.length > MIN_CAPACITY and ours.arena.growths == 1, "the arena never grew"


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

"""Native decoder layers (``native_layers.py``): one C call for a Llama-family model's layers in eager rounds.

Oracles: the same packed model's original layers (transformers' own layer code on the same native products), on
the same static cache, for logits and the K/V written (equal to fp32 rounding, every argmax the same); HF greedy
``generate`` on the *unpacked* model for whole generations (the three tiny families, window on and off, and the
embedded model). A counter on the C call proves the native path ran where a test says it does, and did not
where it must not (``generate`` on the same model object, an adapter on transformers' layers).
"""

from __future__ import annotations

import copy
import dataclasses

import helpers
import pytest
import torch
from helpers import (
    FAMILIES,
    code_and_chat_ids,
    hf_greedy,
    one_round,
    random_prompt,
    run_lookahead,
    scratch_region,
    tiny_model,
)

from lp_runner.backends import detect_backend
from lp_runner.backends.adapter import ModelAdapter, causal
from lp_runner.backends.cpu import native, native_layers
from lp_runner.backends.cpu.prepack import KERNELS, native_unavailable_reason, prepack_linears
from lp_runner.models.loading import default_cache_dir, weights_checksum

NATIVE_REASON = native_unavailable_reason(torch.nn.Linear(2, 2), default_cache_dir())
pytestmark = pytest.mark.skipif(NATIVE_REASON is not None, reason=f"no native kernel: {NATIVE_REASON}")


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """Rows of every native layer run while the test runs (a stacked call counts each of its layers)."""
    seen: list[int] = []
    real = native.LayerStack.run

    def counted(self, hidden, *args, **kwargs):
        seen.extend([hidden.shape[0]] * len(self.layers))
        return real(self, hidden, *args, **kwargs)

    monkeypatch.setattr(native.LayerStack, "run", counted)
    return seen


def _native_model(stock: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(stock)
    prepack_linears(model, kernel=KERNELS["native"])
    return model


@pytest.mark.parametrize("family", [*FAMILIES, "qwen2-hybrid"])
def test_native_rounds_equal_the_original_layers(tiny, family: str, calls) -> None:
    """A prefill of 40 rows, then rounds of 1-8 rows over it: logits and the K/V written as the model's own
    layers give them (same products, same static cache), to fp32 rounding, with every argmax the same."""
    model = _native_model(tiny(family))
    layers = model.config.num_hidden_layers
    reference = ModelAdapter(model, backend=detect_backend(model).transformers_layers())
    fast = ModelAdapter(model)
    assert fast.backend.whole_layers == layers and fast.backend.kernels.endswith(native_layers.NATIVE_LAYERS_SUFFIX)
    assert reference.backend.whole_layers == 0
    assert not reference.backend.kernels.endswith(native_layers.NATIVE_LAYERS_SUFFIX)
    calls.clear()  # the adapters' own two-row probe ran natively
    prefix = torch.tensor(random_prompt(40, seed=1))
    caches = [scratch_region(a, 64) for a in (reference, fast)]
    ref_logits, fast_logits = (
        one_round(a, prefix, torch.arange(40), causal(40), c, torch.arange(40))
        for a, c in zip((reference, fast), caches, strict=True)
    )
    assert calls == [40] * layers  # the fast adapter's prefill of 40 rows runs natively too
    torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(fast_logits.argmax(-1), ref_logits.argmax(-1))
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 2, 3, 8):
        ids = torch.randint(0, 50, (rows,), generator=gen)
        vis = torch.rand(rows, rows, generator=gen) < 0.5
        vis |= torch.eye(rows, dtype=torch.bool)
        vis = vis.tril()
        positions = 40 + vis.sum(1) - 1  # each row's depth in its branch
        before = len(calls)
        ref_logits, fast_logits = (
            one_round(a, ids, positions, vis, c, torch.arange(rows))
            for a, c in zip((reference, fast), caches, strict=True)
        )
        assert calls[before:] == [rows] * layers
        torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(fast_logits.argmax(-1), ref_logits.argmax(-1))
        for ref_layer, fast_layer in zip(caches[0].arena.layers(), caches[1].arena.layers(), strict=True):
            for name in ("keys", "values"):
                got, want = getattr(fast_layer, name)[:, :, : 40 + rows], getattr(ref_layer, name)[:, :, : 40 + rows]
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for cache in caches:
            cache.crop(40)


@pytest.mark.parametrize("family", [*FAMILIES, "mistral-sliding", "qwen2-hybrid"])
def test_native_layer_engine_equals_hf_greedy_on_the_unpacked_model(tiny, family: str, calls) -> None:
    stock = tiny(family)
    model = _native_model(stock)
    for seed in range(3):
        prompt = random_prompt(24, seed=seed)
        expected = hf_greedy(stock, prompt, 40)
        assert run_lookahead(model, prompt, W=4, N=3, G=4).output_ids == expected, (family, seed, "window")
        assert run_lookahead(model, prompt, W=1, N=4, G=3, lookahead_branch=False).output_ids == expected
    assert calls, "the engine's rounds ran the original layers"


def test_outside_the_adapter_the_model_is_what_it_was(tiny, calls) -> None:
    """``generate`` on the same model object, after an adapter ran native layers, runs the original layers (no
    native call) and gives the tokens it gave before; the state dict (and so the weights checksum, what
    ``--resume`` compares) is unchanged, and no module carries anything of the backend's."""
    model = _native_model(tiny("llama"))
    prompt = random_prompt(16, seed=4)
    before, checksum, keys = hf_greedy(model, prompt, 12), weights_checksum(model), list(model.state_dict())
    attributes = [set(vars(module)) for module in model.modules()]
    assert ModelAdapter(model).backend.whole_layers == model.config.num_hidden_layers
    assert [set(vars(module)) for module in model.modules()] == attributes
    assert calls == [2] * model.config.num_hidden_layers  # the adapter's own probe: inside the adapter
    calls.clear()
    assert hf_greedy(model, prompt, 12) == before and calls == []
    assert list(model.state_dict()) == keys and weights_checksum(model) == checksum


def test_layers_that_cannot_take_it_keep_their_forward(tiny) -> None:
    """Torch's or oneDNN's products, unfused siblings, another activation: no layer is changed, and the reason
    names what is missing."""
    for model, reason in (
        (copy.deepcopy(tiny("llama")), "not one native product"),
        (_onednn(tiny("llama")), "not one native product"),
        (_unfused(tiny("llama")), "not one native product"),
        (_gelu(tiny("llama")), "not SiLU"),
    ):
        assert reason in native_layers.native_layer_weights(model)
        assert ModelAdapter(model).backend.whole_layers == 0


def _onednn(stock):
    model = copy.deepcopy(stock)
    prepack_linears(model, kernel=KERNELS["onednn"])
    return model


def _unfused(stock):
    model = copy.deepcopy(stock)
    prepack_linears(model, fuse=False, kernel=KERNELS["native"])
    return model


def _gelu(stock):
    model = _native_model(stock)
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    return model


@pytest.mark.slow
def test_native_layer_embedded_model_equals_hf_greedy(embedded, humaneval, calls) -> None:
    """The embedded model with native layers against HF greedy on the stock model: code and chat, window on
    and off, every round's layers native."""
    stock, tokenizer = embedded
    model = _native_model(stock)
    prompts = code_and_chat_ids(tokenizer, humaneval(2), "Name three rivers in Europe and one fact about each.")
    eos = [tokenizer.eos_token_id]
    for kwargs in ({"W": 5, "N": 4, "G": 5}, {"W": 1, "N": 5, "G": 1, "lookahead_branch": False}):
        for ids in prompts:
            expected = hf_greedy(stock, ids, 64, eos)
            calls.clear()
            assert run_lookahead(model, ids, max_new_tokens=64, eos_ids=eos, **kwargs).output_ids == expected
            assert calls and set(calls) != {len(ids)}, "no round ran natively"


def _native_rounds(model: torch.nn.Module) -> list[torch.Tensor]:
    """Logits of a fixed series of native rounds, then every K/V buffer: two caches used in turn (rounds of 1-8
    rows in tree layouts, each cropped back), then one of them grown past its buffer by rounds it keeps (the
    buffers replaced: their addresses change under the layers)."""
    adapter = ModelAdapter(model)
    prefix = 248  # the smallest buffer holds 256 slots: the kept rounds below outgrow it
    caches = [scratch_region(adapter, prefix + 8) for _ in range(2)]
    for seed, cache in enumerate(caches):
        one_round(adapter, torch.tensor(random_prompt(prefix, seed=seed)), torch.arange(prefix), causal(prefix), cache,
                        torch.tensor([prefix - 1]))  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    out = []
    for rows in (1, 2, 3, 8):
        for cache in caches:
            ids = torch.randint(0, 50, (rows,), generator=gen)
            vis = (torch.rand(rows, rows, generator=gen) < 0.5) | torch.eye(rows, dtype=torch.bool)
            vis = vis.tril()
            out.append(one_round(adapter, ids, prefix + vis.sum(1) - 1, vis, cache, torch.arange(rows)))
            cache.crop(prefix)
    grown = caches[0]
    capacity = grown.arena.layers()[0].keys.shape[2]
    for step in range(3):
        past = prefix + 8 * step
        ids = torch.randint(0, 50, (8,), generator=gen)
        out.append(one_round(adapter, ids, torch.arange(past, past + 8), causal(8), grown, torch.arange(8)))
    assert grown.arena.layers()[0].keys.shape[2] > capacity, "the cache did not grow"
    return out + [t.clone() for c in caches for layer in c.arena.layers() for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("family", ["llama", "mistral-sliding", "qwen2-hybrid"])
@pytest.mark.parametrize("kernel", ["native", "native-bf16"])
def test_the_stacked_call_is_the_layer_by_layer_calls_bit_for_bit(family: str, kernel: str, calls, monkeypatch):
    """``lp_native_llama_layers`` (every layer in one C call, from an address table built once per model and
    cache) against the same rounds made one C call per layer (``llama_layer``: what a build without the stacked
    entry runs): every logit and every K/V slot equal bit for bit, over two caches used in turn and a cache
    replaced by a larger one mid-way (a table kept past it would write into the old buffers). Four layers, full
    or sliding attention, float32 and bfloat16 weights."""
    name, overrides = helpers.MATRIX.get(family, (family, {}))
    model = tiny_model(name, num_hidden_layers=4, **overrides)
    prepack_linears(model, kernel=KERNELS[kernel])
    stacked = _native_rounds(model)
    assert set(calls) == {248, 1, 2, 3, 8}, "the prefills and rounds did not run the native layers"
    # a build without the stacked entry: llama_layer per layer
    monkeypatch.setattr(native, "_ROUTED", dataclasses.replace(native.routed(), layers=None))
    per_layer = _native_rounds(model)
    assert len(stacked) == len(per_layer)
    for got, want in zip(stacked, per_layer, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kernel", ["native", "native-bf16"])
def test_the_thread_count_changes_no_bit(kernel: str, calls) -> None:
    """The same native prefill (248 rows: past ``ROWWISE_PARALLEL_ROWS``, so the norms, rotary, SiLU and residual
    steps share their rows out) and rounds of 1-8 rows on one thread and on two: every logit and every K/V slot
    equal bit for bit. The rest of the suite runs on one thread (conftest), where no row is shared out."""
    model = tiny_model("llama", num_hidden_layers=2)
    prepack_linears(model, kernel=KERNELS[kernel])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _native_rounds(model)
        torch.set_num_threads(2)
        two = _native_rounds(model)
    finally:
        torch.set_num_threads(threads)
    assert 248 in calls
    for got, want in zip(two, one, strict=True):
        assert torch.equal(got, want)


def test_a_finished_generations_buffers_are_freed_with_its_cache(tiny, calls) -> None:
    """The layer stack (whose table holds the K/V buffers' addresses, so it keeps them alive) lives as long as its
    cache: once the engine drops a cache, its buffers go, though the model lives on."""
    import gc
    import weakref

    model = _native_model(tiny("llama"))
    adapter = ModelAdapter(model)
    cache = scratch_region(adapter, 64)
    one_round(adapter, torch.tensor(random_prompt(8, seed=3)), torch.arange(8), causal(8), cache, torch.tensor([7]))
    one_round(adapter, torch.tensor([5, 6]), torch.tensor([8, 9]), causal(2), cache, torch.arange(2))
    assert 2 in calls, "the round did not run on a layer stack"
    buffers = [weakref.ref(t) for c in cache.arena.layers() for t in (c.keys, c.values)]
    del cache
    gc.collect()
    assert all(ref() is None for ref in buffers)


def test_each_layer_of_a_stack_reads_its_own_mask_and_buffers() -> None:
    """A stacked call hands layer l its own mask, epsilon and K/V buffers: with a different random mask per
    layer, hidden state and K/V are those of ``llama_layer`` called layer by layer, bit for bit."""
    model = _native_model(tiny_model("llama", num_hidden_layers=3))
    adapter = ModelAdapter(model)
    caches = [scratch_region(adapter, 64) for _ in range(2)]
    for cache in caches:
        one_round(adapter, torch.tensor(random_prompt(8, seed=3)), torch.arange(8), causal(8), cache, torch.tensor([7]))
    weights = list(adapter.backend.layer_weights)
    first = weights[0]
    capacity, dim = caches[0].arena.layers()[0].keys.shape[2:]
    gen = torch.Generator().manual_seed(6)
    rows = 3
    hidden = torch.randn(rows, model.config.hidden_size, generator=gen)
    angles = torch.rand(rows, dim, generator=gen) * 6
    cos, sin, slots = angles.cos(), angles.sin(), torch.tensor([8, 9, 10])
    masks = []
    for _ in weights:
        mask = torch.zeros(rows, capacity).masked_fill(torch.rand(rows, capacity, generator=gen) < 0.5, -1e38)
        mask[:, 0] = 0.0
        masks.append(mask)
    stacked, per_layer = hidden.clone(), hidden.clone()
    native.LayerStack(
        [w.as_args() for w in weights], [c.keys[0] for c in caches[0].arena.layers()],
        [c.values[0] for c in caches[0].arena.layers()],
        first.heads, first.intermediate, first.scale,
    ).run(stacked, cos, sin, slots, masks)  # fmt: skip
    for w, mask, c in zip(weights, masks, caches[1].arena.layers(), strict=True):
        native.llama_layer(per_layer, w.as_args(), cos, sin, slots, mask, c.keys[0], c.values[0], w.heads,
                           w.intermediate, w.scale)  # fmt: skip
    assert torch.equal(stacked, per_layer) and not torch.equal(stacked, hidden)
    for a, b in zip(caches[0].arena.layers(), caches[1].arena.layers(), strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    shared = hidden.clone()  # one mask for every layer gives other values: the masks were read per layer
    for w, c in zip(weights, caches[1].arena.layers(), strict=True):
        native.llama_layer(shared, w.as_args(), cos, sin, slots, masks[0], c.keys[0], c.values[0], w.heads,
                           w.intermediate, w.scale)  # fmt: skip
    assert not torch.equal(shared, stacked)


def test_a_slot_outside_the_buffer_is_refused_before_any_write(tiny) -> None:
    """The C layer checks every K/V slot against the buffer before it writes, and the stacked call before its
    first layer runs: a bad slot is an error, and every buffer and the residual stream are left as they were."""
    model = _native_model(tiny("llama"))
    adapter = ModelAdapter(model)
    cache = scratch_region(adapter, 64)
    one_round(adapter, torch.tensor(random_prompt(8, seed=3)), torch.arange(8), causal(8), cache, torch.tensor([7]))
    layer, weights = cache.arena.layers()[0], adapter.backend.layer_weights[0]
    all_weights = list(adapter.backend.layer_weights)
    stack = native.LayerStack(
        [w.as_args() for w in all_weights],
        [c.keys[0] for c in cache.arena.layers()],
        [c.values[0] for c in cache.arena.layers()],
        weights.heads, weights.intermediate, weights.scale,
    )  # fmt: skip
    capacity, dim = layer.keys.shape[2], layer.keys.shape[3]
    hidden = torch.randn(2, model.config.hidden_size)
    before = hidden.clone()
    buffers = [t.clone() for c in cache.arena.layers() for t in (c.keys, c.values)]
    cos, sin = torch.ones(2, dim), torch.zeros(2, dim)
    mask = torch.zeros(2, capacity)
    for slots in (torch.tensor([8, capacity]), torch.tensor([-1, 9])):
        with pytest.raises(ValueError, match="native layer refused"):
            native.llama_layer(
                hidden, weights.as_args(), cos, sin, slots, mask, layer.keys[0], layer.values[0],
                weights.heads, weights.intermediate, weights.scale,
            )  # fmt: skip
        with pytest.raises(ValueError, match="native layers refused .* or a K/V slot outside the buffer"):
            stack.run(hidden, cos, sin, slots, [mask] * len(all_weights))
    good = torch.tensor([8, 9])
    wide, double = torch.randn(2, model.config.hidden_size + 1), hidden.double()
    for bad in ((wide, cos, sin, good, [mask]), (double, cos, sin, good, [mask]), (hidden, cos, sin, good, [])):
        with pytest.raises(ValueError, match="do not fit"):  # refused in Python: the C call would read past them
            stack.run(*bad[:4], bad[4] * len(all_weights))
    assert torch.equal(hidden, before)
    after = [t for c in cache.arena.layers() for t in (c.keys, c.values)]
    assert all(torch.equal(t, b) for t, b in zip(after, buffers, strict=True))
    stack.run(hidden, cos, sin, good, [mask] * len(all_weights))  # the same call, slots inside
    assert not torch.equal(hidden, before) and not torch.equal(cache.arena.layers()[-1].keys, buffers[-2])


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in float32 units in the last place (signed magnitudes mapped onto one integer line)."""
    ia, ib = (t.float().view(torch.int32).long() for t in (a, b))
    ia, ib = (torch.where(i < 0, -(i & 0x7FFFFFFF), i) for i in (ia, ib))
    return (ia - ib).abs()


def test_the_layers_silu_gate_is_silu_times_up_to_a_few_ulps() -> None:
    """The layer's activation (a vector exp, no libm call per element) against float64 SiLU(gate) x up, over the
    whole range a gate takes (0 and -0, past expf's overflow at -88.7, rows whose width is no multiple of a vector):
    within 3 ulp (torch's own SiLU: 2), finite, and -0 where the exact value is below 1e-36."""
    lib = native.library(str(default_cache_dir()), native.extra_flags())
    gen = torch.Generator().manual_seed(0)
    rows, width = 3, 8001
    gate = torch.cat([torch.linspace(-120.0, 120.0, 20000), torch.randn(4003, generator=gen) * 4])
    gate = gate[torch.randperm(gate.numel(), generator=gen)]
    gate[-9:] = torch.tensor([0.0, -0.0, 88.0, 89.0, -87.0, -87.3, -88.0, -104.0, 1e-30])  # the last vector's tail
    gate = gate.reshape(rows, width)
    for up in (torch.ones(rows, width), torch.rand(rows, width, generator=gen) * 4 - 2):
        gu = torch.cat([gate, up], dim=1).contiguous()
        act = torch.empty(rows, width)
        assert lib.lp_native_silu_gate_f32(gu.data_ptr(), act.data_ptr(), rows, width) == 0
        exact = gate.double() / (1 + torch.exp(-gate.double())) * up.double()
        normal = exact.abs() > 1e-30
        assert _ulps(act[normal], exact[normal].float()).max() <= 3
        assert torch.isfinite(act).all() and (act[~normal].abs() <= 1e-30).all()
        assert torch.equal(act[gate < -87.3], torch.zeros(int((gate < -87.3).sum())))
    assert lib.lp_native_silu_gate_f32(gu.data_ptr(), act.data_ptr(), 0, width) == -1


@pytest.mark.parametrize("family", FAMILIES)
def test_rotary_rows_are_the_models_own_call_bit_for_bit(family: str) -> None:
    """A round's rotary rows come from a table of every position the K/V holds, made by the model's own rotary
    module: bit for bit what its call gives for the round's positions (any order, repeats, the last position),
    made again when the K/V grows; a rope type that rescales with the length gets no table (its own call)."""
    model = tiny_model(family)
    rotary = model.model.rotary_emb
    hidden = torch.zeros(1, 3, model.config.hidden_size)
    gen = torch.Generator().manual_seed(3)
    for capacity in (512, 2048):
        for ids in (torch.tensor([capacity - 1, 0, 7, 7]), torch.randint(0, capacity, (37,), generator=gen)):
            got = native_layers.rotary_rows(rotary, hidden, ids, capacity)
            want = native_layers._rotary_call(rotary, hidden, ids)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        table = native_layers._ROTARY[rotary]
        assert table is not None and table.cos.shape[0] == capacity  # grown with the K/V
    dynamic = copy.deepcopy(rotary)
    dynamic.rope_type = "dynamic"
    ids = torch.arange(5)
    got = native_layers.rotary_rows(dynamic, hidden, ids, 64)
    assert native_layers._ROTARY[dynamic] is None
    assert all(torch.equal(g, w) for g, w in zip(got, native_layers._rotary_call(dynamic, hidden, ids), strict=True))

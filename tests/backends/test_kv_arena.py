"""A generation's static K/V: one arena for every layer, never reallocated while the generation runs.

``move_rows`` on an arena cache is one slice copy per run of consecutive moves for all layers (counted in aten
ops), with the bits of a gather-then-scatter of every layer; a fixed cache refuses to grow (a captured graph reads
it at its address), a scratch
cache still grows; the engine's generation caches are fixed and keep their address from the first round to the
last (on the CPU's default static path, the native layers, as on the bucketed GPU path in test_static_rounds).
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from helpers import hf_greedy, random_prompt, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from lp_runner.backends.adapter import ModelAdapter, causal, crop, move_rows
from lp_runner.backends.cpu.prepack import apply_prepack, native_unavailable_reason
from lp_runner.backends.kv_cache import KVCapacityError, StaticBufferLayer, allocate_arena, shared_arena
from lp_runner.config import GenerationConfig, LookaheadConfig
from lp_runner.decoding.engine import LookaheadEngine
from lp_runner.models.loading import default_cache_dir


class _Ops(TorchDispatchMode):
    """Counts the aten ops run while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _static_cache(layers: int, capacity: int = 16):
    """A DynamicCache-shaped object of ``layers`` arena-backed static layers holding random K/V."""
    model = tiny_model("llama", num_hidden_layers=layers)
    adapter = ModelAdapter(model, static_cache=True)
    cache = adapter.new_cache(capacity)
    gen = torch.Generator().manual_seed(layers)
    with torch.inference_mode():
        arena = shared_arena(cache.layers)
        arena.copy_(torch.randn(arena.shape, generator=gen))
    return cache


def test_move_rows_is_one_slice_copy_per_run_over_every_layer() -> None:
    cache = _static_cache(layers=5)
    assert shared_arena(cache.layers) is not None
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    with _Ops() as counted:
        move_rows(cache, [9, 10, 3], [2, 3, 3])  # 3 -> 3 stays; 10 is read before 3 is written
    assert counted.ops["copy_"] == 1 and counted.ops["index_copy_"] == 0, counted.ops
    for layer, (keys, values) in zip(cache.layers, before, strict=True):
        want_k, want_v = keys.clone(), values.clone()
        want_k[:, :, [2, 3]], want_v[:, :, [2, 3]] = keys[:, :, [9, 10]], values[:, :, [9, 10]]
        assert torch.equal(layer.keys, want_k) and torch.equal(layer.values, want_v)


def test_a_layer_that_grew_out_of_its_arena_moves_layer_by_layer() -> None:
    cache = _static_cache(layers=3)
    with torch.inference_mode():
        cache.layers[1].reserve(300)  # a scratch cache may grow: that layer now has buffers of its own
    assert cache.layers[1].arena is None and shared_arena(cache.layers) is None
    before = [(layer.keys[:, :, :16].clone(), layer.values[:, :, :16].clone()) for layer in cache.layers]
    with _Ops() as counted:
        move_rows(cache, [7], [1])
    assert counted.ops["copy_"] == 2 * 3  # keys and values of every layer
    for layer, (keys, values) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.keys[:, :, 1], keys[:, :, 7]) and torch.equal(layer.values[:, :, 1], values[:, :, 7])


@pytest.mark.parametrize("arena", [True, False])
def test_move_rows_equals_reading_every_source_before_any_write(arena: bool) -> None:
    """Random moves (runs, overlapping shifts left and right, scattered rows, a slot that is both a source and a
    later destination) give the bits of gathering every source, then scattering: the commit's contract."""
    import random

    rng = random.Random(7)
    for case in range(200):
        cache = _static_cache(layers=2, capacity=24)
        if not arena:
            with torch.inference_mode():
                cache.layers[0].reserve(300)  # layers with buffers of their own: the per-layer path
        n = rng.randint(1, 6)
        if case % 3 == 0:  # one run shifted by a small offset either way (overlapping when |offset| < n)
            start, offset = rng.randint(4, 12), rng.choice([-3, -2, -1, 1, 2, 3])
            src, dst = list(range(start, start + n)), list(range(start + offset, start + offset + n))
        else:
            src = rng.sample(range(24), n)
            dst = rng.sample(range(24), n)
        before = [(layer.keys[:, :, :24].clone(), layer.values[:, :, :24].clone()) for layer in cache.layers]
        move_rows(cache, src, dst)
        for layer, (keys, values) in zip(cache.layers, before, strict=True):
            want_k, want_v = keys.clone(), values.clone()
            want_k[:, :, dst], want_v[:, :, dst] = keys[:, :, src], values[:, :, src]
            assert torch.equal(layer.keys[:, :, :24], want_k), (case, src, dst)
            assert torch.equal(layer.values[:, :, :24], want_v), (case, src, dst)


def test_arena_views_are_the_layers_own_contiguous_buffers() -> None:
    layers = [StaticBufferLayer(32) for _ in range(3)]
    arena = allocate_arena(layers, 2, 8, torch.float32, torch.device("cpu"))
    assert arena.shape == (3, 2, 1, 2, 32, 8)
    for i, layer in enumerate(layers):
        assert layer.keys.is_contiguous() and layer.keys.data_ptr() == arena[i, 0].data_ptr()
        assert layer.values.data_ptr() == arena[i, 1].data_ptr() and layer.arena is arena
    with pytest.raises(ValueError, match="one capacity"):
        allocate_arena([StaticBufferLayer(32), StaticBufferLayer(64)], 2, 8, torch.float32, torch.device("cpu"))


def test_a_fixed_layer_refuses_to_grow_a_scratch_layer_grows() -> None:
    fixed, scratch = StaticBufferLayer(256, fixed=True), StaticBufferLayer(256)
    for layer in (fixed, scratch):
        layer.allocate(2, 8, torch.float32, torch.device("cpu"))
    fixed.reserve(256)  # within its capacity: nothing to do
    with pytest.raises(KVCapacityError, match="needs 300 K/V slots, past the generation's fixed capacity of 256"):
        fixed.reserve(300)
    scratch.reserve(300)
    assert scratch.capacity == 512 and scratch.keys.shape[2] == 512


def test_engine_generation_caches_are_fixed_and_never_move() -> None:
    """The CPU's default static path (native layers over native products): every round of a generation on the
    buffers allocated at its start; the output still HF greedy's."""
    stock = tiny_model("llama")
    if native_unavailable_reason(stock, default_cache_dir()) is not None:
        pytest.skip("no native kernel here")
    model = copy.deepcopy(stock)
    apply_prepack(model, "native")
    adapter = ModelAdapter(model)
    assert adapter.backend.whole_layers and adapter.static_cache
    seen = []
    real = adapter.forward

    def recording(ids, positions, visibility, cache, logit_rows):
        seen.append((id(cache), tuple(layer.keys.data_ptr() for layer in cache.layers), cache.layers[0].fixed))
        return real(ids, positions, visibility, cache, logit_rows)

    adapter.forward = recording
    la = LookaheadConfig(window_size=4, ngram_size=3, verification_set_size=4)
    prompt = random_prompt(12, 3) * 2
    result = LookaheadEngine(adapter, la, GenerationConfig(max_new_tokens=40), []).generate(prompt)
    assert result.output_ids == hf_greedy(stock, prompt, 40)
    assert len(seen) > 5 and len({entry[:2] for entry in seen}) == 1 and all(entry[2] for entry in seen)


def test_static_cache_with_moves_equals_the_ordinary_one() -> None:
    """Arena moves inside rounds against the AppendBuffer path's: the same logits round after round."""
    model = tiny_model("qwen2")
    ours, ref = ModelAdapter(model, static_cache=True), ModelAdapter(model)
    caches = {id(a): a.new_cache(64, fixed=a is ours) for a in (ours, ref)}
    tokens = torch.tensor(random_prompt(20, seed=2))
    for a in (ours, ref):
        a.forward(tokens, torch.arange(20), causal(20), caches[id(a)], torch.tensor([19]))
    t = 20
    for step in range(8):
        ids = torch.tensor(random_prompt(4, seed=step))
        positions = torch.arange(t, t + 4)
        got, want = (a.forward(ids, positions, causal(4), caches[id(a)], torch.arange(4)) for a in (ours, ref))
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        for a in (ours, ref):
            move_rows(caches[id(a)], [t + 3, t + 2], [t, t + 1])
            crop(caches[id(a)], t + 2)
        t += 2


def test_runs_groups_consecutive_moves() -> None:
    from lp_runner.backends.kv_cache import runs

    assert runs([7, 8, 9, 3], [2, 3, 4, 5]) == [(7, 2, 3), (3, 5, 1)]  # the docstring's example
    assert runs([5, 6], [9, 11]) == [(5, 9, 1), (6, 11, 1)]  # sources consecutive, slots not: two runs
    assert runs([], []) == []

"""The K/V arena: one tensor for every layer and every generation, regions handed out, written by position.

A region's moves are one slice copy per run of consecutive moves over every layer at once (counted in aten ops),
with the bits of a gather-then-scatter; a generation's region refuses to outgrow its size (a captured graph
reads the arena at its address), a scratch region grows its arena; the engine's generations keep one arena from
the first round to the last, and the adapter keeps it across runs; a region anywhere in the arena (other
generations' slots around it) computes what a region at slot 0 does, on every attention path.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from helpers import hf_greedy, one_round, random_prompt, scratch_region, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from lp_runner.backends.adapter import ModelAdapter, causal
from lp_runner.backends.cpu.prepack import apply_prepack, native_unavailable_reason
from lp_runner.backends.kv_cache import KVCapacityError, runs
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


def _random_region(layers: int, size: int = 16):
    """A region of ``size`` slots, full, in an arena of ``layers`` layers holding random K/V."""
    adapter = ModelAdapter(tiny_model("llama", num_hidden_layers=layers))
    region = scratch_region(adapter, size)
    region.length = size
    gen = torch.Generator().manual_seed(layers)
    with torch.inference_mode():
        region.arena.tensor.copy_(torch.randn(region.arena.tensor.shape, generator=gen))
    return region


def _kv(region, slots: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys[:, :, :slots].clone(), layer.values[:, :, :slots].clone()) for layer in region.arena.layers()]


def test_moves_are_one_slice_copy_per_run_over_every_layer() -> None:
    region = _random_region(layers=5)
    before = _kv(region, 16)
    with _Ops() as counted:
        region.move([9, 10, 3], [2, 3, 3])  # 3 -> 3 stays; 10 is read before 3 is written
        region.arena.flush()
    assert counted.ops["copy_"] == 1 and counted.ops["index_copy_"] == 0, counted.ops
    for layer, (keys, values) in zip(region.arena.layers(), before, strict=True):
        want_k, want_v = keys.clone(), values.clone()
        want_k[:, :, [2, 3]], want_v[:, :, [2, 3]] = keys[:, :, [9, 10]], values[:, :, [9, 10]]
        assert torch.equal(layer.keys[:, :, :16], want_k) and torch.equal(layer.values[:, :, :16], want_v)


def test_moves_equal_reading_every_source_before_any_write() -> None:
    """Random moves (runs, overlapping shifts left and right, scattered rows, a slot that is both a source and a
    later destination) give the bits of gathering every source, then scattering: the commit's contract."""
    import random

    rng = random.Random(7)
    for case in range(200):
        region = _random_region(layers=2, size=24)
        n = rng.randint(1, 6)
        if case % 3 == 0:  # one run shifted by a small offset either way (overlapping when |offset| < n)
            start, offset = rng.randint(4, 12), rng.choice([-3, -2, -1, 1, 2, 3])
            src, dst = list(range(start, start + n)), list(range(start + offset, start + offset + n))
        else:
            src = rng.sample(range(24), n)
            dst = rng.sample(range(24), n)
        before = _kv(region, 24)
        region.move(src, dst)
        after = [(region.keys(i), region.values(i)) for i in range(2)]
        for (keys, values), (got_k, got_v) in zip(before, after, strict=True):
            want_k, want_v = keys.clone(), values.clone()
            want_k[:, :, dst], want_v[:, :, dst] = keys[:, :, src], values[:, :, src]
            assert torch.equal(got_k, want_k[:, :, :24]), (case, src, dst)
            assert torch.equal(got_v, want_v[:, :, :24]), (case, src, dst)


def test_arena_views_are_the_layers_own_contiguous_buffers() -> None:
    adapter = ModelAdapter(tiny_model("llama", num_hidden_layers=3))
    with adapter.arena() as arena:
        assert arena.tensor.shape == (3, 2, 1, *adapter.kv_shape[:1], 256, adapter.kv_shape[1])
        for i, layer in enumerate(arena.layers()):
            assert layer.keys.is_contiguous() and layer.keys.data_ptr() == arena.tensor[i, 0].data_ptr()
            assert layer.values.data_ptr() == arena.tensor[i, 1].data_ptr()
        assert arena.cache.layers == arena.layers()  # every layer of a plain attention model holds K/V here


def test_a_job_region_refuses_to_grow_a_scratch_region_grows() -> None:
    adapter = ModelAdapter(tiny_model("llama"))
    with adapter.arena([240]) as job:
        region = job.region(240)
        region.reserve(240)  # within its size: nothing to do
        with pytest.raises(KVCapacityError, match="needs 300 K/V slots, past its generation's region of 240"):
            region.reserve(300)
        scratch = scratch_region(adapter, 16)
        scratch.length = 3
        with torch.inference_mode():
            scratch.arena.tensor[..., :3, :] = 1.5
        scratch.reserve(300)
        assert scratch.size >= 300 and scratch.arena.capacity == 512 and scratch.arena.growths == 1
        assert torch.equal(scratch.keys(0), torch.full_like(scratch.keys(0), 1.5))  # carried into the new arena


def test_engine_generations_keep_one_arena_across_rounds_and_runs() -> None:
    """The CPU's default path (native layers over native products): every round of a generation on the arena
    claimed at its start, the next run on the same arena (the adapter holds it); the output HF greedy's."""
    stock = tiny_model("llama")
    if native_unavailable_reason(stock, default_cache_dir()) is not None:
        pytest.skip("no native kernel here")
    model = copy.deepcopy(stock)
    apply_prepack(model, "native")
    adapter = ModelAdapter(model)
    assert adapter.backend.whole_layers
    seen = []
    real = adapter.run

    def recording(rounds, regions):
        seen.append((id(regions[0]), regions[0].arena.tensor.data_ptr()))
        return real(rounds, regions)

    adapter.run = recording
    la = LookaheadConfig(window_size=4, ngram_size=3, verification_set_size=4)
    prompt = random_prompt(12, 3) * 2
    engine = LookaheadEngine(adapter, la, GenerationConfig(max_new_tokens=40), [])
    assert engine.generate(prompt).output_ids == hf_greedy(stock, prompt, 40)
    first = len(seen)
    assert first > 5 and len(set(seen)) == 1
    assert engine.generate(prompt).output_ids == hf_greedy(stock, prompt, 40)
    assert {ptr for _, ptr in seen[first:]} == {seen[0][1]}  # the second run: the same arena


@pytest.mark.parametrize("family", ["qwen2", "mistral-sliding", "gemma2"])
def test_a_region_anywhere_in_the_arena_equals_one_at_slot_0(family: str) -> None:
    """Rounds with moves and crops in a region after another generation's (whose slots hold large garbage): the
    logits of the same rounds in a region at slot 0, round after round. gemma2 (softcapped eager attention) runs its
    own attention under the round's mask as a 4-D mask, the others take the round's attention by keyword: either
    way every slot outside the row's region is hidden (a row that saw a garbage key would give other logits; the
    garbage is finite because transformers' layers read the live width under the mask)."""
    model = tiny_model(family)
    adapter = ModelAdapter(model)
    with adapter.arena([64, 64]) as arena:
        with torch.inference_mode():
            arena.tensor.fill_(1e4)
        other, ours = arena.region(64), arena.region(64)
        assert ours.base == 64
        ref = scratch_region(adapter, 64)
        tokens = torch.tensor(random_prompt(20, seed=2))
        got, want = (
            one_round(adapter, tokens, torch.arange(20), causal(20), kv, torch.tensor([19])) for kv in (ours, ref)
        )
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        t = 20
        for step in range(8):
            ids = torch.tensor(random_prompt(4, seed=step))
            positions = torch.arange(t, t + 4)
            got, want = (one_round(adapter, ids, positions, causal(4), kv, torch.arange(4)) for kv in (ours, ref))
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
            for kv in (ours, ref):
                kv.move([t + 3, t + 2], [t, t + 1])
                kv.crop(t + 2)
            t += 2
        assert other.length == 0


def test_runs_groups_consecutive_moves() -> None:
    assert runs([7, 8, 9, 3], [2, 3, 4, 5]) == [(7, 2, 3), (3, 5, 1)]  # the docstring's example
    assert runs([5, 6], [9, 11]) == [(5, 9, 1), (6, 11, 1)]  # sources consecutive, slots not: two runs
    assert runs([], []) == []

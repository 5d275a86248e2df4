"""The one round function (``rounds.Rounds``), bucketed: the GPU's round path, run here on the CPU minus the capture.

Oracles: the adapter's unbucketed eager rounds for single rounds (the same logits to fp32 rounding, the same
argmax), HF greedy ``generate`` for whole generations, the visibility rule written out slot by slot (``_rule_mask``)
for the round mask, and the compiled rounds against the eager bucketed ones at every bucket boundary.
What a CPU cannot show: the CUDA graphs themselves (inductor's graph trees skip the capture on a CPU and run the
same compiled code); ``benchmarks/gpu_check.sh`` measures them where a GPU exists. The compiling tests are slow
(one compilation of a tiny model: some 20 s on two cores).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import (
    FAMILIES,
    compiled_adapter,
    hf_greedy,
    job_region,
    one_round,
    random_prompt,
    scratch_region,
    tiny_model,
)

from lp_runner.backends import rounds as rounds_module
from lp_runner.backends.adapter import ModelAdapter, causal
from lp_runner.backends.buckets import BucketLadder
from lp_runner.backends.kv_cache import MIN_CAPACITY, KVCapacityError
from lp_runner.backends.round_mask import round_attention, round_mask
from lp_runner.backends.staging import Rows, StagedInputs, stage
from lp_runner.config import GenerationConfig, LookaheadConfig
from lp_runner.decoding.engine import LookaheadEngine

WINDOWED = ("mistral-sliding", "qwen2-hybrid")  # every layer slides; one sliding and one full layer (a dict mask)


# ------------------------------------------------------------------------------------------------------ ladder


@pytest.mark.parametrize(
    "rows, expected",
    [(1, 2), (2, 2), (3, 4), (4, 4), (5, 8), (33, 64), (512, 512), (513, 513), (4000, 4000)],
)
def test_rows_run_at_the_smallest_bucket_that_holds_them(rows: int, expected: int) -> None:
    ladder = BucketLadder()
    assert ladder.rows_for(rows) == expected
    assert ladder.captured(expected) == (expected <= 512)  # past the top: its own count, not a captured shape


@pytest.mark.parametrize(
    "length, capacity, expected",
    [(5, 2048, 256), (256, 2048, 256), (257, 2048, 512), (300, 2048, 512), (1500, 2048, 2048), (300, 256, 256)],
)
def test_kv_width_is_the_live_power_of_two(length: int, capacity: int, expected: int) -> None:
    if length > capacity:
        with pytest.raises(ValueError, match="do not fit"):
            BucketLadder().kv_width(length, capacity)
        return
    assert BucketLadder().kv_width(length, capacity) == expected


def test_kv_width_refuses_a_round_past_the_buffer() -> None:
    with pytest.raises(ValueError, match="1500 live positions do not fit a buffer of 1024"):
        BucketLadder().kv_width(1500, 1024)


@pytest.mark.parametrize(
    "rows, size, expected",
    [
        (8, 608, [0, 504, 600]),  # the docstring: widths 256, 512, 1024 (the region's last slot, 608, reads 1024)
        (2, 208, [0]),  # the whole region within the smallest width
        (512, 608, [0, 96]),  # a bucket at its own width 512, then the region's end
        (8, 1024, [0, 504, 1016]),  # ends exactly on a power of two: 1024 is its width
    ],
)
def test_the_warm_up_reads_every_width_of_its_region(tiny, rows: int, size: int, expected: list[int]) -> None:
    """One cached length per K/V width a bucket's rounds read in the region, each reading its width."""
    adapter = ModelAdapter(tiny("llama"), bucketed=True)
    with adapter.arena() as arena:
        arena.grow(1024)
        region = arena.region(size - arena.region_extra)  # a region of exactly ``size`` slots
        assert region.size == size and arena.capacity == 1024 + MIN_CAPACITY
        pasts = adapter.rounds.widths_past(rows, region)
    assert pasts == expected
    widths = [adapter.rounds.ladder.kv_width(past + rows, arena.capacity) for past in pasts]
    assert widths == sorted(set(widths))  # each a different width, none skipped from the smallest one up
    assert widths[-1] == adapter.rounds.ladder.kv_width(size, arena.capacity)


@pytest.mark.parametrize("rows", [(), (1, 2), (4, 2), (2, 2)])
def test_a_ladder_must_increase_from_two(rows) -> None:
    with pytest.raises(ValueError, match="increasing"):
        BucketLadder(rows)


# ------------------------------------------------------------------------------------------------ round mask


def _masks_of(segments, window, capacity: int):
    """(round_mask's inputs for ``segments`` = [(rows, region base, past)], the mask it must give) -> [sum rows,
    capacity]: the visibility rule of ``round_mask``'s docstring applied slot by slot, in plain Python loops (an
    oracle independent of the tensor code): row i of a generation sees its region's cached prefix and the round's
    rows its visibility names, minus, under a sliding window w, every key whose position is w or more behind its
    own; every other slot is hidden."""
    hidden = torch.finfo(torch.float32).min
    total = sum(len(r.tokens) for r, _, _ in segments)
    want = torch.full((total, capacity), hidden)
    visibility = torch.zeros(total, total, dtype=torch.bool)
    first, end, writes = (torch.zeros(total, dtype=torch.long) for _ in range(3))
    row = 0
    for rows, base, past in segments:
        q = len(rows.tokens)
        for i in range(q):
            position = rows.positions[i]
            keys = {base + j: j for j in range(past)}  # slot -> its position
            keys |= {base + past + j: rows.positions[j] for j in range(q) if rows.visibility[i, j]}
            for slot, key_position in keys.items():
                if window is None or position - key_position < window:
                    want[row + i, slot] = 0.0
        visibility[row : row + q, row : row + q] = rows.visibility
        first[row : row + q], end[row : row + q] = base, base + past
        writes[row : row + q] = torch.arange(base + past, base + past + q)
        row += q
    positions = torch.tensor([p for r, _, _ in segments for p in r.positions])
    return (visibility, first, end, positions, writes), want


def _segment(rows: int, past: int, seed: int) -> Rows:
    gen = torch.Generator().manual_seed(seed)
    visibility = (torch.rand(rows, rows, generator=gen) < 0.5) | torch.eye(rows, dtype=torch.bool)
    positions = past + torch.randint(0, 4, (rows,), generator=gen)  # siblings share positions
    return Rows([0] * rows, positions.tolist(), visibility, list(range(rows)))


@pytest.mark.parametrize("window", [None, 3, 8])
@pytest.mark.parametrize(
    "segments, width, capacity",
    [
        ([(2, 0, 0)], 8, 8),
        ([(4, 0, 5)], 16, 32),
        ([(8, 0, 20)], 32, 32),
        ([(3, 0, 3)], 8, 64),
        ([(4, 16, 5)], 32, 64),  # a region past slot 0
        ([(3, 40, 0)], 64, 64),
        ([(2, 0, 5), (1, 64, 3), (4, 32, 10)], 128, 128),  # three generations, regions out of order
    ],
)
def test_round_mask_is_each_segments_mask_at_its_regions_slots(window, segments, width, capacity) -> None:
    """Slot for slot the visibility rule (``_masks_of``, its per-row sliding window included) at each region's
    slots, every other slot (other generations', past the round) hidden, cut to ``width``."""
    segs = [(_segment(q, past, seed=10 * k + q), base, past) for k, (q, base, past) in enumerate(segments)]
    (visibility, first, end, positions, writes), want = _masks_of(segs, window, capacity)
    keys = torch.arange(width)
    got = round_mask(visibility, first, end, positions, writes, keys, window, torch.float32)
    assert got.shape == (1, 1, len(positions), width)
    assert torch.equal(got[0, 0], want[:, :width])
    tiled = round_mask(visibility, first, end, positions, writes, keys, window, torch.float32, 3)
    assert torch.equal(tiled[0, 0], want[:, :width].repeat(3, 1))  # packed row g * Q + i reads row i


def test_round_attention_reads_the_live_width_only() -> None:
    """Slots past the mask's width are not read: garbage there changes nothing; the result is sdpa's with K/V
    heads repeated (transformers' reference)."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, rows, dim, width, capacity = 6, 2, 3, 8, 16, 64
    query = torch.randn(1, heads, rows, dim, generator=gen)
    key = torch.randn(1, kv_heads, capacity, dim, generator=gen)
    value = torch.randn(1, kv_heads, capacity, dim, generator=gen)
    visibility = torch.ones(rows, rows, dtype=torch.bool).tril()
    first, end, writes = torch.zeros(rows, dtype=torch.long), torch.full((rows,), 10), torch.arange(10, 13)
    mask = round_mask(visibility, first, end, torch.arange(10, 13), writes, torch.arange(width), None, torch.float32, 3)
    got, _ = round_attention(None, query, key, value, mask, scaling=dim**-0.5)
    key[:, :, width:], value[:, :, width:] = float("nan"), float("nan")
    again, _ = round_attention(None, query, key, value, mask, scaling=dim**-0.5)
    assert torch.equal(got, again)
    k, v = (t[:, :, :width].repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    plain = mask[:, :, :rows]  # the untiled mask
    ref = torch.softmax(query @ k.transpose(-1, -2) * dim**-0.5 + plain, dim=-1) @ v  # [1, H, Q, D]
    torch.testing.assert_close(got, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------- staging


def test_stage_writes_every_input_once_padded_to_the_bucket() -> None:
    """The docstring's example: segments (2 rows, region at 0, past 5) and (1 row, region at 64, past 3) in a
    bucket of 4."""
    a_vis = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    a = Rows((7, 8), (5, 6), a_vis, (0, 1))
    b = Rows((9,), (3,), torch.ones(1, 1, dtype=torch.bool), (0,))
    host = stage(4, 4, [(a, 0, 5), (b, 64, 3)], False)
    assert host.dtype == torch.uint8 and host.numel() == StagedInputs.nbytes(4, 4) == 8 * 24 + 16
    staged = StagedInputs.views(host.clone(), 4, 4)
    assert staged.input_ids.tolist() == [7, 8, 9, 9]  # the filler repeats the last row
    assert staged.position_ids.tolist() == [5, 6, 3, 3]
    assert staged.logit_rows.tolist() == [0, 1, 2, 0]  # each segment's own, shifted; the filler's reads row 0
    assert staged.write_slots.tolist() == [5, 6, 67, 68]  # the filler after the last segment's rows
    assert staged.cached_from.tolist() == [0, 0, 64, 0] and staged.cached_to.tolist() == [5, 5, 67, 0]
    want = torch.zeros(4, 4, dtype=torch.bool)
    want[:2, :2], want[2, 2] = a_vis, True
    want[3, 3] = True  # the filler sees itself only, and no real row sees it
    assert torch.equal(staged.visibility, want)


# ---------------------------------------------------------------------------------------------- eager rounds


def _prefill(prefix: list[int], adapters, caches: dict) -> None:
    """``prefix`` as one round on each adapter's region (``caches[id(adapter)]``)."""
    n = len(prefix)
    for adapter in adapters:
        one_round(adapter, torch.tensor(prefix), torch.arange(n), causal(n), caches[id(adapter)], torch.tensor([0]))


def _round_pairs(model, static: ModelAdapter, rows_list, prefix_len: int = 40, capacity: int = 64):
    """Single rounds of each row count through ``static`` (in its job arena) and the ordinary eager adapter on
    the same prefix, cropped back after each: yields (rows, static logits, ordinary logits)."""
    ref = ModelAdapter(model)
    prefix = random_prompt(prefix_len, seed=5)
    with job_region(static, capacity) as region:
        caches = {id(ref): scratch_region(ref, capacity), id(static): region}
        _prefill(prefix, (ref, static), caches)
        for rows in rows_list:
            ids = torch.tensor(random_prompt(rows, seed=rows))
            positions = torch.arange(prefix_len, prefix_len + rows)
            got, want = (
                one_round(adapter, ids, positions, causal(rows), caches[id(adapter)], torch.arange(rows))
                for adapter in (static, ref)
            )
            yield rows, got, want
            for adapter in (ref, static):
                caches[id(adapter)].crop(prefix_len)


BOUNDARIES = sorted({1, *(b for b in (2, 4, 8, 16, 32)), *(b + 1 for b in (2, 4, 8, 16, 32))})


@pytest.mark.parametrize("family", FAMILIES + WINDOWED)
def test_eager_static_rounds_equal_the_ordinary_forward(family: str) -> None:
    """At every bucket boundary (rows = bucket and bucket + 1), padded and run on the job arena with the round
    mask and the live width: the ordinary forward's logits to fp32 rounding, its argmax exactly."""
    model = tiny_model(family)
    static = ModelAdapter(model, bucketed=True)
    assert static.rounds is not None and static.rounds.compiled is None
    for rows, got, want in _round_pairs(model, static, BOUNDARIES):
        assert got.shape == want.shape == (rows, model.config.vocab_size)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=f"{family}, {rows} rows")
        assert torch.equal(got.argmax(-1), want.argmax(-1)), (family, rows)


@pytest.mark.parametrize("family", FAMILIES + WINDOWED)
def test_bucketed_engine_equals_hf_greedy(family: str) -> None:
    """Whole generations (window, candidates, accepted rows moved) through bucketed eager rounds: HF greedy's
    tokens. The rounds reuse the adapter's one job arena generation after generation."""
    model = tiny_model(family)
    adapter = ModelAdapter(model, bucketed=True)
    la = LookaheadConfig(window_size=4, ngram_size=3, verification_set_size=4)
    engine = LookaheadEngine(adapter, la, GenerationConfig(max_new_tokens=40), [])
    arenas = set()
    for seed in (3, 4):
        prompt = random_prompt(12, seed) * 2
        result = engine.generate(prompt)
        assert result.output_ids == hf_greedy(model, prompt, 40), (family, seed)
        assert result.stats.forwards < 40  # candidates were accepted: multi-row rounds and row moves ran
        with adapter.arena() as arena:
            arenas.add(arena.tensor.data_ptr())
    assert len(arenas) == 1  # the second generation reused the first one's arena


# --------------------------------------------------------------------------------------- the mask, the copy


def test_the_mask_is_built_once_per_round_and_every_layer_reads_it(monkeypatch) -> None:
    model = tiny_model("llama", num_hidden_layers=3)
    adapter = ModelAdapter(model, bucketed=True)
    built, seen = [], []

    def counting_mask(*args, **kwargs):
        built.append(round_mask(*args, **kwargs))
        return built[-1]

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        seen.append((id(attention_mask), attention_mask.shape[-1], key.shape[-2]))
        return round_attention(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(rounds_module, "round_mask", counting_mask)
    monkeypatch.setattr(adapter.rounds, "attention", recording_attention)  # what each round names as its attention
    rounds = list(_round_pairs(model, adapter, [1, 3, 5, 9], capacity=64))
    assert len(rounds) == 4
    assert len(seen) == 5 * 3  # every layer of every round (the prefill and four) attended through the round mask
    masks = {id(m) for m in built}  # the reference adapter's rounds build theirs with the same function
    for r in range(5):
        layers = seen[3 * r : 3 * (r + 1)]
        assert len({entry[0] for entry in layers}) == 1  # the one mask of that round, not a copy per layer
        assert layers[0][0] in masks
    width, capacity = seen[-1][1:]
    assert width == 256 and capacity == 1024 + MIN_CAPACITY  # the live width of the buffer is read, not its capacity


@pytest.mark.parametrize("bucketed", [True, False])
def test_a_round_inputs_are_views_of_one_staged_tensor(monkeypatch, bucketed: bool) -> None:
    """The ids, positions, logit rows, write slots, region bounds and visibility the round function reads are
    views of one tensor, staged once per round (on a CPU the eager round reads the host tensor itself; a device
    fills its staging buffer from it in one copy: ``test_compiled_round_inputs_arrive_in_one_copy``)."""
    model = tiny_model("llama")
    adapter = ModelAdapter(model, bucketed=bucketed)
    with job_region(adapter, 64) as cache:
        one_round(adapter, torch.arange(10), torch.arange(10), causal(10), cache, torch.tensor([9]))
        received = []
        real = adapter.rounds._round

        def recording(*args):
            received.append([a for a in args if isinstance(a, torch.Tensor)])
            return real(*args)

        monkeypatch.setattr(adapter.rounds, "_round", recording)
        staged = []
        real_stage = rounds_module.stage
        monkeypatch.setattr(rounds_module, "stage", lambda *a: staged.append(real_stage(*a)) or staged[-1])
        one_round(adapter, torch.arange(5), torch.arange(10, 15), causal(5), cache, torch.arange(5))
        assert len(staged) == len(received) == 1  # one staged tensor, one call of the round function
        storage = staged[0].untyped_storage().data_ptr()
        inputs = [t for t in received[0] if t.untyped_storage().data_ptr() == storage]
        assert len(inputs) == 7  # ids, positions, logit rows, write slots, cached from / to, visibility
        assert all(layer.write_slots.untyped_storage().data_ptr() == storage for layer in cache.arena.layers())
        assert inputs[2].numel() == (8 if bucketed else 5)  # logit rows: the bucket's, or the round's own


@pytest.mark.slow
def test_compiled_round_inputs_arrive_in_one_copy(monkeypatch) -> None:
    """A round that replays a graph reads its inputs from the bucket's static staging buffer, filled from the one
    staged host tensor (a dispatch mode cannot count the copy here: torch.compile refuses to run under one)."""
    model = tiny_model("llama")
    torch._dynamo.reset()
    adapter, _ = compiled_adapter(model)
    with job_region(adapter, 64) as cache:
        one_round(adapter, torch.arange(10), torch.arange(10), causal(10), cache, torch.tensor([9]))
        staging = adapter.rounds._staging(8, 8)
        staged = []
        real_stage = rounds_module.stage
        monkeypatch.setattr(rounds_module, "stage", lambda *a: staged.append(real_stage(*a)) or staged[-1])
        compiles = adapter.rounds.counts()[0]
        one_round(adapter, torch.arange(5), torch.arange(10, 15), causal(5), cache, torch.arange(5))
        assert len(staged) == 1 and torch.equal(staging.buffer, staged[0])  # its bytes, in the static buffer
        assert staging.buffer.data_ptr() != staged[0].data_ptr()
        assert all(layer.write_slots is staging.write_slots for layer in cache.arena.layers())
        assert adapter.rounds.counts()[0] == compiles  # replayed what the warm-up compiled


# ---------------------------------------------------------------------------------------- fixed addresses


def test_a_generation_region_never_moves_and_cannot_be_outrun() -> None:
    model = tiny_model("llama")
    adapter = ModelAdapter(model, bucketed=True)
    la = LookaheadConfig(window_size=4, ngram_size=3, verification_set_size=4)
    engine = LookaheadEngine(adapter, la, GenerationConfig(max_new_tokens=30), [])
    addresses = set()
    real = adapter.rounds.forward

    def recording(rounds, regions):
        addresses.add(tuple(layer.keys.data_ptr() for layer in regions[0].arena.layers()))
        return real(rounds, regions)

    adapter.rounds.forward = recording
    for seed in (1, 2):
        engine.generate(random_prompt(12, seed) * 2)
    assert len(addresses) == 1  # every round of both generations on the same arena
    with job_region(adapter, 10) as cache:
        rows = cache.size + 1
        with pytest.raises(KVCapacityError, match="past its generation's region"):
            one_round(
                adapter, torch.zeros(rows, dtype=torch.long), torch.arange(rows), causal(rows), cache, torch.tensor([0])
            )


def test_a_second_loop_at_once_gets_an_arena_of_its_own() -> None:
    """A second round loop alive at once (LP ranks on threads over one adapter) gets an arena of its own and the
    same results; the job arena goes to the next loop once handed back, also when the loop raised, its regions
    freed; a scratch region grows its own arena."""
    model = tiny_model("llama")
    adapter = ModelAdapter(model, bucketed=True)
    with job_region(adapter, 40) as first, job_region(adapter, 40) as second:
        assert first.arena is not second.arena
        tokens = torch.tensor(random_prompt(9, seed=1))
        a, b = (one_round(adapter, tokens, torch.arange(9), causal(9), c, torch.arange(9)) for c in (first, second))
        assert torch.equal(a, b)
    with pytest.raises(KeyError), job_region(adapter, 40) as third:  # a failed loop hands the arena back too
        assert third.arena is first.arena and third.base == first.base
        raise KeyError("a failed round")
    assert not first.arena.regions
    with job_region(adapter, 40) as fourth:
        assert fourth.arena is first.arena and fourth.base == first.base
    scratch = scratch_region(adapter)  # grows when outrun, like every scratch region
    one_round(adapter, torch.zeros(800, dtype=torch.long), torch.arange(800), causal(800), scratch, torch.tensor([0]))
    assert scratch.arena.growths == 1 and scratch.length == 800


# ------------------------------------------------------------------------------------------- compiled rounds


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2-hybrid"])
def test_compiled_rounds_one_graph_for_every_bucket_equal_eager_rounds(family: str) -> None:
    """Compiled (torch.compile, mode reduce-overhead, as on a GPU minus the capture): after the warm-up every bucket
    boundary at three K/V widths (the widest the power of two the arena is built on), two generations and a job
    arena grown between them run without a recompilation (``error_on_recompile``), each round with the eager static
    round's argmax; whole generations give HF greedy's tokens. The K/V arena and the staged inputs are marked static
    in address."""
    from torch._dynamo.utils import counters

    model = tiny_model(family)
    torch._dynamo.reset()
    counters.clear()
    compiled, warm_s = compiled_adapter(model, bucketed=True)
    eager = ModelAdapter(model, bucketed=True)
    assert warm_s > 0
    assert set(compiled.rounds.capture_s) == set(compiled.rounds.ladder.rows)
    with compiled.arena() as arena:
        first = arena.tensor
    for layer in arena.layers():
        assert layer.keys._dynamo_static_input_type == layer.values._dynamo_static_input_type == "unguarded"
    with torch._dynamo.config.patch(error_on_recompile=True):
        # K/V widths 256, 1024 and 2048, the second on a larger arena; at 1100 the widest width is the power of two
        # the arena is built on (a graph of its own while the arena was that power of two)
        for prefix_len in (40, 600, 1100):
            pairs = _pairs_compiled(model, compiled, eager, prefix_len)
            for rows, got, want in pairs:
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=f"{rows} rows after {prefix_len}")
                assert torch.equal(got.argmax(-1), want.argmax(-1)), (rows, prefix_len)
        assert arena.tensor is not first and arena.allocations == 2  # grown: no recompilation
        la = LookaheadConfig(window_size=4, ngram_size=3, verification_set_size=4)
        engine = LookaheadEngine(compiled, la, GenerationConfig(max_new_tokens=40), [])
        for seed in (3, 4):
            prompt = random_prompt(12, seed) * 2
            assert engine.generate(prompt).output_ids == hf_greedy(model, prompt, 40), seed
    assert counters["stats"]["unique_graphs"] == 1
    # every static input unguarded, whatever the torch's default (``guard=True`` before 2.10): a guard on a
    # staging buffer's or key-slot vector's identity would make each (bucket, width) pair a recompilation
    staged = [t for s in compiled.rounds._staged.values() for t in (s.input_ids, s.position_ids, s.logit_rows,
                                                                   s.write_slots, s.cached_from, s.cached_to,
                                                                   s.visibility)]  # fmt: skip
    assert len(compiled.rounds._key_slots) >= 2 and len(staged) == 7 * len(compiled.rounds.ladder.rows)
    for tensor in (*staged, *compiled.rounds._key_slots.values()):
        assert tensor._dynamo_static_input_type == "unguarded"


@pytest.mark.slow
def test_compiled_batched_rounds_are_the_same_graph_and_exact() -> None:
    """Rounds of several generations (``run.batch`` 3: prompts joining as others end, prefills riding with other
    generations' rounds) through the one compiled round function after its warm-up: no recompilation
    (``error_on_recompile``), one graph in all, every output HF greedy's."""
    from torch._dynamo.utils import counters

    from lp_runner.decoding.engine import Job

    model = tiny_model("qwen2-hybrid")
    torch._dynamo.reset()
    counters.clear()
    compiled = ModelAdapter(model, bucketed=True)
    la = LookaheadConfig(window_size=4, ngram_size=3, verification_set_size=4)
    engine = LookaheadEngine(compiled, la, GenerationConfig(max_new_tokens=30), [])
    prompts = [random_prompt(n, seed) * 2 for n, seed in ((12, 0), (3, 1), (20, 2), (7, 3), (9, 4))]
    compiled.compile([engine.capacity(max(map(len, prompts)))] * 3)  # the arena the job's loop claims
    done: dict = {}
    jobs = iter([Job(p, tag=i) for i, p in enumerate(prompts)])
    with torch._dynamo.config.patch(error_on_recompile=True):
        engine.run(lambda: next(jobs, None), lambda job, result: done.__setitem__(job.tag, result), batch=3)
    for i, prompt in enumerate(prompts):
        assert done[i].output_ids == hf_greedy(model, prompt, 30), i
    assert max(rec.batch_size for r in done.values() for rec in r.stats.records) == 3  # rounds were shared
    assert counters["stats"]["unique_graphs"] == 1
    with compiled.arena() as arena:
        assert arena.allocations == 1  # the job ran on the arena the warm-up recorded its graphs on


def test_warm_up_at_the_jobs_arena_is_the_arena_its_generations_run_on() -> None:
    """Warmed up at the job's need (``LookaheadEngine.capacity`` of its longest prompt, as the worker does), a
    generation of a long prompt runs on the arena the warm-up made (on a GPU, where its graphs were captured);
    warmed at a small arena, the same prompt grows it mid-job (every graph recorded again)."""
    model = tiny_model("llama", max_position_embeddings=2048)
    prompt = random_prompt(900, seed=5)
    la = LookaheadConfig(window_size=4, ngram_size=3, verification_set_size=4)
    for warm, allocations in ((None, 1), (64, 2)):
        adapter = ModelAdapter(model, bucketed=True)
        engine = LookaheadEngine(adapter, la, GenerationConfig(max_new_tokens=20), [])
        need = engine.capacity(len(prompt)) if warm is None else warm
        with adapter.arena([need]) as arena:
            adapter.rounds.warm_up(arena, arena.slots([need]), max_rows=4)
        assert engine.generate(prompt).output_ids == hf_greedy(model, prompt, 20)
        assert arena.allocations == allocations, warm


def _pairs_compiled(model, compiled: ModelAdapter, eager: ModelAdapter, prefix_len: int):
    prefix = random_prompt(prefix_len, seed=5)
    lent = contextlib.ExitStack()
    caches = {id(a): lent.enter_context(job_region(a, prefix_len + 40)) for a in (compiled, eager)}
    _prefill(prefix, (compiled, eager), caches)
    out = []
    for rows in BOUNDARIES:
        ids = torch.tensor(random_prompt(rows, seed=rows))
        positions = torch.arange(prefix_len, prefix_len + rows)
        got, want = (
            one_round(adapter, ids, positions, causal(rows), caches[id(adapter)], torch.arange(rows)).clone()
            for adapter in (compiled, eager)
        )
        out.append((rows, got, want))
        if rows > 2:  # a commit's row move on the job arena between rounds
            for adapter in (compiled, eager):
                caches[id(adapter)].move([prefix_len + rows - 1], [prefix_len])
        for adapter in (compiled, eager):
            caches[id(adapter)].crop(prefix_len)
    lent.close()
    return out

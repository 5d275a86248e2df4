"""Many prompts per forward (``run.batch``): exact per prompt, isolated per generation, under LP and D groups.

Oracles: HF greedy ``generate`` per prompt (fp32), each generation's own forward on its own cache (isolation),
the same prompt generated alone (sampling: its samples must not depend on its neighbours), an uninterrupted job
(kill and ``--resume``). Every exactness test also checks that generations really shared forwards and joined as
others finished, so none passes on a batch that never formed.
"""

from __future__ import annotations

import copy
import signal
import threading
from pathlib import Path

import pytest
import torch
from dist_helpers import (
    LocalGroup,
    complete_lines,
    hf_greedy_of,
    job_args,
    read_jsonl,
    run_job,
    start_job,
    stop,
    wait_for,
    write_prompts,
)
from helpers import hf_greedy, one_round, random_prompt, scratch_region, stand_in_builds, tiny_model

from lp_runner.backends.adapter import ModelAdapter, causal
from lp_runner.backends.cpu import native
from lp_runner.backends.cpu.prepack import KERNELS, native_unavailable_reason, prepack_linears
from lp_runner.backends.round_mask import round_mask
from lp_runner.backends.staging import StagedInputs, stage
from lp_runner.config import ConfigError, GenerationConfig, LookaheadConfig, load_config
from lp_runner.decoding.batch_round import batch_support
from lp_runner.decoding.engine import Job, LookaheadEngine
from lp_runner.decoding.layout import compile_round
from lp_runner.decoding.metrics import batch_figures
from lp_runner.models.loading import default_cache_dir
from lp_runner.parallel.exchange import Entry, agree_batch, winner
from lp_runner.tuning.costmodel import CostCurve, CurvePoint, batched_curve

NATIVE_REASON = native_unavailable_reason(torch.nn.Linear(2, 2), default_cache_dir())
needs_native = pytest.mark.skipif(NATIVE_REASON is not None, reason=f"no native kernel: {NATIVE_REASON}")
HIDDEN = torch.finfo(torch.float32).min

# mixed lengths: a 3-token prompt beside 40-token ones; more prompts than the batch, so some join as others end
PROMPT_SPECS = [(12, 0), (3, 1), (40, 2), (7, 3), (25, 4), (16, 5), (33, 6)]


def native_model(stock: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(stock)
    prepack_linears(model, kernel=KERNELS["native"])
    return model


def run_batch(engine: LookaheadEngine, prompts, batch: int, sample_keys=None) -> dict:
    """Every prompt's result by index, through ``engine.run`` with ``batch`` generations in flight."""
    jobs = iter(
        [Job(p, sample_key=None if sample_keys is None else sample_keys[i], tag=i) for i, p in enumerate(prompts)]
    )
    out: dict = {}
    engine.run(lambda: next(jobs, None), lambda job, result: out.__setitem__(job.tag, result), batch=batch)
    return out


def engine_for(model, max_new: int, eos=(), gen: GenerationConfig | None = None, **la) -> LookaheadEngine:
    lookahead = LookaheadConfig(**{"window_size": 4, "ngram_size": 3, "verification_set_size": 4, **la})
    return LookaheadEngine(ModelAdapter(model), lookahead, gen or GenerationConfig(max_new_tokens=max_new), list(eos))


def assert_batched(results: dict, batch: int) -> None:
    """Guards: forwards were shared (fewer forwards than rounds), and generations ended at different rounds."""
    rounds = sum(r.stats.rounds for r in results.values())
    forwards = sum(r.stats.forward_share for r in results.values())
    assert forwards < rounds - 1, (forwards, rounds)
    assert max(rec.batch_size for r in results.values() for rec in r.stats.records) == batch
    assert len({r.stats.rounds for r in results.values()}) > 1


# ---------------------------------------------------------------- the batched round's contract


def _staged(layouts, bases, pasts):
    """``stage`` of the rounds at their own rows and logit rows, with the K slots its mask reads (the live end)."""
    segments = list(zip(layouts, bases, pasts, strict=True))
    rows, logits = sum(len(la.tokens) for la in layouts), sum(len(la.logit_rows) for la in layouts)
    staged = StagedInputs.views(stage(rows, logits, segments), rows, logits)
    width = max(b + p + len(la.tokens) for la, b, p in segments)
    return staged, torch.arange(width)


def _mask(staged: StagedInputs, keys: torch.Tensor, window: int | None) -> torch.Tensor:  # [B, K] bool: seen
    inputs = (staged.visibility, staged.cached_from, staged.cached_to, staged.position_ids, staged.write_slots)
    return round_mask(*inputs, keys, window, torch.float32)[0, 0] == 0


def test_staging_worked_example() -> None:
    """backends.staging's docstring: A (past 5, live key + one candidate token) in slots 0.., B (past 3) in 64.."""
    a = compile_round([11], 5, [[]], (0, 0), [[12]])
    b = compile_round([21], 3, [[]], (0, 0), [])
    staged, keys = _staged([a, b], [0, 64], [5, 3])
    assert staged.input_ids.tolist() == [11, 12, 21]
    assert staged.position_ids.tolist() == [5, 6, 3]
    assert staged.write_slots.tolist() == [5, 6, 67]
    assert staged.cached_from.tolist() == [0, 0, 64] and staged.cached_to.tolist() == [5, 5, 67]
    assert staged.logit_rows.tolist() == [0, 1, 2]
    seen = _mask(staged, keys, None)
    assert [torch.nonzero(row).flatten().tolist() for row in seen] == [
        [0, 1, 2, 3, 4, 5],
        [0, 1, 2, 3, 4, 5, 6],
        [64, 65, 66, 67],
    ]  # each row its own region's prefix and rows, nothing of the other generation


def test_the_round_mask_sliding_window_is_per_row() -> None:
    """Window 3: the live key at position 4 sees keys 2..4; its candidate row at 5 loses key 2 as well."""
    a = compile_round([9], 4, [[]], (0, 0), [[8]])
    staged, keys = _staged([a], [16], [4])
    seen = _mask(staged, keys, 3)[:, 16:]
    assert seen.int().tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]]


def test_segment_table_worked_example() -> None:
    seg = native.SegmentTable.of([2, 3], [0, 512], [100, 40])
    assert (seg.start.tolist(), seg.moff.tolist(), seg.mask_size) == ([0, 2, 5], [0, 200], 320)


def test_arena_first_fit_compaction_and_growth(tiny) -> None:
    """kv_cache's docstring example, with the K/V carried through the compaction and the growth (every layer's
    views re-made on the grown arena)."""
    adapter = ModelAdapter(tiny("llama"))
    with adapter.arena() as arena:
        first, second = arena.region(96), arena.region(64)
        assert (arena.capacity, first.base, second.base) == (256, 0, 96)
        keys = arena.layers()[0].keys
        with torch.inference_mode():  # the arena is an inference tensor
            keys[:, :, 96:106] = torch.arange(10.0)[None, None, :, None]  # the second region's cached positions
        second.length = 10
        second.move([3], [9])  # queued: applied with every region's moves before the next forward
        assert keys[0, 0, 105, 0] == 9.0 and keys[0, 0, 99, 0] == 3.0
        arena.release(first)
        third = arena.region(128)
        assert (second.base, third.base, arena.compactions) == (0, 64, 1)
        assert arena.layers()[0].keys[0, 0, :10, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 3]  # carried, moved
        fourth = arena.region(128)
        assert (arena.capacity, fourth.base, arena.growths, arena.allocations) == (512, 192, 1, 2)
        assert arena.layers()[0].keys[0, 0, :10, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 3]
        assert second.keys(0)[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 3]
        assert all(layer.keys.data_ptr() == arena.tensor[i, 0].data_ptr() for i, layer in enumerate(arena.layers()))


def test_batched_curve_worked_example() -> None:
    curve = CostCurve(tuple(CurvePoint(0, q, ms / 1e3, ms / 1e3) for q, ms in ((1, 20), (8, 24), (16, 32), (48, 80))))
    per_generation = batched_curve(curve, 8)
    assert [round(1e3 * per_generation.seconds(q, 1), 6) for q in (1, 2, 6)] == [3.0, 4.0, 10.0]
    assert batched_curve(curve, 1) is curve


def test_batch_figures_worked_example() -> None:
    stats = [type("S", (), {"forward_share": 5.0, "batch_rows_share": 40.0})() for _ in range(2)]
    got = batch_figures(stats, {"rounds": 20, "new_tokens": 30})
    assert got == {
        "batched_forwards": 10.0,
        "generations_per_forward": 2.0,
        "rows_per_forward": 8.0,
        "job_tokens_per_forward": 3.0,
    }


def test_run_batch_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"run.batch must be >= 1 \(1: one prompt at a time\), got 0"):
        load_config(overrides=["run.batch=0"])


def test_one_all_gather_carries_every_generations_verdict() -> None:
    """Two ranks, three generations of different settings: one collective, fixed-size blocks, each generation
    decided on its own (greedy: longest hit, ties to the lowest rank), digests checked per generation."""
    group = LocalGroup(2)
    verdicts = {  # rank -> per generation (hits, emitted, candidate, columns)
        0: [(2, (5, 6, 7), 0, {0: 9}), (0, (3,), -1, {}), (1, (4, 4), 1, {})],
        1: [(1, (5, 8), 1, {2: 1}), (1, (3, 2), 0, {1: 5}), (1, (4, 1), 0, {})],
    }
    sizes = [(4, 3), (11, 1), (4, 6)]  # (max_emit, window) per generation: blocks of 4 + 11 + 6
    out: dict = {}

    def rank(r: int) -> None:
        comm = group.comm(r)
        entries = [Entry(100 + k, *verdicts[r][k], *sizes[k], winner) for k in range(3)]
        out[r] = (agree_batch(comm, entries), comm.collectives)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r in range(2):
        decisions, collectives = out[r]
        assert collectives == 1
        assert [(d.rank, d.emitted, d.candidate) for d in decisions] == [
            (0, (5, 6, 7), 0),
            (1, (3, 2), 0),
            (0, (4, 4), 1),
        ]
        assert [d.won for d in decisions] == [r == 0, r == 1, r == 0]
        assert decisions[0].columns == {0: 9, 2: 1} and decisions[1].columns == {1: 5}
    solo = agree_batch(None, [Entry(1, *verdicts[0][0], 4, 3, winner)])
    assert solo[0].emitted == (5, 6, 7) and solo[0].won and solo[0].comm_s == 0.0


# ---------------------------------------------------------------- isolation: no row sees another generation's keys


@needs_native
def test_native_attention_reads_only_its_own_segment() -> None:
    """Three segments over one buffer whose other slots hold NaN: each segment's rows give what a call of that
    segment alone gives, bit for bit (a row that read one foreign key would be NaN)."""
    gen = torch.Generator().manual_seed(0)
    heads, groups, dim, capacity = 3, 3, 64, 200
    rows, bases, widths = [2, 1, 4], [0, 64, 150], [20, 9, 45]
    keys = torch.full((heads, capacity, dim), float("nan"))
    values = torch.full((heads, capacity, dim), float("nan"))
    masks = []
    for r, b, w in zip(rows, bases, widths, strict=True):
        keys[:, b : b + w] = torch.randn(heads, w, dim, generator=gen)
        values[:, b : b + w] = torch.randn(heads, w, dim, generator=gen)
        m = torch.zeros(r, w).masked_fill(torch.rand(r, w, generator=gen) < 0.3, HIDDEN)
        m[:, 0] = 0.0
        masks.append(m)
    q_rows = sum(rows)
    query = torch.randn(heads, groups * q_rows, dim, generator=gen)
    segments = native.SegmentTable.of(rows, bases, widths)
    out = native.attention_segments(query, keys, values, torch.cat([m.reshape(-1) for m in masks]), 0.125, segments)
    assert torch.isfinite(out).all()
    first = 0
    for r, b, w, m in zip(rows, bases, widths, masks, strict=True):
        own = query.view(heads, groups, q_rows, dim)[:, :, first : first + r].reshape(heads, groups * r, dim)
        alone = native.attention(own, keys[:, b : b + w], values[:, b : b + w], m, 0.125)
        got = out.view(heads, groups, q_rows, dim)[:, :, first : first + r].reshape(heads, groups * r, dim)
        assert torch.equal(got, alone)
        first += r


@pytest.mark.parametrize("path", ["transformers", pytest.param("native", marks=needs_native), "bucketed"])
@pytest.mark.parametrize("family", ["llama", "qwen2-hybrid"])
def test_batched_round_equals_isolated_forwards(path: str, family: str) -> None:
    """Three generations with cached prefixes of 30, 5 and 17 positions, then one batched round of ordinary,
    lookahead and verification rows: every logit equals the generation's own forward on its own cache (native:
    bit for bit), and the K/V written lands in its own region only. The arena's other slots hold NaN where a row
    reads its own region's slots only (the native layers: a row that attended to any key outside its region would
    poison its logits); transformers' layers read the live width under the round's mask, so there they hold large
    finite garbage, which a row that saw it would turn into other logits."""
    stock = tiny_model(family)
    model = native_model(stock) if path == "native" else stock
    adapter = ModelAdapter(model, bucketed=path == "bucketed")
    assert (adapter.backend.whole_layers > 0) == (path == "native")
    with adapter.arena([64] * 3) as arena:
        poison = float("nan") if path == "native" else 1e4
        with torch.inference_mode():  # the arena is an inference tensor
            arena.tensor.fill_(poison)
        gen = torch.Generator().manual_seed(7)
        prefixes = [random_prompt(n, seed=10 + n) for n in (30, 5, 17)]
        regions = [arena.region(64) for _ in prefixes]
        own = [scratch_region(adapter, 64) for _ in prefixes]
        prefill = [compile_round(p, 0, [[]], (0, 0), []) for p in prefixes]
        adapter.run(prefill, regions)
        for p, cache in zip(prefixes, own, strict=True):
            one_round(adapter, torch.tensor(p), torch.arange(len(p)), causal(len(p)), cache, torch.tensor([len(p) - 1]))
        levels = [
            torch.randint(0, 90, (3,), generator=gen).tolist(),
            torch.randint(0, 90, (4,), generator=gen).tolist(),
        ]
        layouts = [
            compile_round(prefixes[0][-1:] * 2, 29, [[]], (0, 0), [[1, 2, 3], [4]]),  # two ordinary rows (a re-feed)
            compile_round(prefixes[1][-1:], 5, levels, (0, 4), [[7, 8]]),  # the window's rows and a candidate
            compile_round(prefixes[2][-1:], 17, [[]], (0, 0), []),  # the live key alone
        ]
        past = [29, 5, 17]
        own[0].crop(29)  # the first re-feeds its last cached position
        regions[0].crop(29)
        got = adapter.run(layouts, regions).split([len(layout.logit_rows) for layout in layouts])
        for b, (layout, cache) in enumerate(zip(layouts, own, strict=True)):
            alone = one_round(
                adapter, layout.input_ids, layout.position_ids, layout.visibility, cache, layout.logit_rows
            )
            assert torch.isfinite(got[b]).all(), b
            if path == "native":
                assert torch.equal(got[b], alone), b
            else:
                torch.testing.assert_close(got[b], alone, rtol=1e-5, atol=1e-5)
            end = past[b] + layout.num_rows
            for i, layer in enumerate(arena.layers()):
                torch.testing.assert_close(regions[b].keys(i), cache.keys(i), rtol=1e-5, atol=1e-5)
                assert regions[b].length == end
                if path != "bucketed":  # a bucketed round's fillers write past the last segment's rows
                    untouched = layer.keys[:, :, regions[b].base + end : regions[b].base + 64]
                    assert (torch.isnan(untouched) if path == "native" else untouched == poison).all()


def test_probe_refuses_a_model_that_attends_across_generations(monkeypatch) -> None:
    """``batch_round.batch_support`` compares a batched round with separate forwards: masks that let the second
    generation see the first's keys are caught (the run then keeps one prompt at a time)."""
    import lp_runner.backends.rounds as rounds_module

    def leaky(visibility, cached_from, *rest):  # every row also sees every slot below its own region
        return round_mask(visibility, torch.zeros_like(cached_from), *rest)

    adapter = ModelAdapter(tiny_model("llama"))
    monkeypatch.setattr(rounds_module, "round_mask", leaky)
    assert "differ from separate forwards" in batch_support(adapter)
    assert batch_support(ModelAdapter(tiny_model("llama"))) is not None  # the same leak, another adapter
    monkeypatch.undo()
    assert batch_support(ModelAdapter(tiny_model("llama"))) is None


# ---------------------------------------------------------------- exact per prompt


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "mistral-sliding", "qwen2-hybrid"])
@pytest.mark.parametrize("path", ["transformers", pytest.param("native", marks=needs_native), "bucketed"])
def test_batch_outputs_equal_hf_greedy_per_prompt(family: str, path: str) -> None:
    """Seven prompts of 3 to 40 tokens, three in flight: each output equals HF greedy on its own prompt; some stop
    at an EOS (a frequent token of the model's output), so generations end at different rounds and the next
    prompt joins mid-flight."""
    stock = tiny_model(family)
    model = native_model(stock) if path == "native" else stock
    prompts = [random_prompt(n, seed) for n, seed in PROMPT_SPECS]
    eos = [hf_greedy(stock, prompts[0], 30)[20]]  # a token the model does emit: some generations end early
    expected = [hf_greedy(stock, p, 30, eos_ids=eos) for p in prompts]
    assert len({len(e) for e in expected}) > 1  # guard: EOS cut some generations short
    engine = engine_for(model, 30, eos)
    if path == "bucketed":  # a GPU's path (eager here): every round of the batch at a row bucket, one mask
        engine.adapter = ModelAdapter(model, bucketed=True)
    results = run_batch(engine, prompts, 3)
    for i in range(len(prompts)):
        assert results[i].output_ids == expected[i], (family, path, i)
    assert_batched(results, 3)
    assert sum(r.stats.accepted_tokens for r in results.values()) > 0  # candidates were verified and accepted


def test_batch_with_the_job_store_and_window_off_is_exact(tiny) -> None:
    """``pool_scope: job`` (the default) with the window off, as the auto preset's usual choice: finished
    generations feed the store while others are in flight; every output is still HF greedy's."""
    stock = tiny("llama")
    prompts = [random_prompt(n, seed) for n, seed in PROMPT_SPECS] * 2  # repeats: the store's outputs recur
    expected = [hf_greedy(stock, p, 24) for p in prompts]
    engine = engine_for(stock, 24, lookahead_branch=False, verification_set_size=2)
    results = run_batch(engine, prompts, 4)
    assert [results[i].output_ids for i in range(len(prompts))] == expected
    assert sum(r.stats.sources.get("job", {}).get("accepted", 0) for r in results.values()) > 0  # the store helped
    assert engine.store.generations == len(prompts)


def test_embedded_batch_equals_hf_greedy(embedded, humaneval) -> None:
    """The embedded model on its default CPU path (native products and layers): code and chat prompts, three in
    flight, as the runner builds the engine."""
    from helpers import code_and_chat_ids

    from lp_runner.backends.cpu.prepack import apply_prepack

    model, tok = embedded
    packed = copy.deepcopy(model)
    apply_prepack(packed, "auto", default_cache_dir())
    prompts = code_and_chat_ids(tok, humaneval(3), "Name three uses of a hash map.")
    expected = [hf_greedy(model, p, 40, eos_ids=[tok.eos_token_id]) for p in prompts]
    engine = LookaheadEngine(
        ModelAdapter(packed), LookaheadConfig(lookahead_branch=False, verification_set_size=2),
        GenerationConfig(max_new_tokens=40), [tok.eos_token_id],
    )  # fmt: skip
    results = run_batch(engine, prompts, 3)
    assert [results[i].output_ids for i in range(len(prompts))] == expected
    assert max(rec.batch_size for r in results.values() for rec in r.stats.records) == 3


@needs_native
def test_a_batch_of_one_equals_the_plain_path() -> None:
    """One prompt through the batched forward (its region of a slot cache, the segments' C call) gives the rounds
    the plain path gives (its own cache): the same tokens, rounds, rows and padding, round by round."""
    model = native_model(tiny_model("llama"))
    prompt = random_prompt(20, 9)
    plain = engine_for(model, 40).generate(prompt)
    batched = run_batch(engine_for(model, 40), [prompt], 2)[0]
    assert batched.output_ids == plain.output_ids
    fields = ("rows", "padded_rows", "hits", "emitted", "past_len", "plan_candidates", "winner_candidate")
    assert [[getattr(r, f) for f in fields] for r in batched.stats.records] == [
        [getattr(r, f) for f in fields] for r in plain.stats.records
    ]


@pytest.mark.parametrize("world_size", [2, 3])
def test_lp_batch_in_one_process_is_exact(world_size: int) -> None:
    """P ranks on threads, three generations in flight each: every rank's outputs equal HF greedy, one collective
    per round for the whole batch (each generation counts every round it was in), identical decisions."""
    stock = tiny_model("llama")
    prompts = [random_prompt(n, seed) for n, seed in PROMPT_SPECS[:5]]
    expected = [hf_greedy(stock, p, 32) for p in prompts]
    group = LocalGroup(world_size)
    la = LookaheadConfig(window_size=5, ngram_size=4, verification_set_size=5)

    def work(rank: int) -> tuple:
        replica = copy.deepcopy(stock)  # each rank its own model, as each process has (an adapter switches its
        # config's attention implementation during a forward)
        engine = LookaheadEngine(ModelAdapter(replica), la, GenerationConfig(max_new_tokens=32), [], group.comm(rank))
        return run_batch(engine, prompts, 3), engine.comm.collectives

    results = group.run_ranks(work, timeout=300)
    forwards = None
    for by_index, collectives in results:
        assert [by_index[i].output_ids for i in range(len(prompts))] == expected
        assert all(r.stats.collectives == r.stats.rounds for r in by_index.values())
        shared = round(sum(r.stats.forward_share for r in by_index.values()))
        # one all_gather per batched round, whatever the batch, and one per generation (its ranks' rows)
        assert collectives == shared + len(prompts)
        forwards = shared if forwards is None else forwards
        assert shared == forwards
        assert_batched(by_index, 3)
    wins = [[rec.winner_rank for rec in results[0][0][i].stats.records] for i in range(len(prompts))]
    assert any(w != 0 for ws in wins for w in ws)  # ranks other than 0 won rounds: their tokens were adopted


# ---------------------------------------------------------------- sampling


@needs_native
def test_samples_of_a_prompt_do_not_depend_on_its_batch_neighbours() -> None:
    """Sampling keyed by prompt id: each prompt's samples alone (one at a time) equal its samples among
    neighbours, whichever neighbours (two different batches). Native rounds give every row the bits it gets
    alone, so the draws meet the same probabilities."""
    model = native_model(tiny_model("llama"))
    gen = GenerationConfig(max_new_tokens=24, do_sample=True, seed=5, temperature=0.8, top_k=40)
    prompts = [random_prompt(n, seed) for n, seed in PROMPT_SPECS]
    keys = [f"id:p{i}" for i in range(len(prompts))]
    alone = [
        engine_for(model, 24, gen=gen).generate(p, sample_key=k).output_ids for p, k in zip(prompts, keys, strict=True)
    ]
    together = run_batch(engine_for(model, 24, gen=gen), prompts, 3, keys)
    assert [together[i].output_ids for i in range(len(prompts))] == alone
    order = [6, 2, 4, 0]  # other neighbours, another order
    others = run_batch(engine_for(model, 24, gen=gen), [prompts[i] for i in order], 4, [keys[i] for i in order])
    assert [others[k].output_ids for k in range(len(order))] == [alone[i] for i in order]
    assert_batched(together, 3)
    assert any(
        out != hf_greedy(tiny_model("llama"), p, 24) for out, p in zip(alone, prompts, strict=True)
    )  # really sampled


# ---------------------------------------------------------------- real processes: LP, D groups, kill and resume


def cli_args(model: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return job_args(model, prompts, out, "--set", "parallel.timeout_s=60", *extra, max_new_tokens=24)


def by_id(path: Path) -> dict[str, list[int]]:
    return {r["id"]: r["output_ids"] for r in read_jsonl(path)}


@pytest.mark.slow
def test_lp_two_ranks_batch_three_under_torchrun(tiny_dir: Path, tmp_path: Path) -> None:
    """P = 2 ranks (gloo) with three generations in flight equal one process one prompt at a time, and HF greedy."""
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": f"Item {i}: the list"} for i in range(6)])
    run_job(cli_args(tiny_dir, prompts, tmp_path / "one.jsonl"), timeout=600)
    proc = run_job(cli_args(tiny_dir, prompts, tmp_path / "lp.jsonl", "--set", "run.batch=3"), torchrun=2, timeout=600)
    assert by_id(tmp_path / "lp.jsonl") == by_id(tmp_path / "one.jsonl")
    records = read_jsonl(tmp_path / "lp.jsonl")
    assert all(r["workers"] == 2 and r["stats"]["collectives"] == r["stats"]["rounds"] for r in records)
    assert max(r["stats"]["rounds"] / r["stats"]["forward_share"] for r in records) > 1.5  # forwards were shared
    assert "batch 3: " in proc.stderr
    for r in records:
        assert r["output_ids"] == hf_greedy_of(tiny_dir, r["prompt_ids"], 24), r["id"]


@pytest.mark.slow
def test_groups_batch_their_own_generations(tiny_dir: Path, tmp_path: Path) -> None:
    """D = 2 groups of P = 1, each with two generations in flight from the job's queue: the outputs of one
    process one prompt at a time."""
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": f"Item {i}: and"} for i in range(7)])
    run_job(cli_args(tiny_dir, prompts, tmp_path / "one.jsonl"), timeout=600)
    extra = ("--set", "parallel.groups=2", "--set", "run.batch=2")
    run_job(cli_args(tiny_dir, prompts, tmp_path / "d2.jsonl", *extra), torchrun=2, timeout=600)
    assert by_id(tmp_path / "d2.jsonl") == by_id(tmp_path / "one.jsonl")
    records = read_jsonl(tmp_path / "d2.jsonl")
    assert {r["group"] for r in records} == {0, 1}
    assert max(r["stats"]["rounds"] / r["stats"]["forward_share"] for r in records) > 1.5


@pytest.mark.slow
def test_killed_batched_job_resumes_to_the_uninterrupted_output(tiny_dir: Path, tmp_path: Path) -> None:
    """A batched job (four in flight) killed after its first records, then ``--resume``d (batched again): every
    prompt's output equals the uninterrupted batched job's, and one prompt at a time's; nothing twice."""
    prompts = write_prompts(
        tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": f"Item {i}: the list goes on and"} for i in range(40)]
    )
    batch = ("--set", "run.batch=4")
    run_job(cli_args(tiny_dir, prompts, tmp_path / "ref.jsonl", *batch), timeout=600)
    run_job(cli_args(tiny_dir, prompts, tmp_path / "one.jsonl"), timeout=600)
    out = tmp_path / "o.jsonl"
    args = cli_args(tiny_dir, prompts, out, *batch)
    run = start_job(args)
    try:
        wait_for(lambda: complete_lines(out) >= 2, 300, run)  # the job under way: two records written
        run.send_signal(signal.SIGKILL)
        run.wait(60)
    finally:
        stop(run)
    kept = complete_lines(out)
    assert 1 <= kept < 40
    resumed = run_job([*args, "--resume"], timeout=600)
    assert f"skipped: {kept} already in the output (--resume)" in resumed.stderr
    records = read_jsonl(out)
    assert len(records) == 40 and len({r["id"] for r in records}) == 40
    assert by_id(out) == by_id(tmp_path / "ref.jsonl") == by_id(tmp_path / "one.jsonl")


def test_auto_preset_spends_fewer_speculative_rows_per_generation_as_the_batch_grows() -> None:
    """On a curve flat to 8 rows and steep after (this project's 2-thread CPU curve, rounded), the auto preset
    priced on a batch's share of each forward verifies fewer rows per generation and round at batch 4 and 16 than
    one prompt at a time, and its predicted job throughput grows with the batch."""
    from lp_runner.tuning.acceptance import shipped_prior
    from lp_runner.tuning.costmodel import RowPlan
    from lp_runner.tuning.preset import AutoPreset, simulate

    ms = {1: 23, 2: 23, 4: 25, 8: 30, 12: 30, 16: 33, 24: 45, 32: 57, 48: 78}
    curve = CostCurve(tuple(CurvePoint(kv, q, t / 1e3, t / 1e3 + q * 1e-4) for kv in (64, 512) for q, t in ms.items()))
    samples = shipped_prior().samples

    def verify_rows_per_round(la: LookaheadConfig) -> float:
        shapes = [s for sample in samples for s in simulate(la, sample)]
        return sum(sum(s.candidates) for s in shapes) / len(shapes)

    rows, throughput = {}, {}
    for batch in (1, 4, 16):
        plan = RowPlan.from_curve(curve) if batch == 1 else RowPlan.identity()
        auto = AutoPreset(LookaheadConfig(), (), batched_curve(curve, batch), plan, batch=batch, prior=shipped_prior())
        rows[batch] = verify_rows_per_round(auto.lookahead)
        throughput[batch] = 1e3 / auto.choice.predicted_ms_per_token  # the job's tokens/s: ms are a batch's share
    assert rows[1] > rows[4] > rows[16] or rows[1] > rows[4] == rows[16] == 0, rows
    assert throughput[1] < throughput[4] < throughput[16], throughput


@needs_native
@pytest.mark.parametrize("build", list(stand_in_builds()) or ["none"])
def test_segment_attention_on_each_build(build: str, native_routing) -> None:
    """The attention over segments built for the instruction sets this CPU stands in for (AVX2, SSE2): each
    segment's rows equal a call of that segment alone on the same build, and the default build's bits where the
    builds share them (FMA builds); head sizes of the vector and scalar paths."""
    builds = stand_in_builds()
    if build not in builds:
        pytest.skip("this CPU stands in for no other instruction set")
    flags, bitwise = builds[build]
    gen = torch.Generator().manual_seed(3)
    for dim in (64, 40):
        rows, bases, widths = [3, 1, 2], [0, 40, 90], [30, 17, 25]
        keys, values = (torch.randn(2, 128, dim, generator=gen) for _ in range(2))
        masks = [
            torch.zeros(r, w).masked_fill(torch.rand(r, w, generator=gen) < 0.3, HIDDEN)
            for r, w in zip(rows, widths, strict=True)
        ]
        for m in masks:
            m[:, 0] = 0.0
        query = torch.randn(2, 3 * sum(rows), dim, generator=gen)
        flat, segments = torch.cat([m.reshape(-1) for m in masks]), native.SegmentTable.of(rows, bases, widths)
        out = {}
        for name in ("default", build):
            native.route(native.library(str(default_cache_dir()), () if name == "default" else flags))
            out[name] = native.attention_segments(query, keys, values, flat, dim**-0.5, segments)
            first = 0
            for r, b, w, m in zip(rows, bases, widths, masks, strict=True):
                own = query.view(2, 3, sum(rows), dim)[:, :, first : first + r].reshape(2, 3 * r, dim)
                alone = native.attention(own, keys[:, b : b + w], values[:, b : b + w], m, dim**-0.5)
                got = out[name].view(2, 3, sum(rows), dim)[:, :, first : first + r].reshape(2, 3 * r, dim)
                assert torch.equal(got, alone), (name, dim)
                first += r
        if bitwise:
            assert torch.equal(out[build], out["default"]), dim

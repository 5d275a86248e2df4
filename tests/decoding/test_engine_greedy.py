"""The top-level property: lookahead decoding emits exactly the tokens of HF greedy ``generate``.

Tiny random models of three families, a (W, N, G) grid that includes the edges (G = 0: nothing to verify; N = 3:
one trajectory level; W = 1: a single column), prompt-seeded pools on and off, and three candidate-source modes
(``MODES``). Each test also proves it did not pass vacuously: candidates were verified and accepted, EOS fell
inside an accepted run, the budget cut one.
"""

from __future__ import annotations

import functools

import pytest
from helpers import FAMILIES, hf_greedy, make_engine, random_prompt, run_lookahead, shared_tiny_model, tiny_model
from transformers import Cache

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.config import LookaheadConfig
from lp_runner.errors import ConfigError, InputError

GRID = [(1, 3, 0), (1, 3, 2), (2, 3, 1), (4, 3, 4), (5, 4, 5), (7, 5, 7), (3, 6, 3), (15, 5, 15)]  # (W, N, G)
PROMPT_SEEDS = (0, 1, 2)
PROMPT_LEN = 12
NEW_TOKENS = 40

# Candidate sources (LookaheadConfig fields beyond W, N, G, pool_from_prompt):
MODES = {
    # the published algorithm: Jacobi window + n-gram pool only (no context lookup, no pool repair from the output)
    "jacobi": {"context_lookup": False, "pool_from_output": False, "pool_scope": "prompt"},  # no job store
    # the runner's defaults: context lookup and pool repair on top
    "default": {},
    # no window rows at all: pool and context lookup only (prompt-lookup style)
    "no_branch": {"lookahead_branch": False},
}


@functools.cache
def oracle(family: str, seed: int, max_new_tokens: int = NEW_TOKENS, eos: tuple[int, ...] = ()) -> list[int]:
    return hf_greedy(shared_tiny_model(family), random_prompt(PROMPT_LEN, seed), max_new_tokens, eos)


def check_grid_point(model, family: str, W: int, N: int, G: int, mode: str) -> tuple[int, int]:
    """Every prompt and pool_from_prompt setting must equal the oracle; returns (accepted, verified) totals."""
    accepted = verified = 0
    for pool_from_prompt in (True, False):
        for seed in PROMPT_SEEDS:
            prompt = random_prompt(PROMPT_LEN, seed)
            result = run_lookahead(model, prompt, W, N, G, pool_from_prompt, NEW_TOKENS, **MODES[mode])
            expected = oracle(family, seed)
            where = f"{family} {mode} W={W} N={N} G={G} pool_from_prompt={pool_from_prompt} prompt {seed}"
            assert result.output_ids == expected, where
            stats = result.stats
            assert stats.new_tokens == len(result.output_ids) == NEW_TOKENS
            assert stats.forwards == stats.rounds == len(stats.records)
            accepted += stats.accepted_tokens
            verified += stats.verified_rounds
    if G == 0:
        assert accepted == verified == 0  # nothing can be verified without candidates
    return accepted, verified


@pytest.mark.parametrize("mode", ["jacobi", "default"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("W", "N", "G"), GRID, ids=[f"W{w}-N{n}-G{g}" for w, n, g in GRID])
def test_matches_greedy(tiny, family: str, W: int, N: int, G: int, mode: str) -> None:
    accepted, verified = check_grid_point(tiny(family), family, W, N, G, mode)
    if G > 0:
        # guard: this configuration really verified and accepted candidates on these repetitive models
        assert verified > 0
        assert accepted > 0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("W", "N", "G"), [(1, 3, 2), (5, 4, 5), (7, 5, 7)], ids=["W1-N3-G2", "W5-N4-G5", "W7-N5-G7"])
def test_matches_greedy_without_lookahead_branch(tiny, family: str, W: int, N: int, G: int) -> None:
    accepted, verified = check_grid_point(tiny(family), family, W, N, G, "no_branch")
    assert verified > 0 and accepted > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_jacobi_trajectories_alone_produce_accepted_tokens(tiny, family: str) -> None:
    # no prompt seeding, no context lookup, no repair from the output: every candidate is a trajectory n-gram
    model = tiny(family)
    accepted = 0
    for seed in PROMPT_SEEDS:
        prompt = random_prompt(PROMPT_LEN, seed)
        result = run_lookahead(model, prompt, 5, 4, 5, False, NEW_TOKENS, **MODES["jacobi"])
        assert result.output_ids == oracle(family, seed)
        assert set(result.stats.sources) <= {"pool"}
        accepted += result.stats.accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("k", [0, 1, 5, NEW_TOKENS - 1, NEW_TOKENS])
def test_resumed_generation_ends_as_an_uninterrupted_one(tiny, k: int) -> None:
    # generate(..., committed=first k tokens) re-prefills them and returns the whole output
    model = tiny("llama")
    engine = make_engine(model, 7, 5, 7, True, NEW_TOKENS)
    expected = oracle("llama", 1)
    result = engine.generate(random_prompt(PROMPT_LEN, 1), committed=expected[:k])
    assert result.output_ids == expected
    assert result.stats.new_tokens == NEW_TOKENS - k  # only the tokens this call produced


def test_engine_is_reusable_across_prompts(tiny) -> None:
    # the runner builds one engine per run: no state may leak from one prompt to the next
    model = tiny("qwen2")
    engine = make_engine(model, 5, 4, 5, True, NEW_TOKENS)
    for seed in (2, 0, 2, 1):
        assert engine.generate(random_prompt(PROMPT_LEN, seed)).output_ids == oracle("qwen2", seed)


def test_on_commit_streams_the_output_in_order(tiny) -> None:
    model = tiny("llama")
    engine = make_engine(model, 7, 5, 7, True, NEW_TOKENS)
    chunks: list[list[int]] = []
    result = engine.generate(random_prompt(PROMPT_LEN, 1), on_commit=lambda toks: chunks.append(list(toks)))
    assert [t for c in chunks for t in c] == result.output_ids == oracle("llama", 1)
    assert len(chunks) == result.stats.rounds
    assert max(len(c) for c in chunks) > 1  # some round committed several tokens at once


@pytest.mark.parametrize("family", FAMILIES)
def test_eos_inside_an_accepted_run_ends_output_there(tiny, family: str) -> None:
    """EOS = a token first produced at step k of the greedy output: the output is the oracle's, cut after k."""
    model = tiny(family)
    cut_inside_run = 0
    tried = 0
    for seed in PROMPT_SEEDS:
        prompt = random_prompt(PROMPT_LEN, seed)
        full = oracle(family, seed)
        firsts = [k for k in range(3, NEW_TOKENS - 1) if full.index(full[k]) == k][:6]
        for k in firsts:
            eos = full[k]
            expected = hf_greedy(model, prompt, NEW_TOKENS, [eos])
            assert expected == full[: k + 1]  # the oracle itself stops at the first EOS, EOS included
            for W, N, G in [(5, 4, 5), (7, 5, 7), (4, 3, 4)]:
                result = run_lookahead(model, prompt, W, N, G, True, NEW_TOKENS, [eos])
                assert result.output_ids == expected, f"seed {seed} eos {eos} W={W} N={N} G={G}"
                last = result.stats.records[-1]
                tried += 1
                if last.hits > 0 and last.hits + 1 > last.emitted:
                    cut_inside_run += 1  # the round accepted tokens past the EOS and dropped them
    assert tried > 20
    assert cut_inside_run > 0, "no EOS fell inside an accepted run: the test would pass vacuously"


@pytest.mark.parametrize("family", FAMILIES)
def test_max_new_tokens_is_never_exceeded(tiny, family: str) -> None:
    model = tiny(family)
    cut_by_budget = 0
    for budget in (1, 2, 3, 7, 13):
        for seed in PROMPT_SEEDS:
            prompt = random_prompt(PROMPT_LEN, seed)
            expected = oracle(family, seed)[:budget]
            for W, N, G in [(1, 3, 0), (5, 4, 5), (7, 5, 7), (15, 5, 15)]:
                result = run_lookahead(model, prompt, W, N, G, True, budget)
                assert result.output_ids == expected, f"budget {budget} seed {seed} W={W} N={N} G={G}"
                assert result.stats.new_tokens == budget
                assert result.stats.forwards <= budget  # every forward commits at least one token
                last = result.stats.records[-1]
                if last.hits + 1 > last.emitted:
                    cut_by_budget += 1
    assert cut_by_budget > 0, "the budget never cut an accepted run: the test would pass vacuously"


# ---------------------------------------------------------------------------------------------------------
# Failures


class Boom(RuntimeError):
    pass


def layer_lengths(cache: Cache) -> list[int]:
    return [layer.keys.shape[-2] if layer.is_initialized else 0 for layer in cache.layers]


class CacheSpy:
    """A forward pre-hook for a decoder layer: records the cache it is handed and every layer's length then."""

    def __init__(self) -> None:
        self.calls: list[tuple[Cache, list[int]]] = []

    def __call__(self, module, args, kwargs) -> None:
        caches = [v for v in (*args, *kwargs.values()) if isinstance(v, Cache)]
        assert len(caches) == 1, "the decoder layer is expected to receive the cache"
        self.calls.append((caches[0], layer_lengths(caches[0])))


def fail_when(spy: CacheSpy, round_index: int):
    """A forward pre-hook that raises once ``spy`` has seen ``round_index`` forwards (i.e. in that round)."""

    def hook(module, *_) -> None:
        if len(spy.calls) == round_index:
            raise Boom(f"injected failure in round {round_index}")

    return hook


@pytest.mark.parametrize("layer", [0, 1])
def test_failed_round_leaves_no_trace_on_a_fresh_generate(layer: int) -> None:
    model = tiny_model("mistral")  # a model of its own: a hook must not leak into other tests
    prompt = random_prompt(PROMPT_LEN, 0)
    expected = hf_greedy(model, prompt, NEW_TOKENS)
    engine = make_engine(model, 5, 4, 5, True, NEW_TOKENS)
    spy = CacheSpy()
    handles = [
        model.model.layers[0].register_forward_pre_hook(spy, with_kwargs=True),
        model.model.layers[layer].register_forward_pre_hook(fail_when(spy, 6)),  # after the spy when layer = 0
    ]
    try:
        with pytest.raises(Boom):
            engine.generate(prompt)
    finally:
        for h in handles:
            h.remove()
    assert len(spy.calls) == 6  # the failure hit round 6, after several committed rounds
    result = engine.generate(prompt)  # the same engine object
    assert result.output_ids == expected
    assert result.stats.accepted_tokens > 0


@pytest.mark.parametrize(
    "where",
    [
        "lm_head",  # every layer already wrote this round's K/V
        "layer1",  # layer 0 wrote this round's K/V, layer 1 did not
    ],
)
def test_failed_round_restores_the_cache(where: str) -> None:
    """DESIGN: 'a failure inside a round leaves output, cache, window and pool as they were'.

    A spy on the adapter's one forward records each round's K/V regions and their lengths when it started; after
    the failure the region holds the committed prefix again (the round's rows written past it are overwritten by
    the next), its slots are free and the job arena is back with the adapter for the next run."""
    model = tiny_model("llama")
    engine = make_engine(model, 5, 4, 5, True, NEW_TOKENS)
    calls: list[list[tuple[object, int]]] = []
    run = engine.adapter.run

    def spy(rounds, regions):
        calls.append([(region, region.length) for region in regions])
        return run(rounds, regions)

    def fail_in_round_6(module, *_) -> None:
        if len(calls) == 6:
            raise Boom("injected failure in round 6")

    engine.adapter.run = spy
    failing = model.lm_head if where == "lm_head" else model.model.layers[1]
    handle = failing.register_forward_pre_hook(fail_in_round_6)
    try:
        with pytest.raises(Boom):
            engine.generate(random_prompt(PROMPT_LEN, 0))
    finally:
        handle.remove()
        del engine.adapter.run
    ((region, length_at_start),) = calls[-1]
    assert length_at_start > PROMPT_LEN  # the failing round was not the prefill
    assert region.length == length_at_start
    assert region not in region.arena.regions  # its slots are free
    with engine.adapter.arena() as arena:
        assert arena is region.arena  # handed back to the adapter: the next run reuses it


@pytest.mark.parametrize(
    ("family", "window"),
    [
        ("mistral", {"sliding_window": 8}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
    ],
    ids=["mistral-8", "qwen2-8"],
)
def test_sliding_window_model_is_exact_past_the_window(family: str, window: dict) -> None:
    """Window 8, text 12 + 40 tokens and rounds of up to 66 rows: every row sees only its own last 8 positions
    (``batch.pack_round``'s per-row window), so the output equals HF greedy, which masks and rolls the window itself.
    More families and hybrid layouts: ``test_families.py``."""
    model = tiny_model(family, **window)
    prompt = random_prompt(PROMPT_LEN, 0)
    expected = hf_greedy(model, prompt, NEW_TOKENS)
    result = run_lookahead(model, prompt, 5, 4, 5, True, NEW_TOKENS)
    assert result.output_ids == expected
    assert result.stats.accepted_tokens > 0  # candidates really were verified past the window


# ---------------------------------------------------------------------------------------------------------
# Bad settings and inputs


@pytest.mark.parametrize(
    ("W", "N", "G", "message"),
    [
        (5, 2, 5, "ngram_size (N) must be >= 3, got 2"),
        (0, 4, 5, "window_size (W) must be >= 1, got 0"),
        (5, 4, -1, "verification_set_size (G) must be >= 0, got -1"),
    ],
)
def test_engine_rejects_bad_lookahead_before_touching_the_model(tiny, W: int, N: int, G: int, message: str) -> None:
    from lp_runner.config import GenerationConfig
    from lp_runner.decoding.engine import LookaheadEngine

    model = tiny("llama")
    adapter = ModelAdapter(model)
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            LookaheadEngine(
                adapter,
                LookaheadConfig(window_size=W, ngram_size=N, verification_set_size=G),
                GenerationConfig(max_new_tokens=8),
                [],
            )
    finally:
        handle.remove()
    assert calls == []


def test_prompt_checks(tiny) -> None:
    model = tiny("llama")  # max_position_embeddings = 512
    engine = make_engine(model, 5, 4, 5, True, max_new_tokens=100)
    with pytest.raises(InputError, match="empty prompt"):
        engine.generate([])
    with pytest.raises(
        InputError, match="prompt of 413 tokens plus max_new_tokens=100 exceeds the model's context of 512"
    ):
        engine.generate([1] * 413)
    engine.check_prompt([1] * 412)  # exactly fits


def test_generation_at_the_end_of_the_context(tiny) -> None:
    # the window's guesses run past the last position the model has (512): they must not break the output
    model = tiny("llama")
    prompt = random_prompt(500, 3)
    result = run_lookahead(model, prompt, 7, 5, 7, True, 12)
    assert result.output_ids == hf_greedy(model, prompt, 12)


def test_remembered_oracle_answers_as_a_fresh_one() -> None:
    """``remember_greedy``'s memo (the embedded model's oracle) serves shorter budgets, EOS stops and longer
    budgets exactly as fresh ``generate`` calls on an unregistered copy of the same model would."""
    import copy

    from helpers import remember_greedy

    fresh = tiny_model("qwen2", seed=4)
    remembered = remember_greedy(copy.deepcopy(fresh))
    prompt = random_prompt(PROMPT_LEN, seed=4)
    long_run = hf_greedy(remembered, prompt, 30)
    eos = [long_run[12]]  # a token of the output: its first occurrence ends an EOS run early
    for budget, stop in ((30, []), (10, []), (45, []), (30, eos), (5, eos), (60, eos)):
        assert hf_greedy(remembered, prompt, budget, stop) == hf_greedy(fresh, prompt, budget, stop), (budget, stop)

"""The job store (``lookahead.pool_scope: job``) on hand-made sequences: lookups and ranking, the memory bound,
replicas, save/load and bad files, the simulation across samples (exactness: ``test_job_pool_exact.py``)."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from lp_runner.config import LookaheadConfig
from lp_runner.decoding.coordinator import Coordinator
from lp_runner.decoding.job_store import SCAN, SEP, JobPool, JobPoolSource, rank_continuations, store_views
from lp_runner.decoding.sources import Feedback, Proposal
from lp_runner.errors import InputError
from lp_runner.tuning.acceptance import Sample
from lp_runner.tuning.preset import simulate

FP = "tok-a"  # a tokenizer fingerprint


def test_continuations_docstring_example():
    store = JobPool(100)
    store.add((), (5, 6, 7, 5, 6, 8))
    store.add((), (5, 6, 7))
    assert list(store._tokens) == [5, 6, 7, 5, 6, 8, SEP, 5, 6, 7, SEP]
    assert store.continuations((9, 5, 6), 3) == (2, [(7,), (8,), (7, 5, 6)])
    assert store.continuations((9, 4), 3) == (0, [])  # nothing ends in 4
    assert store.continuations((9, 4, 5, 6), 3, min_key=3) == (0, [])  # (4, 5, 6) never occurred


@pytest.mark.parametrize(
    "conts,limit,length,expected",
    [
        # docstring example: 7 three times, 9 once; after 7, 8 twice over 3 once
        ([(7, 8), (9, 1), (7, 3), (7, 8)], 2, 2, [(7, 8), (9, 1)]),
        # ties go to the most recent (first listed)
        ([(4, 1), (5, 2)], 1, 2, [(4, 1)]),
        # the path follows occurrences that agree so far, and stops where they end
        ([(7, 8, 1), (7, 8), (7, 2, 2)], 1, 4, [(7, 8, 1)]),
        # length cuts; limit caps the number of distinct first tokens
        ([(1, 2, 3), (4, 5, 6), (7,)], 5, 1, [(1,), (4,), (7,)]),
    ],
)
def test_rank_continuations(conts, limit, length, expected):
    assert rank_continuations(conts, limit, length) == expected


def test_lookup_reads_the_scan_most_recent_occurrences():
    store = JobPool(10_000)
    store.add((), tuple(t for i in range(SCAN + 30) for t in (1, 1000 + i)))  # (1, 1000), (1, 1001), ...
    k, conts = store.continuations((1,), 1)
    assert k == 1 and conts == [(1000 + i,) for i in range(SCAN + 29, 29, -1)]


def _rank_by_definition(conts, limit, length):
    """``rank_continuations`` as its docstring defines it, with no shortcut: the oracle for the fast one."""

    def by_frequency(tokens):
        counts = {}
        for t in tokens:
            counts[t] = counts.get(t, 0) + 1
        return sorted(counts, key=lambda t: -counts[t])

    out = []
    for first in by_frequency(c[0] for c in conts)[:limit]:
        members, path = [c for c in conts if c[0] == first], [first]
        while len(path) < length:
            nexts = by_frequency(c[len(path)] for c in members if len(c) > len(path))
            if not nexts:
                break
            members = [c for c in members if len(c) > len(path) and c[len(path)] == nexts[0]]
            path.append(nexts[0])
        out.append(tuple(path))
    return out


def test_rank_continuations_matches_its_definition():
    rng = random.Random(1)
    for _ in range(2000):
        conts = [tuple(rng.randrange(4) for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(1, 12))]
        limit, length = rng.randrange(1, 5), rng.randrange(1, 7)
        assert rank_continuations(conts, limit, length) == _rank_by_definition(conts, limit, length)


@pytest.mark.parametrize("store_prompts", [False, True])
def test_store_views_answer_as_each_samples_own_store(store_prompts):
    """One store built once, read through a view per sample, answers every lookup as a store holding only the
    samples before it (the auto preset's search reads views instead of building a store per setting). A vocabulary
    of 5 makes keys recur more than SCAN times and continuations run into the next sample's text."""
    rng = random.Random(0)
    samples = [
        (tuple(rng.randrange(5) for _ in range(rng.randrange(0, 5))), tuple(rng.randrange(5) for _ in range(n)))
        for n in (90, 0, 135, 1, 180, 114, 156, 7, 132, 183)
    ]
    views = store_views(samples, 10_000, store_prompts)
    own = JobPool(10_000, store_prompts)
    for (prompt, output), view in zip(samples, views, strict=True):
        for _ in range(40):
            history = tuple(rng.randrange(5) for _ in range(rng.randrange(1, 5)))
            length, min_key = rng.randrange(1, 6), rng.randrange(1, 4)
            assert view.continuations(history, length, min_key) == own.continuations(history, length, min_key)
        own.add(prompt, output)
    total = sum(len(o) + (len(p) if store_prompts else 0) for p, o in samples)
    assert store_views(samples, total, store_prompts) is not None
    assert store_views(samples, total - 1, store_prompts) is None  # the store would evict: no views


def test_source_proposes_and_adapts():
    store = JobPool(100)
    store.add((), (1, 2, 3, 4, 5))
    src = JobPoolSource(store, num_tokens=3)
    (proposal,) = src.propose([9, 1, 2], 2)
    assert proposal == Proposal((3, 4, 5), "job", 2)
    src.feedback(Feedback(proposal, 1))  # partial accept of a 2-token match's proposal: 3 -> 2 tokens for k = 2
    assert [p.tokens for p in src.propose([9, 1, 2], 2)] == [(3, 4)]
    assert src.propose([9, 8], 2) == []


def test_store_prompts_only_when_asked():
    with_prompts, without = JobPool(100, store_prompts=True), JobPool(100, store_prompts=False)
    for store in (with_prompts, without):
        store.add((1, 2, 3), (4, 5))
    assert with_prompts.sequences == ((1, 2, 3), (4, 5)) and without.sequences == ((4, 5),)


def test_memory_bound_evicts_oldest():
    store = JobPool(max_tokens=10)
    for g in range(6):
        store.add((), tuple(range(10 * g, 10 * g + 4)))  # 4 tokens each
        assert store.num_tokens <= 10
    # over the bound, the oldest go until 3/4 of it is left: the two newest remain
    assert store.sequences == ((40, 41, 42, 43), (50, 51, 52, 53))
    assert store.continuations((41,), 2) == (1, [(42, 43)])
    assert store.continuations((1,), 2) == (0, [])  # evicted text no longer proposes
    assert store.evictions == 2  # at the 3rd and the 5th generation
    long = JobPool(max_tokens=3)
    long.add((), (1, 2, 3, 4, 5))  # longer than the bound: its last tokens
    assert long.sequences == ((3, 4, 5),) and long.num_tokens == 3
    assert JobPool(0).continuations((1,), 3) == (0, []) and JobPool(0).num_tokens == 0


def test_replicas_fed_the_same_generations_are_identical():
    a, b = JobPool(50), JobPool(50)
    gens = [((i,), tuple((i * 7 + j) % 13 for j in range(9))) for i in range(12)]  # evicts several times
    for store in (a, b):
        for prompt, out in gens:
            store.add(prompt, out)
    assert a.digest() == b.digest() and a._index == b._index and a._tokens == b._tokens
    la = LookaheadConfig(lookahead_branch=False, verification_set_size=3)
    history = [3, 10, 4]
    plan_a = Coordinator(la, 2, [1, 2], store=a).plan(history, None)
    plan_b = Coordinator(la, 2, [1, 2], store=b).plan(history, None)
    assert plan_a == plan_b and "job" in plan_a.sources  # not vacuous: the store proposed


def test_save_load_round_trip(tmp_path):
    store = JobPool(40)
    for i in range(9):
        store.add((), tuple(range(i, i + 7)))
    path = tmp_path / "pool.json"
    store.save(path, FP)
    loaded = JobPool(40)
    loaded.load(path, FP)
    assert loaded.digest() == store.digest() and loaded._index == store._index
    assert loaded.generations == store.generations
    assert loaded.continuations((9, 10), 3) == store.continuations((9, 10), 3)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda text: text[: len(text) // 2], "truncated"),
        (lambda text: text.replace('"version":1', '"version":2'), "version 2"),
        (lambda text: text.replace(FP, "tok-b"), "another tokenizer"),
        (lambda text: text.replace('"format":"lp_runner.job_pool"', '"format":"x"'), "not an lp_runner pool"),
        (lambda text: text.replace('"num_tokens":3', '"num_tokens":4'), "damaged"),
    ],
)
def test_bad_pool_files_are_refused_in_one_line(tmp_path, damage, message):
    store = JobPool(40)
    store.add((), (1, 2, 3))
    path = tmp_path / "pool.json"
    store.save(path, FP)
    path.write_text(damage(path.read_text()))
    with pytest.raises(InputError) as err:
        JobPool(40).load(path, FP)
    assert message in str(err.value) and "\n" not in str(err.value)


def _pool_file(path, sequences) -> None:
    path.write_text(
        json.dumps(
            {"format": "lp_runner.job_pool", "version": 1, "tokenizer": FP, "generations": len(sequences),
             "sequences": sequences, "num_tokens": sum(len(s) for s in sequences if isinstance(s, list))}
        )
    )  # fmt: skip


@pytest.mark.parametrize(
    "sequences,message",
    [
        ([[1, 2], [3, 64, 5]], ": sequence 1, token 1: id 64 is outside the model's vocabulary of 64 ids"),
        ([[1, -2]], ": sequence 0, token 1: -2 is not a token id"),
        ([[1, True]], ": sequence 0, token 1: true is not a token id"),
        ([[1, 2.0]], ": sequence 0, token 1: 2.0 is not a token id"),
        ([[1], 7], " is damaged: sequence 1 is not a list of token ids"),
    ],
)
def test_pool_file_ids_are_checked_against_the_vocabulary(tmp_path, sequences, message):
    """Every token id of a pool file is a row of the model's vocabulary (``vocab_size``), or the first forward
    that reads it fails inside the model; the error names the first bad entry."""
    path = tmp_path / "pool.json"
    _pool_file(path, sequences)
    with pytest.raises(InputError) as err:
        JobPool(100).load(path, FP, vocab_size=64)
    assert str(err.value) == f"pool file {path}{message}"
    _pool_file(path, [[1, 2], [3, 63, 0]])  # the last row of the vocabulary is a token
    store = JobPool(100)
    store.load(path, FP, vocab_size=64)
    assert store.sequences == ((1, 2), (3, 63, 0))


def test_prompt_scope_plans_as_before():
    """``pool_scope: prompt`` builds no job source: the sources and plans are those of a coordinator without one."""
    la = LookaheadConfig(lookahead_branch=False)
    coord = Coordinator(la, 1, [1, 2, 3, 1, 2])
    assert [s.name for s in coord.sources] == ["context", "pool"]
    store = JobPool(100)
    store.add((), (2, 9, 9, 9))
    job = Coordinator(dataclasses.replace(la, pool_scope="job"), 1, [1, 2, 3, 1, 2], store=store)
    assert [s.name for s in job.sources] == ["context", "job", "pool"]


def test_simulation_carries_the_store_across_samples():
    """The second sample repeats the first one's output: with the store, its rounds verify the repeat."""
    la = LookaheadConfig(lookahead_branch=False, context_lookup=False, verification_set_size=1, pool_scope="job")
    first = Sample((1, 2), tuple(range(10, 30)))
    second = Sample((3, 4), (10, *range(11, 30)))
    store = JobPool(1000)
    simulate(la, first, store)
    with_store = simulate(la, second, store)
    without = simulate(la, second)  # default: no store, whatever the scope
    assert len(with_store) < len(without)
    assert store.generations == 2


def test_pool_file_is_json(tmp_path):
    store = JobPool(10)
    store.add((), (1, 2))
    store.save(tmp_path / "p.json", FP)
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["version"] == 1 and data["sequences"] == [[1, 2]] and data["tokenizer"] == FP


def test_job_proposals_go_first_after_a_longer_match():
    """Context matched 1 token (its last 2 tokens never occurred together before), the store 2: the store's
    candidate fills a budget of 1; with the store's match no longer than the context's, context stays first."""
    store = JobPool(100)
    store.add((), (4, 5, 6, 7))
    la = LookaheadConfig(lookahead_branch=False, verification_set_size=1, pool_scope="job")
    history = [5, 9, 4, 5]  # context: (4, 5) never occurred before, 5 did (-> 9, 4, 5); the store holds (4, 5)
    plan = Coordinator(la, 1, history, store=store).plan(history, None)
    assert plan.sources == ("job",) and plan.candidates == ((6, 7),)
    history = [4, 5, 9, 4, 5]  # context now matches (4, 5) too: a tie keeps context first
    plan = Coordinator(la, 1, history, store=store).plan(history, None)
    assert plan.sources == ("context",) and plan.candidates == ((9, 4, 5),)


@pytest.mark.parametrize("rows_free", [True, False])
def test_auto_preset_keeps_the_job_scope(rows_free):
    """Under the auto preset with ``pool_scope: job`` written in the config, the chosen setting still runs the job
    store, whether it is a simulated window-off setting (rows dear) or a recorded window setting (rows free),
    and pinning the scope rules out no setting."""
    from lp_runner.tuning.acceptance import shipped_prior
    from lp_runner.tuning.costmodel import CostCurve, RowPlan
    from lp_runner.tuning.preset import search

    curve = CostCurve.linear(0.050, 0.0 if rows_free else 0.030, max_rows=512)
    base = LookaheadConfig(pool_scope="job", pool_max_tokens=5000)
    prior = shipped_prior()
    choice = search(
        base, ["pool_scope", "pool_max_tokens"], curve, RowPlan.from_curve(curve), prior.samples, prior.recorded
    )
    assert choice.lookahead.lookahead_branch == rows_free, choice.reason
    assert (choice.lookahead.pool_scope, choice.lookahead.pool_max_tokens) == ("job", 5000)

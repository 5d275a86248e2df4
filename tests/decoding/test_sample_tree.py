"""Sampling verification on the device (``sample_tree``) against the host walk and exactly computed distributions.

Oracles: ``sampling.split_verify`` (the host walk the engine ran before, itself held to exact distributions by
test_sampling_unit) on the same seeded streams, round by round, on thousands of random rounds including the
corner cases (no candidates, another rank's first tokens, duplicates, one-token supports that the last-token
rule accepts, truncated targets); the exact distribution of emitted runs (ancestral sampling cut where this rank's
candidates end) for the device program alone, by a chi-square test over many rounds; the module doc's worked
tree, table by table. The engine's end-to-end sampling tests (test_sampling_e2e, its TV bounds) run this path.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from lp_runner.decoding.verify.greedy import Verdict
from lp_runner.decoding.verify.sample_tree import NO_NODE, SampleTree, TreeTables, decide, verdict
from lp_runner.decoding.verify.sampling import NO_CANDIDATE, split_verify

A, B, C, D = 0, 1, 2, 3


def _decide(probs: torch.Tensor, plan_first: list[int], local: list[list[int]], key: str) -> Verdict:
    tree = SampleTree.build(plan_first, local, random.Random(key + ":first"), random.Random(key + ":rest"))
    width = max(1, max(len(t) for t in tree.tokens))
    return verdict(decide(probs, TreeTables.views(tree.tables(), tree.size, width), tree.max_depth).tolist())


def _reference(probs: torch.Tensor, plan_first: list[int], local: list[list[int]], key: str) -> Verdict:
    return split_verify(
        probs, plan_first, local, random.Random(key + ":first").random, random.Random(key + ":rest").random
    )


def test_the_worked_tree() -> None:
    """The module doc's example: plan first tokens [A, B, C] (C another rank's), local [A, B, D], [A, C], [B]."""
    shared, local = random.Random("s"), random.Random("l")
    tree = SampleTree.build([A, B, C, A], [[A, B, D], [A, C], [B]], shared, local)
    assert tree.rows == (0, 1, 6, 2, 5, 3)  # breadth first: (), (A,), (B,), (A, B), (A, C), (A, B, D)
    assert tree.tokens == ((A, B, C), (B, C), (), (D,), (), ())
    assert tree.children == ((1, 2, NO_NODE), (3, 4), (), (5,), (), ())
    assert tree.parent == (NO_NODE, 0, 0, 1, 1, 3) and tree.depth == (0, 1, 1, 2, 2, 3)
    assert tree.candidate == (-1, 0, 2, 0, 1, 0) and tree.token_into == (-1, A, B, B, C, D)
    again_shared, again_local = random.Random("s"), random.Random("l")
    first = [again_shared.random() for _ in range(4)]
    rest = [again_local.random() for _ in range(4)]
    assert tree.draws[0] == tuple(first)  # three tests and the root's own draw, shared stream
    assert tree.draws[1] == tuple(rest[0:3]) and tree.draws[2] == (rest[0],)  # the local stream starts again
    assert tree.draws[3] == tuple(rest[1:3]) and tree.draws[4] == (rest[2],) and tree.draws[5] == (rest[2],)
    views = TreeTables.views(tree.tables(), tree.size, 3)
    assert views.rows.tolist() == list(tree.rows) and views.tested.tolist() == [3, 2, 0, 1, 0, 0]
    assert views.tokens.tolist()[1] == [B, C, -1] and views.children.tolist()[0] == [1, 2, NO_NODE]
    assert views.ancestors.tolist()[5] == [False, True, False, True, False, False]  # (A,) and (A, B); not the root
    assert views.draws.tolist()[3] == [rest[1], rest[2], 0.0, 0.0]


def _random_round(rng: np.random.Generator, vocab: int) -> tuple[torch.Tensor, list[int], list[list[int]]]:
    plan = [
        list(map(int, rng.integers(0, vocab, size=int(rng.integers(1, 5))))) for _ in range(int(rng.integers(0, 7)))
    ]
    local = [c for c in plan if rng.random() < 0.7]  # the rest are another rank's
    rows = 1 + sum(len(c) for c in local)
    kind = rng.integers(0, 3)
    if kind == 0:  # dense
        p = rng.dirichlet([0.7] * vocab, size=rows)
    elif kind == 1:  # truncated, as top-k / top-p leave them
        p = rng.dirichlet([0.5] * vocab, size=rows) * (rng.random((rows, vocab)) < 0.4)
        p[np.arange(rows), rng.integers(0, vocab, size=rows)] += 0.05
    else:  # one token holds (nearly) all the mass: the last-token rule's case
        p = np.zeros((rows, vocab))
        p[np.arange(rows), rng.integers(0, vocab, size=rows)] = 1.0
        p += (rng.random((rows, vocab)) < 0.1) * 1e-12
    return torch.tensor(p / p.sum(1, keepdims=True)), [c[0] for c in plan], local


def test_device_verdicts_equal_the_host_walk_on_the_same_streams() -> None:
    rng = np.random.default_rng(44)
    seen = Counter()
    for case in range(3000):
        probs, plan_first, local = _random_round(rng, int(rng.integers(2, 10)))
        got, want = _decide(probs, plan_first, local, f"r{case}"), _reference(probs, plan_first, local, f"r{case}")
        assert got == want, (case, plan_first, local)
        seen["accepted"] += want.hits > 0
        seen["deep"] += want.hits > 1
        seen["remote first"] += want.hits == 0 and bool(plan_first) and want.emitted[0] in plan_first
        seen["no candidates"] += not plan_first
    assert min(seen.values()) > 50, seen  # every kind of round was decided, not one path over and over


def test_device_verdicts_are_distributed_as_ancestral_sampling() -> None:
    """The device program alone against the exact distribution of emitted runs: after the root's first token
    (tested over every rank's first tokens), ancestral sampling goes on while the sampled prefix is a prefix of
    this rank's candidates, one token past it. Fresh streams per round; a chi-square over whole runs."""
    vocab, n = 4, 6000
    rng = np.random.default_rng(5)
    local = [[A, B, C], [A, B, D], [A, C], [B]]
    plan_first = [A, B, D]  # D is another rank's
    rows = {(): rng.dirichlet([1.0] * vocab)}
    for cand in local:
        for s in range(len(cand)):
            rows.setdefault(tuple(cand[: s + 1]), rng.dirichlet([1.0] * vocab))
    table = [rows[()]] + [rows[tuple(c[: s + 1])] for c in local for s in range(len(c))]
    probs = torch.tensor(np.stack(table))
    nodes = set(rows) - {()}
    exact: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], mass: float) -> None:
        for tok, p in enumerate(rows[prefix]):
            run = (*prefix, tok)
            if run in nodes:
                walk(run, mass * p)
            else:
                exact[run] = mass * p

    walk((), 1.0)
    counts = Counter(_decide(probs, plan_first, local, f"stat{k}").emitted for k in range(n))
    assert set(counts) <= set(exact)
    stat = sum((counts[run] - n * p) ** 2 / (n * p) for run, p in exact.items())
    p_value = float(torch.special.gammaincc(torch.tensor((len(exact) - 1) / 2.0), torch.tensor(stat / 2.0)))
    assert p_value > 1e-4, f"chi-square {stat:.1f} on {len(exact) - 1} dof: p = {p_value:.2e}"
    accepted = sum(k for run, k in counts.items() if len(run) > 1)
    assert accepted > n / 4  # candidates were accepted, deep runs too: not a vacuous pass
    assert any(len(run) == 4 for run in counts)


def test_decide_reads_nothing_on_the_host() -> None:
    """Every value ``decide`` computes stays a tensor: no conversion of the probabilities (or anything derived
    from them) to a host value, so on a GPU it queues work and the round's one read-back syncs once."""

    class Tracked(torch.Tensor):
        reads = 0

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in {"tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__index__"}:
                cls.reads += 1
            return super().__torch_function__(func, types, args, kwargs or {})

    probs, plan_first, local = _random_round(np.random.default_rng(1), 6)
    while not local:
        probs, plan_first, local = _random_round(np.random.default_rng(len(plan_first) + 7), 6)
    tree = SampleTree.build(plan_first, local, random.Random(1), random.Random(2))
    tables = TreeTables.views(tree.tables(), tree.size, max(1, max(len(t) for t in tree.tokens)))
    out = decide(probs.as_subclass(Tracked), tables, tree.max_depth)
    assert Tracked.reads == 0
    assert verdict(out.as_subclass(torch.Tensor).tolist()) == split_verify(
        probs, plan_first, local, random.Random(1).random, random.Random(2).random
    )


def test_a_round_without_candidates_draws_from_the_live_key_and_no_mass_is_refused() -> None:
    tree = SampleTree.build([], [], random.Random(0), random.Random(0))
    tables = TreeTables.views(tree.tables(), tree.size, 1)
    probs = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)  # only token 2 can be drawn
    assert verdict(decide(probs, tables, tree.max_depth).tolist()) == Verdict(NO_CANDIDATE, 0, (2,))
    with pytest.raises(ValueError, match="no mass"):
        verdict(decide(torch.zeros(1, 3, dtype=torch.float64), tables, tree.max_depth).tolist())


def _root_only(tokens: tuple[int, ...], draws: tuple[float, ...]) -> SampleTree:
    """A round whose candidates are all another rank's: the root alone, with scripted uniforms."""
    return SampleTree((0,), (tokens,), ((NO_NODE,) * len(tokens),), (NO_NODE,), (-1,), (0,), (-1,), (draws,))


# (intent, distribution, tested tokens, uniforms, emitted token): the boundaries of the tests and of the draw
EDGES = [
    ("the last token with mass is accepted though rounding left the residual a hair above its mass",
     (0.3975645350270777, 0.23477710513788289, 0.3676583598350393), (A, B, C), (0.99, 0.99, 1.0 - 2.0**-53, 0.5), C),
    ("u = 0 never draws a token without mass (the inverse CDF takes the first index past the target)",
     (0.0, 0.5, 0.5), (), (0.0,), B),
    ("u = 1 draws the last token with mass, not one past the end", (0.5, 0.5, 0.0, 0.0), (), (1.0,), B),
    ("a residual draw skips the rejected tokens", (0.25, 0.25, 0.5), (C,), (0.9, 0.5), B),
]  # fmt: skip


@pytest.mark.parametrize("intent, dist, tokens, draws, token", EDGES, ids=[e[0] for e in EDGES])
def test_edges_of_the_tests_and_draws(intent, dist, tokens, draws, token) -> None:
    from lp_runner.decoding.verify.sampling import sample_first

    tree = _root_only(tokens, draws)
    tables = TreeTables.views(tree.tables(), tree.size, max(1, len(tokens)))
    got = verdict(decide(torch.tensor([dist], dtype=torch.float64), tables, tree.max_depth).tolist())
    scripted = iter(draws)
    assert sample_first(torch.tensor(dist, dtype=torch.float64), tokens, lambda: next(scripted)) == token  # the host
    assert got == Verdict(NO_CANDIDATE, 0, (token,))


def test_the_engine_decides_on_the_device_as_the_host_walk_would(monkeypatch) -> None:
    """The real engine's rounds (tiny Llama, sampling): every verdict its verifier decided with ``decide`` equals
    ``split_verify`` on the same round's warped rows, candidates and seeded streams; rounds that accepted
    candidates are among them. The verifier is the engine's own, watched: it runs ``read_back_many`` unchanged,
    made to decide on the device as it does where the logits are not on the host."""
    from helpers import random_prompt, shared_tiny_model

    from lp_runner.backends.adapter import ModelAdapter
    from lp_runner.config import GenerationConfig, LookaheadConfig
    from lp_runner.decoding import scheduler
    from lp_runner.decoding.engine import LookaheadEngine
    from lp_runner.decoding.verify.sampling import warp_logits
    from lp_runner.decoding.verify.verifier import SamplingVerifier

    checked = Counter()

    class Watched(SamplingVerifier):
        def prepare(self, plan_candidates, candidates, round_key):
            self.inputs = [*getattr(self, "inputs", []), (plan_candidates, candidates, round_key)]
            return super().prepare(plan_candidates, candidates, round_key)

        def read_back_many(self, logits, layouts, prepared):
            out = super().read_back_many(logits, layouts, prepared)
            gen, at = self.gen, 0
            for layout, rb, (plan, local, key) in zip(layouts, out, self.inputs, strict=True):
                rows = [at + layout.ordinary_logit, *(at + i for r in layout.verify_logits for i in r)]
                probs = warp_logits(logits[rows], gen.temperature, gen.top_k, gen.top_p)
                streams = [random.Random(f"{gen.seed}:{key[0]}:{key[1]}:{s}").random for s in ("first", "rest")]
                assert rb.verdict == split_verify(probs, [c[0] for c in plan], local, *streams), key
                checked["rounds"] += 1
                checked["accepted"] += rb.verdict.hits > 0
                at += len(layout.logit_rows)
            self.inputs = []
            return out

    monkeypatch.setattr(scheduler, "make_verifier", lambda gen, device=None: Watched(gen, device, on_device=True))
    gen = GenerationConfig(max_new_tokens=40, do_sample=True, seed=3, temperature=0.7, top_k=20)
    la = LookaheadConfig(window_size=4, ngram_size=3, verification_set_size=4)
    engine = LookaheadEngine(ModelAdapter(shared_tiny_model("llama")), la, gen, [])
    for key in range(3):
        engine.generate(random_prompt(12, key) * 2, sample_key=key)
    assert checked["rounds"] >= 20 and checked["accepted"] >= 3, checked


def test_the_verdict_is_decided_where_the_logits_are() -> None:
    """A GPU's logits are decided by the tensor program (no distribution leaves the device); a CPU's by the host
    walk, which visits only the nodes it reaches. Both give the same verdict on the same round (above)."""
    from lp_runner.config import GenerationConfig
    from lp_runner.decoding.verify.verifier import HostWalk, Prepared, SamplingVerifier

    gen = GenerationConfig(do_sample=True, seed=1)
    on_cpu, on_gpu = SamplingVerifier(gen, torch.device("cpu")), SamplingVerifier(gen, torch.device("meta"))
    assert not on_cpu.on_device and on_gpu.on_device
    assert isinstance(on_cpu.prepare([[A, B]], [[A, B]], (0, 1)), HostWalk)
    assert isinstance(on_gpu.prepare([[A, B]], [[A, B]], (0, 1)), Prepared)

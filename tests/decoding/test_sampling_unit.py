"""Exact sampling through lookahead verification: HF-identical warping and one-hot residual verification.

Warping is compared bit for bit with what HF ``generate`` builds and produces. The verifier is checked from
hand-made tables with scripted draws (exact verdicts), then statistically: the runs it emits over many seeded
draws are compared with distributions computed exactly from the toy targets. Seeds are fixed, so every run is
deterministic; each statistical check states how often it would fail for a fresh seed if the sampler were exact.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from lp_runner.decoding.verify.greedy import Verdict
from lp_runner.decoding.verify.sampling import NO_CANDIDATE, sample_from, sample_verify, sampling_warpers, warp_logits

A, B, C, D, E = range(5)
Run = tuple[int, ...]

# ---------------------------------------------------------------------------------------------------------------
# Warping: the same warpers, order and skip rules as HF generate(do_sample=True, ...)
# ---------------------------------------------------------------------------------------------------------------

# (temperature, top_k, top_p): each warper alone, all skipped, combined, top_k beyond the vocabulary, top_k = 1
WARP_SETTINGS = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.0, 5, 1.0),
    (1.0, 0, 0.8),
    (0.6, 3, 0.7),
    (1.5, 200, 0.95),
    (1.3, 1, 1.0),
]


def _random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale  # [R, V]


@pytest.mark.parametrize("temperature, top_k, top_p", WARP_SETTINGS)
def test_warpers_are_the_ones_generate_builds(tiny, temperature, top_k, top_p):
    """Same classes, parameters and order as ``_get_logits_processor``; warped probabilities bit-identical."""
    model = tiny("llama")
    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    hf = model._get_logits_processor(generation_config=config, input_ids_seq_length=4, device="cpu", model_kwargs={})
    ours = sampling_warpers(temperature, top_k, top_p)
    assert [(type(w), vars(w)) for w in ours] == [(type(w), vars(w)) for w in hf]

    logits = _random_logits(6, model.config.vocab_size, seed=11)  # [R, V]
    input_ids = torch.zeros(6, 4, dtype=torch.long)
    expected = torch.softmax(hf(input_ids, logits.clone()).to(torch.float64), dim=-1)
    assert torch.equal(warp_logits(logits, temperature, top_k, top_p), expected)


@pytest.mark.parametrize("temperature, top_k, top_p", WARP_SETTINGS[:5])
def test_warp_matches_generate_scores(tiny, temperature, top_k, top_p):
    """generate's own raw logits, warped here, give exactly the distribution of its output_scores."""
    model = tiny("llama")
    prompt = torch.tensor([[3, 17, 42, 8, 8, 61]])
    out = model.generate(
        prompt,
        do_sample=True,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=1,
        output_scores=True,  # the warped scores generate samples from
        output_logits=True,  # the raw logits they came from
        return_dict_in_generate=True,
    )
    raw, scores = out.logits[0], out.scores[0]  # [1, V] each
    probs = warp_logits(raw, temperature, top_k, top_p)  # [1, V]
    assert torch.equal(probs, torch.softmax(scores.to(torch.float64), dim=-1))
    if (top_k, top_p) != (0, 1.0):  # not vacuous: the filters really removed tokens
        assert 0 < int((probs == 0).sum()) < model.config.vocab_size


def test_warp_casts_to_float32_first_like_generate():
    """HF's sampling loop warps float32 copies of the logits (``_sample``), whatever the model's dtype."""
    logits = _random_logits(3, 50, seed=5).to(torch.bfloat16)  # [R, V]
    input_ids = torch.zeros(3, 1, dtype=torch.long)
    expected = torch.softmax(sampling_warpers(0.8, 4, 0.9)(input_ids, logits.float()).double(), dim=-1)
    assert torch.equal(warp_logits(logits, 0.8, 4, 0.9), expected)


# ---------------------------------------------------------------------------------------------------------------
# sample_from and sample_verify on hand-made tables, with scripted draws
# ---------------------------------------------------------------------------------------------------------------

# (intent, weights, u, expected index)
SAMPLE_FROM_CASES = [
    ("u = 0 skips leading zero-weight indices", [0.0, 0.5, 0.0, 0.5], 0.0, 1),
    ("just below a boundary stays left of it", [0.0, 0.5, 0.0, 0.5], 0.4999, 1),
    ("at a boundary moves right, past the zero-weight index between", [0.0, 0.5, 0.0, 0.5], 0.5, 3),
    ("u just below 1 stops at the last weight, not on trailing zeros", [0.5, 0.5, 0.0, 0.0], math.nextafter(1, 0), 1),
    ("u = 1 (some generators return it) is guarded the same way", [0.5, 0.5, 0.0, 0.0], 1.0, 1),
    ("unnormalised weights are scaled by their total", [2.0, 6.0], 0.25, 1),
    ("... on both sides of the boundary", [2.0, 6.0], 0.2499, 0),
]


@pytest.mark.parametrize("intent, weights, u, expected", SAMPLE_FROM_CASES, ids=[c[0] for c in SAMPLE_FROM_CASES])
def test_sample_from(intent, weights, u, expected):
    assert sample_from(torch.tensor(weights, dtype=torch.float64), u) == expected
    assert sample_from(torch.tensor(weights, dtype=torch.float32), u) == expected


def test_sample_from_refuses_a_distribution_without_mass():
    with pytest.raises(ValueError, match="no mass"):
        sample_from(torch.zeros(4, dtype=torch.float64), 0.5)


def _dist(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64)  # [V]


# The issue's target and the next-token distributions after A and after B.
P_ISSUE = _dist(0.2, 0.3, 0.1, 0.4)
Q_A = _dist(0.5, 0.1, 0.1, 0.3)
Q_B = _dist(0.1, 0.1, 0.7, 0.1)
ISSUE_CANDIDATES = [[A], [A], [B]]
ISSUE_ROWS = [Q_A[None], Q_A[None], Q_B[None]]  # [len 1, V] each

# A prefix tree over 4 tokens for multi-token candidates: the target's distribution after each prefix.
TREE = {
    (): P_ISSUE,
    (A,): _dist(0.1, 0.6, 0.2, 0.1),
    (A, B): _dist(0.25, 0.25, 0.25, 0.25),
    (A, B, C): _dist(0.4, 0.3, 0.2, 0.1),
    (A, B, D): _dist(0.1, 0.2, 0.3, 0.4),
    (A, C): _dist(0.3, 0.3, 0.3, 0.1),
    (B,): Q_B,
}
TREE_CANDIDATES = [[A, B, C], [A, B, D], [A, C], [B]]


def _rows(table: dict[Run, torch.Tensor], candidates: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """candidate_probs from a prefix table: row s of candidate c is the distribution after c[0..s]."""
    return [torch.stack([table[tuple(c[: s + 1])] for s in range(len(c))]) for c in candidates]


# Rounding trap: after rejecting .331 and .303 the running residual mass is 0.36600000000000005 > .366, so a draw
# just below 1 would reject the last token of the support and leave nothing to sample.
NEAR_FULL = _dist(0.331, 0.303, 0.366)

# (intent, first_probs, candidates, candidate_probs, draws, expected verdict)
VERIFY_CASES = [
    (
        "docstring example: A rejected, B accepted from the residual (.3 / .8), bonus D from q_B",
        P_ISSUE,
        ISSUE_CANDIDATES,
        ISSUE_ROWS,
        [0.5, 0.3, 0.95],
        Verdict(2, 1, (B, D)),
    ),
    (
        "A accepted at once: the lowest of the duplicates is the candidate, bonus B from q_A",
        P_ISSUE,
        ISSUE_CANDIDATES,
        ISSUE_ROWS,
        [0.1, 0.55],
        Verdict(0, 1, (A, B)),
    ),
    (
        "a duplicate is tested once: A and B rejected (3 draws in all), C from the residual (0, 0, .1, .4) / .5",
        P_ISSUE,
        ISSUE_CANDIDATES,
        ISSUE_ROWS,
        [0.5, 0.9, 0.1],
        Verdict(NO_CANDIDATE, 0, (C,)),
    ),
    ("no candidates: one draw, straight from the target", P_ISSUE, [], [], [0.55], Verdict(NO_CANDIDATE, 0, (C,))),
    (
        "a token without mass is never accepted, not even by a draw of 0",
        _dist(0.0, 0.5, 0.5, 0.0),
        [[A], [D]],
        [_dist(1, 0, 0, 0)[None]] * 2,
        [0.0, 0.0, 0.0],
        Verdict(NO_CANDIDATE, 0, (B,)),
    ),
    (
        "shared prefixes: A, B accepted, C rejected, D accepted (.2 * .75 < .25), bonus D from p(.|A,B,D)",
        P_ISSUE,
        TREE_CANDIDATES,
        _rows(TREE, TREE_CANDIDATES),
        [0.1, 0.5, 0.3, 0.2, 0.65],
        Verdict(1, 3, (A, B, D, D)),
    ),
    (
        "all rejected at offset 1: D from the residual of p(.|A) without B and C; candidate 0 is on the path",
        P_ISSUE,
        TREE_CANDIDATES,
        _rows(TREE, TREE_CANDIDATES),
        [0.1, 0.9, 0.99, 0.5],
        Verdict(0, 1, (A, D)),
    ),
    (
        "a candidate that ends where another goes on stays on the path: [A] is the candidate after A, then B fails",
        P_ISSUE,
        [[A], [A, B]],
        _rows(TREE, [[A], [A, B]]),
        [0.1, 0.9, 0.0],
        Verdict(0, 1, (A, A)),
    ),
    (
        "the last token of the support is accepted even when rounding makes its test fallible",
        NEAR_FULL,
        [[0], [1], [2]],
        [_dist(1, 0, 0)[None]] * 3,
        [0.99, 0.99, math.nextafter(1, 0), 0.5],
        Verdict(2, 1, (2, 0)),
    ),
]


def _scripted(draws: Sequence[float]) -> tuple[Callable[[], float], Callable[[], int]]:
    """A draw source replaying ``draws`` and a counter of how many were taken."""
    taken = 0

    def draw() -> float:
        nonlocal taken
        taken += 1
        return draws[taken - 1]

    return draw, lambda: taken


@pytest.mark.parametrize(
    "intent, first, candidates, rows, draws, expected", VERIFY_CASES, ids=[c[0][:60] for c in VERIFY_CASES]
)
def test_sample_verify_table(intent, first, candidates, rows, draws, expected):
    draw, taken = _scripted(draws)
    assert sample_verify(first, candidates, rows, draw) == expected
    assert taken() == len(draws)  # one draw per acceptance test plus one for the final token, no more


def test_same_draws_same_verdicts():
    """The verifier is a pure function of its inputs and the draw stream (LP ranks may share one)."""
    target = PrefixTarget.dirichlet(vocab=5, seed=3, alpha=1.0)
    candidates = [[A, B, C], [A, B, D], [A, C], [B], [A, B, C]]
    first, rows = target.verify_inputs(candidates)

    def verdicts(seed: int) -> list[Verdict]:
        draw = random.Random(seed).random
        return [sample_verify(first, candidates, rows, draw) for _ in range(300)]

    assert verdicts(1) == verdicts(1)
    assert verdicts(1) != verdicts(2)


# ---------------------------------------------------------------------------------------------------------------
# Statistical checks against exactly computed distributions
# ---------------------------------------------------------------------------------------------------------------

SIGMAS = 4.0  # two-sided normal tail beyond 4 SE: ~6.3e-5 per cell for a fresh seed
MIN_EXPECTED = 10.0  # cells expected fewer times are pooled: the normal / chi-square approximations need counts
CHI2_P_MIN = 1e-4  # the chi-square test fails a fresh seed with probability ~1e-4


class PrefixTarget:
    """A toy target model: a fixed next-token distribution for every prefix after the live key, made on demand."""

    def __init__(self, make_row: Callable[[Run], torch.Tensor]) -> None:
        self._make_row = make_row
        self._rows: dict[Run, torch.Tensor] = {}

    @classmethod
    def dirichlet(cls, vocab: int, seed: int, alpha: float) -> PrefixTarget:
        def make(prefix: Run) -> torch.Tensor:
            rng = np.random.default_rng([seed, len(prefix), *prefix])
            return torch.from_numpy(rng.dirichlet([alpha] * vocab))  # [V] float64

        return cls(make)

    @classmethod
    def warped(cls, vocab: int, seed: int, temperature: float, top_k: int, top_p: float) -> PrefixTarget:
        def make(prefix: Run) -> torch.Tensor:
            prefix_seed = int(np.random.default_rng([seed, len(prefix), *prefix]).integers(2**31))
            logits = _random_logits(1, vocab, seed=prefix_seed, scale=2.0)  # [1, V]
            return warp_logits(logits, temperature, top_k, top_p)[0]  # [V]

        return cls(make)

    def row(self, prefix: Run) -> torch.Tensor:
        if prefix not in self._rows:
            self._rows[prefix] = self._make_row(prefix)
        return self._rows[prefix]

    def p(self, prefix: Run, token: int) -> float:
        return float(self.row(prefix)[token])

    def verify_inputs(self, candidates: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        rows = [torch.stack([self.row(tuple(c[: s + 1])) for s in range(len(c))]) for c in candidates]
        return self.row(()), rows

    def exact_runs(self, candidates: Sequence[Sequence[int]]) -> dict[Run, float]:
        """The exact distribution of whole emitted runs: ancestral sampling that goes on while the sampled prefix is
        a prefix of some candidate and stops one token after it leaves the candidates' tree."""
        nodes = {tuple(c[:k]) for c in candidates for k in range(1, len(c) + 1)}
        out: dict[Run, float] = {}

        def walk(prefix: Run, mass: float) -> None:
            for tok, p in enumerate(self.row(prefix).tolist()):
                if p > 0.0:
                    run = (*prefix, tok)
                    if run in nodes:
                        walk(run, mass * p)
                    else:
                        out[run] = mass * p

        walk((), 1.0)
        return out

    def exact_first_two(self, candidates: Sequence[Sequence[int]]) -> dict[Run, float]:
        """Runs cut to 2 tokens, computed directly as p(x1) * p(x2 | x1).

        The run goes on past x1 exactly when some candidate starts with x1 (x1 is then either accepted or, having
        been tested, cannot come from the residual). So a first token that no candidate starts with ends the run:
        its cell is (x1,) with p(x1); a covered first token is always followed by x2 ~ p(. | x1), accepted, sampled
        from a residual or a bonus alike: its cells are (x1, x2) with p(x1) * p(x2 | x1). This is independent of
        ``exact_runs`` (an oracle for the oracle) and checks the bonus / residual token after the first.
        """
        covered = {c[0] for c in candidates if c}
        out: dict[Run, float] = {}
        for x1, p1 in enumerate(self.row(()).tolist()):
            if p1 == 0.0:
                continue
            if x1 not in covered:
                out[(x1,)] = p1
                continue
            for x2, p2 in enumerate(self.row((x1,)).tolist()):
                if p2 > 0.0:
                    out[(x1, x2)] = p1 * p2
        return out


def _draw_runs(
    first: torch.Tensor, candidates: Sequence[Sequence[int]], rows: Sequence[torch.Tensor], n: int, seed: int
) -> Counter[Verdict]:
    draw = random.Random(seed).random
    verdicts: Counter[Verdict] = Counter()
    for _ in range(n):
        verdicts[sample_verify(first, candidates, rows, draw)] += 1
    return verdicts


def _check_verdict_shapes(verdicts: Iterable[Verdict], candidates: Sequence[Sequence[int]]) -> None:
    """len(emitted) == hits + 1; the candidate is the lowest whose suffix starts with the accepted tokens."""
    for v in verdicts:
        assert len(v.emitted) == v.hits + 1
        accepted = list(v.emitted[: v.hits])
        on_path = [c for c, cand in enumerate(candidates) if v.hits and list(cand[: v.hits]) == accepted]
        assert v.candidate == (on_path[0] if v.hits else NO_CANDIDATE)


def _marginal(counts: Counter, cut: int) -> Counter:
    out: Counter = Counter()
    for run, k in counts.items():
        out[run[:cut]] += k
    return out


def _pooled(counts: Counter, expected: dict, n: int) -> tuple[list[int], list[float]]:
    """Observed counts and probabilities per cell, cells expected fewer than MIN_EXPECTED times pooled into one.

    Every observed outcome must be possible: an emitted run of probability 0 fails here, whatever its count.
    """
    impossible = set(counts) - {k for k, p in expected.items() if p > 0.0}
    assert not impossible, f"emitted runs of probability 0: {sorted(impossible)[:5]}"
    observed, probs = [], []
    rare_count, rare_p = 0, 0.0
    for cell, p in expected.items():
        if n * p >= MIN_EXPECTED:
            observed.append(counts[cell])
            probs.append(p)
        else:
            rare_count += counts[cell]
            rare_p += p
    if rare_p > 0.0:
        observed.append(rare_count)
        probs.append(rare_p)
    assert math.isclose(sum(probs), 1.0, abs_tol=1e-9) and sum(observed) == n
    return observed, probs


def _assert_cells_within_se(counts: Counter, expected: dict, n: int) -> None:
    """Each (pooled) cell's frequency within SIGMAS standard errors of its exact probability: with K cells a fresh
    seed fails with probability at most K * 6.3e-5 (at most ~30 cells here: < 2e-3)."""
    observed, probs = _pooled(counts, expected, n)
    for k, p in zip(observed, probs, strict=True):
        se = math.sqrt(p * (1.0 - p) / n)
        assert abs(k / n - p) <= SIGMAS * se, f"frequency {k / n:.5f} vs exact {p:.5f} (SE {se:.5f})"


def _assert_chi_square(counts: Counter, expected: dict, n: int) -> None:
    """Pearson chi-square over whole runs (every cell at once): fails a fresh seed with probability ~CHI2_P_MIN."""
    observed, probs = _pooled(counts, expected, n)
    if len(observed) < 2:
        return
    stat = sum((k - n * p) ** 2 / (n * p) for k, p in zip(observed, probs, strict=True))
    dof = len(observed) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))
    assert p_value > CHI2_P_MIN, f"chi-square {stat:.1f} on {dof} dof: p = {p_value:.2e}"


def test_issue_case_one_token_candidates():
    """Target (A .2, B .3, C .1, D .4), candidates [A], [A], [B]: 200k draws.

    First token ~ p; after A or B (accepted, so the candidate ended) a bonus token ~ q_A or q_B; after C or D
    (residual samples) nothing. So the runs are (A, y) with .2 q_A(y), (B, y) with .3 q_B(y), (C,) .1, (D,) .4.
    """
    n = 200_000
    verdicts = _draw_runs(P_ISSUE, ISSUE_CANDIDATES, ISSUE_ROWS, n, seed=2024)
    _check_verdict_shapes(verdicts, ISSUE_CANDIDATES)
    runs: Counter = Counter()
    for v, k in verdicts.items():
        runs[v.emitted] += k

    first = {(x,): float(P_ISSUE[x]) for x in range(4)}
    _assert_cells_within_se(_marginal(runs, 1), first, n)
    joint = {(C,): 0.1, (D,): 0.4}
    joint |= {(A, y): 0.2 * float(Q_A[y]) for y in range(4)}
    joint |= {(B, y): 0.3 * float(Q_B[y]) for y in range(4)}
    _assert_cells_within_se(runs, joint, n)

    # not vacuous: A or B (half the mass) was accepted in about half the draws, and both duplicates' token won
    accepted = sum(k for v, k in verdicts.items() if v.hits > 0)
    assert abs(accepted / n - 0.5) <= SIGMAS * math.sqrt(0.25 / n)
    assert {v.candidate for v in verdicts} == {NO_CANDIDATE, 0, 2}


# (intent, candidates, Dirichlet alpha, seed); vocabulary A..E
TREE_STAT_CASES = [
    ("shared prefixes and a one-token candidate", [[A, B, C], [A, B, D], [A, C], [B]], 1.0, 7),
    (
        "duplicates, mixed orders, a candidate ending where a longer one goes on",
        [[C], [A, B], [C], [A, B], [B, A], [A]],
        1.0,
        8,
    ),
    ("every first token proposed: no residual sample at offset 0", [[A], [B], [C], [D], [E, A, A]], 1.0, 9),
    ("peaked targets (alpha .3), a long shared chain", [[D, D, D, D], [D, D, E], [E, D], [D]], 0.3, 20),
]


@pytest.mark.parametrize("intent, candidates, alpha, seed", TREE_STAT_CASES, ids=[c[0] for c in TREE_STAT_CASES])
def test_runs_match_ancestral_sampling(intent, candidates, alpha, seed):
    """100k draws per case: first token, first two tokens and whole runs against the exact distributions."""
    n = 100_000
    target = PrefixTarget.dirichlet(vocab=5, seed=seed, alpha=alpha)
    first, rows = target.verify_inputs(candidates)
    verdicts = _draw_runs(first, candidates, rows, n, seed=seed)
    _check_verdict_shapes(verdicts, candidates)
    runs: Counter = Counter()
    for v, k in verdicts.items():
        runs[v.emitted] += k

    first_two = target.exact_first_two(candidates)
    _assert_cells_within_se(_marginal(runs, 1), {(x,): target.p((), x) for x in range(5)}, n)
    _assert_cells_within_se(_marginal(runs, 2), first_two, n)
    _assert_chi_square(runs, target.exact_runs(candidates), n)

    # not vacuous: a first candidate token is accepted in a substantial share of draws, as often as it should be
    covered = sum(p for run, p in first_two.items() if len(run) == 2)
    accepted = sum(k for v, k in verdicts.items() if v.hits > 0)
    assert covered >= 0.25, "test design: pick a seed whose candidates carry more mass"
    assert abs(accepted / n - covered) <= SIGMAS * math.sqrt(covered * (1 - covered) / n) + 1e-12
    if max(len(c) for c in candidates) > 1:
        assert max(v.hits for v in verdicts) >= 2  # deeper offsets were verified too


# (temperature, top_k, top_p) that leave few tokens with mass
TRUNCATED_SETTINGS = [(0.8, 3, 1.0), (1.0, 0, 0.7), (1.3, 5, 0.7)]


@pytest.mark.parametrize("temperature, top_k, top_p", TRUNCATED_SETTINGS)
def test_truncated_targets_never_emit_filtered_tokens(temperature, top_k, top_p):
    """Warped top-k / top-p targets; 100k draws per setting, split between two candidate sets: filtered
    (zero-mass) tokens proposed first at offsets 0 and 1, next to kept ones; and the whole kept support proposed
    after a filtered token, so that every draw must accept a kept token."""
    n = 100_000
    target = PrefixTarget.warped(vocab=12, seed=31, temperature=temperature, top_k=top_k, top_p=top_p)
    root = target.row(())
    kept = torch.argsort(root, descending=True)[: int((root > 0).sum())].tolist()
    filtered = (root == 0).nonzero().flatten().tolist()
    assert len(kept) >= 2 and filtered, "test design: the warpers must keep some tokens and drop others"
    top = kept[0]
    after_top = target.row((top,))
    filtered_after_top = (after_top == 0).nonzero().flatten().tolist()
    best_after_top = int(after_top.argmax())
    assert filtered_after_top

    candidate_sets = [
        [[filtered[0]], [top, filtered_after_top[0]], [filtered[0], top], [kept[1]], [top, best_after_top, top]],
        [[filtered[0]]] + [[k] for k in kept],
    ]
    for i, candidates in enumerate(candidate_sets):
        first, rows = target.verify_inputs(candidates)
        verdicts = _draw_runs(first, candidates, rows, n // len(candidate_sets), seed=100 + i)
        m = sum(verdicts.values())
        _check_verdict_shapes(verdicts, candidates)
        runs: Counter = Counter()
        for v, k in verdicts.items():
            runs[v.emitted] += k
        # every token of every run, accepted or sampled, has mass under its own prefix's target
        for run in runs:
            assert all(target.p(run[:j], tok) > 0.0 for j, tok in enumerate(run)), run
        _assert_cells_within_se(_marginal(runs, 1), {(x,): float(root[x]) for x in range(12)}, m)
        _assert_chi_square(runs, target.exact_runs(candidates), m)
        accepted = sum(k for v, k in verdicts.items() if v.hits > 0)
        assert accepted / m >= 0.25  # not vacuous: candidate tokens were accepted, next to the filtered ones
        if i == 1:  # every kept token is proposed: rejecting them all would leave no mass, so one always wins
            assert accepted == m


def test_sample_first_is_offset_zero_of_sample_verify():
    """LP splits verification at offset 0 (shared stream on every rank): it must be the same decision, draw for
    draw, as the single-rank verifier's first offset."""
    from lp_runner.decoding.verify.sampling import sample_first

    rng = np.random.default_rng(5)
    for trial in range(200):
        probs = torch.from_numpy(rng.dirichlet(np.full(6, 0.5)))
        tokens = rng.integers(0, 6, size=int(rng.integers(1, 5))).tolist()
        rows = [torch.full((1, 6), 1 / 6, dtype=torch.float64) for _ in tokens]  # after-token rows: irrelevant here
        a, b = random.Random(trial), random.Random(trial)
        first = sample_first(probs, tokens, a.random)
        verdict = sample_verify(probs, [[t] for t in tokens], rows, b.random)
        assert first == verdict.emitted[0]

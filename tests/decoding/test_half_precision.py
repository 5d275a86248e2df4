"""Exactness in half precision (``decoding.verify.agreement``): identical, or diverged at a tie the dtype cannot decide.

In bfloat16 a packed round computes the live key's row with other shapes than one-row decoding, so its logits
move by a few ulps; where the two best tokens are that close, the argmax may flip and the two runs continue
differently, both valid. Token equality with the one-row run is therefore replaced by the definition in
``agreement.py``: equal up to the first difference, and there the reference's top-two margin within
``TOLERANCE_ULPS`` ulps. The unit tests below build logits by hand (including margins just outside the tolerance,
so the definition can fail); the end-to-end test runs the embedded model in bfloat16 on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, humaneval_prompts, make_engine

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.decoding.verify.agreement import (
    TOLERANCE_ULPS,
    compare,
    first_difference,
    margin_at,
    prefill_logits,
    ulp,
)

VOCAB = 8
A, B = 3, 5  # the reference's token and the other run's token at the first difference


def logits_with(za: float, zb: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[VOCAB] logits, every other token far below, z[A] = za and z[B] = zb (exact in ``dtype``)."""
    z = torch.full((VOCAB,), -10.0, dtype=dtype)
    z[A], z[B] = za, zb
    assert z[A].item() == za and z[B].item() == zb, "test values must be representable in the dtype"
    return z


def never_called(step: int) -> torch.Tensor:
    raise AssertionError("identical sequences need no logits")


@pytest.mark.parametrize(
    "value, dtype, expected",
    [
        (20.25, torch.bfloat16, 2.0**-3),  # 16 <= 20.25 < 32: eps 2**-7 times 2**4
        (-3.0, torch.bfloat16, 2.0**-6),  # the sign does not matter; 2 <= 3 < 4
        (1.0, torch.bfloat16, 2.0**-7),  # eps itself
        (1.0, torch.float16, 2.0**-10),
        (1.0, torch.float32, 2.0**-23),
        (0.0, torch.bfloat16, torch.finfo(torch.bfloat16).tiny * 2.0**-7),  # subnormal spacing, never 0
    ],
)
def test_ulp(value, dtype, expected):
    assert ulp(value, dtype) == expected


def test_ulp_is_the_spacing_of_the_dtype():
    # the next representable value above x is x + ulp(x), for values across the logit range
    for x in (0.75, 3.5, 20.25, 41.0):
        t = torch.tensor(x, dtype=torch.bfloat16)
        up = torch.nextafter(t, torch.tensor(float("inf"), dtype=torch.bfloat16))
        assert (up - t).item() == ulp(x, torch.bfloat16)


@pytest.mark.parametrize(
    "reference, other, expected",
    [
        ([1, 2, 3], [1, 2, 3], None),  # identical
        ([1, 2, 3], [1, 5, 3], 1),  # a later agreement does not matter: the first difference does
        ([1, 2], [1, 2, 3], 2),  # a length difference counts at the shorter length
        ([], [], None),
        ([7], [8], 0),
    ],
)
def test_first_difference(reference, other, expected):
    assert first_difference(reference, other) == expected


def test_identical_sequences_are_exact_without_logits():
    got = compare([1, 2, 3], [1, 2, 3], never_called, torch.bfloat16)
    assert got.identical and got.exact and got.position is None


@pytest.mark.parametrize(
    "za, zb, ulps, within",
    [
        (20.25, 20.0, 2.0, True),  # a near tie at 20 (ulp 0.125): the dtype cannot decide it
        (21.0, 20.0, 8.0, True),  # exactly the tolerance
        (21.125, 20.0, 9.0, False),  # one ulp beyond it
        (22.0, 20.0, 16.0, False),  # a clear preference: a flip here would be a bug
        (20.0, 20.125, 1.0, True),  # the teacher-forced forward ranks the other token first: still a tie
        (40.0, 39.0, 4.0, True),  # ulp 0.25 above 32: the same gap is fewer ulps at a larger logit
        (3.0, 2.0, 64.0, False),  # ulp 2**-6 below 4: the same gap is many ulps at a small logit
    ],
)
def test_compare_measures_the_margin_at_the_first_difference(za, zb, ulps, within):
    steps: list[int] = []

    def step_logits(step: int) -> torch.Tensor:
        steps.append(step)
        return logits_with(za, zb)

    got = compare([9, 9, A, 1], [9, 9, B, 2], step_logits, torch.bfloat16)
    assert steps == [2], "logits are asked for once, at the first difference"
    assert (got.position, got.reference_token, got.other_token) == (2, A, B)
    assert got.margin == za - zb
    assert got.margin_ulps == ulps
    assert got.within_tolerance is within and got.exact is within and not got.identical
    assert got.reference_top1 == (A if za >= zb else B)


def test_the_tolerance_is_in_the_dtype_of_the_logits():
    # 0.25 at a logit of 20 is 2 bfloat16 ulps but 2**17 float32 ulps (2**-19 apart): float32 ties are far narrower
    z = logits_with(20.25, 20.0, torch.float32)
    assert margin_at(z, A, B, torch.bfloat16)[2]
    margin, ulps, within = margin_at(z, A, B, torch.float32)
    assert margin == 0.25 and ulps == 2.0**17 and not within
    assert margin_at(z, A, B, torch.float16)[1] == 16.0  # float16: eps 2**-10, ulp at 20 is 2**-6


def test_a_length_difference_is_not_rounding():
    got = compare([1, 2, 3], [1, 2], never_called, torch.bfloat16)
    assert not got.exact and got.position == 2 and got.margin is None
    assert got.reference_token == 3 and got.other_token is None


def test_tolerance_can_be_tightened():
    z = logits_with(20.25, 20.0)
    assert compare([A], [B], lambda step: z, torch.bfloat16, tolerance_ulps=1.0).exact is False
    assert compare([A], [B], lambda step: z, torch.bfloat16).tolerance_ulps == TOLERANCE_ULPS


def test_prefill_logits_are_the_reference_steps(tiny):
    # the teacher-forced reference logits must belong to the step asked for: in float32 their argmax at step i
    # is the greedy token i (the tiny models' margins are far above float32 rounding)
    model = tiny("llama")
    prompt = [5, 17, 3, 44, 12]
    reference = hf_greedy(model, prompt, 12)
    at = prefill_logits(ModelAdapter(model), prompt, reference)
    assert [int(at(i).argmax()) for i in range(len(reference))] == reference


# ---------------------------------------------------------------------------------------------------------------
# The embedded model in bfloat16 on the CPU

NEW_TOKENS = 64
# (name, W, N, G, further LookaheadConfig fields): the settings compared with one-row decoding
SETTINGS = [
    # what the auto preset chooses on this CPU (benchmarks/results/half_precision.json): one context candidate,
    # no window, a few rows per round
    ("lean", 7, 5, 1, {"lookahead_branch": False}),
    # the Jacobi window and 7 candidates: up to ~60 rows per round, the most reordered reductions
    ("wide", 7, 5, 7, {}),
]


@pytest.fixture(scope="module")
def embedded_bf16():
    from lp_runner.models.loading import fetch_embedded_model, load_model_and_tokenizer

    model, tokenizer, _ = load_model_and_tokenizer(fetch_embedded_model(), dtype=torch.bfloat16, device="cpu")
    return model, tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1, 2])
def test_bf16_lookahead_agrees_with_one_row_decoding(embedded_bf16, index):
    """Each setting, and HF greedy, against the engine's own one-row decoding (nothing verified, no window):
    identical, or the first difference a tie within TOLERANCE_ULPS in the one-row run's teacher-forced logits.
    On HumanEval/0 the wide setting parts from one-row decoding at new token 35, a 1-ulp tie (this CPU,
    benchmarks/results/half_precision.md)."""
    model, tok = embedded_bf16
    eos = [tok.eos_token_id]
    ids = tok(humaneval_prompts(index + 1)[index])["input_ids"]
    adapter = ModelAdapter(model)
    one_row = make_engine(
        model, 7, 5, 0, False, NEW_TOKENS, eos, lookahead_branch=False, context_lookup=False
    ).generate(ids)
    assert one_row.stats.rows == one_row.stats.rounds + len(ids) - 1, "one-row decoding: one row per round"
    reference = one_row.output_ids
    steps = prefill_logits(adapter, ids, reference)

    runs = {"hf-greedy": hf_greedy(model, ids, NEW_TOKENS, eos)}
    for name, w, n, g, extra in SETTINGS:
        res = make_engine(model, w, n, g, True, NEW_TOKENS, eos, **extra).generate(ids)
        assert res.stats.rows > res.stats.rounds + len(ids) - 1, f"{name}: rounds must pack more than one row"
        assert res.stats.accepted_tokens > 0, f"{name}: candidates must be accepted, or nothing was tested"
        runs[name] = res.output_ids
    for name, out in runs.items():
        got = compare(reference, out, steps, torch.bfloat16)
        assert got.exact, f"{name} vs one-row decoding: {got.to_dict()}"

"""Exactness in half precision (``decoding.verify.agreement``): equal to the reference except at teacher-forced ties.

In bfloat16 a packed round computes the live key's row with other shapes than one-row decoding, so its logits
move a little; where the two best tokens are that close, the argmax may flip and the two runs continue
differently, both valid. Token equality with the one-row run is therefore replaced by the definition in
``agreement.py``: at every difference the two tokens are the reference's teacher-forced top two, their margin
within a tolerance in logit units measured for the model on the device, and after each such tie the other method
runs again from the reference's prefix, so a later difference is judged too. The unit tests below build logits by
hand (margins just outside the tolerance, a third token in between, a bug after a tie: the definition can fail);
the end-to-end test runs the embedded model in bfloat16 on the CPU. float32 stays the exactness oracle
(``test_embedded_exact.py``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, humaneval_prompts, make_engine

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.decoding.verify.agreement import (
    MEASURED_TOLERANCES,
    compare,
    first_difference,
    judge_tie,
    prefill_logits,
)

VOCAB = 8
A, B, C = 3, 5, 6  # the reference's token, the other run's token, a third one
TOL = 0.5  # logit units, for the hand-made cases


def logits_with(**values: float) -> torch.Tensor:
    """[VOCAB] bfloat16 logits, every token at -10 except those given by name (a=..., b=..., c=...)."""
    z = torch.full((VOCAB,), -10.0, dtype=torch.bfloat16)
    for name, value in values.items():
        z[{"a": A, "b": B, "c": C}[name]] = value
        assert z[{"a": A, "b": B, "c": C}[name]].item() == value, "test values must be exact in bfloat16"
    return z


def never_called(step: int):
    raise AssertionError("nothing to look at: the runs agree")


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


def test_identical_sequences_are_exact_without_logits_or_resuming():
    got = compare([1, 2, 3], [1, 2, 3], never_called, TOL, never_called)
    assert got.identical and got.exact and got.ties == () and got.resumed == 0


@pytest.mark.parametrize(
    "logits, top_two, within",
    [
        (logits_with(a=20.25, b=20.0), True, True),  # a near tie of the two best: the dtype cannot decide it
        (logits_with(a=20.0, b=20.5), True, True),  # the forward itself ranks b first: still a tie
        (logits_with(a=21.0, b=20.0), True, False),  # the two best, but 1.0 apart: beyond the tolerance
        (logits_with(a=20.0, c=19.875, b=19.75), False, True),  # b is third: close, but a bug, never a tie
        (logits_with(a=2.25, b=2.0), True, True),  # absolute units: the same margin at a small logit, same verdict
        (logits_with(a=20.0, b=20.0, c=20.0), True, True),  # three exactly equal: any two are a top two
    ],
)
def test_a_difference_is_a_tie_only_between_the_top_two_within_the_tolerance(logits, top_two, within):
    tie = judge_tie(logits, A, B, TOL, position=4)
    assert (tie.top_two, tie.within_tolerance, tie.ok) == (top_two, within, top_two and within)
    assert tie.position == 4 and tie.margin == pytest.approx(logits[A].item() - logits[B].item())
    got = compare([A], [B], lambda step: logits, TOL, never_called)  # the last token: nothing to resume
    assert got.exact is (top_two and within) and not got.identical


def test_the_comparison_goes_on_after_a_tie_from_the_reference():
    """reference 1 A 7 A 9; the other run ties at step 1 (B), is resumed from [1, A] and agrees up to step 3, where
    it gives C, the third token there: not exact. A bug after an early tie is caught."""
    reference = [1, A, 7, A, 9]
    steps = {1: logits_with(a=20.0, b=19.875), 3: logits_with(a=20.0, b=19.875, c=19.75)}
    resumed_at = []

    def resume(step: int) -> list[int]:
        resumed_at.append(step)
        return [7, C, 9, 9, 9]  # more tokens than the reference has left: the rest is ignored

    got = compare(reference, [1, B, 4, 4, 4], steps.__getitem__, TOL, resume)
    assert resumed_at == [2] and got.resumed == 1
    assert [t.position for t in got.ties] == [1, 3] and [t.ok for t in got.ties] == [True, False]
    assert not got.exact and got.position == 1


def test_ties_resumed_to_the_end_are_exact():
    reference = [1, A, 7, A]
    steps = {1: logits_with(a=20.0, b=19.875), 3: logits_with(a=5.0, b=5.25)}
    resumes = {2: [7, B], 4: []}
    got = compare(reference, [1, B, 4, 4], steps.__getitem__, TOL, resumes.__getitem__)
    assert got.exact and not got.identical and [t.position for t in got.ties] == [1, 3]


def test_a_run_that_ends_early_is_no_tie_and_too_many_ties_are_unfinished():
    assert not compare([1, 2, 3], [1, 2], never_called, TOL, never_called).exact  # no token to judge at step 2
    reference = [A] * 6
    got = compare(reference, [B], lambda step: logits_with(a=20.0, b=19.875), TOL, lambda step: [B], max_ties=3)
    assert got.unfinished and not got.exact and len(got.ties) == 3 and all(t.ok for t in got.ties)


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
TOLERANCE = MEASURED_TOLERANCES[("SmolLM2-135M-Instruct", "cpu", "bfloat16")]
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
    """Each setting, and HF greedy, against the engine's own one-row decoding (nothing verified, no window): at
    every difference a teacher-forced top-two tie within the tolerance measured for this model on a CPU, each
    run resumed from the reference's prefix after each tie (``agreement.compare``)."""
    model, tok = embedded_bf16
    eos = [tok.eos_token_id]
    ids = tok(humaneval_prompts(index + 1)[index])["input_ids"]
    adapter = ModelAdapter(model)

    def one_row_engine():
        return make_engine(model, 7, 5, 0, False, NEW_TOKENS, eos, lookahead_branch=False, context_lookup=False)

    one_row = one_row_engine().generate(ids)
    assert one_row.stats.rows == one_row.stats.rounds + len(ids) - 1, "one-row decoding: one row per round"
    reference = one_row.output_ids
    steps = prefill_logits(adapter, ids, reference)

    def hf_from(k: int) -> list[int]:  # HF greedy teacher-forced on the reference's first k tokens
        return hf_greedy(model, ids + reference[:k], NEW_TOKENS - k, eos)

    runs = {"hf-greedy": (hf_greedy(model, ids, NEW_TOKENS, eos), hf_from)}
    for name, w, n, g, extra in SETTINGS:
        engine = make_engine(model, w, n, g, True, NEW_TOKENS, eos, **extra)
        res = engine.generate(ids)
        assert res.stats.rows > res.stats.rounds + len(ids) - 1, f"{name}: rounds must pack more than one row"
        assert res.stats.accepted_tokens > 0, f"{name}: candidates must be accepted, or nothing was tested"
        runs[name] = (res.output_ids, lambda k, engine=engine: engine.generate(ids + reference[:k]).output_ids)
    for name, (out, resume) in runs.items():
        got = compare(reference, out, steps, TOLERANCE, resume)
        assert got.exact, f"{name} vs one-row decoding: {got.to_dict()}"

"""What "exact" means in half precision: equal to the reference except at steps whose teacher-forced top two tie.

In float32 lp_runner's output is token-identical to one-row greedy decoding (``tests/decoding/test_embedded_exact.py``),
and fp32 with TF32 off stays the oracle on a GPU. In bfloat16 / float16 it cannot be in general: a packed round
computes the live key's row with other shapes (more rows per matmul, a longer mask, padded rows), so kernels sum in
another order and the row's logits move a little. Wherever the two best tokens are closer than that, the argmax may
flip, and from then on the two runs continue differently, both valid greedy continuations. HF ``generate`` is in the
same position against lp_runner's one-row decoding (its own mask and attention path).

The definition (``compare``): ``other`` agrees with ``reference`` when, at every step where they differ (step i,
reference token a, other token b), the reference's teacher-forced logits ``z`` at step i (``prefill_logits``: one
forward over the prompt and the reference's first i tokens) have

* {a, b} as their top two (a third token in between is no rounding of a near tie: it is a bug), and
* ``|z_a - z_b| <= tolerance``, in absolute logit units.

After such a tie the comparison goes on: the other method is run again from the prompt and the reference's first
i + 1 tokens (teacher-forced from the reference, ``resume``), and compared with the rest of the reference, so a bug
later in the sequence cannot hide behind an early tie. A run that stops without a differing token (a length
difference) is not rounding.

Why absolute units, measured per model and device: the gap shift two valid computations of one row can produce is
set by the sums that feed the logits (the model's width, its final norm, the kernels' reduction order), not by the
logits' own magnitude: a tolerance in ulps of the logit is needlessly wide at large logits and too tight at small
ones (below 0.06 at |z| < 2 in bfloat16). ``benchmarks/half_precision.py --device D`` measures it for a model on a
device: the largest shift of the top-two gap between HF's incremental logits and one teacher-forced forward of the
same tokens, times ``TOLERANCE_FACTOR``; ``MEASURED_TOLERANCES`` keeps the values the tests use.

Worked example (tolerance 0.5): at step 3 the reference has a (z_a = 20.25) and the other run b (z_b = 20.0), the
two largest logits: a tie (margin 0.25). The other method is run again from the prompt + reference[:4]; at step 9 it
gives c where the reference has d, z_d = 18.0 but z_c = 17.9 is the third largest: not a tie, so not exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.decoding.layout import compile_round

TOLERANCE_FACTOR = 2.0  # the measured largest gap shift, doubled: a margin for prompts the measurement did not see
MAX_TIES = 32  # comparisons resumed after at most this many ties (each resume is one more generation)
# (model folder name, device type, dtype) -> tolerance in logit units, from `benchmarks/half_precision.py --device`
MEASURED_TOLERANCES: dict[tuple[str, str, str], float] = {
    # --device cpu --limit 4 --max-new-tokens 64: the top-two gap moved by at most 0.25 (any logit by 0.91)
    ("SmolLM2-135M-Instruct", "cpu", "bfloat16"): 0.5,
}


def first_difference(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """The first step where the two differ (a length difference counts at the shorter length); None if equal."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):  # lengths may differ
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


@dataclass(frozen=True)
class Tie:
    """One step where the two runs differ, judged on the reference's teacher-forced logits there."""

    position: int  # counted in new tokens
    reference_token: int
    other_token: int | None  # None: the other run ended there (a length difference)
    margin: float | None = None  # z[reference_token] - z[other_token]
    top_two: bool = False  # the two tokens are the step's two largest logits
    within_tolerance: bool = False

    @property
    def ok(self) -> bool:
        return self.top_two and self.within_tolerance


@dataclass(frozen=True)
class Agreement:
    """How ``other`` relates to ``reference``: every difference in order (the last one the first that failed, if
    any), and whether each is a tie the dtype cannot decide."""

    identical: bool
    ties: tuple[Tie, ...] = ()
    tolerance: float = 0.0
    resumed: int = 0  # times the other method ran again from the reference's prefix
    unfinished: bool = False  # stopped after MAX_TIES ties with reference left: the rest not compared

    @property
    def exact(self) -> bool:
        """Exact in the dtype's sense: identical, or differing only at ties, the whole reference compared."""
        return all(t.ok for t in self.ties) and not self.unfinished

    @property
    def position(self) -> int | None:
        """The first difference (None if identical)."""
        return self.ties[0].position if self.ties else None

    @property
    def margin(self) -> float | None:
        return self.ties[0].margin if self.ties else None

    def to_dict(self) -> dict:
        return {**asdict(self), "exact": self.exact, "position": self.position, "margin": self.margin}


def judge_tie(
    logits: torch.Tensor,  # [vocab], the reference's teacher-forced logits at the step
    reference_token: int,
    other_token: int,
    tolerance: float,
    position: int = 0,
) -> Tie:
    """Whether the two tokens are the step's top two and their margin within ``tolerance`` (logit units).

    Top two: both logits at least the second largest (so a three-way exact tie still counts, while a token with a
    third logit in between does not). The margin is signed: the teacher-forced forward may rank the other first."""
    z = logits.float()  # [vocab]; bfloat16 / float16 values are exact in float32
    za, zb = z[reference_token].item(), z[other_token].item()
    second = z.topk(2).values[1].item()
    top_two = reference_token != other_token and min(za, zb) >= second
    margin = za - zb
    return Tie(position, reference_token, other_token, margin, top_two, abs(margin) <= tolerance)


def compare(
    reference: Sequence[int],
    other: Sequence[int],
    step_logits: Callable[[int], torch.Tensor],  # step i -> [vocab], the reference's logits for new token i
    tolerance: float,
    resume: Callable[[int], Sequence[int]],
    max_ties: int = MAX_TIES,
) -> Agreement:
    """Apply the definition (module doc): each difference judged as a tie, and after each tie the other method
    resumed from the reference's first i + 1 tokens (``resume(i + 1)``: its new tokens after the prompt and that
    prefix; more than the reference has left are ignored) and compared with the rest of the reference. Stops at
    the first difference that is not a tie, at the end of the reference, or after ``max_ties`` ties
    (``unfinished``: not exact, since the rest was not compared)."""
    ties: list[Tie] = []
    start, segment, resumed = 0, list(other), 0
    while True:
        rest = reference[start:]
        i = first_difference(rest, segment[: len(rest)] if len(segment) > len(rest) else segment)
        if i is None:
            return Agreement(not ties, tuple(ties), tolerance, resumed)
        step = start + i
        if i >= len(segment):  # the other run ended first: no token to judge
            ties.append(Tie(step, reference[step], None))
            return Agreement(False, tuple(ties), tolerance, resumed)
        tie = judge_tie(step_logits(step), reference[step], segment[i], tolerance, step)
        ties.append(tie)
        if not tie.ok or step + 1 >= len(reference):
            return Agreement(False, tuple(ties), tolerance, resumed)
        if len(ties) >= max_ties:
            return Agreement(False, tuple(ties), tolerance, resumed, unfinished=True)
        start, segment = step + 1, list(resume(step + 1))
        resumed += 1


def prefill_logits(adapter: ModelAdapter, prompt_ids: Sequence[int], reference: Sequence[int]) -> Callable:
    """``step -> [vocab]``: the logits for new token ``step`` after prompt + reference[:step], from one prefill.

    The forward is the engine's own prefill round (ordinary rows only, causal, a fresh cache, the live key's logits
    only), through the one model wrapper; it is teacher-forced on the reference, so both runs' tokens up to the
    difference are its input.
    """

    def at(step: int) -> torch.Tensor:
        tokens = [*prompt_ids, *reference[:step]]
        layout = compile_round(tokens, 0, [], (0, 0), [])
        with adapter.arena([len(tokens)], scratch=True) as arena:
            logits = adapter.run([layout], [arena.region(len(tokens))])  # [1, vocab]
        return logits[0]

    return at

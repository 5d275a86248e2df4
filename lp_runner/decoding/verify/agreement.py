"""What "exact" means in half precision: equal up to the first step where the reference's top two are a tie.

In float32 lp_runner's output is token-identical to one-row greedy decoding (``tests/decoding/test_embedded_exact.py``).
In bfloat16 / float16 it cannot be in general: a packed round computes the live key's row with other shapes (more rows
per matmul, a longer mask, padded rows), so kernels sum in another order and the row's logits move by a few units in the
last place (ulps). Wherever the two best tokens are closer than that, the argmax may flip, and from
then on the two sequences are different, equally valid greedy continuations. HF ``generate`` is in the same
position against lp_runner's one-row decoding (its own mask and attention path), and even against itself across
thread counts.

The definition: ``other`` agrees with ``reference`` in a dtype when the sequences are identical, or when at their
first difference (step i, reference token a, other token b) the reference's logits for step i put a and b within
``TOLERANCE_ULPS`` ulps of the dtype at their magnitude::

    |z_a - z_b| <= TOLERANCE_ULPS * ulp(max(|z_a|, |z_b|))     z: the reference's logits at step i

After such a step the sequences legitimately diverge, so nothing after it is compared. The logits ``z`` come from
one teacher-forced forward over the prompt and the reference's first i tokens (``prefill_logits``: the engine's
own prefill, one sequence, no candidates), so the margin is measured on a computation of the same prefix, not on
either run's own (unrecorded) logits.

Why 8 ulps: an argmax can flip only where another computation moves the top-two gap by more than the gap, so the
bound is the largest gap shift between two valid computations of the same row. On the embedded SmolLM2-135M in
bfloat16 on CPU, HF's incremental decoding and one teacher-forced forward of the same sequence (bench16, 16
prompts x up to 128 steps, ``benchmarks/results/half_precision.json``) move the top-two gap by at most 7 ulps of
the top-1 logit (any single logit by up to 24, mostly under 10); 8 ulps is that bound rounded up to a power of
two (1.0 at a logit of 16..32 in bfloat16, 3 % of it). The margins actually found at first differences there are
0-2 ulps. ``benchmarks/half_precision.py`` measures the gap shift again on every run and reports it beside the
counts. A difference where the reference's margin is larger is reported as outside the tolerance: a bug, or a
case the bound does not cover, to be looked at, never silently accepted.

Worked example (bfloat16, eps = 2**-7): z_a = 20.25, z_b = 20.0 -> ulp(20.25) = 2**4 * 2**-7 = 0.125, margin 0.25
= 2 ulps: within tolerance. z_a = 22.0, z_b = 20.0: margin 16 ulps: outside.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.decoding.layout import compile_round

TOLERANCE_ULPS = 8.0  # see the module docstring for the measurement behind it


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s representable numbers at ``|value|``: eps * 2**floor(log2 |value|).

    ulp(20.25, bfloat16) = 0.125; ulp(1.0, float16) = 2**-10; below the smallest normal the subnormal spacing.
    """
    info = torch.finfo(dtype)
    if abs(value) < info.tiny:
        return info.tiny * info.eps
    _, exponent = math.frexp(abs(value))  # |value| = m * 2**exponent, 0.5 <= m < 1
    return info.eps * 2.0 ** (exponent - 1)


def first_difference(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """The first step where the two differ (a length difference counts at the shorter length); None if equal."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):  # lengths may differ
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


@dataclass(frozen=True)
class Agreement:
    """How ``other`` relates to ``reference``; the margin fields are None when there is nothing to measure."""

    identical: bool
    position: int | None = None  # first differing step, counted in new tokens
    reference_token: int | None = None
    other_token: int | None = None  # None: ``other`` ended there (a length difference)
    margin: float | None = None  # z[reference_token] - z[other_token], the reference's logits at ``position``
    margin_ulps: float | None = None  # |margin| / ulp(max(|z_a|, |z_b|))
    reference_top1: int | None = None  # the argmax of those logits (== reference_token unless they tie too)
    tolerance_ulps: float = TOLERANCE_ULPS
    within_tolerance: bool = False

    @property
    def exact(self) -> bool:
        """Exact in the dtype's sense: identical, or diverged at a step the dtype cannot decide."""
        return self.identical or self.within_tolerance

    def to_dict(self) -> dict:
        return {**asdict(self), "exact": self.exact}


def margin_at(
    logits: torch.Tensor,  # [vocab], the reference's logits at the step
    reference_token: int,
    other_token: int,
    dtype: torch.dtype,
    tolerance_ulps: float = TOLERANCE_ULPS,
) -> tuple[float, float, bool]:
    """(margin, margin in ulps, within tolerance) of the two tokens' logits, in ``dtype``'s ulps.

    ``dtype`` is the precision the logits were computed in (they may arrive upcast). The margin is signed (the
    teacher-forced forward may itself rank the other token first); the tolerance test uses its size.
    """
    z = logits.float()  # [vocab]; bfloat16 / float16 values are exact in float32
    za, zb = z[reference_token].item(), z[other_token].item()
    margin = za - zb
    ulps = abs(margin) / ulp(max(abs(za), abs(zb)), dtype)
    return margin, ulps, ulps <= tolerance_ulps


def compare(
    reference: Sequence[int],
    other: Sequence[int],
    step_logits: Callable[[int], torch.Tensor],  # step i -> [vocab], the reference's logits for new token i
    dtype: torch.dtype,
    tolerance_ulps: float = TOLERANCE_ULPS,
) -> Agreement:
    """Apply the definition: identical, or the first difference and whether the dtype can decide it.

    ``step_logits`` is called at most once, at the first difference. A length difference with no differing token
    (one run stopped early without a token to compare) is outside the tolerance: rounding does not explain it.
    """
    i = first_difference(reference, other)
    if i is None:
        return Agreement(identical=True, tolerance_ulps=tolerance_ulps)
    if i >= len(reference) or i >= len(other):
        ref_tok = reference[i] if i < len(reference) else None
        oth_tok = other[i] if i < len(other) else None
        return Agreement(False, i, ref_tok, oth_tok, tolerance_ulps=tolerance_ulps)
    logits = step_logits(i)  # [vocab]
    margin, ulps, within = margin_at(logits, reference[i], other[i], dtype, tolerance_ulps)
    top1 = int(logits.argmax().item())
    return Agreement(False, i, reference[i], other[i], margin, ulps, top1, tolerance_ulps, within)


def prefill_logits(adapter: ModelAdapter, prompt_ids: Sequence[int], reference: Sequence[int]) -> Callable:
    """``step -> [vocab]``: the logits for new token ``step`` after prompt + reference[:step], from one prefill.

    The forward is the engine's own prefill round (ordinary rows only, causal, a fresh cache, the live key's logits
    only), through the one model wrapper; it is teacher-forced on the reference, so both runs' tokens up to the
    difference are its input.
    """

    def at(step: int) -> torch.Tensor:
        tokens = [*prompt_ids, *reference[:step]]
        layout = compile_round(tokens, 0, [], (0, 0), [])
        logits = adapter.forward(
            layout.input_ids, layout.position_ids, layout.visibility, adapter.new_cache(), layout.logit_rows
        )  # [1, vocab]
        return logits[0]

    return at

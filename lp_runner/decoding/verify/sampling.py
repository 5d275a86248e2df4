"""Exact sampling through lookahead verification: HF-identical warping and one-hot residual verification.

Two pieces, both pure and host-side:

* ``warp_logits`` turns logits into the distribution HF ``generate(do_sample=True, temperature, top_k, top_p)``
  samples from, using transformers' own warpers in the order and with the skip rules of
  ``GenerationMixin._get_logits_processor`` (see ``sampling_warpers``).
* ``sample_verify`` is the sampling counterpart of ``greedy.greedy_verify``: it walks the candidates' token tree
  with one-hot residual acceptance tests, so the emitted tokens are distributed exactly as ancestral sampling from
  the warped target would distribute them, whatever the candidates were.

Randomness is injected (``draw`` returns uniforms in [0, 1)): nothing here touches a global RNG, so ranks that
must agree can share one stream.

The engine runs the same tests as one tensor program on the device (``sample_tree``); this host walk
(``split_verify``, LP's split of it) is the reference that program is held to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lp_runner.decoding.verify.greedy import Verdict

NO_CANDIDATE = -1  # Verdict.candidate when no candidate token was accepted
# With num_beams == 1, HF's _get_logits_processor gives every warper min_tokens_to_keep=1.
MIN_TOKENS_TO_KEEP = 1
# Rejecting a token whose mass is within this fraction of the remaining residual triggers an exact check that some
# other token still carries mass (only float rounding could make a full-support rejection possible).
_NEAR_FULL = 1e-9

Draw = Callable[[], float]


def sampling_warpers(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """The warpers HF ``generate`` builds for do_sample=True, num_beams=1 and these three values, in its order.

    From transformers 5.24 ``GenerationMixin._get_logits_processor`` (generation/utils.py):
        temperature, skipped when None or == 1.0   -> TemperatureLogitsWarper(temperature)
        top_k,       skipped when None or == 0     -> TopKLogitsWarper(top_k, min_tokens_to_keep=1)
        top_p,       skipped when None or >= 1.0   -> TopPLogitsWarper(top_p, min_tokens_to_keep=1)
    (top_h, min_p, typical_p, epsilon/eta cutoffs sit between or after these and are not configurable here.)
    """
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(temperature)))
    if top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=int(top_k), min_tokens_to_keep=MIN_TOKENS_TO_KEEP))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=float(top_p), min_tokens_to_keep=MIN_TOKENS_TO_KEEP))
    return warpers


def warp_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[num_rows, vocab] logits -> [num_rows, vocab] float64 probabilities, as HF generate samples them.

    HF's sampling loop casts the next-token logits to float32 before the processors run (``_sample``:
    ``outputs.logits[:, -1].to(copy=True, dtype=torch.float32)``), so the warped scores here are bit-identical to
    its ``output_scores``; the softmax is taken in float64 (HF takes it in float32, the same distribution up to
    float32 rounding).
    """
    scores = logits.to(torch.float32)  # [R, V]
    no_ids = torch.empty((scores.shape[0], 0), dtype=torch.long, device=scores.device)  # warpers ignore input_ids
    scores = sampling_warpers(temperature, top_k, top_p)(no_ids, scores)  # [R, V], -inf where filtered
    return torch.softmax(scores.to(torch.float64), dim=-1)  # [R, V]


def sample_from(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of one index from [vocab] non-negative weights (need not sum to 1) with u in [0, 1).

    Returns the first index whose float64 cumulative weight exceeds u * total, so a zero-weight index is never
    returned: its cumulative weight equals its predecessor's. Should u * total reach the total (u = 1.0, which some
    generators can return), the last index that carries weight is returned instead of running off the end.
    """
    return _sample_host(_host(probs), u)


def sample_verify(
    first_probs: torch.Tensor | np.ndarray,
    candidates: Sequence[Sequence[int]],
    candidate_probs: Sequence[torch.Tensor | np.ndarray],
    draw: Draw,
) -> Verdict:
    """Emit tokens distributed exactly as sampling from the target, accepting candidate tokens where it can.

    first_probs: [vocab] warped target distribution after the live key.
    candidates: token suffixes (any lengths) that all follow the live key.
    candidate_probs[c]: [len(candidates[c]), vocab]; row s is the target distribution after reading
        candidates[c][0..s].
    draw: uniform(0, 1) source; one draw per acceptance test and one for the final sampled token.

    Every candidate token is a one-hot proposal. At offset s (target p, residual r = p, survivors = candidates
    still on the accepted path whose suffix reaches offset s) the distinct tokens at offset s are tested in
    candidate order: token c is accepted with probability r[c] / sum(r); on rejection r[c] = 0 (so a token
    proposed twice is tested once). After accepting c the survivors are those with c at offset s, and the next
    target is row s of the lowest survivor (all survivors share the prefix, so every survivor's row is the same
    distribution). When no survivor reaches the next offset, the bonus token is sampled from that target; when
    every distinct token at an offset is rejected, the final token is sampled from the residual. Either way the
    verdict has len(emitted) == hits + 1, and candidate is the lowest-index candidate that starts with all
    accepted tokens (NO_CANDIDATE if nothing was accepted): its first ``hits`` verification rows are the ones to
    commit.

    Worked example: p = (A .2, B .3, C .1, D .4), candidates [[A], [A], [B]], draws 0.5, 0.3, 0.95.
        offset 0: distinct tokens A, B. Test A: 0.5 >= .2, rejected; r = (0, .3, .1, .4) / .8.
                  Test B: 0.3 < .3 / .8 = .375, accepted; survivors [2].
        offset 1: candidate 2 has no token there: bonus y = sample_from(candidate_probs[2][0], 0.95).
        -> Verdict(candidate=2, hits=1, emitted=(B, y)).
    Had B been rejected too (draw >= .375), the final token would come from r = (0, 0, .1, .4) / .5: C or D.

    Why it is exact, one offset at a time (p the target, c1, c2, ... the distinct tokens in test order):
        P(emit c1) = p(c1);
        P(emit c2) = (1 - p(c1)) * p(c2) / (1 - p(c1)) = p(c2), and so on for every tested token;
        P(emit x), x untested = P(all rejected) * p(x) / (1 - sum of tested p) = p(x),
    since P(all rejected) = 1 - sum of tested p. Without tested tokens x is drawn from p directly. So the token
    emitted at every offset is distributed as the target given the tokens emitted before it, and whether another
    offset follows depends only on those tokens (is the emitted prefix a prefix of some candidate that goes on).
    The emitted run is therefore an ancestral sample from the target cut at a prefix-determined point, whatever
    the candidates, their order or duplicates (they only change which draws are used, not the distribution).
    The candidates must not depend on this round's draws.
    """
    target = _host(first_probs)  # [V]
    path = list(range(len(candidates)))  # candidates that start with every token accepted so far
    emitted: list[int] = []
    offset = 0
    while True:
        live = [c for c in path if len(candidates[c]) > offset]
        if not live:  # nothing proposed here: the bonus token comes straight from the target
            emitted.append(_sample_host(target, draw()))
            break
        distinct = list(dict.fromkeys(candidates[c][offset] for c in live))
        accepted = _test_tokens(target, distinct, draw)
        if accepted is None:  # all rejected: sample from the residual (rejected tokens zeroed)
            residual = target.copy()  # [V]
            residual[distinct] = 0.0
            emitted.append(_sample_host(residual, draw()))
            break
        emitted.append(accepted)
        path = [c for c in live if candidates[c][offset] == accepted]
        target = _host(candidate_probs[path[0]])[offset]  # [V] (numpy indexing: torch indexing costs microseconds)
        offset += 1
    hits = len(emitted) - 1
    return Verdict(path[0] if hits else NO_CANDIDATE, hits, tuple(emitted))


def sample_first(first_probs: torch.Tensor | np.ndarray, tokens: Sequence[int], draw: Draw) -> int:
    """Offset 0 of ``sample_verify`` alone: one-hot residual tests of the distinct ``tokens``, else a residual draw.

    Under LP every rank runs this on the same shared draws over the round's distinct first tokens (all ranks know
    the plan); the rank holding the candidates that start with the result continues with ``sample_verify`` on the
    distribution after it. Together that is exactly ``sample_verify`` on all candidates.
    """
    target = _host(first_probs)  # [V]
    accepted = _test_tokens(target, list(dict.fromkeys(tokens)), draw)
    if accepted is not None:
        return accepted
    residual = target.copy()  # [V]
    residual[list(tokens)] = 0.0
    return _sample_host(residual, draw())


def split_verify(
    probs: torch.Tensor | np.ndarray,  # [1 + verify rows, V]: the live key's distribution, then each candidate row's
    plan_first_tokens: Sequence[int],  # the first token of every candidate of the round (all ranks')
    candidates: Sequence[Sequence[int]],  # this rank's candidates; their rows follow row 0 in order
    shared: Draw,  # the stream every rank of the round shares
    local: Draw,  # this rank's own stream
) -> Verdict:
    """One rank's exact sampling verdict, LP's split of ``sample_verify`` (see ``verifier.SamplingVerifier``):
    the first token from ``sample_first`` over every rank's first tokens on the shared stream, then
    ``sample_verify`` over this rank's candidates that start with it on the local one. The host walk, kept as
    the reference the device's ``sample_tree.decide`` is held to (``test_sample_tree``)."""
    probs = _host(probs)  # [1 + verify rows, V]
    first = sample_first(probs[0], plan_first_tokens, shared)
    survivors = [c for c, cand in enumerate(candidates) if cand[0] == first]
    if not survivors:
        return Verdict(NO_CANDIDATE, 0, (first,))
    offsets = [1 + sum(len(candidates[k]) for k in range(c)) for c in survivors]  # row of each survivor's g[0]
    cont = sample_verify(
        probs[offsets[0]],  # the distribution after reading ``first`` (same on every survivor)
        [candidates[c][1:] for c in survivors],
        [probs[o + 1 : o + len(candidates[c])] for c, o in zip(survivors, offsets, strict=True)],
        local,
    )
    winner_local = survivors[cont.candidate] if cont.candidate >= 0 else survivors[0]
    return Verdict(winner_local, 1 + cont.hits, (first, *cont.emitted))


def _host(probs: torch.Tensor | np.ndarray) -> np.ndarray:
    """[..., vocab] probabilities as a float64 host array, a view when they already are one on the CPU (the tests
    and ``split_verify`` pass host arrays; the engine decides on the device, ``sample_tree``).

    The few scalar reads and the one cumulative sum per offset cost well under a microsecond each there, against
    several microseconds per torch call on a small tensor.
    """
    if isinstance(probs, np.ndarray):
        return probs if probs.dtype == np.float64 else probs.astype(np.float64)
    if probs.dtype != torch.float64:  # .to() is not free even when it has nothing to do
        probs = probs.to(torch.float64)
    return probs.numpy(force=True)


def _sample_host(probs: np.ndarray, u: float) -> int:
    cdf = np.cumsum(probs)  # [V] float64
    total = float(cdf[-1])
    if not total > 0.0:
        raise ValueError("cannot sample from a distribution with no mass")
    target = u * total
    if target >= total:  # rounding at u -> 1: the last index with mass, not one past the end
        return int(cdf.searchsorted(total, side="left"))
    return int(cdf.searchsorted(target, side="right"))


def _test_tokens(target: np.ndarray, tokens: Sequence[int], draw: Draw) -> int | None:
    """One-hot residual tests of ``tokens`` (distinct) against [vocab] ``target``: the accepted token or None."""
    remaining = float(target.sum())  # residual mass; renormalising is dividing by it
    rejected_support = 0  # rejected tokens that carried mass
    for tok in tokens:
        mass = float(target[tok])
        if draw() * remaining < mass:
            return tok
        if mass > 0.0:
            if remaining - mass <= _NEAR_FULL * remaining and _is_last_support(target, rejected_support):
                return tok  # exactly: this token holds all the residual mass, its acceptance probability is 1
            rejected_support += 1
            remaining -= mass
    return None


def _is_last_support(target: np.ndarray, rejected_support: int) -> bool:
    """True when the token under test is the only unrejected one with mass (rounding made its test fallible)."""
    return int(np.count_nonzero(target)) == rejected_support + 1

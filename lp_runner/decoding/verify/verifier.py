"""The verifier of a generation, chosen once: greedy (argmax paths) or exact sampling (residual tests).

Both turn one rank's round forward into that rank's ``Verdict`` (its best local candidate, the accepted suffix
tokens, the emitted run), and say which rank's verdict the round publishes (``choose``), so the engine's loop
never asks which mode it is in.

A round's logits leave the device once (``read_back``): greedy reads the argmax of every logit row (R integers);
sampling reads those and the warped distributions of the rows it tests, packed into one float64 tensor. Every
later step (verification, the window's new columns) works on that host copy, so a round costs one device->host
synchronisation whatever the mode (``tests/test_readback.py`` counts them).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from lp_runner.config import GenerationConfig
from lp_runner.decoding.layout import RoundLayout
from lp_runner.decoding.pool import Suffix
from lp_runner.decoding.verify.greedy import Verdict, greedy_verify
from lp_runner.decoding.verify.sampling import NO_CANDIDATE, sample_first, sample_verify, warp_logits
from lp_runner.parallel.exchange import RankReport, sampling_winner, winner


@dataclass(frozen=True)
class ReadBack:
    """What a round's forward hands to the host, in one transfer."""

    preds: list[int]  # argmax of every logit row
    probs: np.ndarray | None = None  # [1 + verify rows, vocab] float64 warped distributions (sampling only)


class Verifier(Protocol):
    def read_back(self, logits: torch.Tensor, layout: RoundLayout) -> ReadBack:
        """The round's one device->host transfer: everything ``verify`` and the window need from ``logits``."""
        ...

    def read_back_many(self, logits: torch.Tensor, layouts: Sequence[RoundLayout]) -> list[ReadBack]:
        """``read_back`` for a batched round (``logits``: each layout's logit rows in turn), still one transfer."""
        ...

    def verify(
        self,
        readback: ReadBack,
        layout: RoundLayout,
        plan_candidates: Sequence[Suffix],  # every candidate of the round, all ranks
        candidates: Sequence[Suffix],  # this rank's
        round_key: tuple[int | str, int],  # (generation, round): names the random streams of a round
    ) -> Verdict: ...

    def choose(self, reports: Sequence[RankReport]) -> int:
        """The rank whose verdict every rank publishes."""
        ...


class GreedyVerifier:
    """Longest verified path (``verify.greedy_verify``); the longest hit over ranks wins, ties to the lowest."""

    def read_back(self, logits: torch.Tensor, layout: RoundLayout) -> ReadBack:
        return ReadBack(logits.argmax(-1).tolist())

    def read_back_many(self, logits: torch.Tensor, layouts: Sequence[RoundLayout]) -> list[ReadBack]:
        preds = logits.argmax(-1).tolist()  # [sum of logit rows]: the one transfer
        return [ReadBack(part) for part in _split(preds, layouts)]

    def verify(self, readback, layout, plan_candidates, candidates, round_key) -> Verdict:
        preds = readback.preds
        return greedy_verify(
            preds[layout.ordinary_logit], candidates, [[preds[i] for i in rows] for rows in layout.verify_logits]
        )

    def choose(self, reports: Sequence[RankReport]) -> int:
        return winner(reports)


class SamplingVerifier:
    """Exact sampling verification (see ``sampling.py``), split so that LP needs no extra collective.

    The first token is decided on every rank from a stream shared by all ranks (seed, generation, round) over
    the round's distinct first tokens; the continuation uses a second stream and only the local candidates that
    start with that token (grouping puts them all on one rank). The lookahead rows stay greedy proposals.
    """

    def __init__(self, gen: GenerationConfig) -> None:
        self.gen = gen

    def read_back(self, logits: torch.Tensor, layout: RoundLayout) -> ReadBack:
        """The argmax of every row (the window's columns) and the warped rows sampling tests, as one float64
        tensor (token ids are exact in float64), moved to the host once."""
        return self.read_back_many(logits, [layout])[0]

    def read_back_many(self, logits: torch.Tensor, layouts: Sequence[RoundLayout]) -> list[ReadBack]:
        gen = self.gen
        parts, shapes, at = [], [], 0
        for layout in layouts:  # each generation's tested rows, warped on the device
            rows = [at + layout.ordinary_logit, *(at + i for r in layout.verify_logits for i in r)]
            probs = warp_logits(logits[rows], gen.temperature, gen.top_k, gen.top_p)  # [1 + verify rows, V] float64
            parts.append(probs.reshape(-1))
            shapes.append(probs.shape)
            at += len(layout.logit_rows)
        packed = torch.cat([*parts, logits.argmax(-1).to(torch.float64)])  # [sum (1 + verify) * V + R]
        host = packed.numpy(force=True)  # the one transfer
        split = sum(part.numel() for part in parts)
        preds = _split(host[split:].astype(np.int64).tolist(), layouts)
        out, at = [], 0
        for shape, pred in zip(shapes, preds, strict=True):
            size = shape[0] * shape[1]
            out.append(ReadBack(pred, host[at : at + size].reshape(shape)))
            at += size
        return out

    def verify(self, readback, layout, plan_candidates, candidates, round_key) -> Verdict:
        gen = self.gen
        shared = random.Random(f"{gen.seed}:{round_key[0]}:{round_key[1]}:first")
        local = random.Random(f"{gen.seed}:{round_key[0]}:{round_key[1]}:rest")
        probs = readback.probs  # [1 + verify rows, V] float64, host
        first = sample_first(probs[0], [c[0] for c in plan_candidates], shared.random)
        survivors = [c for c, cand in enumerate(candidates) if cand[0] == first]
        if not survivors:
            return Verdict(NO_CANDIDATE, 0, (first,))
        offsets = [1 + sum(len(candidates[k]) for k in range(c)) for c in survivors]  # row of each survivor's g[0]
        cont = sample_verify(
            probs[offsets[0]],  # the distribution after reading ``first`` (same on every survivor)
            [candidates[c][1:] for c in survivors],
            [probs[o + 1 : o + len(candidates[c])] for c, o in zip(survivors, offsets, strict=True)],
            local.random,
        )
        winner_local = survivors[cont.candidate] if cont.candidate >= 0 else survivors[0]
        return Verdict(winner_local, 1 + cont.hits, (first, *cont.emitted))

    def choose(self, reports: Sequence[RankReport]) -> int:
        return sampling_winner(reports)


def _split(values: list, layouts: Sequence[RoundLayout]) -> list[list]:
    """``values`` of every layout's logit rows in turn -> one list per layout."""
    out, at = [], 0
    for layout in layouts:
        n = len(layout.logit_rows)
        out.append(values[at : at + n])
        at += n
    return out


def make_verifier(gen: GenerationConfig) -> Verifier:
    return SamplingVerifier(gen) if gen.do_sample else GreedyVerifier()

"""The verifier of a generation, chosen once: greedy (argmax paths) or exact sampling (residual tests).

Both turn one rank's round forward into that rank's ``Verdict`` (its best local candidate, the accepted suffix
tokens, the emitted run), and say which rank's verdict the round publishes (``choose``), so the engine's loop
never asks which mode it is in.

A round's logits leave the device once (``read_back_many``): greedy reads the argmax of every logit row (R
integers); sampling decides its verdict where the logits are (``sample_tree``: the residual tests and the draws of
every node of the round's candidate tree, from a tree the host built before the forward, ``prepare``) and reads
back those few integers with the argmax of every row (the window's columns). Every later step works on that host
copy, so a round costs one device->host synchronisation whatever the mode (``tests/test_readback.py`` counts
them), and no distribution leaves the device.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from lp_runner.config import GenerationConfig
from lp_runner.decoding.layout import RoundLayout
from lp_runner.decoding.pool import Suffix
from lp_runner.decoding.verify.greedy import Verdict, greedy_verify
from lp_runner.decoding.verify.sample_tree import SampleTree, TreeTables, decide, verdict
from lp_runner.decoding.verify.sampling import warp_logits
from lp_runner.device import pins_host_memory
from lp_runner.parallel.exchange import RankReport, sampling_winner, winner


@dataclass(frozen=True)
class ReadBack:
    """What a round's forward hands to the host, in one transfer."""

    preds: list[int]  # argmax of every logit row
    verdict: Verdict | None = None  # sampling: the verdict decided on the device


@dataclass(frozen=True)
class Prepared:
    """A round's sampling verification as built before its forward: the tree and its tables (host, pinned for a
    GPU: their one copy to the device does not wait)."""

    tree: SampleTree
    tables: torch.Tensor  # [table size] int64 (``SampleTree.tables``)
    width: int  # the most tokens a node tests (the tables' Z)


class Verifier(Protocol):
    def prepare(
        self, plan_candidates: Sequence[Suffix], candidates: Sequence[Suffix], round_key: tuple[int | str, int]
    ) -> Prepared | None:
        """What ``read_back_many`` needs besides the logits, made before the forward (None: nothing)."""
        ...

    def read_back_many(
        self, logits: torch.Tensor, layouts: Sequence[RoundLayout], prepared: Sequence[Prepared | None]
    ) -> list[ReadBack]:
        """The round's one device->host transfer for every generation of the round (``logits``: each layout's logit
        rows in turn): everything ``verify`` and the window need."""
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

    def prepare(
        self, plan_candidates: Sequence[Suffix], candidates: Sequence[Suffix], round_key: tuple[int | str, int]
    ) -> None:
        return None  # greedy needs nothing but the logits

    def read_back_many(
        self, logits: torch.Tensor, layouts: Sequence[RoundLayout], prepared: Sequence[None] = ()
    ) -> list[ReadBack]:
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
    start with that token (grouping puts them all on one rank). The lookahead rows stay greedy proposals. The
    streams' uniforms are drawn on the host before the forward (``prepare``: they name the samples, so a seed
    gives the same tokens on any device); the tests and the draws run on the device (``sample_tree.decide``),
    the same verdicts as the host walk ``sampling.split_verify``.
    """

    def __init__(self, gen: GenerationConfig, device: torch.device | None = None) -> None:
        self.gen = gen
        self.pin = pins_host_memory(device or torch.device("cpu"))

    def prepare(
        self, plan_candidates: Sequence[Suffix], candidates: Sequence[Suffix], round_key: tuple[int | str, int]
    ) -> Prepared:
        gen = self.gen
        shared = random.Random(f"{gen.seed}:{round_key[0]}:{round_key[1]}:first")
        local = random.Random(f"{gen.seed}:{round_key[0]}:{round_key[1]}:rest")
        tree = SampleTree.build([c[0] for c in plan_candidates], candidates, shared, local)
        return Prepared(tree, tree.tables(self.pin), max(1, max(len(t) for t in tree.tokens)))

    def read_back_many(
        self, logits: torch.Tensor, layouts: Sequence[RoundLayout], prepared: Sequence[Prepared]
    ) -> list[ReadBack]:
        """Each generation's tested rows warped and decided on the device; their verdicts and the argmax of every
        row in one int64 tensor, moved to the host once."""
        gen = self.gen
        parts, at = [logits.argmax(-1)], 0  # [sum of logit rows]
        for layout, prep in zip(layouts, prepared, strict=True):
            rows = [at + layout.ordinary_logit, *(at + i for r in layout.verify_logits for i in r)]
            probs = warp_logits(logits[rows], gen.temperature, gen.top_k, gen.top_p)  # [1 + verify rows, V] float64
            tables = TreeTables.views(prep.tables.to(logits.device, non_blocking=True), prep.tree.size, prep.width)
            parts.append(decide(probs, tables, prep.tree.max_depth))  # [3 + depth + 1]
            at += len(layout.logit_rows)
        host = torch.cat(parts).tolist()  # the one transfer
        preds = _split(host[:at], layouts)
        out, at = [], at
        for pred, prep in zip(preds, prepared, strict=True):
            size = 3 + prep.tree.max_depth + 1
            out.append(ReadBack(pred, verdict(host[at : at + size])))
            at += size
        return out

    def verify(self, readback, layout, plan_candidates, candidates, round_key) -> Verdict:
        return readback.verdict  # decided on the device, in ``read_back_many``

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


def make_verifier(gen: GenerationConfig, device: torch.device | None = None) -> Verifier:
    """The generation's verifier; ``device``: where its rounds' logits are (sampling pins its tables for a GPU)."""
    return SamplingVerifier(gen, device) if gen.do_sample else GreedyVerifier()

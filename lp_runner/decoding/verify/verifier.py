"""The verifier of a generation, chosen once: greedy (argmax paths) or exact sampling (residual tests).

Both turn one rank's round forward into that rank's ``Verdict`` (its best local candidate, the accepted suffix
tokens, the emitted run), and say which rank's verdict the round publishes (``choose``), so the engine's loop
never asks which mode it is in.

A round's logits leave the device once (``read_back_many``): greedy reads the argmax of every logit row (R
integers); sampling decides its verdict where the logits are (``sample_tree``: the residual tests and the draws of
every node of the round's candidate tree, from a tree the host built before the forward, ``prepare``) and reads
back those few integers with the argmax of every row (the window's columns). Every later step works on that host
copy, so a round costs one device->host synchronisation whatever the mode (``tests/decoding/test_readback.py`` counts
them), and no distribution leaves the device. Where the logits already are on the host (a CPU forward), the same
verdicts come from the host walk (``sampling.split_verify``): it visits only the nodes the walk reaches, where
the tensor program decides every node of the tree, so on a CPU the walk is the cheaper of two equal answers.
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
from lp_runner.decoding.verify.sample_tree import SampleTree, TreeTables, decide, verdict
from lp_runner.decoding.verify.sampling import split_verify, warp_logits
from lp_runner.device import pins_host_memory
from lp_runner.parallel.exchange import RankReport, sampling_winner, winner


@dataclass(frozen=True)
class ReadBack:
    """What a round's forward hands to the host, in one transfer."""

    preds: list[int]  # argmax of every logit row
    verdict: Verdict | None = None  # sampling: the verdict decided on the device


@dataclass(frozen=True)
class HostWalk:
    """A round's sampling verification where the logits are on the host: what ``split_verify`` needs."""

    plan_first: list[int]  # the first token of every candidate of the round (all ranks')
    candidates: Sequence[Suffix]  # this rank's candidates
    round_key: tuple[int | str, int]


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
    ) -> Prepared | HostWalk | None:
        """What ``read_back_many`` needs besides the logits, made before the forward (None: nothing)."""
        ...

    def read_back_many(
        self, logits: torch.Tensor, layouts: Sequence[RoundLayout], prepared: Sequence[Prepared | HostWalk | None]
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
    """Longest verified path (``greedy.greedy_verify``); the longest hit over ranks wins, ties to the lowest."""

    def prepare(
        self, plan_candidates: Sequence[Suffix], candidates: Sequence[Suffix], round_key: tuple[int | str, int]
    ) -> None:
        return None  # greedy needs nothing but the logits

    def read_back_many(
        self, logits: torch.Tensor, layouts: Sequence[RoundLayout], prepared: Sequence[None] = ()
    ) -> list[ReadBack]:
        return [ReadBack(part) for part in _split(argmax_rows(logits), layouts)]

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

    def __init__(
        self, gen: GenerationConfig, device: torch.device | None = None, on_device: bool | None = None
    ) -> None:
        """``on_device``: decide with the tensor program (``sample_tree.decide``); None: where the logits are not
        on the host (``device`` not a CPU)."""
        device = device or torch.device("cpu")
        self.gen = gen
        self.pin = pins_host_memory(device)
        self.on_device = device.type != "cpu" if on_device is None else on_device

    def _streams(self, round_key: tuple[int | str, int]) -> tuple[random.Random, random.Random]:
        """The round's two seeded streams: the one every rank shares (first token), this rank's own (the rest)."""
        seed = self.gen.seed
        return (random.Random(f"{seed}:{round_key[0]}:{round_key[1]}:first"),
                random.Random(f"{seed}:{round_key[0]}:{round_key[1]}:rest"))  # fmt: skip

    def prepare(
        self, plan_candidates: Sequence[Suffix], candidates: Sequence[Suffix], round_key: tuple[int | str, int]
    ) -> Prepared | HostWalk:
        plan_first = [c[0] for c in plan_candidates]
        if not self.on_device:
            return HostWalk(plan_first, candidates, round_key)
        tree = SampleTree.build(plan_first, candidates, *self._streams(round_key))
        return Prepared(tree, tree.tables(self.pin), max(1, max(len(t) for t in tree.tokens)))

    def read_back_many(
        self, logits: torch.Tensor, layouts: Sequence[RoundLayout], prepared: Sequence[Prepared | HostWalk]
    ) -> list[ReadBack]:
        """Each generation's tested rows warped and decided on the device; their verdicts and the argmax of every
        row in one int64 tensor, moved to the host once."""
        gen = self.gen
        if not self.on_device:
            return self._walk_on_host(logits, layouts, prepared)
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

    def _walk_on_host(
        self, logits: torch.Tensor, layouts: Sequence[RoundLayout], walks: Sequence[HostWalk]
    ) -> list[ReadBack]:
        """Logits on the host: each generation's tested rows warped, and with the argmax of every row made one
        float64 array in one read (token ids are exact in float64); each verdict from the host walk on the same
        seeded streams as ``prepare``'s tree would draw (``test_sample_tree`` holds the two equal)."""
        gen = self.gen
        parts, shapes, at = [], [], 0
        for layout in layouts:
            rows = [at + layout.ordinary_logit, *(at + i for r in layout.verify_logits for i in r)]
            probs = warp_logits(logits[rows], gen.temperature, gen.top_k, gen.top_p)  # [1 + verify rows, V] float64
            parts.append(probs.reshape(-1))
            shapes.append(probs.shape)
            at += len(layout.logit_rows)
        host = torch.cat([*parts, logits.argmax(-1).to(torch.float64)]).numpy(force=True)  # the one read
        split = sum(part.numel() for part in parts)
        preds = _split(host[split:].astype(np.int64).tolist(), layouts)
        out, at = [], 0
        for shape, pred, walk in zip(shapes, preds, walks, strict=True):
            probs = host[at : at + shape[0] * shape[1]].reshape(shape)
            shared, local = self._streams(walk.round_key)
            decided = split_verify(probs, walk.plan_first, walk.candidates, shared.random, local.random)
            out.append(ReadBack(pred, decided))
            at += shape[0] * shape[1]
        return out

    def verify(self, readback, layout, plan_candidates, candidates, round_key) -> Verdict:
        return readback.verdict  # decided in ``read_back_many``

    def choose(self, reports: Sequence[RankReport]) -> int:
        return sampling_winner(reports)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The argmax of every row of ``logits`` ([R, vocab]) as host integers: the round's one device->host transfer.

    Host logits (a CPU forward) go through numpy, whose argmax is vectorized where torch's CPU argmax compares
    one element at a time (about a tenth of the time over a 49k vocabulary); both return the first maximum, a NaN
    counting as the maximum (``tests/decoding/test_readback.py`` holds them equal), as ``generate``'s greedy
    ``argmax`` does."""
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_FLOATS:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


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

"""LP in one process: P engines on threads behind an in-memory all_gather, and the exchange on its own.

The engines, the coordinator replicas, the payloads, the digest check and the publication are all the real ones;
only the transport is an in-process barrier instead of gloo/NCCL. That makes LP's protocol (winner choice,
re-feed by the losing ranks, merged window columns) testable in seconds and debuggable in one process; the
torchrun tests (``test_lp.py``) check the real transport.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from dist_helpers import LocalGroup
from helpers import hf_greedy, random_prompt, shared_tiny_model

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.config import GenerationConfig, LookaheadConfig
from lp_runner.decoding.engine import LookaheadEngine
from lp_runner.errors import DistributedError
from lp_runner.parallel.comm import SoloCommunicator
from lp_runner.parallel.exchange import Entry, agree_batch, pack_values, winner


def run_ranks(world_size: int, la: LookaheadConfig, prompt: Sequence[int], max_new_tokens: int, family="llama"):
    """Every rank's GenerationResult for one prompt, the ranks running concurrently on threads."""
    model = shared_tiny_model(family)
    group = LocalGroup(world_size)
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    engines = [LookaheadEngine(ModelAdapter(model), la, gen, [], group.comm(r)) for r in range(world_size)]
    return group.run_ranks(lambda rank: engines[rank].generate(list(prompt)), timeout=120)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("wng", [(7, 5, 7), (4, 3, 2)])
def test_lp_in_one_process_matches_hf_greedy(world_size: int, wng: tuple[int, int, int]) -> None:
    w, n, g = wng
    la = LookaheadConfig(window_size=w, ngram_size=n, verification_set_size=g)
    prompt = random_prompt(24, seed=5)
    expected = hf_greedy(shared_tiny_model("llama"), prompt, 48)
    results = run_ranks(world_size, la, prompt, 48)
    for rank, res in enumerate(results):
        assert res.output_ids == expected, f"rank {rank}"
    wins = [rec.winner_rank for rec in results[0].stats.records]
    assert all([rec.winner_rank for rec in r.stats.records] == wins for r in results)  # one decision per round
    assert results[0].stats.collectives == results[0].stats.rounds  # one exchange per round


def test_lp_in_one_process_ranks_other_than_0_win_and_publish() -> None:
    """The losing ranks adopt the winner's tokens and re-feed them: with rank 1 winning some rounds outright,
    the output can only be exact if publication from rank 1 works."""
    la = LookaheadConfig(window_size=7, ngram_size=5, verification_set_size=7)
    prompt = random_prompt(24, seed=5)
    results = run_ranks(2, la, prompt, 64)
    assert results[0].output_ids == hf_greedy(shared_tiny_model("llama"), prompt, 64)
    wins = results[0].stats.wins_by_rank
    assert wins.get("1", 0) > 0, wins
    won_by_1 = [rec for rec in results[0].stats.records if rec.winner_rank == 1]
    assert any(rec.hits > 0 for rec in won_by_1)  # rank 1's accepted tokens were published


class Gathered(SoloCommunicator):
    """Rank 0 of a group whose other ranks sent ``others`` (their payloads as host values): the real gather's
    result, without a transport."""

    rank, collectives = 0, 0

    def __init__(self, *others: list[int]) -> None:
        super().__init__()
        self.others = others
        self.world_size = 1 + len(others)

    def all_gather(self, payload: torch.Tensor) -> torch.Tensor:
        return torch.stack([payload, *(torch.tensor(o, dtype=torch.long) for o in self.others)])


def test_one_rank_alone_decides_as_a_gather_of_one_rank() -> None:
    """P = 1 without a launcher skips the collective; its decision must be the one a one-rank gather makes."""
    entry = Entry(123, 2, (7, 8, 9), 4, {0: 11, 1: 12}, max_emit=5, window_size=3, choose=winner)
    (solo,) = agree_batch(None, [entry])
    (gather,) = agree_batch(Gathered(), [entry])
    assert (solo.rank, solo.hits, solo.emitted, solo.candidate, solo.columns, solo.won) == (
        gather.rank,
        gather.hits,
        gather.emitted,
        gather.candidate,
        gather.columns,
        gather.won,
    )
    assert (gather.rank, gather.hits, gather.emitted, gather.candidate, gather.won) == (0, 2, (7, 8, 9), 4, True)


def test_agreement_refuses_replicas_that_planned_differently() -> None:
    other = pack_values(0, (5,), 999, -1, {}, 5, 3)  # rank 1 planned another round (digest 999)
    with pytest.raises(DistributedError, match="disagree on the round plan"):
        agree_batch(Gathered(other), [Entry(123, 1, (7, 8), 0, {}, 5, 3, winner)])


def test_agreement_merges_columns_and_adopts_the_longest_hit() -> None:
    other = pack_values(3, (4, 5, 6, 7), 123, 2, {2: 33}, 5, 3)
    (d,) = agree_batch(Gathered(other), [Entry(123, 1, (7, 8), 0, {0: 11, 1: 22}, 5, 3, winner)])
    assert (d.rank, d.hits, d.emitted, d.candidate, d.won) == (1, 3, (4, 5, 6, 7), 2, False)
    assert d.columns == {0: 11, 1: 22, 2: 33}


def test_pack_values_is_the_payload_layout() -> None:
    """A block by hand: header, emitted padded to E, columns by position."""
    assert pack_values(1, (7, 8), 5, 0, {1: 9}, 3, 2) == [1, 2, 5, 0, 7, 8, -1, -1, 9]


def test_a_round_payload_is_one_host_tensor_gathered_once() -> None:
    """Every generation's block in one tensor, made by the communicator once (pinned there for a GPU) and passed
    to the one all_gather as it is; the decisions come from the one read-back."""

    class Spy(SoloCommunicator):
        rank, world_size = 0, 2

        def __init__(self) -> None:
            super().__init__()
            self.made, self.gathered = [], []

        def host_payload(self, values):
            self.made.append(super().host_payload(values))
            return self.made[-1]

        def all_gather(self, payload: torch.Tensor) -> torch.Tensor:
            self.gathered.append(payload)
            return torch.stack([payload, payload])

    comm = Spy()
    entries = [Entry(5, 1, (7, 8), 0, {0: 3}, 3, 2, winner), Entry(6, 0, (4,), -1, {1: 2}, 4, 3, winner)]
    decisions = agree_batch(comm, entries)
    assert len(comm.made) == len(comm.gathered) == 1 and comm.gathered[0] is comm.made[0]
    blocks = pack_values(1, (7, 8), 5, 0, {0: 3}, 4, 3) + pack_values(0, (4,), 6, -1, {1: 2}, 4, 3)
    assert comm.made[0].tolist() == blocks
    assert [(d.hits, d.emitted, d.columns) for d in decisions] == [(1, (7, 8), {0: 3}), (0, (4,), {1: 2})]

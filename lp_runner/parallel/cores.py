"""CPU jobs of D groups: the cores a group leaves when the queue runs dry go to the groups still running.

At the end of a D-group job the last prompts run while the other groups have nothing left to do: on a GPU node
their devices idle, on a CPU node their cores do too, and the job waits on its slowest group at a fraction of the
machine (measured on 2 cores, bench16, D = 2 x 1 thread: each group busy 89-99% of the job). A CPU forward takes
more threads mid-generation at no cost to its tokens: the thread count splits the same products differently
across cores, as a different row count does, and greedy output is checked against HF greedy either way. So a
rank with no more work says so in the launcher's store, and every busy rank on the same node looks every
``PERIOD_S`` between rounds and takes its share of the node's threads (``shared_threads``).

The idle ranks of a node are one integer in the store: each adds ``1 << LOCAL_RANK`` once, so the sum is a
bitmask of who left (nodes of up to 62 ranks; beyond that nothing is shared). A node is torchrun's
``GROUP_RANK`` (the agent whose LOCAL_RANKs these are).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from lp_runner.logs import log
from lp_runner.parallel.groups import store_call

PERIOD_S = 0.5  # how often a busy rank looks at its node's idle mask (one store round trip, ~0.1 ms)
MAX_LOCAL_RANKS = 62  # bits of the store's int64 counter a mask may use


def shared_threads(threads: int, local_ranks: int, idle_mask: int, local_rank: int) -> int:
    """This busy rank's threads once the ranks in ``idle_mask`` have left: the node's ``threads x local_ranks``
    split over the busy ranks, the remainder to the lowest local ranks; never fewer than ``threads``.

    ``shared_threads(1, 2, 0b10, 0)`` -> 2; ``shared_threads(1, 3, 0b100, 1)`` -> 1 (3 threads over ranks 0
    and 1: rank 0 takes 2); ``shared_threads(4, 4, 0, 2)`` -> 4 (nobody left)."""
    busy = [r for r in range(local_ranks) if not (idle_mask >> r) & 1]
    if local_rank not in busy:
        return threads
    base, extra = divmod(threads * local_ranks, len(busy))
    return max(threads, base + (1 if busy.index(local_rank) < extra else 0))


class CoreShare:
    """One rank's part: ``leave`` when its group has no more work, ``__call__`` (an ``on_commit`` hook) while it
    generates. Thread changes are logged; a lost store is a ``DistributedError``."""

    def __init__(
        self,
        store: dist.Store,
        node: str,
        local_rank: int,
        local_ranks: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.key = f"idle/{node}"
        self.local_rank = local_rank
        self.local_ranks = local_ranks
        self.threads = torch.get_num_threads()  # this rank's own share, as start_worker set it
        self.clock = clock
        self.looked = clock()

    @classmethod
    def from_env(cls, connect: Callable[[], dist.Store]) -> CoreShare | None:
        """This rank's share under torchrun (``connect``: a client of the launcher's store); None where there is
        nothing to share (alone on its node, or a node of more than MAX_LOCAL_RANKS ranks)."""
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if not 1 < local_ranks <= MAX_LOCAL_RANKS:
            return None
        return cls(connect(), os.environ.get("GROUP_RANK", "0"), int(os.environ.get("LOCAL_RANK", "0")), local_ranks)

    def leave(self) -> None:
        """This rank has no more work: its threads go to the busy ranks of its node."""
        self._call(lambda: self.store.add(self.key, 1 << self.local_rank))

    def __call__(self, tokens: Sequence[int] = ()) -> None:
        now = self.clock()
        if now - self.looked < PERIOD_S:
            return
        self.looked = now
        mask = self._call(lambda: self.store.add(self.key, 0))
        want = shared_threads(self.threads, self.local_ranks, mask, self.local_rank)
        if want != torch.get_num_threads():
            log.info(
                "local rank %d: %d of %d ranks on this node have no more work; %d threads",
                self.local_rank,
                mask.bit_count(),
                self.local_ranks,
                want,
            )
            torch.set_num_threads(want)

    @staticmethod
    def _call(op: Callable[[], int]) -> int:
        return store_call(op, "store")

"""The bounded wait on a collective the host is not blocked on (NCCL's): how late it sees the completion, and
that a dead peer still raises at the bound.

The work is a stand-in for NCCL's work handle only (no CUDA here): it completes at a chosen instant of a simulated
clock that the wait reads and that its sleeps advance, so the rule is checked exactly, independent of this
machine's load. The real gloo pair with a stalled peer is ``tests/test_placement.py``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from lp_runner.errors import DistributedError
from lp_runner.parallel import comm
from lp_runner.parallel.comm import POLL_S, SPIN_S, wait_bounded

QUERY_S = 2e-6  # what one is_completed (an event query) costs on the simulated clock
YIELD_S = 1e-6  # what a sleep(0) costs: a syscall that releases the GIL


class Clock:
    """Simulated time: reading it is free, a poll costs QUERY_S, a sleep advances it by what was asked."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds if seconds > 0 else YIELD_S


class Work:
    """A collective issued at the clock's current instant that completes ``after_s`` later (never: inf)."""

    def __init__(self, clock: Clock, after_s: float) -> None:
        self.clock = clock
        self.done_at = clock.now + after_s
        self.polls = 0
        self.waited = False

    def is_completed(self) -> bool:
        self.polls += 1
        self.clock.now += QUERY_S
        return self.clock.now >= self.done_at

    def wait(self) -> bool:
        self.waited = True
        return True


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(comm, "time", SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    return clock


ONE_POLL_S = QUERY_S + YIELD_S


@pytest.mark.parametrize(
    "after_s, late_by_at_most",
    [
        (0.0, QUERY_S),  # already done: one query, no sleep
        (50e-6, ONE_POLL_S),  # an NVLink all_gather of a few hundred bytes
        (1.0e-3, ONE_POLL_S),  # the case sleeps doubling from 50 us saw at 1.55 ms
        (SPIN_S * 0.9, ONE_POLL_S),  # still spinning
        (8e-3, POLL_S + QUERY_S),  # a peer late by more than the spin: within one fixed sleep
        (0.75, POLL_S + QUERY_S),
    ],
)
def test_a_completed_collective_is_seen_within_one_poll(clock: Clock, after_s: float, late_by_at_most: float):
    work = Work(clock, after_s)
    wait_bounded(work, timeout_s=10.0, host_blocks=False)
    late_by = clock.now - work.done_at
    assert 0 <= late_by <= late_by_at_most + 1e-12
    assert work.waited  # the collective's own error, if any, is raised by its wait
    if after_s < SPIN_S:
        assert all(s == 0 for s in clock.sleeps)  # no real sleep while spinning
    else:
        assert set(clock.sleeps) == {0.0, POLL_S}  # spin, then one fixed interval: no growing sleeps


def test_a_dead_peer_raises_at_the_bound_without_burning_the_whole_wait(clock: Clock) -> None:
    """A peer that never joins: DistributedError once ``timeout_s`` has passed (and not much after), having
    polled about SPIN_S / (one spin poll) + the rest / POLL_S times, not millions."""
    work = Work(clock, math.inf)
    start = clock.now
    with pytest.raises(DistributedError, match=r"no answer within parallel.timeout_s=2 s"):
        wait_bounded(work, timeout_s=2.0, host_blocks=False)
    assert 2.0 <= clock.now - start <= 2.0 + POLL_S + 2 * QUERY_S
    assert not work.waited
    spins = SPIN_S / ONE_POLL_S
    assert work.polls <= spins + (2.0 - SPIN_S) / POLL_S + 2


def test_a_host_blocking_wait_is_left_to_the_backend(clock: Clock) -> None:
    """gloo: ``wait`` blocks and honours the group's timeout itself; no polling, no sleeping."""
    work = Work(clock, math.inf)
    wait_bounded(work, timeout_s=2.0, host_blocks=True)
    assert (work.waited, work.polls, clock.sleeps) == (True, 0, [])

"""The garbage collector around a worker's start-up and the preset's search (lp_runner/collector.py)."""

from __future__ import annotations

import gc

import pytest

from lp_runner.collector import collector_paused, worker_start_up


@pytest.fixture
def collector_restored():
    """Whatever a test does to the collector, the next test finds it enabled and nothing frozen."""
    yield
    gc.unfreeze()
    gc.enable()


class Node:
    """A tracked object that can sit in a reference cycle."""

    def __init__(self) -> None:
        self.other = None


def test_start_up_pauses_the_collector_then_freezes_what_it_made(collector_restored) -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    with worker_start_up():
        assert not gc.isenabled()
        made = [Node() for _ in range(100)]
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(made)  # out of every later collection
    frozen = gc.get_freeze_count()
    after = Node()
    after.other = after  # a cycle made after the start-up is still collected
    del after
    assert gc.collect() >= 1
    assert gc.get_freeze_count() == frozen


def test_start_up_keeps_a_disabled_collector_disabled_and_freezes_on_failure(collector_restored) -> None:
    gc.disable()
    with pytest.raises(RuntimeError), worker_start_up():
        raise RuntimeError("the model did not load")
    assert not gc.isenabled() and gc.get_freeze_count() > 0


def test_paused_collector_resumes(collector_restored) -> None:
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()  # it was off before: it stays off

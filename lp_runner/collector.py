"""Python's cyclic garbage collector around the work that allocates the most objects.

The collector runs when allocations outnumber deallocations by a threshold, and a full collection walks every
tracked object. A process with torch, transformers, a tokenizer and a model loaded tracks some 370,000 of them
(the embedded model), so each full collection costs about 0.2 s on a 2-core CPU. Two
places paid for them without need, neither making reference cycles worth collecting:

* the auto preset's search (millions of short-lived tuples, freed by reference counting): ``collector_paused``;
* a worker's start-up (loading, the backend, calibration): the README's main command made 7 full collections, the
  last of them, owed by the start-up's objects, inside the first prompt's generation (0.18-0.21 s of a 2.2-2.6 s
  generation of 256 tokens). ``worker_start_up`` pauses the collector while a process's worker starts, then
  freezes what is alive (``gc.freeze``: never scanned again, still freed by reference counting) and lets
  collections resume over what the job itself allocates. A collection after that start-up found 160 objects to
  free: freezing holds nothing that would have been freed. The whole command ran 0.88x the wall time
  (``docs/results.md``, "Python's garbage collector and a worker's start-up").
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector held off for the duration (a decorator or a ``with``); collections resume, and catch up, after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def worker_start_up() -> Iterator[None]:
    """Around the start of the worker a process runs for the rest of its life (a CLI rank, a Ray actor): the collector
    held off, then every object alive frozen out of later collections, and the collector resumed.

    Only where the worker lives as long as the process: an object frozen while alive and later dropped in a reference
    cycle is never collected, so a library caller starting one worker after another (``lp_runner.api``) does not get
    this."""
    with collector_paused():
        try:
            yield
        finally:
            gc.freeze()  # before the collector resumes: what start-up made is never scanned

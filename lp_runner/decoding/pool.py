"""The n-gram pool: for each first token (key), at most G suffixes of N-1 tokens, least recently used first out.

Why LRU with a per-key cap: the verification budget per round is G suffixes for one key, so keeping more per key
only costs memory, and the freshest trajectory n-grams are the ones most likely to match the text being written.

A round's n-grams are queued (``defer_many``), not inserted, where the round is committed: the next round reads
one key only (its live key), so only that key's queued n-grams are inserted before it plans (``candidates`` does
it), and the rest once its forward is launched (``flush``), off the round's critical path. Each key's n-grams are
still inserted in their order before that key is read, so every read sees what inserting at once would give.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

Suffix = tuple[int, ...]


class NGramPool:
    """key -> LRU-ordered suffixes (oldest first), at most ``cap`` per key.

    Worked example (cap 2): insert 5:(1,2), 5:(3,4), 5:(1,2) -> 5 holds [(3,4), (1,2)] (the re-insert moved
    (1,2) to most recent); insert 5:(7,8) -> the oldest (3,4) is evicted: [(1,2), (7,8)];
    ``candidates(5, 2)`` -> [(7,8), (1,2)] (most recent first).
    """

    def __init__(self, cap: int, suffix_len: int) -> None:
        if cap < 0:
            raise ValueError(f"pool cap must be >= 0, got {cap}")
        self.cap = cap
        self.suffix_len = suffix_len
        self._buckets: dict[int, OrderedDict[Suffix, None]] = {}
        self._queued: list[tuple[int, Sequence[int]]] = []  # deferred n-grams, in insertion order

    def insert(self, key: int, suffix: Sequence[int]) -> None:
        if self.cap == 0:
            return
        if self._queued:
            self._settle(key)  # this key's queued n-grams go first: its LRU order is the order they came in
        self._insert(key, suffix)

    def insert_many(self, ngrams: Iterable[tuple[int, Sequence[int]]]) -> None:
        for key, suffix in ngrams:
            self.insert(key, suffix)

    def defer_many(self, ngrams: Iterable[tuple[int, Sequence[int]]]) -> None:
        """Queue ``ngrams`` for insertion: each key's are inserted before that key is next read (``candidates``)
        or written, the rest at ``flush``. Reads see the same pool as after ``insert_many``."""
        if self.cap:
            self._queued.extend(ngrams)

    def flush(self) -> None:
        """Insert every queued n-gram, in order (after the round's forward is launched)."""
        queued, self._queued = self._queued, []
        for key, suffix in queued:
            self._insert(key, suffix)

    def _settle(self, key: int) -> None:
        """Insert ``key``'s queued n-grams (in order), keeping the others queued.

        Example: queued [(5, a), (7, b), (5, c)], settle 5 -> 5 gets a then c; [(7, b)] stays queued."""
        rest = []
        for ngram in self._queued:
            if ngram[0] == key:
                self._insert(key, ngram[1])
            else:
                rest.append(ngram)
        self._queued = rest

    def _insert(self, key: int, suffix: Sequence[int]) -> None:
        suffix = tuple(suffix)
        if len(suffix) != self.suffix_len:
            raise ValueError(f"suffix length {len(suffix)} != {self.suffix_len}")
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = OrderedDict()
        if suffix in bucket:
            bucket.move_to_end(suffix)
            return
        bucket[suffix] = None
        if len(bucket) > self.cap:
            bucket.popitem(last=False)

    def candidates(self, key: int, limit: int) -> list[Suffix]:
        """Up to ``limit`` suffixes for ``key``, most recently inserted first (its queued n-grams inserted first)."""
        if self._queued:
            self._settle(key)
        bucket = self._buckets.get(key)
        if not bucket or limit <= 0:
            return []
        out: list[Suffix] = []
        for suffix in reversed(bucket):
            out.append(suffix)
            if len(out) == limit:
                break
        return out

    def bucket(self, key: int) -> list[Suffix]:
        """The suffixes for ``key``, oldest first (for tests and inspection)."""
        if self._queued:
            self._settle(key)
        return list(self._buckets.get(key, ()))

    def __len__(self) -> int:
        self.flush()
        return sum(len(b) for b in self._buckets.values())


def sequence_ngrams(tokens: Sequence[int], n: int) -> list[tuple[int, Suffix]]:
    """All (key, suffix) n-grams of a token sequence, in order: [1,2,3,4], n=3 -> [(1,(2,3)), (2,(3,4))]."""
    return [(tokens[i], tuple(tokens[i + 1 : i + n])) for i in range(len(tokens) - n + 1)]

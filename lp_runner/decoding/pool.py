"""The n-gram pool: for each first token (key), at most G suffixes of N-1 tokens, least recently used first out.

Why LRU with a per-key cap: the verification budget per round is G suffixes for one key, so keeping more per key
only costs memory, and the freshest trajectory n-grams are the ones most likely to match the text being written.
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

    def insert(self, key: int, suffix: Sequence[int]) -> None:
        if self.cap == 0:
            return
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

    def insert_many(self, ngrams: Iterable[tuple[int, Sequence[int]]]) -> None:
        for key, suffix in ngrams:
            self.insert(key, suffix)

    def candidates(self, key: int, limit: int) -> list[Suffix]:
        """Up to ``limit`` suffixes for ``key``, most recently inserted first."""
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
        return list(self._buckets.get(key, ()))

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())


def sequence_ngrams(tokens: Sequence[int], n: int) -> list[tuple[int, Suffix]]:
    """All (key, suffix) n-grams of a token sequence, in order: [1,2,3,4], n=3 -> [(1,(2,3)), (2,(3,4))]."""
    return [(tokens[i], tuple(tokens[i + 1 : i + n])) for i in range(len(tokens) - n + 1)]

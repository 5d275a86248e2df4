"""The job's store (``lookahead.pool_scope: job``): earlier generations of one run propose continuations.

Chat outputs of one model repeat themselves across prompts (openings, list scaffolding, closing sentences, code
boilerplate), which a per-prompt pool and context index never see. ``JobPool`` keeps the committed text of every
finished generation of a job, bounded by ``advanced.pool_max_tokens`` (oldest generations evicted first), and
``JobPoolSource`` proposes from it under the same budget G as the other sources.

Data structure (chosen by the lookup cost, ``benchmarks/global_pool.py``): one flat token list (generations
separated by a sentinel) and, per match length k in 1..``MAX_KEY``, a keyed table k-gram -> end positions in
ascending order. A lookup reads only the ``SCAN`` most recent occurrences of the longest matching key, so its cost
does not grow with the store (a suffix tree would also answer in O(match), but costs far more memory per token
in Python); the frequency statistics are taken over those occurrences.

Determinism: the store changes only in ``add``, called by the engine with the prompt and output of a finished
generation, identically on every LP rank; eviction and lookups depend on nothing else. So replicated
coordinators hold identical stores (the plan digest checks it), a store saved and loaded is the same store, and
a Ray recovery rebuilds it from the records already written.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from array import array
from collections.abc import Sequence
from pathlib import Path

from lp_runner.decoding.pool import Suffix
from lp_runner.decoding.sources import Feedback, Proposal, adapt_length
from lp_runner.errors import InputError
from lp_runner.outfiles import write_file

MAX_KEY = 3  # longest k-gram key (match length), as the context index's default
SCAN = 64  # most recent occurrences of a key read per lookup: the lookup's cost bound
SEP = -1  # between generations: no key or continuation crosses it
STORE_PROMPTS = False  # prompts are not stored: measured (benchmarks/results/global_pool.md), they add no tokens
FORMAT = "lp_runner.job_pool"  # the pool files' format name, kept across versions (the module it named moved)
VERSION = 1


class JobPool:
    """Committed text of a job's finished generations, indexed by k-gram for continuation lookups.

    Worked example (max_tokens 100): add (5, 6, 7, 5, 6, 8) then (5, 6, 7): tokens [5,6,7,5,6,8,SEP,5,6,7,SEP];
    the 2-gram (5, 6) ends at positions 1, 4, 8. ``continuations((9, 5, 6), 3)`` uses the longest matching key,
    (5, 6) (the 3-gram (9, 5, 6) never occurred), and returns what followed its most recent occurrences, most
    recent first, with it: (2, [(7,), (8,), (7, 5, 6)]) (positions 8 and 4 stop at the separator).
    """

    def __init__(self, max_tokens: int, store_prompts: bool = STORE_PROMPTS) -> None:
        if max_tokens < 0:
            raise ValueError(f"pool_max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.store_prompts = store_prompts
        self._seqs: list[tuple[int, ...]] = []  # stored sequences, oldest first
        self._num_tokens = 0
        # int64 arrays, not lists: a million stored tokens would otherwise be a million objects for the cyclic
        # garbage collector to walk (measured: a 20 ms pause at the p99 of lookups, 1/3 of a round)
        self._tokens = array("q")
        self._index: list[dict[tuple[int, ...], array]] = [{} for _ in range(MAX_KEY + 1)]
        self.generations = 0  # generations added (evicted ones included)
        self.evictions = 0  # times the bound was hit and the oldest generations dropped

    # -- growth -----------------------------------------------------------------------------------------------
    def add(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """A finished generation: its output (and its prompt, with ``store_prompts``) joins the store."""
        self.generations += 1
        if self.store_prompts:
            self._append(tuple(prompt_ids))
        self._append(tuple(output_ids))
        if self._num_tokens > self.max_tokens:
            self._evict()

    def _append(self, seq: tuple[int, ...]) -> None:
        if self.max_tokens == 0 or not seq:
            return
        seq = seq[-self.max_tokens :]
        self._seqs.append(seq)
        self._num_tokens += len(seq)
        self._index_seq(seq)

    def _index_seq(self, seq: tuple[int, ...]) -> None:
        start = len(self._tokens)
        self._tokens.extend(seq)
        self._tokens.append(SEP)
        tokens = self._tokens
        for end in range(start, start + len(seq)):
            for k in range(1, MAX_KEY + 1):
                if end - k + 1 < start:
                    break
                key = tuple(tokens[end - k + 1 : end + 1])
                ends = self._index[k].get(key)
                if ends is None:
                    ends = self._index[k][key] = array("q")
                ends.append(end)

    def _evict(self) -> None:
        """Oldest sequences out until the bound holds, then one rebuild of the index (between generations only:
        its cost is amortized over the tokens added since the last eviction, at least a quarter of the bound)."""
        self.evictions += 1
        target = (3 * self.max_tokens) // 4
        drop = 0
        while self._num_tokens > target and drop < len(self._seqs):
            self._num_tokens -= len(self._seqs[drop])
            drop += 1
        kept = self._seqs[drop:]
        self._seqs, self._tokens = [], array("q")
        self._index = [{} for _ in range(MAX_KEY + 1)]
        for seq in kept:
            self._seqs.append(seq)
            self._index_seq(seq)

    # -- lookup -----------------------------------------------------------------------------------------------
    def continuations(
        self, history: Sequence[int], length: int, min_key: int = 1, before: int | None = None
    ) -> tuple[int, list[Suffix]]:
        """(match length k, what followed the ``SCAN`` most recent occurrences of the longest matching suffix of
        ``history``, most recent first, each up to ``length`` tokens); (0, []) when no suffix of at least
        ``min_key`` tokens occurred. ``before``: only the text stored before that token position (``StoreView``)."""
        if length <= 0 or not self._seqs:
            return 0, []
        tokens = self._tokens
        for k in range(min(MAX_KEY, len(history)), min_key - 1, -1):
            ends = self._index[k].get(tuple(history[len(history) - k :]))
            if not ends:
                continue
            hi = len(ends) if before is None else bisect.bisect_left(ends, before)
            out = []
            for end in reversed(ends[max(hi - SCAN, 0) : hi]):
                cont = tuple(tokens[end + 1 : end + 1 + length])
                if SEP in cont:
                    cont = cont[: cont.index(SEP)]
                if cont:
                    out.append(cont)
            if out:
                return k, out
        return 0, []

    # -- inspection, save and load ----------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def sequences(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self._seqs)

    def digest(self) -> str:
        """A fingerprint of the contents (replicas fed the same generations have the same one)."""
        return hashlib.sha256(repr((self.max_tokens, self._seqs)).encode()).hexdigest()[:16]

    def save(self, path: str | Path, tokenizer_fingerprint: str) -> None:
        """A versioned JSON file: the stored sequences, oldest first (loading re-adds them: the same store).

        Written as every output is (``outfiles.write_file``): beside the file and renamed over it, so a failed
        write (a full disk) leaves the old file as it was and is a one-line OutputError."""
        data = {
            "format": FORMAT,
            "version": VERSION,
            "tokenizer": tokenizer_fingerprint,
            "num_tokens": self._num_tokens,
            "generations": self.generations,
            "sequences": [list(s) for s in self._seqs],
        }
        write_file(path, json.dumps(data, separators=(",", ":")).encode("utf-8"))

    def load(self, path: str | Path, tokenizer_fingerprint: str, vocab_size: int | None = None) -> None:
        """Add a saved store's sequences (oldest first); a file of another format, version or tokenizer, a
        truncated one, or one with a token id outside ``vocab_size`` (the model's), is refused with a one-line
        InputError (``read_pool_file``)."""
        sequences, generations = read_pool_file(path, tokenizer_fingerprint, vocab_size)
        for seq in sequences:
            self._append(tuple(seq))
        if self._num_tokens > self.max_tokens:
            self._evict()
        self.generations += generations


_POOL_START = re.compile(rb'\s*\{\s*"format"\s*:\s*"' + re.escape(FORMAT.encode()) + rb'"')


def check_pool_out(path: str | Path) -> None:
    """``--pool-out``: an existing file it would replace is a pool file, or empty (InputError otherwise, before any
    work). ``save`` replaces the file whole, as it should a previous pool (``--pool-in x --pool-out x``); a
    records file, the prompts or any other file given by mistake would be gone without a word, where ``--output``
    refuses to replace what is not its own records. Read by its first bytes (``save`` writes ``format`` first):
    a pool file may be hundreds of megabytes."""
    p = Path(path)
    if not p.is_file():  # none yet, or a stream (written in place, never replaced: ``outfiles``)
        return
    try:
        with p.open("rb") as f:
            start = f.read(256)
    except OSError as exc:
        raise InputError(f"cannot read --pool-out {p} ({exc.strerror or exc})") from None
    if start.strip() and not _POOL_START.match(start):
        raise InputError(
            f"--pool-out {p} exists and is not an lp_runner pool file; saving the pool would replace it: "
            "give another file, or remove it first"
        )


def read_pool_file(
    path: str | Path, tokenizer_fingerprint: str | None, vocab_size: int | None = None
) -> tuple[list[list[int]], int]:
    """A pool file's (sequences, generations), or a one-line InputError naming the file and the first bad entry.

    ``tokenizer_fingerprint``: the run's tokenizer (None: not checked, e.g. before the tokenizer is at hand);
    ``vocab_size``: the model's vocabulary (None: not known yet): every token id must be one of its rows, or the
    first forward that reads it would fail inside the model (an index out of range)."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"pool file not found: {p}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InputError(f"pool file {p} is truncated or not a pool file (invalid JSON)") from None
    except OSError as exc:
        raise InputError(f"cannot read pool file {p} ({exc.strerror or exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InputError(f"pool file {p} is not an lp_runner pool file")
    if data.get("version") != VERSION:
        raise InputError(f"pool file {p} has version {data.get('version')!r}; this lp_runner reads version {VERSION}")
    if tokenizer_fingerprint is not None and data.get("tokenizer") != tokenizer_fingerprint:
        raise InputError(f"pool file {p} was made with another tokenizer; its token ids would mean other text")
    seqs = data.get("sequences")
    if not isinstance(seqs, list):
        raise InputError(f"pool file {p} is damaged: it has no list of sequences")
    top = vocab_size if vocab_size is not None else float("inf")
    for i, seq in enumerate(seqs):
        if not isinstance(seq, list):
            raise InputError(f"pool file {p} is damaged: sequence {i} is not a list of token ids")
        for k, t in enumerate(seq):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < top:
                where = f"pool file {p}: sequence {i}, token {k}"
                if isinstance(t, int) and not isinstance(t, bool) and t >= 0:
                    raise InputError(f"{where}: id {t} is outside the model's vocabulary of {vocab_size} ids")
                raise InputError(f"{where}: {json.dumps(t)} is not a token id")
    if sum(len(s) for s in seqs) != data.get("num_tokens"):
        raise InputError(f"pool file {p} is damaged: its sequences do not add up to its num_tokens")
    generations = data.get("generations", len(seqs))
    if isinstance(generations, bool) or not isinstance(generations, int) or generations < 0:
        raise InputError(f"pool file {p} is damaged: generations is {json.dumps(generations)}, not a count")
    return seqs, generations


class StoreView:
    """A ``JobPool`` as it stood when it held only its first ``before`` tokens: read-only, for ``JobPoolSource``.

    Why: the auto preset simulates a job's samples in order for every setting it prices, each against the store
    of the samples before it. Stores only grow until they evict, so one store built once, read through a view per
    sample, answers as each setting's own store would; building a store per setting was a tenth of a search
    (``store_views``)."""

    def __init__(self, store: JobPool, before: int) -> None:
        self.store = store
        self.before = before

    def continuations(self, history: Sequence[int], length: int, min_key: int = 1) -> tuple[int, list[Suffix]]:
        return self.store.continuations(history, length, min_key, self.before)


def store_views(
    samples: Sequence[tuple[Sequence[int], Sequence[int]]], max_tokens: int, store_prompts: bool = STORE_PROMPTS
) -> list[StoreView] | None:
    """Per (prompt, output) sample in order, the store of the samples before it (``StoreView``); None where the
    samples would make the store evict (a view cannot show what an eviction removed)."""
    store = JobPool(max_tokens, store_prompts)
    views = []
    for prompt_ids, output_ids in samples:
        views.append(StoreView(store, len(store._tokens)))
        store.add(prompt_ids, output_ids)
        if store.evictions:
            return None
    return views


def tokenizer_fingerprint(tokenizer) -> str:
    """What a pool file's token ids mean: a hash of the vocabulary (token -> id) and the special tokens."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()[:16]


class JobPoolSource:
    """Proposes from a ``JobPool``: for the longest key k that occurred, up to ``limit`` continuations ranked by
    frequency among the scanned occurrences.

    Ranking: distinct first tokens by how many occurrences continue with them (ties: the most recent first);
    each becomes one candidate, extended token by token along the most frequent next token among the
    occurrences that agree with it so far (ties: most recent). Distinct first tokens make the G candidates cover
    G different next tokens instead of G variants of one.
    Example: continuations [(7, 8), (9, 1), (7, 3), (7, 8)] (most recent first), limit 2 -> first tokens 7 (3
    times) and 9 (once); 7 continues with 8 (twice) over 3 (once): [(7, 8), (9, 1)].

    Proposal lengths adapt per match length as the context source's do (``feedback``), from ``num_tokens``.
    The coordinator puts these proposals ahead of the context source's when they come from a longer match.
    """

    name = "job"

    def __init__(self, store: JobPool | StoreView, num_tokens: int, adaptive: bool = True, min_ngram: int = 1) -> None:
        self.store = store
        self.num_tokens = num_tokens
        self.adaptive = adaptive
        self.min_ngram = min(min_ngram, MAX_KEY)
        self.lengths = [num_tokens] * (MAX_KEY + 1)

    def propose(self, history: Sequence[int], limit: int) -> list[Proposal]:
        if limit <= 0:
            return []
        k, conts = self.store.continuations(history, max(self.lengths), self.min_ngram)
        if not conts:
            return []
        return [Proposal(c, self.name, k) for c in rank_continuations(conts, limit, self.lengths[k])]

    def observe(self, history: Sequence[int], num_new: int) -> None:
        pass  # the store grows between generations (``JobPool.add``), never inside one

    def feedback(self, fb: Feedback) -> None:
        if self.adaptive:
            k = fb.proposal.match_len
            self.lengths[k] = adapt_length(self.lengths[k], fb, self.num_tokens)


def rank_continuations(conts: Sequence[Suffix], limit: int, length: int) -> list[Suffix]:
    """See ``JobPoolSource``; ``conts`` most recent first, each non-empty."""
    firsts = _by_frequency([c[0] for c in conts])
    out: list[Suffix] = []
    for first in firsts[:limit]:
        members = [c for c in conts if c[0] == first]
        path = [first]
        while len(path) < length:
            if len(members) == 1:  # one occurrence left: the path follows it to its end (most lookups end here)
                path.extend(members[0][len(path) : length])
                break
            depth = len(path)
            nexts = _by_frequency([c[depth] for c in members if len(c) > depth])
            if not nexts:
                break
            path.append(nexts[0])
            members = [c for c in members if len(c) > depth and c[depth] == nexts[0]]
        out.append(tuple(path))
    return out


def _by_frequency(tokens: Sequence[int]) -> list[int]:
    """Distinct tokens, most frequent first, ties in order of first appearance: [7, 9, 7, 3, 9, 7] -> [7, 9, 3]."""
    if len(tokens) < 2:
        return list(tokens)
    counts = dict.fromkeys(tokens, 0)  # in order of first appearance
    if len(counts) == 1:
        return list(counts)
    for t in tokens:
        counts[t] += 1
    return sorted(counts, key=counts.__getitem__, reverse=True)  # stable under reverse: ties keep their order

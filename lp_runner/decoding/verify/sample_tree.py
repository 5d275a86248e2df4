"""Exact sampling verification as one tensor program per round: the tests and the draws run where the logits are.

``sampling.sample_verify`` walks the candidates' token tree on the host, one residual test at a time, reading
full-vocabulary distributions it copied there. The walk's inputs are known before the forward runs, except the
distributions: which tokens a node tests (the distinct next tokens of the candidates that share its prefix, in
candidate order), and which uniforms it uses (a node's tests begin where its ancestors' accepted tests ended:
that count follows from the accepted prefix alone). So every node of the tree can be decided at once, on the
device, from its own distribution: the tests of its tokens and, should the walk end there, its draw. The host
builds the tree (``SampleTree``, pure Python over the round's few candidates, with the uniforms of its seeded
streams); ``decide`` runs on the device and returns the round's verdict as a few integers; the round reads them
back once, with the argmax of every row.

The tree of one rank's round (the LP split of ``verifier.SamplingVerifier``): the root tests the round's distinct
first tokens over every rank's candidates against the live key's distribution, with the stream every rank shares;
below it, the nodes are the prefixes of this rank's candidates, tested with the rank's own stream. Worked example,
plan first tokens [A, B, C] (C is another rank's), this rank's candidates [A, B, D], [A, C], [B]; rows of the
probabilities: 0 the live key's, 1-3 after A, AB, ABD, 4-5 after A, AC, 6 after B:

    node  prefix     row  tests     children     stream, first uniform
    0     ()         0    A, B, C   1, 2, -1     shared, 0
    1     (A,)       1    B, C      3, 4         local, 0
    2     (B,)       6    -         -            local, 0
    3     (A, B)     2    D         5            local, 1   (B accepted at node 1's first test: one uniform used)
    4     (A, C)     5    -         -            local, 2   (B rejected, C accepted: two used)
    5     (A, B, D)  3    -         -            local, 2   (then D accepted at node 3's first test)

A node's test of token t (its k-th) accepts when u_k * r_k < p(t), r_k the node's mass left after the rejected
tests before it (``sampling._test_tokens``, with its rule for a token that holds all the mass left); the walk
follows accepted tokens from the root; where it stops it draws from the node's residual (its distribution with
the tested tokens zeroed: a leaf's is the distribution itself, the bonus token) with the next uniform. A token
accepted at the root that none of this rank's candidates starts with ends the walk there (another rank goes on).
The verdict is ``sampling``'s: candidate = the lowest of this rank's candidates with the accepted prefix, hits =
its length, emitted = the prefix and the final draw.

Exactness: the same tests on the same uniforms as the host walk, so the same verdicts, except where a uniform
falls within float64 rounding of a test's threshold (the running residual is a cumulative sum here, a running
difference there; ``test_sample_tree`` compares the two on thousands of rounds) — and the distribution is exact
either way (``sample_verify``'s proof does not depend on the order of rounding).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lp_runner.decoding.verify.greedy import Verdict
from lp_runner.decoding.verify.sampling import _NEAR_FULL, NO_CANDIDATE

NO_NODE = -1
_INT_FIELDS = ("rows", "tested", "parent", "token_into", "depth", "candidate")  # one [N] int64 vector each


@dataclass(frozen=True)
class SampleTree:
    """The nodes of one rank's round (see the module doc), node 0 the root, parents before children."""

    rows: tuple[int, ...]  # [N] the row of the round's probabilities that is the node's distribution
    tokens: tuple[tuple[int, ...], ...]  # [N][Z_n] the tokens it tests, in order
    children: tuple[tuple[int, ...], ...]  # [N][Z_n] the node reached by accepting each, NO_NODE: none here
    parent: tuple[int, ...]  # [N] NO_NODE for the root
    token_into: tuple[int, ...]  # [N] the token accepted at the parent to reach it (-1 for the root)
    depth: tuple[int, ...]  # [N] accepted tokens on the way to it
    candidate: tuple[int, ...]  # [N] the lowest local candidate with its prefix (NO_CANDIDATE for the root)
    draws: tuple[tuple[float, ...], ...]  # [N][Z_n + 1] its tests' uniforms, then its final draw's

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    @classmethod
    def build(
        cls,
        plan_first_tokens: Sequence[int],
        candidates: Sequence[Sequence[int]],
        shared: random.Random,
        local: random.Random,
    ) -> SampleTree:
        """The tree of a round whose plan's candidates start with ``plan_first_tokens`` (all ranks') and whose
        local candidates are ``candidates`` (their rows follow row 0 in order: candidate c's token s has row
        1 + sum of the lengths before c + s), uniforms from the ``shared`` and ``local`` streams."""
        base, at = [], 1
        for cand in candidates:
            base.append(at)
            at += len(cand)
        rows, tokens, children, parent, into, depth, cand_of, start = [0], [], [], [NO_NODE], [-1], [0], [-1], [0]
        prefixes: dict[tuple[int, ...], int] = {}
        order = [()]  # node -> prefix
        k = 0
        while k < len(order):  # breadth first: parents before children
            prefix = order[k]
            d = len(prefix)
            if d == 0:
                tested = list(dict.fromkeys(plan_first_tokens))
            else:
                live = [c for c in candidates if tuple(c[:d]) == prefix and len(c) > d]
                tested = list(dict.fromkeys(c[d] for c in live))
            kids = []
            for j, tok in enumerate(tested):
                child = (*prefix, tok)
                owner = next((c for c, cand in enumerate(candidates) if tuple(cand[: d + 1]) == child), None)
                if owner is None:  # a first token of another rank's candidates only
                    kids.append(NO_NODE)
                    continue
                prefixes[child] = len(order)
                kids.append(len(order))
                order.append(child)
                rows.append(base[owner] + d)
                parent.append(k)
                into.append(tok)
                depth.append(d + 1)
                cand_of.append(owner)
                start.append(0 if d == 0 else start[k] + j + 1)  # the local stream starts again below the root
            tokens.append(tuple(tested))
            children.append(tuple(kids))
            k += 1
        first = [shared.random() for _ in range(len(tokens[0]) + 1)]
        need = max((start[n] + len(tokens[n]) + 1 for n in range(1, len(order))), default=0)
        rest = [local.random() for _ in range(need)]
        draws = [tuple(first)] + [tuple(rest[start[n] : start[n] + len(tokens[n]) + 1]) for n in range(1, len(order))]
        return cls(tuple(rows), tuple(tokens), tuple(children), tuple(parent), tuple(into), tuple(depth),
                   tuple(cand_of), tuple(draws))  # fmt: skip

    def tables(self, pin: bool = False) -> torch.Tensor:
        """The tree as one int64 host tensor (pinned when ``pin``) for one copy to the device; ``TreeTables.views``
        reads it there. Layout for N nodes testing at most Z tokens each: [rows, tested (count), parent,
        token_into, depth, candidate] (N each), tokens [N, Z] (-1 pad), children [N, Z], ancestors [N, N] (0/1:
        strict ancestors but the root), then the uniforms [N, Z + 1] as float64 bits."""
        n, z = self.size, max(1, max(len(t) for t in self.tokens))
        ints = [
            *self.rows,
            *(len(t) for t in self.tokens),
            *self.parent,
            *self.token_into,
            *self.depth,
            *self.candidate,
        ]
        for table in (self.tokens, self.children):
            for row in table:
                ints += [*row, *[-1] * (z - len(row))]
        for node in range(n):
            up, above = [0] * n, self.parent[node]
            while above > 0:  # the root's edge is not an edge
                up[above] = 1
                above = self.parent[above]
            ints += up
        out = torch.empty(len(ints) + n * (z + 1), dtype=torch.int64, pin_memory=pin)
        out[: len(ints)] = torch.tensor(ints, dtype=torch.int64)
        uniforms = torch.tensor([[*d, *[0.0] * (z + 1 - len(d))] for d in self.draws], dtype=torch.float64)
        out[len(ints) :] = uniforms.reshape(-1).view(torch.int64)
        return out


@dataclass(frozen=True)
class TreeTables:
    """``SampleTree.tables`` on the device, as views."""

    rows: torch.Tensor  # [N]
    tested: torch.Tensor  # [N]
    parent: torch.Tensor  # [N]
    token_into: torch.Tensor  # [N]
    depth: torch.Tensor  # [N]
    candidate: torch.Tensor  # [N]
    tokens: torch.Tensor  # [N, Z]
    children: torch.Tensor  # [N, Z]
    ancestors: torch.Tensor  # [N, N] bool
    draws: torch.Tensor  # [N, Z + 1] float64

    @classmethod
    def views(cls, flat: torch.Tensor, nodes: int, width: int) -> TreeTables:
        n, z = nodes, width
        vectors = flat[: len(_INT_FIELDS) * n].view(len(_INT_FIELDS), n)  # [6, N]
        at = len(_INT_FIELDS) * n
        tokens = flat[at : at + n * z].view(n, z)
        children = flat[at + n * z : at + 2 * n * z].view(n, z)
        at += 2 * n * z
        ancestors = flat[at : at + n * n].view(n, n) != 0
        draws = flat[at + n * n :].view(torch.float64).view(n, z + 1)
        return cls(*vectors, tokens, children, ancestors, draws)


def decide(
    probs: torch.Tensor,  # [rows, V] float64: the round's warped distributions (row 0 the live key's)
    tree: TreeTables,
    max_depth: int,
) -> torch.Tensor:  # [3 + max_depth + 1] int64: candidate, hits, emitted count, emitted (padded with -1)
    """The round's verdict from every node decided at once (see the module doc). Tensor ops only, no value read
    on the host, nothing of vocabulary size copied but the one row the final draw is made from. A final draw from
    a distribution without mass (which the tests' rule for a last token rules out) comes back as token -1;
    ``verdict`` refuses it."""
    n, z = tree.tokens.shape
    device = probs.device
    valid = torch.arange(z, device=device)[None, :] < tree.tested[:, None]  # [N, Z]
    total = probs.sum(-1).index_select(0, tree.rows)  # [N]
    # tokens with mass per node: ceil maps a probability in (0, 1] to 1 and 0 to 0, and a float64 sum of ones is
    # exact; several times cheaper on a CPU than count_nonzero (which casts a [rows, V] bool tensor to int64)
    support = probs.ceil().sum(-1).index_select(0, tree.rows).long()  # [N]
    mass = probs[tree.rows[:, None], tree.tokens.clamp(min=0)] * valid  # [N, Z]
    left = total[:, None] - (mass.cumsum(1) - mass)  # [N, Z]: the mass left before each test
    carried = (valid & (mass > 0)).long()
    rejected_support = carried.cumsum(1) - carried  # [N, Z]: tested tokens with mass rejected before this one
    last = (mass > 0) & (left - mass <= _NEAR_FULL * left) & (support[:, None] == rejected_support + 1)
    accept = valid & ((tree.draws[:, :z] * left < mass) | last)  # [N, Z]
    accepted = accept.any(1)  # [N]
    first = accept.long().argmax(1, keepdim=True)  # [N, 1]: the first accepted test (0 where none)
    token = tree.tokens.gather(1, first)[:, 0]  # [N]
    child = tree.children.gather(1, first)[:, 0]  # [N]
    up = tree.parent.clamp(min=0)
    taken = accepted[up] & (token[up] == tree.token_into)  # [N]: the edge into each node is the accepted one
    edges = tree.ancestors | torch.eye(n, dtype=torch.bool, device=device)  # [N, N]: the edges down to each node
    on_path = ~(edges[:, 1:] & ~taken[None, 1:]).any(1)  # [N]: every edge from the root to it taken (root: none)
    end = (on_path.long() * (tree.depth + 1)).argmax().reshape(1)  # [1]: the deepest node reached
    stops = accepted[0] & (child[0] == NO_NODE) & (end[0] == 0)  # the root accepted another rank's first token
    # the final draw at ``end``: its distribution with its tested tokens zeroed, inverse CDF at its next uniform
    row = probs.index_select(0, tree.rows.index_select(0, end))[0]  # [V]
    zeroed = torch.zeros_like(row).index_add_(
        0, tree.tokens.index_select(0, end)[0].clamp(min=0), valid.index_select(0, end)[0].to(row.dtype)
    )  # [V]: > 0 at the tested tokens
    cdf = row.masked_fill(zeroed > 0, 0.0).cumsum(0)  # [V]
    whole = cdf[-1:]  # [1]
    u = tree.draws.index_select(0, end)[0].gather(0, tree.tested.index_select(0, end)) * whole  # [1]
    drawn = torch.where(
        u >= whole,  # u * whole rounded up to the whole: the last token with mass
        torch.searchsorted(cdf, whole, right=False),
        torch.searchsorted(cdf, u, right=True),
    )
    drawn = torch.where(whole > 0, drawn, torch.full_like(drawn, -1))[0]
    final = torch.where(stops, token[0], drawn)
    hits = tree.depth.index_select(0, end)  # [1]
    out = torch.full((3 + max_depth + 2,), -1, dtype=torch.int64, device=device)
    slot = torch.where(on_path & (tree.depth > 0), tree.depth - 1, max_depth + 1)  # [N]; off the path: a spare
    body = out[3:]
    body.scatter_(0, slot, tree.token_into)  # the path's tokens by depth (one node per depth)
    body.scatter_(0, hits, final[None])
    out[:3] = torch.cat([tree.candidate.index_select(0, end), hits, hits + 1])
    return out[:-1]


def verdict(decided: Sequence[int]) -> Verdict:
    """``decide``'s integers, read back, as the rank's verdict."""
    candidate, hits, count = decided[:3]
    emitted = tuple(decided[3 : 3 + count])
    if emitted[-1] < 0:
        raise ValueError("cannot sample from a distribution with no mass")
    return Verdict(candidate if hits else NO_CANDIDATE, hits, emitted)

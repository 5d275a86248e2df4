"""Rounds at fixed shapes on fixed buffers: the adapter's forward on a GPU, one CUDA graph per bucket.

On a GPU a small model's round is bound by kernel launches and host work, not by arithmetic: gpt-fast and vLLM
replay each decode step as a CUDA graph, which needs every input at a fixed shape and a fixed address. A
``StaticRounds`` gives the adapter's forward exactly that, one round at a time:

* shapes: the round runs at its row bucket (``buckets.BucketLadder``: filler rows that see only themselves, seen
  by no one, their K/V past the round, as ``layout.compile_round``'s padding) and reads a power-of-two live K/V width;
  its logit rows are padded to the bucket too (filler logits are dropped), so a (rows, width) pair is one shape;
* addresses: the K/V is the job's arena (``kv_cache.KVArena``, allocated once per job at the job's need; each
  generation a region of it), its layers' views marked static for the compiler (``torch._dynamo.
  mark_static_address``, transformers' ``StaticCache`` does the same) the first time a round reads it; its inputs
  are views of one staging buffer per bucket, also static;
* one copy in: the round's ids, positions, logit rows, write slots, region bounds and [B, B] visibility are
  written into one host tensor (pinned on CUDA) and copied to the bucket's staging buffer with one non-blocking
  copy; the mask is built from them inside the round (``round_mask``: once per round, every layer reads it, only
  the live width);
* compiled (``compile``): ``torch.compile(mode="reduce-overhead", dynamic=True)`` of the whole round. One
  compilation serves every bucket (rows and width are symbols; the model's floats are constants,
  ``constant_floats``); inductor's CUDA graph trees record one graph per distinct shape on its first calls and
  replay it after. On a CPU the same call compiles the same graph and skips the capture (nothing to capture
  there): tests run this path on a CPU, minus the capture.

Rounds that cannot replay a graph run the same round function eagerly on the same buffers: a round of more rows
than the ladder's top, and any round on a scratch arena (``KVArena.growable``: probes, measurements), whose
addresses change as it grows. Eager stays the oracle: ``test_static_rounds`` holds compiled rounds to the
eager ones (argmax, at every bucket boundary) and eager static rounds to the adapter's ordinary forward.

The logits a compiled round returns live in the graph's memory: valid until the adapter's next forward (the
engine reads each round's logits back before it runs the next).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lp_runner.backends.attention import ROUND_KEYWORD
from lp_runner.backends.batch import RoundRows, Rows
from lp_runner.backends.buckets import BucketLadder
from lp_runner.backends.kv_cache import KVArena, KVRegion
from lp_runner.backends.model_call import ModelCall
from lp_runner.backends.round_mask import round_attention, round_mask
from lp_runner.device import pins_host_memory, synchronizer

CAPTURE_CALLS = 3  # calls per bucket at warm-up: CUDA graph trees run a new shape once, record it, then replay
_INT_FIELDS = 6  # int64 vectors of B in the staging buffer: ids, positions, logit rows, write slots, first, end


@dataclass(frozen=True)
class StagedInputs:
    """One bucket's device inputs: views of one staging buffer that a round's single copy fills.

    Byte layout for B rows: int64 [ids | positions | logit rows | write slots | cached from | cached to] (B each),
    then the [B, B] visibility as bytes (bool). Row i sees the cached slots ``cached_from[i]`` .. ``cached_to[i]
    - 1`` (its generation's region's cached prefix) and the in-round rows its visibility row names. Example, B = 2:
    8 x 12 = 96 bytes of integers, 4 of visibility, 100 in all."""

    buffer: torch.Tensor  # [nbytes] uint8
    input_ids: torch.Tensor  # [B] int64
    position_ids: torch.Tensor  # [B] int64
    logit_rows: torch.Tensor  # [B] int64
    write_slots: torch.Tensor  # [B] int64
    cached_from: torch.Tensor  # [B] int64: the first slot of the row's region
    cached_to: torch.Tensor  # [B] int64: past its cached prefix
    visibility: torch.Tensor  # [B, B] bool

    @staticmethod
    def nbytes(rows: int) -> int:
        return 8 * _INT_FIELDS * rows + rows * rows

    @property
    def round_inputs(self) -> tuple[torch.Tensor, ...]:
        """The views the round function reads, in its parameters' order (``StaticRounds._round``)."""
        return (
            self.input_ids,
            self.position_ids,
            self.logit_rows,
            self.write_slots,
            self.cached_from,
            self.cached_to,
            self.visibility,
        )

    @classmethod
    def views(cls, buffer: torch.Tensor, rows: int) -> StagedInputs:
        ints = buffer[: 8 * _INT_FIELDS * rows].view(torch.int64)  # [6B]
        vis = buffer[8 * _INT_FIELDS * rows :].view(torch.bool).view(rows, rows)  # [B, B]
        fields = (ints[k * rows : (k + 1) * rows] for k in range(_INT_FIELDS))
        return cls(buffer, *fields, vis)


def stage(
    rows: int,
    segments: Sequence[tuple[RoundRows, int, int]],  # each segment's rows, its region's first slot, cached positions
    pin: bool,
) -> torch.Tensor:  # [StagedInputs.nbytes(rows)] uint8, host (pinned when ``pin``)
    """The round's inputs, segment after segment, padded to ``rows`` rows, written once into one host tensor
    (``StagedInputs``' layout).

    Filler rows repeat the last row's token and position, see only themselves and are seen by no one (so every
    real row computes what it would without them); their K/V goes to the slots after the last segment's rows, in
    its region (``ModelAdapter.region_size`` leaves the ladder's top there), past anything the round commits.
    Filler logit rows read row 0 and are dropped. A fresh host tensor per round: torch's pinned-memory allocator
    keeps a block from reuse until the copy that reads it has run.

    Example: segments (2 rows, region at 0, past 5) and (1 row, region at 64, past 3) in a bucket of 4: write
    slots [5, 6, 67, 68], cached from [0, 0, 64, 0], cached to [5, 5, 67, 0], visibility block-diagonal with the
    filler seeing itself."""
    host = torch.empty(StagedInputs.nbytes(rows), dtype=torch.uint8, pin_memory=pin)
    raw = host.numpy()
    ints = raw[: 8 * _INT_FIELDS * rows].view(np.int64).reshape(_INT_FIELDS, rows)  # [6, B]
    vis = raw[8 * _INT_FIELDS * rows :].reshape(rows, rows)  # [B, B]
    ids, pos, logits, writes, first, end = ints
    vis[:] = 0
    r = n = 0  # rows and logit rows so far
    for seg, base, past in segments:
        q, k = len(seg.tokens), len(seg.logit_rows)
        ids[r : r + q], pos[r : r + q] = seg.tokens, seg.positions
        logits[n : n + k] = seg.logit_rows
        logits[n : n + k] += r
        writes[r : r + q] = np.arange(base + past, base + past + q)
        first[r : r + q], end[r : r + q] = base, base + past
        vis[r : r + q, r : r + q] = seg.visibility.numpy()
        r, n = r + q, n + k
    ids[r:], pos[r:], logits[n:] = ids[r - 1], pos[r - 1], 0
    writes[r:] = np.arange(writes[r - 1] + 1, writes[r - 1] + 1 + rows - r)
    first[r:] = end[r:] = 0  # no cached key
    vis[np.arange(r, rows), np.arange(r, rows)] = 1  # a filler sees itself only
    return host


def _dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (its own counter)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def static_address(t: torch.Tensor) -> None:
    """Mark ``t``'s address static for the compiler (a graph reads it in place), without a guard on it.

    ``guard=False`` is spelled out because its default changed: torch before 2.10 defaults to ``guard=True``,
    which guards every marked tensor's identity, so each staging buffer (one per bucket) and key-slot vector
    (one per K/V width) became a recompilation of the one round function; past ``cache_size_limit`` (8) a
    ``fullgraph`` compile fails. Unguarded, one compilation serves every (bucket, width) pair on every admitted
    torch, and CUDA graph trees record a new graph when an address changes instead of recompiling."""
    torch._dynamo.mark_static_address(t, guard=False)


def constant_floats(compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``compiled`` with every compilation it makes taking the floats the round reads off the model (norm
    epsilons, attention scales) as constants, guarded by value: a model whose floats differ compiles its own graph.

    Spelled out for torch 2.7: it compiles such a float as a constant the first time and, when a later model of
    the same class brings another value to the same round function (SmolLM2's norm epsilon after a tiny Llama's,
    in one process), recompiles it as a graph input, which the ``fullgraph`` compile rejects ("Data dependent
    operator"): the second model's compilation failed and its job ran eager. Newer torch takes such floats as
    inputs from the first compilation (``dynamic=True``); constants serve it as well, one compilation per distinct
    set of floats. Every call enters the patch: a compilation happens inside whichever call misses dynamo's
    cache."""
    return torch._dynamo.config.patch(specialize_float=True)(compiled)


class StaticRounds:
    """One generation's rounds at fixed shapes on fixed buffers, eager or compiled (see the module doc)."""

    def __init__(
        self,
        call: ModelCall,
        dtype: torch.dtype,
        device: torch.device,
        kv_shape: tuple[int, int],
        compile: bool = False,
        ladder: BucketLadder | None = None,
        attention_keyword: bool = False,
    ) -> None:
        """``call``: the model's forward as the adapter resolved it (cache keyword, masks per layer type);
        ``kv_shape``: (K/V heads, head dim). ``compile``: rounds on a job's arena at a bucket run through
        ``torch.compile`` (CUDA graphs on a GPU); otherwise eager, at the same shapes. ``attention_keyword``: the
        model's layers hand the round's attention down by keyword (``attention.reaches_attention``)."""
        self.call, self.dtype, self.device = call, dtype, device
        self.ladder = ladder or BucketLadder()
        config = call.model.config
        # sdpa models whose layers take the keyword attend through ``round_attention`` (live width, packed heads,
        # the mask tiled once); others keep their own attention over the whole buffer with an untiled mask
        self.live_width = attention_keyword
        self.groups = config.get_text_config().num_attention_heads // kv_shape[0] if self.live_width else 1
        self.attention = round_attention if self.live_width else None  # what each round passes (``_round``)
        self.pin = pins_host_memory(device)
        self.sync = synchronizer(device)
        self.compiled = (
            constant_floats(torch.compile(self._round, dynamic=True, mode="reduce-overhead", fullgraph=True))
            if compile
            else None
        )
        self.capture_s: dict[int, float] = {}  # per row bucket: the seconds of its warm-up calls (compile, capture)
        # what compiled rounds made so far (``counts``): compilations of the round function, and the distinct
        # (bucket, K/V width, arena tensor) shapes run compiled (on CUDA, one graph recorded for each)
        self.compiles = 0
        self._shapes: set[tuple[int, int, int, int]] = set()
        self._marked: dict[int, weakref.ref] = {}  # id -> arena tensor whose layers' views are marked static
        self._staged: dict[int, StagedInputs] = {}  # per row bucket
        self._key_slots: dict[int, torch.Tensor] = {}  # per K/V width: arange(width) on the device

    def _replays(self, arena: KVArena) -> bool:
        """True when rounds on ``arena`` may replay graphs: a job's arena (sized at its start, not growable),
        its layers' views marked static the first time (and again after it grew: new addresses)."""
        if arena.growable:
            return False
        held = self._marked.get(id(arena.tensor))
        if held is None or held() is not arena.tensor:
            for layer in arena.layers():
                static_address(layer.keys)
                static_address(layer.values)
            self._marked = {k: t for k, t in self._marked.items() if t() is not None}
            self._marked[id(arena.tensor)] = weakref.ref(arena.tensor)
        return True

    # ------------------------------------------------------------------------------------------------ rounds

    def forward(self, rounds: Sequence[RoundRows], regions: Sequence[KVRegion]) -> torch.Tensor:  # [sum R, vocab]
        """One round of the generations in ``regions`` (each region's length: the positions cached before the
        round), staged in one copy and run at its bucket (compiled when it can replay a graph). The caller
        reserved the regions for their rows, the last one also for the bucket's fillers, and advances their
        lengths."""
        arena = regions[0].arena
        rows = [len(r.tokens) for r in rounds]
        bucket = self.ladder.rows_for(sum(rows))
        ends = [region.base + region.length + q for region, q in zip(regions, rows, strict=True)]
        live = max(max(ends), ends[-1] + bucket - sum(rows))  # the fillers write after the last segment's rows
        width = self.ladder.kv_width(live, arena.capacity) if self.live_width else arena.capacity
        segments = [(r, region.base, region.length) for r, region in zip(rounds, regions, strict=True)]
        host = stage(bucket, segments, self.pin)
        staged = self._staging(bucket)
        staged.buffer.copy_(host, non_blocking=True)  # the round's one host->device copy
        single = len(regions) == 1
        for layer in arena.layers():
            layer.write_slots, layer.read_slots = staged.write_slots, None
            layer.length = regions[0].base + regions[0].length if single else 0
        graph = self.compiled is not None and self.ladder.captured(bucket) and self._replays(arena)
        if graph:
            torch.compiler.cudagraph_mark_step_begin()  # the previous round's outputs may be overwritten now
        if not graph:
            logits = self._round(*staged.round_inputs, self._slots(width), arena.cache)
        else:
            self._shapes.add((bucket, width, id(arena), arena.allocations))
            compiled = _dynamo_graphs()
            logits = self.compiled(*staged.round_inputs, self._slots(width), arena.cache)
            self.compiles += _dynamo_graphs() - compiled
        return logits[: sum(len(r.logit_rows) for r in rounds)]

    def counts(self) -> tuple[int, int]:
        """(compilations of the round function, distinct shapes run compiled) so far: a job that warmed up every
        shape it uses adds neither after its start-up (on CUDA a new shape is a graph recorded mid-job, while the
        other ranks wait)."""
        return self.compiles, len(self._shapes)

    def _round(
        self,
        input_ids: torch.Tensor,  # [B]
        position_ids: torch.Tensor,  # [B]
        logit_rows: torch.Tensor,  # [B]
        write_slots: torch.Tensor,  # [B]
        cached_from: torch.Tensor,  # [B]
        cached_to: torch.Tensor,  # [B]
        visibility: torch.Tensor,  # [B, B] bool
        key_slots: torch.Tensor,  # [K]
        cache,  # the arena's DynamicCache
    ) -> torch.Tensor:  # [B, vocab]
        """The round itself, the function that is compiled: its masks (one per window, shared by every layer of
        that window), then the model's forward, naming its attention (``self.attention``) where it has one."""
        masks = {
            window: round_mask(
                visibility,
                cached_from,
                cached_to,
                position_ids,
                write_slots,
                key_slots,
                window,
                self.dtype,
                self.groups,
            )
            for window in set(self.call.mask_windows.values())
        }
        attend = {} if self.attention is None else {ROUND_KEYWORD: self.attention}
        return self.call(input_ids, position_ids, masks, cache, logit_rows, **attend)  # [B, vocab]

    def _staging(self, rows: int) -> StagedInputs:
        """The device staging buffer of a bucket (made once, static: a graph reads it in place), or a new one for
        a round past the ladder."""
        staged = self._staged.get(rows)
        if staged is None:
            with torch.inference_mode():
                buffer = torch.empty(StagedInputs.nbytes(rows), dtype=torch.uint8, device=self.device)
            staged = StagedInputs.views(buffer, rows)
            if not self.ladder.captured(rows):
                return staged
            for field in staged.round_inputs:
                static_address(field)
            self._staged[rows] = staged
        return staged

    def _slots(self, width: int) -> torch.Tensor:
        """[width] int64 0 .. width-1 on the device (made once per width, static)."""
        slots = self._key_slots.get(width)
        if slots is None:
            with torch.inference_mode():
                slots = torch.arange(width, device=self.device)
            static_address(slots)
            self._key_slots[width] = slots
        return slots

    # ----------------------------------------------------------------------------------------------- warm-up

    @torch.inference_mode()
    def warm_up(self, arena: KVArena, size: int, max_rows: int | None = None) -> float:
        """Compile, and on a GPU capture, every row bucket up to ``max_rows`` (default: the ladder's top) on
        ``arena`` (the job's: its rounds then replay what this records) at every K/V width a round in its first
        ``size`` slots reads (``widths_past``): the shapes a job whose regions fill those slots runs, so none is
        recorded mid-job. The rounds' K/V is left in a region of ``size`` slots, released after. Returns the
        seconds it took; ``capture_s`` holds each bucket's (all its widths)."""
        region = arena.region(size)
        start = time.perf_counter()
        calls = CAPTURE_CALLS if self.sync is not None else 1  # a CPU compiles at the first call, captures nothing
        for rows in self.ladder.rows:
            if max_rows is not None and rows > max(max_rows, self.ladder.rows[0]):
                break
            t = time.perf_counter()
            causal = torch.ones(rows, rows, dtype=torch.bool).tril()
            for past in self.widths_past(rows, region):
                for _ in range(calls):
                    region.length = past  # the cached prefix whose round reads the width (its values unused)
                    self.forward([Rows([0] * rows, range(rows), causal, range(rows))], [region])
            if self.sync is not None:
                self.sync()
            self.capture_s[rows] = time.perf_counter() - t
        region.length = 0
        arena.release(region)
        return time.perf_counter() - start

    def widths_past(self, rows: int, region: KVRegion) -> list[int]:
        """For a bucket of ``rows``, one cached length per K/V width its rounds read in ``region``: the widths
        from the bucket's own to that of the region's last slot (``BucketLadder.kv_width``), which a job whose
        generations' regions fill the same slots reads. Example: a region of 608 slots at 0 of an arena of 1280,
        8 rows -> widths 256, 512, 1024: cached lengths [0, 504, 600]. A model whose rounds are not cut to their live
        width (its layers take no round attention) reads the whole arena: one length."""
        if not self.live_width:
            return [0]
        capacity, first, end = region.arena.capacity, region.base, region.base + region.size
        width, top = self.ladder.kv_width(first + rows, capacity), self.ladder.kv_width(end, capacity)
        out = [0]
        while width < top:
            width = self.ladder.kv_width(width + 1, capacity)
            out.append(min(width, end) - first - rows)
        return out

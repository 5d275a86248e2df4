"""The one round function: every round of the adapter, staged once, masked once, run eager or compiled.

A round (one or more generations' rows, ``staging``) runs in three steps, the same on every device and backend:

* staged: ``staging.stage`` writes its ids, positions, write slots, cached-prefix bounds, logit rows and [B, B]
  visibility into one host tensor. An eager round on a CPU reads that tensor's views itself; on a GPU one
  non-blocking copy fills the bucket's staging buffer (pinned host memory);
* masked: ``_round`` builds the round's mask from those inputs (``round_mask``: once per round and window, every
  layer of that window reads it, only as wide as the round's live K/V);
* run: by the backend's whole decoder layers where it has them (the CPU backend's native layers, chosen once when
  the backend is made), else by the model's forward on transformers' layers, which take the round's attention by
  keyword (``attention.reaches_attention``, decided once) or run their own under the mask as a 4-D mask.

Bucketed rounds (``bucketed``; a GPU, or ``compile``) give CUDA graphs what they need:

* shapes: the round runs at its row bucket (``buckets.BucketLadder``: filler rows that see only themselves, seen
  by no one, their K/V past the round, as ``layout.compile_round``'s padding) and reads a power-of-two live K/V width;
  its logit rows are padded to the bucket too (filler logits are dropped), so a (rows, width) pair is one shape;
* addresses: the K/V is the job's arena (``kv_cache.KVArena``, allocated once per job at the job's need; each
  generation a region of it), its layers' views marked static for the compiler (``torch._dynamo.
  mark_static_address``, transformers' ``StaticCache`` does the same) the first time a round reads it; its inputs
  are views of one staging buffer per bucket, also static;
* compiled (``compile``): ``torch.compile(mode="reduce-overhead", dynamic=True)`` of ``_round``. One
  compilation serves every bucket (rows and width are symbols; the model's floats are constants,
  ``constant_floats``); inductor's CUDA graph trees record one graph per distinct shape on its first calls and
  replay it after. On a CPU the same call compiles the same graph and skips the capture (nothing to capture
  there): tests run this path on a CPU, minus the capture.

Rounds that cannot replay a graph run the same function eagerly on the same buffers: a round of more rows than the
ladder's top, and any round on a scratch arena (``KVArena.growable``: probes, measurements), whose addresses
change as it grows. Eager stays the oracle: ``test_rounds`` holds compiled rounds to the eager ones (argmax, at
every bucket boundary) and eager rounds to separate forwards and to HF greedy.

The logits a compiled round returns live in the graph's memory: valid until the adapter's next forward (the
engine reads each round's logits back before it runs the next).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence

import torch

from lp_runner.backends.attention import ROUND_KEYWORD
from lp_runner.backends.buckets import BucketLadder
from lp_runner.backends.kv_cache import KVArena, KVRegion
from lp_runner.backends.model_call import ModelCall
from lp_runner.backends.round_mask import round_mask
from lp_runner.backends.staging import RoundRows, Rows, StagedInputs, stage
from lp_runner.device import pins_host_memory, synchronizer

CAPTURE_CALLS = 3  # calls per bucket at warm-up: CUDA graph trees run a new shape once, record it, then replay


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


class Rounds:
    """Every round of an adapter: staged once (``staging.stage``), masked once (``round_mask``), run by one
    function (``_round``), eager or compiled (see the module doc)."""

    def __init__(
        self,
        call: ModelCall,
        dtype: torch.dtype,
        device: torch.device,
        kv_shape: tuple[int, int],
        *,
        layers: Callable[..., torch.Tensor] | None = None,
        attention: Callable | None = None,
        tiled_mask: bool = True,
        bucketed: bool = False,
        compile: bool = False,
        ladder: BucketLadder | None = None,
    ) -> None:
        """``call``: the model's forward as the adapter resolved it (cache keyword, masks per layer type);
        ``kv_shape``: (K/V heads, head dim). ``layers``: the backend's whole decoder layers
        (``ForwardBackend.forward_model`` bound to the model), which then run every eager round instead of
        transformers' layers. ``attention``: the round attention transformers' layers take by keyword
        (``attention.reaches_attention``; its mask tiled for the packed query heads where ``tiled_mask``), or None:
        the model's own attention under the round's mask as a 4-D mask. ``bucketed``: rows padded to the ladder's
        buckets and K/V read at its widths (fixed shapes, fixed addresses: what CUDA graphs replay); otherwise each
        round runs at its own rows and live width. ``compile``: bucketed rounds on a job's arena run through
        ``torch.compile`` (CUDA graphs on a GPU)."""
        self.call, self.dtype, self.device = call, dtype, device
        self.ladder = ladder or BucketLadder()
        self.bucketed = bucketed or compile
        self.layers = layers
        # an attention taken by keyword reads the live width (the mask's) of the buffer; the model's own reads
        # the slots the arena hands it: the live width too where shapes are free, the whole buffer on a bucket
        self.attention = attention
        self.live_width = attention is not None or layers is not None or not self.bucketed
        heads = call.model.config.get_text_config().num_attention_heads
        self.groups = heads // kv_shape[0] if attention is not None and tiled_mask and layers is None else 1
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
        self._key_slots: dict[int, torch.Tensor] = {}  # per K/V width: arange(width) on the device (buckets)
        self._all_slots = torch.empty(0, dtype=torch.long)  # 0 .. n-1 on the device: eager widths are its views

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
        round), staged in one host tensor and run by ``_round``: at its bucket and compiled where it can replay a
        graph, else eager (on a device, after one copy of the staged inputs). The caller reserved the regions for
        their rows, the last one also for the bucket's fillers, and advances their lengths."""
        arena = regions[0].arena
        rows = [len(r.tokens) for r in rounds]
        real, logits = sum(rows), sum(len(r.logit_rows) for r in rounds)
        bucket = self.ladder.rows_for(real) if self.bucketed else real
        ends = [region.base + region.length + q for region, q in zip(regions, rows, strict=True)]
        live = max(max(ends), ends[-1] + bucket - real)  # the fillers write after the last segment's rows
        if not self.bucketed:
            width = live
        else:
            width = self.ladder.kv_width(live, arena.capacity) if self.live_width else arena.capacity
        segments = [(r, region.base, region.length) for r, region in zip(rounds, regions, strict=True)]
        graph = self.compiled is not None and self.ladder.captured(bucket) and self._replays(arena)
        staged_logits = bucket if self.bucketed else logits  # a bucket's logit rows are a fixed shape too
        host = stage(bucket, staged_logits, segments, self.pin)
        if self.device.type == "cpu" and not graph:
            staged = StagedInputs.views(host, bucket, staged_logits)  # the round reads the host tensor itself
        else:
            staged = self._staging(bucket, staged_logits)
            staged.buffer.copy_(host, non_blocking=True)  # the round's one host->device copy
        single = len(regions) == 1
        # the model's own attention (no keyword) reads the slots the arena hands it: the live ones where shapes
        # are free; the round's attention cuts the buffer to its mask's width itself
        read = (0, width) if self.attention is None and not self.bucketed else None
        for layer in arena.layers():
            layer.write_slots, layer.read_slots = staged.write_slots, read
            layer.length = regions[0].base + regions[0].length if single else 0
        if graph:
            torch.compiler.cudagraph_mark_step_begin()  # the previous round's outputs may be overwritten now
            self._shapes.add((bucket, width, id(arena), arena.allocations))
            compiled = _dynamo_graphs()
            out = self.compiled(*staged.round_inputs, self._slots(width), arena.cache)
            self.compiles += _dynamo_graphs() - compiled
        else:
            spans = None
            if self.layers is not None:  # each generation's rows and keys (a bucket's fillers: the last one's)
                spans = [(q, region.base, region.length + q) for q, region in zip(rows, regions, strict=True)]
                q, first, keys = spans[-1]
                spans[-1] = (q + bucket - real, first, keys + bucket - real)
            key_slots = self._slots(width) if self.bucketed else self._eager_slots(width)
            out = self._round(*staged.round_inputs, key_slots, arena.cache, spans)
        return out[:logits]

    def counts(self) -> tuple[int, int]:
        """(compilations of the round function, distinct shapes run compiled) so far: a job that warmed up every
        shape it uses adds neither after its start-up (on CUDA a new shape is a graph recorded mid-job, while the
        other ranks wait)."""
        return self.compiles, len(self._shapes)

    def _round(
        self,
        input_ids: torch.Tensor,  # [B]
        position_ids: torch.Tensor,  # [B]
        logit_rows: torch.Tensor,  # [L]
        write_slots: torch.Tensor,  # [B]
        cached_from: torch.Tensor,  # [B]
        cached_to: torch.Tensor,  # [B]
        visibility: torch.Tensor,  # [B, B] bool
        key_slots: torch.Tensor,  # [K]
        cache,  # the arena's DynamicCache
        spans: Sequence[tuple[int, int, int]] | None = None,  # the whole layers' generations (eager only)
    ) -> torch.Tensor:  # [L, vocab]
        """The round itself, the function that is compiled: its masks (one per window, shared by every layer of
        that window), then the backend's whole layers where it has them, else the model's forward naming its
        attention (``self.attention``) where it takes one."""
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
        if self.layers is not None and spans is not None:
            return self.layers(input_ids, position_ids, self.call.mask(masks), cache, logit_rows, spans)
        attend = {} if self.attention is None else {ROUND_KEYWORD: self.attention}
        return self.call(input_ids, position_ids, masks, cache, logit_rows, **attend)  # [L, vocab]

    def _staging(self, rows: int, logits: int) -> StagedInputs:
        """The device staging buffer of a bucket (made once, static: a graph reads it in place), or a new one for
        a round past the ladder or of free shape."""
        staged = self._staged.get(rows) if logits == rows else None
        if staged is None:
            with torch.inference_mode():
                buffer = torch.empty(StagedInputs.nbytes(rows, logits), dtype=torch.uint8, device=self.device)
            staged = StagedInputs.views(buffer, rows, logits)
            if not (self.bucketed and self.ladder.captured(rows)):
                return staged
            for field in staged.round_inputs:
                static_address(field)
            self._staged[rows] = staged
        return staged

    def _eager_slots(self, width: int) -> torch.Tensor:
        """[width] int64 0 .. width-1 on the device: a view of one vector, remade only when a wider round comes."""
        if self._all_slots.shape[0] < width:
            with torch.inference_mode():
                self._all_slots = torch.arange(max(width, 2 * self._all_slots.shape[0]), device=self.device)
        return self._all_slots[:width]

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
        ``size`` slots reads (``widths_past``): the shapes a job whose regions fill those slots (``KVArena.slots``)
        runs, so none is recorded mid-job. The rounds' K/V is left in a region of ``size`` slots, released after.
        Returns the seconds it took; ``capture_s`` holds each bucket's (all its widths)."""
        region = arena.region(size - arena.region_extra)  # exactly ``size`` slots: the region adds its extra
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

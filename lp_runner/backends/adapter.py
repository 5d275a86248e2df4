"""The only place that talks to a Hugging Face causal LM's forward and K/V cache.

transformers 5.x keeps moving: the cache keyword is ``past_key_values`` up to 5.23 and ``cache`` from 5.24 (the
old name still works there, with a deprecation); ``DynamicCache.crop`` takes only negative counts from 5.20 on
(negative counts work in every 5.x); ``cache_position`` left Llama's forward in 5.4. This adapter resolves those
once, from the model's own signature (no class-name sniffing), and ``tests/backends/test_model_adapter.py`` checks each
operation on every supported model family and on the oldest supported transformers.

Two of transformers' defaults are replaced for the adapter's own forwards, to save copies, not arithmetic: the
cache appends into a growing buffer instead of concatenating (``AppendBufferLayer``; the same bits), and
grouped-query attention over a packed round reads K/V heads in place instead of repeating them
(``lp_runner.backends.attention``; the same kernel and dot products, equal to fp32 rounding).

The kernels under the forward are its backend's (``backends.base.ForwardBackend``, chosen once at load by
``backends.select_backend``): the adapter asks it which attention a packed round runs and whether it runs whole
decoder layers itself, and never tests a kernel's name.

Sliding-window layers (Mistral, Qwen2 with sliding layers, Gemma 2/3 local layers) keep every position here, like
full layers, and see their window through the mask instead: each packed row masks the keys more than ``window - 1``
positions before its own (``sliding_window_mask``), so the window is per row, as in one-row decoding, at any
length. Hybrid models get one mask per layer type (``{"full_attention": ..., "sliding_attention": ...}``, the
mapping transformers' hybrid models accept in place of a 4-D mask).
"""

from __future__ import annotations

import inspect
import time
import weakref
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from lp_runner.backends import detect_backend
from lp_runner.backends.attention import (
    BATCHED,
    SegmentedRound,
    additive_mask,
    packed_gqa,
    sliding_window_mask,
    supports_packed_gqa,
)
from lp_runner.backends.base import ForwardBackend
from lp_runner.backends.kv_cache import (
    AppendBufferLayer,
    StaticBufferLayer,
    allocate_arena,
    copy_slots,
    kv_head_shape,
    shared_arena,
    static_capacity,
)
from lp_runner.backends.static_rounds import StaticRounds
from lp_runner.errors import LPError

if TYPE_CHECKING:
    from lp_runner.backends.batch import BatchRound

SLIDING = "sliding_attention"  # the layer type whose mask is windowed (transformers' name in ``layer_types``)


class UnsupportedModelError(LPError):
    """A model transformers loads but lp_runner cannot run exactly; the message is one line for the user."""


class ModelAdapter:
    """forward(ids, positions, visibility, cache, logit_rows) -> logits of those rows only."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        append_buffer: bool = True,
        packed_gqa: bool = True,
        static_cache: bool = False,
        compile: bool = False,
        skip_guards: bool = True,
        backend: ForwardBackend | None = None,
        bucketed: bool | None = None,
    ) -> None:
        """``append_buffer`` / ``packed_gqa`` off: transformers' own DynamicLayer / sdpa path (benchmarks A/B them).
        ``static_cache``: static-shape rounds (``StaticBufferLayer``, a full-capacity mask), as compiled forwards
        need them. ``compile``: static-shape rounds through ``torch.compile`` (see ``compiled_forward``); eager
        stays the fallback and the oracle. ``skip_guards`` (compiled, after ``warm_up``): dynamo's guards are
        checked on the first forward of every cache and skipped on its later rounds (see ``_guard_stance``).
        ``backend``: the kernels the forward runs on, chosen at load (``backends.select_backend``); default: the
        model's own (``backends.detect_backend``). A backend that runs whole decoder layers runs the eager rounds
        and prefills through them, on static buffers; compiled rounds trace transformers' layers on its kernels.
        ``bucketed`` (None: on a CUDA device): every round at a row bucket on fixed buffers, compiled with CUDA
        graphs when ``compile`` (``static_rounds.StaticRounds``)."""
        self.model = model
        self.append_buffer = append_buffer
        self.packed_gqa = packed_gqa
        self.static_cache = static_cache or compile
        self.compiled = compile
        self.skip_guards = compile and skip_guards
        self._warm = False  # warm_up done: the compiled graph exists
        self._guarded: weakref.ref | None = None  # the cache whose first forward ran with every guard checked
        self._call = model
        params = inspect.signature(model.forward).parameters
        if "cache" in params:
            self._cache_kw = "cache"
        elif "past_key_values" in params:
            self._cache_kw = "past_key_values"
        else:
            raise TypeError(f"{type(model).__name__}.forward takes neither 'cache' nor 'past_key_values'")
        if "logits_to_keep" not in params:
            raise TypeError(f"{type(model).__name__}.forward has no 'logits_to_keep'; lp_runner needs it")
        try:
            self.mask_windows, self.mask_per_type = attention_windows(model.config, DynamicCache(config=model.config))
        except UnsupportedModelError as exc:
            raise UnsupportedModelError(f"{type(model).__name__} cannot run under lp_runner: {exc}") from None
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        backend = detect_backend(model) if backend is None else backend
        self.backend = backend.transformers_layers() if compile else backend
        if self.backend.whole_layers:
            self.static_cache = True  # whole layers write K/V at the adapter's slots
        self.attention = self.backend.attention  # what packed rounds attend with on transformers' layers
        self.vocab_size = model.config.get_text_config().vocab_size
        self.kv_shape = kv_head_shape(model.config.get_text_config())  # (K/V heads, head dim): static buffers
        self.max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.rounds = self._static_rounds(bucketed, compile)
        self._check_takes_packed_masks()  # eagerly: a model that cannot run is refused before any compilation
        if compile and self.rounds is None:
            self._call = compiled_forward(model)

    def _check_takes_packed_masks(self) -> None:
        """Refuse, in one line, a model whose forward cannot take the engine's per-row 4-D mask.

        ALiBi models (BLOOM, Falcon with ``alibi``) build their position bias from a 2-D padding mask and fail
        inside transformers on a 4-D one; a two-token forward finds that out before any prompt is run.
        """
        try:
            self.forward(
                torch.zeros(2, dtype=torch.long), torch.arange(2), causal(2), self.new_cache(), torch.tensor([1])
            )
        except Exception as exc:  # whatever the model's own code raised: the message says which model and why
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UnsupportedModelError(
                f"{type(self.model).__name__} cannot run under lp_runner: its forward does not take a per-row "
                f"attention mask ({reason}); ALiBi models such as BLOOM and Falcon with alibi are not supported"
            ) from exc

    def new_cache(self, capacity: int = 0, *, fixed: bool = False) -> DynamicCache:
        """A DynamicCache whose attention layers keep every position (sliding ones too: their window is a mask) and
        append into a growing buffer (see ``AppendBufferLayer``; transformers' DynamicLayer without append_buffer),
        or, with ``static_cache``, hold a fixed buffer of at least ``capacity`` slots (``StaticBufferLayer``; the
        engine passes the generation's longest possible length, so the buffer is allocated once).

        A rolling sliding-window layer would drop positions a later round still needs once a rejected tail is
        cropped, and cannot be cropped once full; a full layer has neither problem.

        Static buffers are allocated here, in one arena (``kv_cache.allocate_arena``). ``fixed`` (a generation's
        cache, sized by the engine): they are never reallocated, a round that would outrun them raises
        ``KVCapacityError``; otherwise (scratch caches) they grow as before.
        """
        if self.rounds is not None:
            return self.rounds.new_cache(capacity, fixed)
        cache = DynamicCache(config=self.model.config)
        if self.static_cache:
            full = lambda: StaticBufferLayer(static_capacity(capacity), fixed=fixed)  # noqa: E731
        elif self.append_buffer:
            full = lambda: AppendBufferLayer(capacity)  # noqa: E731
        else:
            full = DynamicLayer
        cache.layers = [full() if _is_attention_layer(layer) else layer for layer in cache.layers]
        static = _static_layers(cache)
        if static:
            allocate_arena(static, *self.kv_shape, self.dtype, self.device)
        return cache

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [Q]
        position_ids: torch.Tensor,  # [Q]
        visibility: torch.Tensor,  # [Q, Q] bool, in-round rows only; the cached prefix is always visible
        cache: DynamicCache,
        logit_rows: torch.Tensor,  # [R]
    ) -> torch.Tensor:  # [R, vocab]
        if self.rounds is not None:
            return self.rounds.forward(input_ids, position_ids, visibility, cache, logit_rows)
        past = cache_length(cache)
        windowed = any(self.mask_windows.values())
        static = _static_layers(cache)
        if len(input_ids) == 1 and not windowed and not static:
            # one row that sees every cached key: transformers' own decode step (no mask, as HF generate runs it)
            return self._run(input_ids, position_ids, None, cache, logit_rows)
        if self.compiled and len(input_ids) == 1:
            return self._one_row_as_two(input_ids, position_ids, cache, logit_rows)
        total = past + len(input_ids)
        if static:
            for layer in static:
                layer.reserve(total)
                if not layer.is_initialized:
                    layer.allocate(*self.kv_shape, self.dtype, self.device)
            capacity = static[0].capacity
            slots = torch.arange(past, total, device=self.device)
            if self.compiled:  # a tensor reached through the cache, not an argument: dynamo would fix its length
                torch._dynamo.mark_dynamic(slots, 0)
            for layer in static:
                layer.write_slots = slots
        else:
            capacity = total
        mask = additive_mask(visibility.to(self.device), past, self.dtype, width=capacity)  # [1, 1, Q, capacity]
        if windowed:
            # cached position j sits in slot j (the engine commits in order); in-round keys carry their own
            # positions; slots past the round are hidden whatever position they are given
            query_positions = position_ids.to(self.device)  # [Q]
            key_positions = torch.cat(
                [
                    torch.arange(past, device=self.device),
                    query_positions,
                    torch.arange(total, capacity, device=self.device),
                ]
            )  # [capacity]
            masks = {
                window: mask if window is None else sliding_window_mask(mask, query_positions, key_positions, window)
                for window in set(self.mask_windows.values())
            }
            per_type = {layer_type: masks[window] for layer_type, window in self.mask_windows.items()}
            mask = per_type if self.mask_per_type else next(iter(per_type.values()))
        logits = self._run(input_ids, position_ids, mask, cache, logit_rows)
        for layer in static:
            layer.length = total
        return logits

    @torch.inference_mode()
    def forward_batch(self, batch: BatchRound, cache: DynamicCache) -> torch.Tensor:  # [L, vocab]
        """One forward over several generations (``batch_forward.py``): every row writes its K/V at its slot of
        ``cache`` (a ``slot_cache.SlotCache``'s buffers) and attends to its own generation's keys only. The
        backend's whole layers where it has them (one call over the segments); transformers' layers otherwise, with
        ``attention.batched_attention`` (one attention call per segment). Eager in either case: a compiled forward
        is traced for one sequence. Check ``decoding.forwards.batch_support`` first."""
        device = self.device
        slots = batch.slots.to(device)
        for layer in cache.layers:
            layer.write_slots = slots
        ids, positions, logit_rows = (t.to(device) for t in (batch.input_ids, batch.position_ids, batch.logit_rows))
        if self.backend.whole_layers:
            masks = {window: m.to(device) for window, m in batch.masks.items()}
            per_type = {layer_type: masks[window] for layer_type, window in self.mask_windows.items()}
            mask = per_type if self.mask_per_type else next(iter(per_type.values()))
            logits = self.backend.forward_model(
                self.model, ids, positions, mask, cache, logit_rows, segments=batch.segments
            )
            if logits is not None:
                return logits
        seg = batch.segments
        starts, bases, widths = seg.start.tolist(), seg.base.tolist(), seg.width.tolist()
        masks = {
            window: tuple(batch.segment_mask(window, b).to(device)[None, None] for b in range(seg.count))
            for window in batch.masks
        }
        layer_types = getattr(self.model.config.get_text_config(), "layer_types", None) or [""] * len(cache.layers)
        rnd = SegmentedRound(
            rows=tuple(zip(starts[:-1], starts[1:], strict=True)),
            keys=tuple((b, b + w) for b, w in zip(bases, widths, strict=True)),
            masks=masks,
            layer_windows=tuple(self.mask_windows[t if self.mask_per_type else ""] for t in layer_types),
            inner=self.backend.segment_attention,
        )
        # no layer may use it: a mask of no keys broadcasts to none (one of width 1 would broadcast to every slot),
        # so an attention that is not ``batched_attention`` fails instead of reading other generations' keys
        placeholder = torch.zeros(1, 1, len(ids), 0, dtype=self.dtype, device=device)
        mask = {t: placeholder for t in self.mask_windows} if self.mask_per_type else placeholder
        with packed_gqa(self.model.config, BATCHED):
            out = self.model(
                input_ids=ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=logit_rows,
                lp_batch=rnd,
                **{self._cache_kw: cache},
            )
        return out.logits[0]  # [L, vocab]

    def batch_structure(self) -> str | None:
        """Why this model's layers cannot take a batched round (one line), or None where they may: the backend's
        whole layers, or transformers' sdpa layers that hand the forward's keywords down to their attention over plain
        attention cache layers. Whether they then compute it exactly is the decoding side's probe
        (``decoding.forwards.batch_support``)."""
        if not (self.backend.whole_layers or supports_packed_gqa(self.model.config)):
            return f"{type(self.model).__name__} runs {self.model.config._attn_implementation} attention"
        if not all(_is_attention_layer(layer) for layer in DynamicCache(config=self.model.config).layers):
            return "its cache has layers that are not plain attention layers"
        return None

    def _static_rounds(self, bucketed: bool | None, compile: bool) -> StaticRounds | None:
        """The static-round runner where rounds run bucketed (see ``__init__``), else None."""
        if not (self.device.type == "cuda" if bucketed is None else bucketed):
            return None
        return StaticRounds(
            self.model,
            self._cache_kw,
            self.kv_shape,
            self.dtype,
            self.device,
            self.mask_windows,
            self.mask_per_type,
            _is_attention_layer,
            compile=compile,
        )

    def release_cache(self, cache: DynamicCache) -> None:
        """``cache``'s generation is over: bucketed rounds hand its buffers to the next generation."""
        if self.rounds is not None:
            self.rounds.release(cache)

    def _one_row_as_two(self, input_ids, position_ids, cache: DynamicCache, logit_rows) -> torch.Tensor:
        """A one-row round of a compiled forward, run as two rows: the row, then a filler that sees only itself
        and is seen by nothing (``layout.pad_layout``'s filler; its K/V slot is past the cache's length, so the
        next round overwrites it). A compiled graph is specialised to size-1 dimensions; with every round at two
        rows or more, one graph serves them all."""
        ids = torch.cat([input_ids, input_ids.new_zeros(1)])
        positions = torch.cat([position_ids, position_ids[-1:]])
        logits = self.forward(ids, positions, torch.eye(2, dtype=torch.bool), cache, logit_rows)
        crop(cache, cache_length(cache) - 1)
        return logits

    def warm_up(self, capacity: int) -> float:
        """Compile before the job (a compiled forward compiles on its first call): one round on a scratch cache of
        ``capacity`` slots, the shape class of every later round. Returns the seconds it took (0 when eager)."""
        if not self.compiled:
            return 0.0
        if self.rounds is not None:
            return self.rounds.warm_up(capacity)
        start = time.perf_counter()
        # three rows, two of them read: sizes that no later round's can be forced equal to (dynamo's duck sizing
        # would otherwise specialise the graph to rows == logit rows, and the first other round would recompile)
        self.forward(
            torch.zeros(3, dtype=torch.long), torch.arange(3), causal(3), self.new_cache(capacity), torch.tensor([1, 2])
        )
        self._warm = True
        return time.perf_counter() - start

    def _run(self, input_ids, position_ids, mask, cache: DynamicCache, logit_rows: torch.Tensor) -> torch.Tensor:
        switch = self.packed_gqa and mask is not None and supports_packed_gqa(self.model.config)
        attention = packed_gqa(self.model.config, self.attention) if switch else nullcontext()
        if self.compiled and len(logit_rows) == 1:  # never a size-1 dimension in a compiled graph (see above)
            return self._run(input_ids, position_ids, mask, cache, logit_rows.repeat(2))[:1]
        if self.compiled:  # one kind of tensor in every call: dynamo guards on it, a change would recompile
            input_ids, position_ids, logit_rows = (_inference_tensor(t) for t in (input_ids, position_ids, logit_rows))
        if self.backend.whole_layers and mask is not None:  # the whole round in the backend's layers, where it can
            logits = self.backend.forward_model(
                self.model, input_ids.to(self.device), position_ids.to(self.device), mask, cache, logit_rows
            )
            if logits is not None:
                return logits
        with attention, self._guard_stance(cache):
            out = self._call(
                input_ids=input_ids.to(self.device).unsqueeze(0),
                position_ids=position_ids.to(self.device).unsqueeze(0),
                attention_mask=mask,
                use_cache=True,
                logits_to_keep=logit_rows.to(self.device),
                **{self._cache_kw: cache},
            )
        return out.logits[0]  # [R, vocab]

    def _guard_stance(self, cache: DynamicCache):
        """Dynamo's guard checks for this forward: all of them on a cache's first forward; on its later rounds only
        those torch's ``skip_guard_eval_unsafe`` stance keeps (every tensor input's, and those that told earlier
        graphs apart; a recompilation they would need raises instead of compiling).

        Why: checking some 6,000 guards (the model's modules, the cache's layers) cost about 1.8 ms of a 26 ms
        compiled one-row forward of the embedded model on a 2-core CPU, on every round. Within one cache's
        generation a round differs from the last only in what the graph takes as dynamic sizes (rows, logit rows,
        write slots) and in tensor contents; ``test_compile`` runs every bucket's rounds, three families and a
        native-prepacked model, under ``error_on_recompile``, and two models of one class alternating. A new cache
        (a new prompt, another model, whatever changed between generations) is checked in full, and a failed check
        recompiles as usual. Measured side by side the saving is small (0.15-0.5 ms, ``attention_paths.py``).
        """
        if not (self.skip_guards and self._warm):
            return nullcontext()
        if self._guarded is not None and self._guarded() is cache:
            return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        self._guarded = weakref.ref(cache)
        return nullcontext()


def _inference_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as an inference tensor (called in inference mode). A compiled graph is guarded on its inputs'
    dispatch keys, and a tensor made outside inference mode carries one an inference tensor lacks: without this,
    the engine's first rounds (tensors from the host) and later ones (tensors from earlier forwards) each
    compiled the whole forward again (35-40 s each on a 2-core CPU)."""
    return t if t.is_inference() else t.clone()


def compiled_forward(model: PreTrainedModel):
    """``model`` through ``torch.compile`` for static-shape rounds: dynamic shapes (the row count and the cache
    capacity are symbols, so one graph serves every bucket), inductor's default backend (C++ kernels on a CPU,
    Triton on a GPU). Compiled kernels are cached on disk by inductor (``TORCHINDUCTOR_CACHE_DIR``, set by the
    runner under lp_runner's cache dir), so a second run compiles much faster."""
    return torch.compile(model, dynamic=True)


def attention_windows(config, cache: DynamicCache) -> tuple[dict[str, int | None], bool]:
    """The sliding window of each layer type's mask (None: full attention), and whether the model takes one mask
    per layer type (a dict keyed by ``config.layer_types``) or one 4-D mask for every layer.

    Read from the cache transformers builds for the config (which layers slide, and by how much), so no model is
    named here. Examples: Llama -> ({"": None}, False); Mistral with sliding_window=8 -> ({"": 8}, False);
    Gemma 3 with layer_types [sliding, full] -> ({"sliding_attention": 8, "full_attention": None}, True).
    A layout no mask can express exactly (two windows on one layer type, a windowed type that is not plain
    sliding attention, such as chunked attention) is refused.
    """
    windows = [layer.sliding_window if getattr(layer, "is_sliding", False) else None for layer in cache.layers]
    if not any(windows):
        return {"": None}, False
    layer_types = getattr(config.get_text_config(), "layer_types", None)
    if layer_types is None:
        if len(set(windows)) != 1:
            raise UnsupportedModelError(
                f"layers with different sliding windows {sorted(set(windows), key=str)} but no layer_types"
            )
        return {"": windows[0]}, False
    if len(layer_types) != len(windows):
        raise UnsupportedModelError(f"{len(layer_types)} layer_types for {len(windows)} cache layers")
    by_type: dict[str, int | None] = {}
    for layer_type, window in zip(layer_types, windows, strict=True):
        if by_type.setdefault(layer_type, window) != window or (window is not None and layer_type != SLIDING):
            raise UnsupportedModelError(f"unsupported attention layout: layer type {layer_type!r} with window {window}")
    return by_type, True


def _static_layers(cache: DynamicCache) -> list[StaticBufferLayer]:
    return [layer for layer in cache.layers if isinstance(layer, StaticBufferLayer)]


def _is_attention_layer(layer) -> bool:
    """A plain K/V layer, full or sliding (not a recurrent, conv or quantized layer, which are kept as they are)."""
    return type(layer) in (DynamicLayer, DynamicSlidingWindowLayer)


def causal(t: int) -> torch.Tensor:
    """[T, T] bool visibility of a plain causal block (row i sees rows 0..i)."""
    return torch.ones(t, t, dtype=torch.bool).tril()  # [T, T]


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` cached positions of every layer (negative-count crop: valid on every 5.x).

    Each layer is cropped by its own length: after a forward that failed part-way, the layers before the failure
    hold this round's K/V and the later ones do not, so one count for all layers would cut committed positions.
    """
    for layer in cache.layers:
        remove = layer.get_seq_length() - length
        if remove < 0:
            raise ValueError(f"cannot crop a cache of {layer.get_seq_length()} positions to {length}")
        if remove:
            layer.crop(-remove)


@torch.inference_mode()  # cache tensors are inference tensors: in-place writes must happen in this mode
def move_rows(cache: DynamicCache, src: Sequence[int], dst: Sequence[int]) -> None:
    """Copy the K/V of cache positions ``src`` to ``dst`` (distinct) in every layer (sources are read before
    writing). A position moved onto itself is left alone: a round whose winning candidate's rows follow its
    ordinary rows (every no-window round's first candidate) moves nothing, where copying it cost about 0.75 ms
    a round on the embedded model's 30 layers (2-core CPU), 6% of a 12 ms round. A cache whose layers view one
    arena (``kv_cache.allocate_arena``: every static generation cache) moves every layer's rows at once, others
    layer by layer (``kv_cache.copy_slots``: one slice copy per run of consecutive moves)."""
    if len(src) != len(dst):
        raise ValueError("src and dst must have equal length")
    moves = [(s, d) for s, d in zip(src, dst, strict=True) if s != d]
    if not moves:
        return
    src, dst = zip(*moves, strict=True)
    arena = shared_arena(cache.layers)
    buffers = [arena] if arena is not None else [t for layer in cache.layers for t in (layer.keys, layer.values)]
    copy_slots(buffers, src, dst)

"""The only place that talks to a Hugging Face causal LM's forward and K/V cache.

transformers 5.x keeps moving: the cache keyword is ``past_key_values`` up to 5.23 and ``cache`` from 5.24 (the
old name still works there, with a deprecation); ``DynamicCache.crop`` takes only negative counts from 5.20 on
(negative counts work in every 5.x); ``cache_position`` left Llama's forward in 5.4. This adapter resolves those
once, from the model's own signature (no class-name sniffing), and ``tests/backends/test_model_adapter.py`` checks each
operation on every supported model family and on the oldest supported transformers.

Every round is one call, ``ModelAdapter.run``: one or more segments (one generation each: a lookahead round, a
prefill chunk) in one forward, each writing its K/V at its own slots of one arena (``backends.kv_cache.KVArena``)
and reading its own region only. Under it is one round function (``rounds.Rounds``): the round staged once
(``staging``), its mask built once (``round_mask``), then run on the backend's whole layers where it has them (the
CPU plug-in), else on transformers' layers with the round's attention (by keyword, or the model's own under the
round's mask); at fixed row buckets, compiled and captured on CUDA, where the adapter is bucketed. What runs is
chosen once, here; no round falls back to another path.

The kernels under the forward are its backend's (``backends.base.ForwardBackend``, chosen once at load by
``backends.select_backend``): the adapter asks it which attention a packed round runs and whether it runs whole
decoder layers itself, and never tests a kernel's name.

Sliding-window layers (Mistral, Qwen2 with sliding layers, Gemma 2/3 local layers) keep every position here, like
full layers, and see their window through the mask instead: each packed row masks the keys more than ``window - 1``
positions before its own (``round_mask``), so the window is per row, as in one-row decoding,
at any length. Hybrid models get one mask per layer type (``{"full_attention": ..., "sliding_attention": ...}``, the
mapping transformers' hybrid models accept in place of a 4-D mask).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from lp_runner.backends import detect_backend
from lp_runner.backends.attention import reaches_attention, supports_round_attention
from lp_runner.backends.base import ForwardBackend
from lp_runner.backends.kv_cache import MIN_CAPACITY, KVArena, KVRegion, region_slots
from lp_runner.backends.model_call import ModelCall
from lp_runner.backends.round_mask import round_attention
from lp_runner.backends.rounds import Rounds
from lp_runner.backends.staging import RoundRows, Rows
from lp_runner.errors import LPError

SLIDING = "sliding_attention"  # the layer type whose mask is windowed (transformers' name in ``layer_types``)


class UnsupportedModelError(LPError):
    """A model transformers loads but lp_runner cannot run exactly; the message is one line for the user."""


class ModelAdapter:
    """run(segments' rows, their K/V regions) -> logits of their logit rows, in order."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        backend: ForwardBackend | None = None,
        bucketed: bool | None = None,
    ) -> None:
        """Eager rounds, until ``compile`` makes them compiled (one adapter per job: the compiled rounds share its
        arena, and its eager ones stay the oracle). ``backend``: the kernels the forward runs on, chosen at load
        (``backends.select_backend``); default: the model's own (``backends.detect_backend``). ``bucketed`` (None:
        on a CUDA device): every round, of one generation or several, at a row bucket on the arena's fixed
        addresses."""
        self.model = model
        self.compiled = False
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
        self.call = ModelCall(model, self._cache_kw, self.mask_windows, self.mask_per_type)  # every round's
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        backend = detect_backend(model) if backend is None else backend
        self.backend = backend
        self.vocab_size = model.config.get_text_config().vocab_size
        # (K/V heads, head dim) of every attention layer; and whether transformers' layers take a round's own
        # attention by keyword: plain sdpa layers that hand the forward's keywords down. Any other attention runs
        # under the round's mask as a 4-D mask
        self.kv_shape, self.keyword = self._probe()
        self.max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.bucketed = self.device.type == "cuda" if bucketed is None else bucketed
        self.rounds = self._rounds()
        self._arena: KVArena | None = None  # the job's arena, held across jobs and calls (``arena``)
        self._claimed = False
        self._arena_lock = threading.Lock()
        self._check_takes_packed_masks()  # eagerly: a model that cannot run is refused before any compilation
        self._eager_rounds = self.rounds  # what ``run(eager=True)`` runs once ``compile`` replaced ``rounds``

    @torch.inference_mode()
    def _probe(self) -> tuple[tuple[int, int], bool]:
        """(K/V heads, head dim) as the attention layers cache them, and whether a round may name its attention in
        its forward (``attention.reaches_attention``), from a one-token forward of the model on transformers' own
        cache. Decided once, here; the model's config is never switched.

        The shape is read from the cache: configs name it in several ways (``num_key_value_heads``, ``n_head``,
        ``multi_query``, ...), some models ignore a field they accept, and the arena must hold what the layers
        write. One arena holds every layer, so the layers must agree, and keys and values must share a head dim."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        caches: list[DynamicCache] = []

        def one_token(**keywords) -> None:
            caches.append(DynamicCache(config=self.model.config))
            self.model(input_ids=ids, use_cache=True, **{self._cache_kw: caches[-1]}, **keywords)

        layers = sum(_is_attention_layer(layer) for layer in DynamicCache(config=self.model.config).layers)
        keyword = supports_round_attention(self.model.config) and reaches_attention(one_token, layers)
        if not keyword:  # the plain forward, on a fresh cache
            one_token()
        shapes = {
            (layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[1], layer.values.shape[3])
            for layer in caches[-1].layers
            if _is_attention_layer(layer) and layer.is_initialized
        }
        if len(shapes) != 1:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} cannot run under lp_runner: its attention layers cache K/V of "
                f"{len(shapes)} shapes (one arena holds every layer's)"
            )
        ((heads, dim, v_heads, v_dim),) = shapes
        if (heads, dim) != (v_heads, v_dim):
            raise UnsupportedModelError(
                f"{type(self.model).__name__} cannot run under lp_runner: its keys ({heads} x {dim}) and values "
                f"({v_heads} x {v_dim}) differ in shape"
            )
        return (heads, dim), keyword

    def _rounds(self) -> Rounds:
        """The one round function, its layers and attention chosen here, once: the backend's whole layers where
        it has them, else transformers' layers with the backend's round attention where they take it by keyword
        (a compiled adapter's: torch's sdpa, ``round_attention``, which the compiler traces; a backend's own
        kernel is a call it cannot)."""
        backend = self.backend
        attention, tiled = (round_attention, True) if self.compiled else (backend.round_attention, backend.tiled_mask)
        return Rounds(
            self.call,
            self.dtype,
            self.device,
            self.kv_shape,
            layers=functools.partial(backend.forward_model, self.model) if backend.whole_layers else None,
            attention=attention if self.keyword else None,
            tiled_mask=tiled,
            bucketed=self.bucketed,
            compile=self.compiled,
        )

    def _check_takes_packed_masks(self) -> None:
        """Find how this model's transformers layers take a round, or refuse it in one line.

        A model whose sdpa layers hand the forward's keywords down to their attention takes the round's attention
        by keyword; one whose layers mishandle it fails, loudly, and runs its own attention under the round's
        mask instead. ALiBi models (BLOOM, Falcon with ``alibi``) build their position bias from a 2-D padding
        mask and fail on a 4-D one: refused. A two-token round of each finds out, before any prompt is run or
        anything is compiled."""

        def two_tokens() -> None:
            with self.arena([2], scratch=True) as arena:
                self.run([Rows([0, 0], [0, 1], causal(2), [1])], [arena.region(2)])

        if self.keyword:
            try:
                two_tokens()
                return
            except Exception:  # noqa: BLE001 - the model's own code refused the round's attention: try the mask
                self.keyword = False
                self.rounds = self._rounds()
        try:
            two_tokens()
        except Exception as exc:  # whatever the model's own code raised: the message says which model and why
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UnsupportedModelError(
                f"{type(self.model).__name__} cannot run under lp_runner: its forward does not take a per-row "
                f"attention mask ({reason}); ALiBi models such as BLOOM and Falcon with alibi are not supported"
            ) from exc

    # ------------------------------------------------------------------------------------------------- K/V

    @contextlib.contextmanager
    def arena(self, needs: Sequence[int] = (), *, scratch: bool = False) -> Iterator[KVArena]:
        """The one way K/V is lent: an arena with room for a region of each of ``needs`` positions
        (``KVArena.region(need)``, all alive at once), the holder's until the block ends.

        The job arena (default): the adapter's own, held across jobs and ``lp_runner.generate`` calls, so a job
        allocates its K/V once and on a GPU its captured graphs (recorded at warm-up, on this arena) replay at the
        same addresses; grown to fit ``needs`` when it is lent. On exit, also on an exception, every region the
        holder left in it is freed and the arena handed back. A second holder at the same time (LP ranks on
        threads over one adapter) gets an arena of its own.

        ``scratch``: a growable arena of the holder's alone (probes, measurements, tests), whose regions grow
        should a round outrun them; it is never replayed on, and nothing is handed back.

        Either way a region holds the room a bucketed round's filler rows write after its rows (the arena's
        ``region_extra``), so the holder asks for the positions its generation needs. A bucketed adapter's arena
        also has ``MIN_CAPACITY`` slots past its power of two: a round's live K/V width (a power of two that holds
        it, ``buckets.BucketLadder.kv_width``) then never equals the arena's size. Where it did, dynamo unified the
        two sizes and the round's slice of the whole buffer was another graph, compiled mid-job."""
        if scratch:
            arena = self._new_arena(needs, growable=True)
            yield arena
            return
        arena = self._claim(needs)
        try:
            yield arena
        finally:
            for region in list(arena.regions):
                arena.release(region)
            with self._arena_lock:
                if arena is self._arena:
                    self._claimed = False

    def _region_extra(self) -> int:
        """The slots a region holds past its positions: a bucketed round's fillers write after its rows."""
        return self.rounds.ladder.max_rows if self.bucketed else 0

    def _new_arena(self, needs: Sequence[int], *, growable: bool) -> KVArena:
        extra = self._region_extra()
        return KVArena(
            self.model.config,
            self.kv_shape,
            self.dtype,
            self.device,
            region_slots(needs, extra),
            attention_layer=_is_attention_layer,
            growable=growable,
            spare=MIN_CAPACITY if self.bucketed else 0,
            region_extra=extra,
        )

    def _claim(self, needs: Sequence[int]) -> KVArena:
        """The job arena grown to fit ``needs``, or a new one while it is lent (``arena``)."""
        with self._arena_lock:
            if self._claimed:
                return self._new_arena(needs, growable=False)
            if self._arena is None:
                self._arena = self._new_arena(needs, growable=False)
            elif self._arena.capacity < self._arena.slots(needs):
                self._arena.grow(self._arena.slots(needs))
            self._claimed = True
            return self._arena

    # ---------------------------------------------------------------------------------------------- rounds

    @torch.inference_mode()
    def run(
        self, rounds: Sequence[RoundRows], regions: Sequence[KVRegion], *, eager: bool = False
    ) -> torch.Tensor:  # [sum R_b, vocab]
        """The round's one forward: segment b's rows (``rounds[b]``) after the ``regions[b].length`` positions
        cached in its region, its K/V written at the slots after them; every segment's logit rows, in order. Each
        region's length then covers the round's rows, until publication keeps or crops them.

        Regions of one arena, each reserved for its rows (``KVRegion.reserve``: a generation's region is sized at
        its start, so a round past it is an error, not a new buffer). ``eager``: on a compiled adapter, the eager
        round function it was compiled from (what ``compile_choice.measure_record`` times the compiled one
        against); otherwise the adapter's own."""
        arena = regions[0].arena
        if any(r.arena is not arena for r in regions):
            raise ValueError("the segments of a round must hold regions of one arena")
        round_function = self._eager_rounds if eager else self.rounds
        arena.flush()  # last round's K/V moves, every generation's at once
        past = [r.length for r in regions]
        rows = [len(r.tokens) for r in rounds]
        for region, p, q in zip(regions, past, rows, strict=True):
            region.reserve(p + q)
        if round_function.bucketed:  # the fillers' slots, after the last segment's
            regions[-1].reserve(past[-1] + rows[-1] + round_function.ladder.rows_for(sum(rows)) - sum(rows))
        logits = round_function.forward(rounds, regions)
        for region, p, q in zip(regions, past, rows, strict=True):
            region.length = p + q
        return logits

    def batch_structure(self) -> str | None:
        """Why this model's layers cannot take a round of several generations (one line), or None where they
        may: every layer's K/V in the arena (plain attention cache layers), so the round's one mask keeps each
        generation to its own region. Whether they then compute it exactly is the decoding side's probe
        (``decoding.batch_round.batch_support``)."""
        if not all(_is_attention_layer(layer) for layer in DynamicCache(config=self.model.config).layers):
            return "its cache has layers that are not plain attention layers"
        return None

    def compile(
        self,
        needs: Sequence[int],
        measurements: Callable[[ModelAdapter], Sequence[Sequence[int]]] | None = None,
        max_rows: int | None = None,
    ) -> float:
        """Every later round compiled (``torch.compile`` at row buckets, CUDA graphs on a GPU: ``rounds.Rounds``) on
        transformers' layers (``ForwardBackend.transformers_layers``), then warmed up (``warm_up``) for a job whose
        generations need ``needs`` positions each, all in flight at once. ``measurements(self)``, asked once the
        adapter is compiled (a calibration is keyed by it): the regions each start-up measurement after the warm-up
        holds at once, which the arena is sized for first, so none grows it under the graphs recorded here.
        Returns the warm-up's seconds; ``max_rows``: the warm-up's largest row bucket (default: every bucket). The
        eager round function stays, for ``run(eager=True)``.

        One adapter per job: its arena and its model are the eager ones'. Should anything fail (no C++ compiler,
        an op inductor cannot lower) the adapter is left eager, as it was, and the exception raised."""
        if self.compiled:
            raise RuntimeError("the adapter is already compiled")
        if self._claimed:
            raise RuntimeError("an adapter cannot be compiled while its job arena is lent")
        before = (self.backend, self.bucketed, self.keyword, self.rounds, self._arena)
        try:
            self.compiled, self.bucketed = True, True
            self.backend = self.backend.transformers_layers()
            self.rounds = self._rounds()
            self._arena = None  # the next is a bucketed one (spare slots, fillers' room)
            self._check_takes_packed_masks()
            others = measurements(self) if measurements is not None else ()
            return self.warm_up(needs, *others, max_rows=max_rows)
        except BaseException:
            self.backend, self.bucketed, self.keyword, self.rounds, self._arena = before
            self.compiled = False
            raise

    def warm_up(self, needs: Sequence[int], *others: Sequence[int], max_rows: int | None = None) -> float:
        """Compile before the job (a compiled round compiles on its first call): every row bucket at every K/V
        width on the job arena, over the slots the job's generations (of ``needs`` positions, all in flight) take;
        the arena sized for them or for any of ``others`` if more (what start-up measurements after the warm-up
        hold at once: sized first, the arena does not grow under the graphs recorded here), so the job's rounds
        replay what this records; ``max_rows``: the largest row bucket warmed (default: every bucket). Returns the
        seconds it took (0 when eager)."""
        if not self.compiled:
            return 0.0
        largest = max((needs, *others), key=lambda n: region_slots(n, self._region_extra()))
        with self.arena(largest) as arena:  # one allocation, at the most any of them holds
            return self.rounds.warm_up(arena, arena.slots(needs), max_rows=max_rows)


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


def _is_attention_layer(layer) -> bool:
    """A plain K/V layer, full or sliding (not a recurrent, conv or quantized layer, which are kept as they are)."""
    return type(layer) in (DynamicLayer, DynamicSlidingWindowLayer)


def causal(t: int) -> torch.Tensor:
    """[T, T] bool visibility of a plain causal block (row i sees rows 0..i)."""
    return torch.ones(t, t, dtype=torch.bool).tril()  # [T, T]

"""The round's attention (``round_mask.round_attention``, the CPU backend's native one) against transformers' own sdpa
attention, and the round's attention named per call, never switched.

The engine-level oracle (HF greedy on every family and the embedded model, whose 9 query heads share 3 K/V
heads) runs through this path in the other test files; here the attention function itself is compared with
transformers' on masked multi-row queries, where transformers repeats K/V and the packed path does not.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from helpers import FAMILIES, additive_mask, hf_greedy, one_round, random_prompt, scratch_region, tiny_model
from transformers.generation.streamers import BaseStreamer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import lp_runner
from lp_runner.backends.adapter import ModelAdapter
from lp_runner.backends.attention import ROUND_KEYWORD, supports_round_attention
from lp_runner.backends.cpu.attention import native_round_attention
from lp_runner.backends.cpu.prepack import native_unavailable_reason
from lp_runner.backends.round_mask import round_attention
from lp_runner.config import GenerationConfig, LookaheadConfig
from lp_runner.decoding.engine import LookaheadEngine
from lp_runner.models.loading import default_cache_dir


class _Attention(torch.nn.Module):
    """The two attributes the attention functions read from a model's attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("kv_heads", [1, 2, 3, 6])
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_packed_gqa_equals_transformers_sdpa(kv_heads: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(10 * kv_heads + rows)
    heads, past, dim = 6, 11, 8
    query = torch.randn(1, heads, rows, dim, generator=gen)
    key = torch.randn(1, kv_heads, past + rows, dim, generator=gen)
    value = torch.randn(1, kv_heads, past + rows, dim, generator=gen)
    visibility = torch.rand(rows, rows, generator=gen) < 0.5
    visibility |= torch.eye(rows, dtype=torch.bool)  # every row sees itself, as in every round layout
    mask = additive_mask(visibility, past, torch.float32)  # [1, 1, Q, past + Q]
    module = _Attention(heads // kv_heads)
    tiled = mask.repeat(1, 1, heads // kv_heads, 1)  # packed row g * Q + i reads row i (``round_mask``'s groups)
    got, _ = round_attention(module, query, key, value, tiled, scaling=dim**-0.5)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    assert got.shape == want.shape == (1, rows, heads, dim)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # and the reference itself: a masked softmax per query head over its K/V head, written out
    group = heads // kv_heads
    k, v = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    ref = torch.softmax(query @ k.transpose(-1, -2) * dim**-0.5 + mask, dim=-1) @ v  # [1, H, Q, D]
    torch.testing.assert_close(got, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


def _native_or_skip():
    if native_unavailable_reason(torch.nn.Linear(2, 2), default_cache_dir()) is not None:
        pytest.skip("no native kernel here")
    from lp_runner.backends.cpu import native

    return native


@pytest.mark.parametrize("dim", [16, 256, 12])  # the vector path (shortest and widest head) and the scalar one
@pytest.mark.parametrize("kv_heads,rows", [(1, 1), (2, 1), (2, 2), (3, 2), (6, 3), (1, 9)])
def test_native_attention_equals_transformers_sdpa(kv_heads: int, rows: int, dim: int) -> None:
    """native_round_attention (the native loop up to NATIVE_MAX_ROWS packed rows, sdpa beyond) against
    transformers' sdpa, on an arena layer's buffer: slots past the round hidden by the mask, slots past the mask's
    width not read at all, heads strided (a buffer's first slots)."""
    _native_or_skip()
    gen = torch.Generator().manual_seed(7 * kv_heads + rows + dim)
    heads, past, capacity = 6, 13, 40
    query = torch.randn(1, heads, rows, dim, generator=gen)
    buffers = [torch.randn(1, kv_heads, capacity + 8, dim, generator=gen) for _ in range(2)]
    key, value = (b[:, :, :capacity] for b in buffers)  # strided over heads
    visibility = (torch.rand(rows, rows, generator=gen) < 0.5) | torch.eye(rows, dtype=torch.bool)
    mask = additive_mask(visibility, past, torch.float32, width=capacity)  # [1, 1, Q, capacity]
    module = _Attention(heads // kv_heads)
    with torch.inference_mode():
        wide = torch.cat([key, torch.full_like(key, float("nan"))], dim=2)  # past the mask's width: never read
        wide_values = torch.cat([value, torch.full_like(value, float("nan"))], dim=2)
        got, _ = native_round_attention(module, query, wide, wide_values, mask, scaling=dim**-0.5)
        want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    assert got.shape == want.shape == (1, rows, heads, dim)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert not torch.equal(mask[..., past + rows :], torch.zeros_like(mask[..., past + rows :]))  # guard: hidden


def _attention_spy(model) -> tuple[list[object], object]:
    """What the first layer's attention is called with: the round's attention (``lp_attention``) or None."""
    seen: list[object] = []
    hook = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get(ROUND_KEYWORD)), with_kwargs=True
    )
    return seen, hook


@pytest.mark.parametrize("family", FAMILIES)
def test_a_round_names_its_attention_and_other_callers_keep_transformers(tiny, family: str) -> None:
    model = tiny(family)
    assert supports_round_attention(model.config)
    adapter = ModelAdapter(model)
    assert adapter.keyword  # every layer took the keyword at the construction probe
    seen, hook = _attention_spy(model)
    try:
        tokens = random_prompt(6, seed=1)
        one_round(
            adapter,
            torch.tensor(tokens),
            torch.arange(6),
            torch.ones(6, 6).bool().tril(),
            scratch_region(adapter),
            torch.tensor([5]),
        )
        assert seen == [round_attention]  # the round's attention (the backend's: packed GQA over the live width)
        assert model.config._attn_implementation == "sdpa"  # never switched: HF generate on this model is untouched
        with torch.inference_mode():
            got = model(input_ids=torch.tensor([tokens])).logits
        assert seen == [round_attention, None]
    finally:
        hook.remove()
    # a direct call runs transformers' own sdpa: the same logits as the reference implementation, eager
    model.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([tokens])).logits
    finally:
        model.config._attn_implementation = "sdpa"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bucketed_rounds_name_the_round_attention(tiny) -> None:
    model = tiny("llama")
    adapter = ModelAdapter(model, bucketed=True)
    seen, hook = _attention_spy(model)
    try:
        one_round(
            adapter,
            torch.tensor([1, 2]),
            torch.arange(2),
            torch.ones(2, 2).bool().tril(),
            scratch_region(adapter),
            torch.tensor([1]),
        )
    finally:
        hook.remove()
    assert seen == [adapter.rounds.attention] and adapter.rounds.attention is not None
    assert model.config._attn_implementation == "sdpa"


def test_other_implementations_are_left_alone(tiny) -> None:
    model = tiny("qwen2")
    model.config._attn_implementation = "eager"
    try:
        assert not supports_round_attention(model.config)
        adapter = ModelAdapter(model)
        assert not adapter.keyword
        seen: list[str] = []
        attention = model.model.layers[0].self_attn
        hook = attention.register_forward_pre_hook(
            lambda m, a, kw: seen.append((m.config._attn_implementation, kw.get(ROUND_KEYWORD))), with_kwargs=True
        )
        try:
            one_round(
                adapter,
                torch.tensor([3]),
                torch.arange(1),
                torch.ones(1, 1).bool(),
                scratch_region(adapter),
                torch.tensor([0]),
            )
        finally:
            hook.remove()
        assert seen == [("eager", None)]
    finally:
        model.config._attn_implementation = "sdpa"


class _Overlaps:
    """Counts the model's forwards that start while another thread's forward is in flight (hooks on the model)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.lock, self.in_flight, self.count = threading.Lock(), {}, 0
        self.hooks = (model.register_forward_pre_hook(self._enter), model.register_forward_hook(self._leave))

    def _enter(self, module, args) -> None:
        me = threading.get_ident()
        with self.lock:
            self.count += any(n for t, n in self.in_flight.items() if t != me)
            self.in_flight[me] = self.in_flight.get(me, 0) + 1

    def _leave(self, module, args, out) -> None:
        with self.lock:
            self.in_flight[threading.get_ident()] -= 1

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


class _Handshake(BaseStreamer):
    """A streamer that, at its generation's first new tokens, says it is mid-generation and waits (once) until the
    other generation says so too: both are then in flight together, whatever the threads' scheduling."""

    def __init__(self, mine: threading.Event, theirs: threading.Event) -> None:
        self.mine, self.theirs, self.puts = mine, theirs, 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and not self.mine.is_set():  # the first put is the prompt
            self.mine.set()
            assert self.theirs.wait(60), "the other generation never started"

    def end(self) -> None:
        pass


@pytest.mark.parametrize("path", ["lp_runner.generate", "bucketed engine"])
def test_hf_generate_beside_a_job_on_the_same_model_is_unaffected(path: str) -> None:
    """HF greedy ``generate`` on one thread and a lookahead job on another, on one model object, at once: each gets
    HF greedy's tokens. A round names its attention in its own call, so the other thread's forwards keep
    transformers' sdpa (a round that switched the model's config made them run the round's attention)."""
    model = tiny_model("llama")  # its own: hooks go on it
    lp_prompt, hf_prompt = random_prompt(12, 3) * 2, random_prompt(10, 7)
    lp_new, hf_new, repeats = 40, 24, 4
    lp_want, hf_want = hf_greedy(model, lp_prompt, lp_new), hf_greedy(model, hf_prompt, hf_new)
    lp_mid, hf_mid = threading.Event(), threading.Event()
    got: dict[str, list[list[int]]] = {"lp": [], "hf": []}
    errors: list[BaseException] = []

    def lookahead() -> None:
        if path == "lp_runner.generate":
            for _ in range(repeats):
                out = lp_runner.generate(model, torch.tensor([lp_prompt]), max_new_tokens=lp_new,
                                         streamer=_Handshake(lp_mid, hf_mid))  # fmt: skip
                got["lp"].append(out[0, len(lp_prompt) :].tolist())
            return
        adapter = ModelAdapter(model, bucketed=True)
        la = LookaheadConfig(window_size=4, ngram_size=3, verification_set_size=4)
        engine = LookaheadEngine(adapter, la, GenerationConfig(max_new_tokens=lp_new), [])
        for _ in range(repeats):
            handshake = _Handshake(lp_mid, hf_mid)
            handshake.put(None)  # the engine streams commits only: count the prompt's put
            got["lp"].append(engine.generate(lp_prompt, on_commit=handshake.put).output_ids)

    def hf() -> None:
        ids = torch.tensor([hf_prompt])
        for _ in range(repeats):
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=hf_new, do_sample=False,
                                     num_beams=1, streamer=_Handshake(hf_mid, lp_mid))  # fmt: skip
            got["hf"].append(out[0, len(hf_prompt) :].tolist())

    def guarded(fn):
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised by the test below
                errors.append(exc)
                lp_mid.set(), hf_mid.set()  # never leave the other thread waiting

        return run

    overlaps = _Overlaps(model)
    try:
        threads = [threading.Thread(target=guarded(fn)) for fn in (lookahead, hf)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
    finally:
        overlaps.remove()
    if errors:
        raise errors[0]
    assert lp_mid.is_set() and hf_mid.is_set()  # both were mid-generation together
    assert overlaps.count > 0  # forwards of the two threads ran at the same time
    assert got["hf"] == [hf_want] * repeats  # HF's own output, every time
    assert got["lp"] == [lp_want] * repeats  # and the job's is HF greedy's too


def test_native_attention_frees_its_scratch() -> None:
    """Each call allocates per-thread score buffers in C; 2,000 calls over 16,384 keys would keep 256 MB resident
    if they were not freed (a leak a long job would find): the process's resident memory must stay flat."""
    native = _native_or_skip()

    def resident_mb() -> float:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    q, k, v = torch.randn(1, 1, 64), torch.randn(1, 16384, 64), torch.randn(1, 16384, 64)
    mask = torch.zeros(1, 16384)  # every key visible: the working thread writes its whole scratch (128 KB)
    native.attention(q, k, v, mask, 0.125)
    before = resident_mb()
    for _ in range(2_000):
        native.attention(q, k, v, mask, 0.125)
    assert resident_mb() - before < 64


def _static_round(heads: int, rows: int, dim: int, seed: int):
    """Packed queries [heads, groups 3 x rows, dim] over a static buffer of 40 slots: 13 cached, the round's rows
    under a random visibility (each row sees itself), the rest spare."""
    gen = torch.Generator().manual_seed(seed)
    past, capacity = 13, 40
    q = torch.randn(heads, 3 * rows, dim, generator=gen)
    k, v = (torch.randn(heads, capacity, dim, generator=gen) for _ in range(2))
    visibility = (torch.rand(rows, rows, generator=gen) < 0.5) | torch.eye(rows, dtype=torch.bool)
    mask = additive_mask(visibility, past, torch.float32, width=capacity)[0, 0]  # [rows, capacity]
    return q, k, v, mask, past + rows


@pytest.mark.parametrize("dim", [64, 12])  # the vector path and the scalar one
def test_native_attention_rows_do_not_depend_on_their_neighbours(dim: int) -> None:
    """Each packed row's output is bit for bit what it gets alone (the product's guarantee, kept by the attention
    loop): a round's verified row then equals the one-row decode of the same token at the same place."""
    native = _native_or_skip()
    q, k, v, mask, _ = _static_round(2, 3, dim, seed=dim)  # 9 packed rows: more than one task of rows per head
    together = native.attention(q, k, v, mask, dim**-0.5)
    for r in range(q.shape[1]):
        alone = native.attention(q[:, r : r + 1], k, v, mask[r % 3 : r % 3 + 1], dim**-0.5)
        assert torch.equal(alone[:, 0], together[:, r]), r


def test_native_attention_never_reads_hidden_slots() -> None:
    """A static buffer's spare slots hold whatever an earlier round left there, NaN included: a hidden key must
    not be read at all (a masked NaN score is still NaN), so the output is the same bits as with zeros there."""
    native = _native_or_skip()
    q, k, v, mask, used = _static_round(2, 2, 64, seed=3)
    clean = native.attention(q, k, v, mask, 0.125)
    k[:, used:], v[:, used:] = float("nan"), float("nan")
    hidden = mask == torch.finfo(torch.float32).min
    k[:, 13:used][:, hidden[0, 13:used]] = float("nan")  # a round key that row 0 does not see: hidden from it
    assert torch.equal(native.attention(q[:, :1], k, v, mask[:1], 0.125), clean[:, :1])
    assert torch.isfinite(clean).all()
    assert torch.equal(
        native.attention(q, k[:, :used].contiguous(), v[:, :used].contiguous(), mask[:, :used], 0.125)[:, :1],
        clean[:, :1],
    )


@pytest.mark.parametrize("dim", [64, 128, 32])  # the specialised vector paths and the generic one
def test_native_attention_with_keys_every_row_sees(dim: int) -> None:
    """Keys that every row of a task sees (a round's cached prefix) are scored and weighed without mask reads;
    rows whose visible prefixes end at different keys (inside a 16-key group, at its edge, at key 0) and hide keys
    after it, as a packed round's branches do: sdpa's output to fp32 rounding, each row bit for bit its output
    alone, and a NaN in a key hidden from a row after its prefix never reaches that row."""
    native = _native_or_skip()
    gen = torch.Generator().manual_seed(dim)
    heads, groups, keys = 2, 3, 100
    prefixes = [64, 0, 17, 48, 100, 33, 80, 64]  # rows of one task share the smallest
    rows = len(prefixes)
    q = torch.randn(heads, groups * rows, dim, generator=gen)
    k, v = (torch.randn(heads, keys, dim, generator=gen) for _ in range(2))
    hidden = torch.finfo(torch.float32).min
    mask = torch.zeros(rows, keys).masked_fill(torch.rand(rows, keys, generator=gen) < 0.4, hidden)
    for r, p in enumerate(prefixes):
        mask[r, :p] = 0.0
        if p < keys:
            mask[r, p] = hidden  # the prefix ends here
    mask[1, 5] = 0.0  # row 1 sees keys after its empty prefix
    got = native.attention(q, k, v, mask, dim**-0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(groups, 1), scale=dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for r in range(groups * rows):
        alone = native.attention(q[:, r : r + 1], k, v, mask[r % rows : r % rows + 1], dim**-0.5)
        assert torch.equal(alone[:, 0], got[:, r]), r
    k[:, 17], v[:, 17] = float("nan"), float("nan")  # hidden from row 2 (its prefix ends there) and others
    blind = [r for r in range(groups * rows) if mask[r % rows, 17] == hidden]
    assert 2 in blind and 0 not in blind  # row 0 (prefix 64) sees key 17 and shares a task with row 2
    again = native.attention(q, k, v, mask, dim**-0.5)  # row 2 shares its task with rows that see key 17
    assert torch.equal(again[:, blind], got[:, blind])

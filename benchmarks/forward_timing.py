"""Shared by the forward benchmarks that put several adapters of one model side by side (``native_layers.py``,
``native_isa.py``): the embedded model on native products, a cached prefix per adapter, and rounds timed
forward by forward in rotating order, so every adapter's median is measured at the same moments."""

from __future__ import annotations

import json
import statistics
import time

import torch

from lp_runner.backends.adapter import ModelAdapter, causal
from lp_runner.backends.cpu.prepack import NATIVE_KERNEL, native_unavailable_reason, prepack_linears
from lp_runner.backends.kv_cache import KVRegion
from lp_runner.backends.staging import Rows
from lp_runner.models.loading import default_cache_dir, load_model_and_tokenizer, resolve_model_path


def native_embedded_model(threads: int) -> torch.nn.Module:
    """The embedded model in fp32 with every linear on the native product (exits saying why where it cannot)."""
    torch.set_num_threads(threads)
    model, _, _ = load_model_and_tokenizer(resolve_model_path("embedded"), dtype="float32")
    reason = native_unavailable_reason(model, default_cache_dir())
    if reason is not None:
        raise SystemExit(f"the native kernel is unavailable here: {reason}")
    prepack_linears(model, kernel=NATIVE_KERNEL)
    return model


def scratch_region(adapter: ModelAdapter, need: int = 0) -> KVRegion:
    """A region for ``need`` positions in a scratch arena of its own (``ModelAdapter.arena(scratch=True)``: nothing
    is handed back, and the region grows should a round outrun it)."""
    with adapter.arena([need], scratch=True) as arena:
        return arena.region(need)


def prefilled_caches(
    adapters: dict[str, ModelAdapter], prefix: int, capacity: int, gen: torch.Generator
) -> dict[str, object]:
    """Per adapter, a cache of ``capacity`` slots holding the same random ``prefix`` tokens."""
    vocab = next(iter(adapters.values())).vocab_size
    tokens = torch.randint(0, vocab, (prefix,), generator=gen)
    caches = {name: scratch_region(a, capacity) for name, a in adapters.items()}
    for name, a in adapters.items():
        if prefix:  # none: the rounds timed on it are prefills
            a.run([Rows.of(tokens, torch.arange(prefix), causal(prefix), torch.tensor([prefix - 1]))], [caches[name]])
    return caches


def time_rounds(
    adapters: dict[str, ModelAdapter], caches: dict, prefix: int, rows: int, reps: int, gen: torch.Generator
) -> dict:
    """One causal round of ``rows`` random tokens after the prefix, ``reps`` times per adapter (plus one warm-up
    pass), order rotated each repetition, each forward cropped back. Returns the row of a results table: the
    median ms per adapter, the logits' largest difference from the first adapter's and whether every argmax
    agrees with it."""
    names, first = list(adapters), next(iter(adapters))
    ids = torch.randint(0, adapters[first].vocab_size, (rows,), generator=gen)
    positions = torch.arange(prefix, prefix + rows)
    times: dict[str, list[float]] = {name: [] for name in names}
    logits = {}
    for rep in range(reps + 1):  # the first repetition warms every adapter at this row count
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            start = time.perf_counter()
            logits[name] = adapters[name].run(
                [Rows.of(ids, positions, causal(rows), torch.arange(rows))], [caches[name]]
            )
            elapsed = time.perf_counter() - start
            caches[name].crop(prefix)
            if rep:
                times[name].append(elapsed)
    row = {"rows": rows, **{f"ms {n}": round(1e3 * statistics.median(t), 2) for n, t in times.items()}}
    row[f"max |logit - {first}|"] = max(float((v - logits[first]).abs().max()) for v in logits.values())
    row["argmax agree"] = all(torch.equal(v.argmax(-1), logits[first].argmax(-1)) for v in logits.values())
    return row


def time_row_counts(adapters: dict[str, ModelAdapter], prefix: int, capacity: int, rows: list[int], reps: int) -> list:
    """``time_rounds`` at each of ``rows`` on caches prefilled with the same ``prefix`` tokens (seed 0), each
    table row printed as it is measured. Returns the table."""
    gen = torch.Generator().manual_seed(0)
    caches = prefilled_caches(adapters, prefix, capacity, gen)
    results = []
    for q in rows:
        results.append(time_rounds(adapters, caches, prefix, q, reps, gen))
        print(json.dumps(results[-1]), flush=True)
    return results

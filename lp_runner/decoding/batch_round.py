"""One packed forward over several generations: the contract of a batched round and its masks.

Each generation (a *segment*) brings its own round (``layout.compile_round``: ordinary, lookahead and
verification rows, its own positions) and its own K/V region (``slot_cache.SlotRegion``). The batched round
concatenates the rows, so the linear layers read each weight once for every generation's rows (what batching
buys: a forward of a few rows streams the weights, and more rows cost little more), while attention stays per
segment: each row reads its own region only, through its segment's mask of ``past + rows`` keys (the cached
prefix, then the round's own rows as its layout's visibility says). No row sees another generation's keys, and a
row's attention costs its own generation's length.

Worked example: generation A (past 5, 2 rows: live key and one candidate token) in slots 0.., generation B
(past 3, 1 row) in slots 64..:

    row  segment  position  slot  keys it may see (slots)        mask row (width)
    0    A        5         5     0..4, 5                        [0 0 0 0 0 | 0 -]      (7)
    1    A        6         6     0..4, 5, 6                     [0 0 0 0 0 | 0 0]      (7)
    2    B        3         67    64..66, 67                     [0 0 0 | 0]            (4)

The flat mask is A's 2 x 7 floats, then B's 1 x 4 (``backends.batch.Segments``: start (0, 2, 3), base (0, 64), width
(7, 4), offsets (0, 14)); logit rows are each layout's own, shifted by its segment's first row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.backends.batch import BatchRound, Segments
from lp_runner.backends.slot_cache import SlotCache
from lp_runner.decoding.layout import RoundLayout, compile_round


def pack_round(
    layouts: Sequence[RoundLayout],
    bases: Sequence[int],  # first slot of each segment's region
    past_lens: Sequence[int],  # cached positions of each segment before the round
    windows: Sequence[int | None],  # the model's sliding windows (None: full attention), ``ModelAdapter.mask_windows``
    dtype: torch.dtype,
) -> BatchRound:
    """The batched round of these generations' layouts (see the module docstring's example)."""
    hidden = torch.finfo(dtype).min
    ids, positions, slots, logit_rows, counts, masks = [], [], [], [], [], {w: [] for w in set(windows)}
    row = 0
    widths = list(zip(past_lens, layouts, strict=True))
    for layout, base, past in zip(layouts, bases, past_lens, strict=True):
        q = layout.num_rows
        ids.append(layout.input_ids)
        positions.append(layout.position_ids)
        slots.append(torch.arange(base + past, base + past + q))
        logit_rows.append(layout.logit_rows + row)
        counts.append(len(layout.logit_rows))
        full = torch.zeros(q, past + q, dtype=dtype)  # [q, past + q]: the cached prefix visible
        full[:, past:].masked_fill_(~layout.visibility, hidden)  # the round's own rows as the layout says
        for window in masks:
            m = full
            if window is not None:  # transformers' rule: the query at p sees keys at p - window < k <= p
                keys = torch.cat([torch.arange(past), layout.position_ids])  # [past + q] cached slot j is position j
                m = full.masked_fill(layout.position_ids[:, None] - keys[None, :] >= window, hidden)
            masks[window].append(m.reshape(-1))
        row += q
    return BatchRound(
        input_ids=torch.cat(ids),
        position_ids=torch.cat(positions),
        slots=torch.cat(slots),
        segments=Segments.of([la.num_rows for la in layouts], bases, [p + la.num_rows for p, la in widths]),
        masks={w: torch.cat(parts) for w, parts in masks.items()},
        logit_rows=torch.cat(logit_rows),
        logit_counts=tuple(counts),
    )


PROBE_TOLERANCE = {torch.float32: 1e-4}  # logits of a batched round against separate forwards; half precision: 3e-2


def probe(adapter: ModelAdapter) -> str | None:
    """Why ``adapter`` cannot run batched rounds exactly, or None: two generations (prompts of 5 and 3 tokens) as
    one batched prefill, then one batched round of a live key and a 2-token candidate each, against the same
    rounds run by each generation alone (``ModelAdapter.forward`` on its own cache). Catches a model whose layers
    do not hand the batch down to the attention (it fails on the placeholder mask) or attend across segments."""
    # the reference rounds run eager on the same kernels: a compiled adapter's graph is for its own job's shapes
    reference = ModelAdapter(adapter.model, backend=adapter.backend) if adapter.compiled else adapter
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, adapter.vocab_size, (n,), generator=gen).tolist() for n in (5, 3)]
    windows = list(adapter.mask_windows.values())
    tol = PROBE_TOLERANCE.get(adapter.dtype, 3e-2)
    try:
        slots = SlotCache.allocate(adapter.model, adapter.kv_shape, adapter.dtype, adapter.device, 64)
        bases = [slots.region(16).base, slots.region(16).base]
        alone_caches = [reference.new_cache(64) for _ in prompts]
        for past in ([0, 0], [len(p) for p in prompts]):
            layouts = [
                compile_round(p, 0, [[]], (0, 0), []) if not k else compile_round(p[-1:], k, [[]], (0, 0), [p[:2]])
                for p, k in zip(prompts, past, strict=True)
            ]
            batch = pack_round(layouts, bases, past, windows, adapter.dtype)
            got = adapter.forward_batch(batch, slots.cache).float().split(batch.logit_counts)
            for b, layout in enumerate(layouts):
                ids, positions, vis, rows = layout.input_ids, layout.position_ids, layout.visibility, layout.logit_rows
                alone = reference.forward(ids, positions, vis, alone_caches[b], rows).float()
                if not torch.allclose(got[b], alone, rtol=tol, atol=tol):
                    err = (got[b] - alone).abs().max().item()
                    return f"a batched round's logits differ from separate forwards by {err:.3g}"
    except Exception as exc:  # the model's own code refused the batch: say why in one line
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"a batched forward failed ({text})"
    return None

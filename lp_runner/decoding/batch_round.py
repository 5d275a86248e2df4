"""Whether a model's layers run a round of several generations exactly: probed once per adapter.

A round of several generations (``run.batch`` > 1) is the adapter's one forward over several segments
(``backends.staging``), each reading its own region of the arena. The layers' structure says whether that can work
(``ModelAdapter.batch_structure``); ``probe`` checks that it does, against each generation's round alone.
"""

from __future__ import annotations

import weakref

import torch

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.decoding.layout import compile_round

PROBE_TOLERANCE = {torch.float32: 1e-4}  # logits of a batched round against separate forwards; half precision: 3e-2


def probe(adapter: ModelAdapter) -> str | None:
    """Why ``adapter`` cannot run batched rounds exactly, or None: two generations (prompts of 5 and 3 tokens) as
    one batched prefill, then one batched round of a live key and a 2-token candidate each, against the same
    rounds run by each generation alone (one segment, on an arena of its own). Catches a model whose layers
    attend across generations. Every round here is on a scratch arena, so a compiled adapter runs its round
    function eagerly: the same function its graphs were compiled from, no second adapter."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, adapter.vocab_size, (n,), generator=gen).tolist() for n in (5, 3)]
    tol = PROBE_TOLERANCE.get(adapter.dtype, 3e-2)
    try:
        with adapter.arena([16, 16], scratch=True) as arena:
            regions = [arena.region(16), arena.region(16)]
            alone = []
            for _ in prompts:
                with adapter.arena([64], scratch=True) as own:
                    alone.append(own.region(64))
            for past in ([0, 0], [len(p) for p in prompts]):
                layouts = [
                    compile_round(p, 0, [[]], (0, 0), []) if not k else compile_round(p[-1:], k, [[]], (0, 0), [p[:2]])
                    for p, k in zip(prompts, past, strict=True)
                ]
                got = adapter.run(layouts, regions).float().split([len(la.logit_rows) for la in layouts])
                for b, layout in enumerate(layouts):
                    want = adapter.run([layout], [alone[b]]).float()
                    if not torch.allclose(got[b], want, rtol=tol, atol=tol):
                        err = (got[b] - want).abs().max().item()
                        return f"a batched round's logits differ from separate forwards by {err:.3g}"
    except Exception as exc:  # the model's own code refused the batch: say why in one line
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"a batched forward failed ({text})"
    return None


_SUPPORT: weakref.WeakKeyDictionary[object, str | None] = weakref.WeakKeyDictionary()


def batch_support(adapter: ModelAdapter) -> str | None:
    """Why ``adapter`` cannot run batched rounds exactly (one line), or None. Found out once per round function
    of the adapter (``ModelAdapter.compile`` gives it another, on other layers): its layers' structure
    (``ModelAdapter.batch_structure``), then a probe of two generations batched against their separate forwards
    (``probe``)."""
    if adapter.rounds not in _SUPPORT:
        _SUPPORT[adapter.rounds] = adapter.batch_structure() or probe(adapter)
    return _SUPPORT[adapter.rounds]

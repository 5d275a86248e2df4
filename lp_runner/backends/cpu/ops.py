"""lp_runner's custom ops for ``torch.compile``: one opaque call per native product, oneDNN product or attention.

Registered through torch.library's low-level ``Library`` (a schema, one kernel for every backend: oneDNN's packed
weights are MkldnnCPU tensors; a fake for shapes), not ``torch.library.custom_op``, whose Python wrapper costs
about 2 us more per call (a tiny product through ``torch.ops``: 8.9 us with it, 6.7 us without, 4.4 us for the bare
function; a scratch timing loop), and a compiled forward of the embedded model makes about 150 such
calls. The ops are functional (no argument is mutated or aliased) and run only inside the adapter's inference-mode
forwards, so they need no autograd kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIBRARY = torch.library.Library("lp_runner", "FRAGMENT")  # kept alive: the registrations live as long as it does


def define_op(name: str, schema: str, kernel: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor]):
    """``lp_runner::name`` with ``schema`` (the part after the name, e.g. ``"(Tensor x) -> Tensor"``), ``kernel``
    as its implementation on every backend and ``fake`` giving its output's shape under tracing. Returns the op's
    overload."""
    _LIBRARY.define(name + schema)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")  # any backend: oneDNN weights are MkldnnCPU
    torch.library.register_fake(f"lp_runner::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.lp_runner, name).default

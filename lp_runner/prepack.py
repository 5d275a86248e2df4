"""oneDNN-prepacked linear layers for CPU forwards (``model.prepack``).

Why: on a CPU a forward of this project's models is a string of matrix products against weights far larger than
the caches, so its floor is the weights' bytes over the memory bandwidth. ``torch.nn.functional.linear`` falls
short of it at the row counts a round uses: MKL's sgemm packs the weight matrix again on every call, which reads
and writes it twice, and it picks a different kernel for 1, 2, 8 or 32 rows. Measured on an AMD EPYC (2 threads,
the embedded model's 211 linear layers, weights out of cache, ``benchmarks/linear_kernels.py``): 1 row 57 ms,
2 rows 78 ms, 8 rows 62 ms; with the weights reordered once into oneDNN's blocked layout
(``mkldnn._reorder_linear_weight``) and multiplied by ``mkldnn._linear_pointwise``: 34, 32 and 33 ms, flat across
row counts and 0.28-0.61x torch's (README, "Prepacked linear layers").

Exactness: oneDNN's product of a row does not depend on how many rows share the call (``row_invariant``, tested),
so a verification row sees exactly the bits that row would see in one-row decoding; torch's own linear gives
different bits at 1 and 2 rows. Against torch's linear the results differ at fp32 rounding (about 1e-6 of the
values), which, like any kernel change, can flip an argmax only at a rounding-level tie; the tests compare the
prepacked engine with transformers' own greedy ``generate`` on the stock model, token for token.

The weights are replaced, not copied: a packed layer holds only the reordered matrix (the same bytes), except a
tied output layer, whose embedding keeps the original for lookups (one extra copy of that matrix).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lp_runner.errors import ConfigError
from lp_runner.parallel.comm import first_line

PREPACK_DTYPES = (torch.float32, torch.bfloat16)  # oneDNN's CPU inner products without a special ISA
PREPACKED = "onednn-prepacked"  # the kernels' name in records, summaries and calibration keys (else "torch")


def _onednn_product(rows: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[R, in] x the reordered [out, in] weight (+ bias) -> [R, out], by oneDNN's inner product."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed_weight, bias, "none", [], "")


@torch.library.custom_op("lp_runner::packed_linear", mutates_args=())
def _packed_linear_op(rows: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product as one opaque op for ``torch.compile``: inductor cannot lower oneDNN's op at symbolic row
    counts, but calls a custom op as an external kernel (eager forwards call oneDNN directly, without this
    wrapper's dispatch cost)."""
    return _onednn_product(rows, packed_weight, bias)


@_packed_linear_op.register_fake
def _(rows: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], packed_weight.shape[0])


class PackedLinear(torch.nn.Module):
    """``nn.Linear``'s forward from a weight reordered once for oneDNN (no autograd: inference only)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # not in the state dict: the reordered bytes are not the checkpoint's weight (the checksum is taken before)
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        product = _packed_linear_op if torch.compiler.is_compiling() else _onednn_product
        out = product(rows, self.packed_weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@dataclass(frozen=True)
class PrepackChoice:
    """What ``model.prepack`` did, for the summary and every record: ``layers`` packed, or why none were."""

    mode: str  # off | on | auto
    layers: int
    reason: str

    @property
    def kernels(self) -> str:
        """The linear kernels the forward runs (part of the calibration key: each has its own curve)."""
        return PREPACKED if self.layers else "torch"

    def describe(self) -> dict:
        return {"mode": self.mode, "kernels": self.kernels, "layers": self.layers, "reason": self.reason}


def unavailable_reason(model: torch.nn.Module) -> str | None:
    """Why this model's linears cannot be prepacked here, or None when they can."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"the model is on {param.device.type}, prepacking is for CPU forwards"
    if not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()):
        return "this torch build has no oneDNN (mkldnn)"
    if param.dtype not in PREPACK_DTYPES:
        return f"{str(param.dtype).replace('torch.', '')} weights (oneDNN prepacking here: float32, bfloat16)"
    try:  # an ISA or build that cannot run the product says so here, not inside the first prompt
        probe = torch.nn.Linear(16, 8, bias=False, dtype=param.dtype)
        with torch.inference_mode():
            expected = torch.nn.functional.linear(torch.ones(2, 16, dtype=param.dtype), probe.weight)
            got = PackedLinear(probe)(torch.ones(2, 16, dtype=param.dtype))
    except (RuntimeError, AttributeError, NotImplementedError) as exc:  # a build without the ops, an ISA without
        # the dtype
        return f"oneDNN cannot run a {str(param.dtype).replace('torch.', '')} inner product here ({first_line(exc)})"
    if not torch.allclose(got, expected, rtol=1e-2, atol=1e-2):
        return "oneDNN's inner product disagrees with torch's on a probe"
    return None


def prepack_linears(model: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` with a ``PackedLinear`` in place; returns how many. Irreversible:
    the original weights of those layers are released (a tied embedding keeps its own)."""
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child))
                packed += 1
    return packed


def apply_prepack(model: torch.nn.Module, mode: str) -> PrepackChoice:
    """``model.prepack``: ``auto`` packs where it can (a CPU with oneDNN, float32 or bfloat16 weights), ``on``
    packs or fails with the reason, ``off`` leaves torch's linear."""
    if mode == "off":
        return PrepackChoice(mode, 0, "off")
    reason = unavailable_reason(model)
    if reason is not None:
        if mode == "on":
            raise ConfigError(f"model.prepack=on: {reason}; use model.prepack=auto or off")
        return PrepackChoice(mode, 0, reason)
    layers = prepack_linears(model)
    return PrepackChoice(mode, layers, "CPU with oneDNN" if mode == "auto" else "on")


def linear_kernels(model: torch.nn.Module) -> str:
    """``onednn-prepacked`` when ``model``'s linears were prepacked, else ``torch``."""
    return PREPACKED if any(isinstance(m, PackedLinear) for m in model.modules()) else "torch"

"""Packed linear layers for CPU forwards (the CPU backend, ``model.backend``): oneDNN's inner product, or lp_runner's
native product (``native.py``), on weights packed once; ``auto`` measures both and takes the faster.

Why: on a CPU a forward of this project's models is a string of matrix products against weights far larger than
the caches, so its floor is the weights' bytes over the memory bandwidth. ``torch.nn.functional.linear`` falls
short of it at the row counts a round uses: MKL's sgemm packs the weight matrix again on every call, which reads
and writes it twice, and it picks a different kernel for 1, 2, 8 or 32 rows. Measured on a 2-core x86 CPU (2 threads,
the embedded model's 211 linear layers, weights out of cache, ``benchmarks/linear_kernels.py``): 1 row 57 ms,
2 rows 78 ms, 8 rows 62 ms; with the weights reordered once into oneDNN's blocked layout
(``mkldnn._reorder_linear_weight``) and multiplied by ``mkldnn._linear_pointwise``: 34, 32 and 33 ms, flat across
row counts and 0.28-0.61x torch's (docs/results.md, "Prepacked linear layers").

Exactness: oneDNN's product of a row does not depend on how many rows share the call (``row_invariant``, tested),
so a verification row sees exactly the bits that row would see in one-row decoding; torch's own linear gives
different bits at 1 and 2 rows. Against torch's linear the results differ at fp32 rounding (about 1e-6 of the
values), which, like any kernel change, can flip an argmax only at a rounding-level tie; the tests compare the
prepacked engine with transformers' own greedy ``generate`` on the stock model, token for token.

The weights are replaced, not copied: a packed layer holds only the reordered matrix (the same bytes), except a
tied output layer, whose embedding keeps the original for lookups (one extra copy of that matrix).

Sibling projections that read the same input (an attention's q/k/v, an MLP's gate/up) become one product over
their stacked weights (``SharedInputProduct``), each sibling a ``ProductSlice`` of its output: 211 products per
forward of the embedded model become 121, and the small k/v products (192 x 576) no longer pay a call each.
Measured on the CPU above, side by side (now ``benchmarks/compare.py``'s ``--unfused`` variant): 2-4% off a
forward in one run, equal within 1% (8 rows: 4% slower) in another, so a gain within that machine's noise; kept
because it costs no exactness and no memory. The logits are bit for bit those of the separate products (oneDNN
reduces each output over the same inputs in the same order; tested on the three tiny families), so fusing
changes no token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lp_runner.backends.cpu import native
from lp_runner.backends.cpu.arena import Arena, thp_mode
from lp_runner.backends.cpu.ops import define_op
from lp_runner.errors import ConfigError, first_line

PREPACK_DTYPES = (torch.float32, torch.bfloat16)  # oneDNN's CPU inner products without a special ISA
PREPACKED = "onednn-prepacked"  # the kernels' name in records, summaries and calibration keys (else "torch")
PREPACKED_FUSED = "onednn-prepacked-fused"  # ... with sibling projections fused (another forward: its own curve)
NATIVE = "native-packed"  # lp_runner's own product (native.py), float32
NATIVE_FUSED = "native-packed-fused"
NATIVE_BF16 = "native-packed-bf16"  # ... on the weights rounded to and stored as bfloat16 (model.backend=native-bf16)
NATIVE_BF16_FUSED = "native-packed-bf16-fused"
HUGE_PAGES_SUFFIX = "-huge-pages"  # ... their weights in transparent huge pages (advanced.huge_pages; arena.py)
# Sibling linears of one module that HF's Llama, Mistral and Qwen2 forwards call on the same input tensor.
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _onednn_product(rows: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[R, in] x the reordered [out, in] weight (+ bias) -> [R, out], by oneDNN's inner product."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed_weight, bias, "none", [], "")


# The oneDNN product as one opaque op for ``torch.compile``: inductor cannot lower oneDNN's op at symbolic row
# counts, but calls a custom op as an external kernel (eager forwards call oneDNN directly, without the dispatch).
_packed_linear_op = define_op(
    "packed_linear",
    "(Tensor rows, Tensor packed_weight, Tensor? bias) -> Tensor",
    lambda rows, packed_weight, bias: _onednn_product(rows, packed_weight, bias),  # looked up per call
    lambda rows, packed_weight, bias: rows.new_empty(rows.shape[0], packed_weight.shape[0]),
)


Product = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", int], torch.Tensor]


@dataclass(frozen=True)
class LinearKernel:
    """A way to multiply by a weight packed once: oneDNN's inner product, or lp_runner's native product."""

    key: str  # ``apply_prepack``'s mode for it (``model.backend``'s, for native and native-bf16)
    label: str  # the summary's
    name: str  # the kernels' name (records, calibration key)
    fused_name: str  # ... with sibling projections fused
    pack: Callable[[torch.Tensor], torch.Tensor]  # [out, in] weight -> its packed form
    eager: Product  # (rows [R, in], packed, bias, out) -> [R, out]
    compiled: Product  # the same as one opaque op, for torch.compile
    # (out, in) -> the packed weight's shape and dtype, for a layout of plain dense tensors (the native ones): those
    # kernels' weights are packed into one allocation (arena.py) by pack_into; None: an opaque layout, each packed
    # on its own
    packed_shape: Callable[[int, int], tuple[tuple[int, ...], torch.dtype]] | None = None
    pack_into: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # (weight, its slot) -> the slot


ONEDNN = LinearKernel(
    "onednn",
    "oneDNN-prepacked",
    PREPACKED,
    PREPACKED_FUSED,
    pack=lambda weight: torch.ops.mkldnn._reorder_linear_weight(weight, None),
    eager=lambda rows, packed, bias, out: _onednn_product(rows, packed, bias),
    compiled=lambda rows, packed, bias, out: _packed_linear_op(rows, packed, bias),
)
NATIVE_KERNEL = LinearKernel(
    "native",
    "native",
    NATIVE,
    NATIVE_FUSED,
    pack=native.pack,
    eager=lambda rows, packed, bias, out: native.product(rows, packed, bias, out),  # looked up per call, as oneDNN's
    compiled=native.native_linear_op,
    packed_shape=lambda out, in_: (native.packed_shape(out, in_), torch.float32),
    pack_into=lambda weight, slot: native.pack(weight, torch.float32, slot),
)
# The native product on weights rounded to bfloat16 and stored so (half the bytes a forward streams), multiplied in
# float32: the product of the float32 model whose linear weights are rounded to bfloat16, bit for bit. It changes
# the model, so only ``model.backend=native-bf16`` asks for it, never ``auto``.
NATIVE_BF16_KERNEL = LinearKernel(
    "native-bf16",
    "native, bfloat16 weights",
    NATIVE_BF16,
    NATIVE_BF16_FUSED,
    pack=lambda weight: native.pack(weight, torch.bfloat16),
    eager=NATIVE_KERNEL.eager,
    compiled=native.native_linear_op,
    packed_shape=lambda out, in_: (native.packed_shape(out, in_), torch.bfloat16),
    pack_into=lambda weight, slot: native.pack(weight, torch.bfloat16, slot),
)
NATIVE_KERNELS = (NATIVE_KERNEL, NATIVE_BF16_KERNEL)  # what native_layers.py runs as one C call for all layers


KERNELS = {kernel.key: kernel for kernel in (ONEDNN, *NATIVE_KERNELS)}


def _packed(kernel: LinearKernel, weight: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    """``weight`` packed for ``kernel``; written into ``into`` (its slot in the model's arena) where given."""
    if into is None:
        return kernel.pack(weight)
    return kernel.pack_into(weight, into)


class PackedLinear(torch.nn.Module):
    """``nn.Linear``'s forward from a weight packed once for ``kernel`` (no autograd: inference only)."""

    huge_pages = False  # its weight in transparent huge pages (prepack_linears; arena.py)

    def __init__(
        self, linear: torch.nn.Linear, kernel: LinearKernel = ONEDNN, into: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.kernel = kernel
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # not in the state dict: the reordered bytes are not the checkpoint's weight (the checksum is taken before)
        self.register_buffer("packed_weight", _packed(kernel, weight, into), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        product = self.kernel.compiled if torch.compiler.is_compiling() else self.kernel.eager
        out = product(rows, self.packed_weight, self.bias, self.out_features)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class SharedInputProduct(torch.nn.Module):
    """One prepacked product for sibling linears that read the same input; ``ProductSlice`` serves each sibling
    its columns.

    The first sibling called computes all of them; the others, called with the *same* tensor object (unchanged
    since, where torch counts changes: ``_version``), get their slice of that result. Once every sibling has had
    its slice the result is dropped, so at most one input and its product per group are held (a prefill's would
    otherwise stay). A sibling called on any other tensor gets a fresh product: a wasted product at worst, never
    a wrong one.
    Under ``torch.compile`` dynamo traces the same memo (identity of the traced input, without version counts),
    so a compiled forward also runs one product per group (tested: inductor would not merge three identical
    calls of the opaque op by itself).
    """

    huge_pages = False  # its weight in transparent huge pages (prepack_linears; arena.py)

    def __init__(
        self, linears: list[torch.nn.Linear], kernel: LinearKernel = ONEDNN, into: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.kernel = kernel
        self.in_features = linears[0].in_features
        self.sizes = [lin.out_features for lin in linears]
        weight = torch.cat([lin.weight.detach() for lin in linears])
        self.register_buffer("packed_weight", _packed(kernel, weight, into), persistent=False)
        bias = None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])
        self.register_buffer("bias", bias, persistent=False)
        self._forget()

    def _forget(self) -> None:
        self._input: torch.Tensor | None = None
        self._input_version = -1
        self._slices: tuple[torch.Tensor, ...] = ()
        self._unserved: set[int] = set()

    def product(self, x: torch.Tensor, compiling: bool = False) -> tuple[torch.Tensor, ...]:
        rows = x.reshape(-1, self.in_features)
        op = self.kernel.compiled if compiling else self.kernel.eager
        out = op(rows, self.packed_weight, self.bias, sum(self.sizes))
        return out.reshape(*x.shape[:-1], out.shape[-1]).split(self.sizes, dim=-1)

    def slice_for(self, index: int, x: torch.Tensor) -> torch.Tensor:
        compiling = torch.compiler.is_compiling()
        version = -1 if compiling else _version(x)
        if x is not self._input or version != self._input_version or index not in self._unserved:
            self._slices = self.product(x, compiling)
            self._input, self._input_version = x, version
            self._unserved = set(range(len(self.sizes)))
        out = self._slices[index]
        self._unserved.discard(index)
        if not self._unserved:
            self._forget()
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, sizes={self.sizes}, bias={self.bias is not None}"


def _version(x: torch.Tensor) -> int:
    """``x``'s in-place change counter; an inference tensor keeps none (-1: identity alone decides, and within one
    decoder layer the siblings' input is not changed between their calls)."""
    return -1 if x.is_inference() else x._version


class ProductSlice(torch.nn.Module):
    """Sibling ``index`` of a ``SharedInputProduct``: in place of its ``nn.Linear``, the same output."""

    def __init__(self, shared: SharedInputProduct, index: int) -> None:
        super().__init__()
        self.shared, self.index = shared, index
        self.in_features, self.out_features = shared.in_features, shared.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.slice_for(self.index, x)

    def extra_repr(self) -> str:
        return f"index={self.index}, out_features={self.out_features}"


@dataclass(frozen=True)
class PrepackChoice:
    """What packing did, for the summary and every record: ``layers`` packed, or why none were."""

    mode: str  # auto | native | native-bf16 (``model.backend``) | onednn | "" (a model packed before, ``of_model``)
    layers: int
    reason: str
    products: int = 0  # products per forward the packed layers make (siblings fused: fewer than ``layers``)
    kernel: str = "onednn"  # KERNELS key of the packed layers' kernel
    measured_ms: dict[str, float] = field(default_factory=dict)  # auto with several kernels: what each took
    huge_pages: bool = False  # the packed weights in transparent huge pages (advanced.huge_pages, granted)
    huge_pages_note: str = ""  # advanced.huge_pages asked and not granted: why

    @property
    def kernels(self) -> str:
        """The linear kernels the forward runs (part of the calibration key: each has its own curve)."""
        if not self.layers:
            return "torch"
        return kernels_name(KERNELS[self.kernel], self.products < self.layers, self.huge_pages)

    def describe(self) -> dict:
        return {
            "mode": self.mode,
            "kernels": self.kernels,
            "label": KERNELS[self.kernel].label if self.layers else "torch",
            "layers": self.layers,
            "products": self.products,
            "reason": self.reason,
            **({"measured_ms": self.measured_ms} if self.measured_ms else {}),
            **({"huge_pages": True} if self.huge_pages else {}),
            **({"huge_pages_note": self.huge_pages_note} if self.huge_pages_note else {}),
        }


def unavailable_reason(model: torch.nn.Module) -> str | None:
    """Why this model's linears cannot be prepacked for oneDNN here, or None when they can."""
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
    return row_dependence(param.dtype, PackedLinear)


# Probe shape for row independence: wide enough that oneDNN picks its many-row kernels (a CPU with AMX takes a
# tile path for many bfloat16 rows and another for one), rows past one register tile
ROW_PROBE = (192, 576, 33)


def row_dependence(dtype: torch.dtype, pack: Callable[[torch.nn.Linear], torch.nn.Module]) -> str | None:
    """Why ``pack``'s product of ``dtype`` rows depends on the rows beside it here (a round would then differ from
    its rows run alone, breaking the packed round's exactness), or None when each row's bits are its own alone.
    Example: bfloat16 on a CPU with AMX, where oneDNN multiplies 33 rows on its tiles and one row without them."""
    out_features, in_features, rows = ROW_PROBE
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.02)
    x = torch.randn(1, rows, in_features, generator=gen).to(dtype)  # [B, Q, in]
    packed = pack(linear)
    with torch.inference_mode():
        together = packed(x)
        alone = torch.cat([packed(x[:, i : i + 1]) for i in range(rows)], dim=1)
    if torch.equal(together, alone):
        return None
    return (
        f"oneDNN's {str(dtype).replace('torch.', '')} product of a row depends on the rows beside it on this CPU "
        "(a packed round would not equal its rows alone)"
    )


def native_unavailable_reason(
    model: torch.nn.Module, cache_root: Path, storage: torch.dtype = torch.float32
) -> str | None:
    """Why lp_runner's native product, its weights stored as ``storage``, cannot serve this model here (builds it
    on first use), or None. Either storage multiplies in float32: the model must be float32."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"the model is on {param.device.type}, the native product is for CPU forwards"
    if param.dtype != torch.float32:
        return f"{str(param.dtype).replace('torch.', '')} weights (the native product: float32)"
    try:
        native.load(cache_root)
    except native.NativeUnavailable as exc:
        return str(exc)
    return native.bf16_unavailable_reason() if storage == torch.bfloat16 else None


def time_kernels(model: torch.nn.Module, kernels: list[LinearKernel], rows: tuple[int, ...] = (1, 8), reps: int = 3):
    """{kernel key: ms} for one product of the model's largest linear (weights out of cache, as in a forward) at
    each of ``rows``, summed; kernels interleaved, best of ``reps``. What ``auto`` chooses by: measured here, on
    this CPU and thread count, not assumed."""
    linear = max((m for m in model.modules() if type(m) is torch.nn.Linear), key=lambda m: m.weight.numel())
    layers = {kernel.key: PackedLinear(linear, kernel) for kernel in kernels}
    xs = [torch.randn(r, linear.in_features, dtype=linear.weight.dtype) for r in rows]
    best = {key: float("inf") for key in layers}
    with torch.inference_mode():
        for _ in range(reps + 1):  # the first pass warms each kernel
            for key, layer in layers.items():
                start = time.perf_counter()
                for x in xs:
                    layer(x)
                best[key] = min(best[key], 1e3 * (time.perf_counter() - start))
    return best


def prepack_linears(
    model: torch.nn.Module, fuse: bool = True, kernel: LinearKernel = ONEDNN, huge_pages: bool = False
) -> tuple[int, int]:
    """Replace every ``nn.Linear`` of ``model`` in place: sibling groups (``SHARED_INPUT_GROUPS``, same input
    size, dtype and bias presence) by ``ProductSlice``s of one ``SharedInputProduct`` when ``fuse``, every other
    one by a ``PackedLinear``, all on ``kernel``. Returns (linear layers replaced, products per forward).
    A kernel with a plain layout (``packed_shape``: the native ones) packs every weight into one allocation, in
    the model's module order (a forward's order), asked for transparent huge pages when ``huge_pages``
    (arena.py says when that pays). Irreversible: the original
    weights of those layers are released as they are packed (a tied embedding keeps its own)."""
    products = _products(model, fuse)
    arena = None
    if kernel.packed_shape is not None and products:
        shapes = [
            kernel.packed_shape(sum(lin.out_features for lin in lins), lins[0].in_features) for _, _, lins in products
        ]
        arena = Arena([shape for shape, _ in shapes], shapes[0][1], huge_pages)
    layers, count = 0, len(products)
    for i in range(count):  # each group's originals released once packed (the list holds them no longer)
        parent, names, linears = products[i]
        products[i] = None
        into = None if arena is None else arena.tensors[i]
        if len(names) == 1:
            packed = PackedLinear(linears[0], kernel, into)
            setattr(parent, names[0], packed)
        else:
            packed = SharedInputProduct(linears, kernel, into)
            for index, name in enumerate(names):
                setattr(parent, name, ProductSlice(packed, index))
        packed.huge_pages = arena is not None and arena.huge_pages  # linear_kernels names it: its own curve
        layers += len(names)
    return layers, count


def _products(
    model: torch.nn.Module, fuse: bool
) -> list[tuple[torch.nn.Module, tuple[str, ...], list[torch.nn.Linear]]]:
    """The products ``prepack_linears`` makes, in the order of their (first) linear among the model's modules
    (a forward's): (parent, attribute names, the linears), one name for a linear on its own, a sibling group's
    names for a fused one."""
    products, grouped = [], set()
    for parent in list(model.modules()):
        for names in SHARED_INPUT_GROUPS if fuse else ():
            siblings = [getattr(parent, name, None) for name in names]
            if not all(type(s) is torch.nn.Linear for s in siblings):
                continue
            kinds = {(s.in_features, s.weight.dtype, s.weight.device, s.bias is None) for s in siblings}
            if len(kinds) != 1:
                continue
            products.append((parent, names, siblings))
            grouped.update(id(s) for s in siblings)
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and id(child) not in grouped:
                products.append((parent, (name,), [child]))
    # the linears' own order among the modules: the LM head after the layers, not first with its parent
    position = {id(module): i for i, module in enumerate(model.modules())}
    return sorted(products, key=lambda product: position[id(product[2][0])])


MODES = ("auto", "native", "native-bf16", "onednn")  # apply_prepack's: model.backend's three and oneDNN's alone


def apply_prepack(
    model: torch.nn.Module,
    mode: str,
    cache_root: Path | None = None,
    agree: Callable[[dict[str, float]], dict[str, float]] | None = None,
    huge_pages: bool = False,
) -> PrepackChoice:
    """Pack ``model``'s linear layers for ``mode``: ``native``, ``native-bf16`` or ``onednn`` packs with that
    kernel or fails with the reason (one line); ``auto`` packs with the faster of the kernels that work here and
    keep the model's weights (timed on the model's largest linear when both do), else leaves torch's linear and
    says why. ``native-bf16`` rounds the linear weights to bfloat16: asked for, never chosen. ``onednn`` is no
    ``model.backend`` value (``auto`` takes it where it is faster): the tests' and benchmarks' way to it.
    ``cache_root``: where the native kernel is built (default: lp_runner's cache folder). ``agree`` (ranks of one
    LP group): called exactly once in ``auto`` by every rank with its timings, returns the timings to decide by
    (rank 0's), so a group's ranks pack with the same kernel and price one cost curve. ``huge_pages``
    (``advanced.huge_pages``): the native kernels' weights asked for transparent huge pages (arena.py)."""
    if mode not in MODES:
        raise ValueError(f"no packing mode {mode!r} (one of {', '.join(MODES)})")
    if cache_root is None:
        from lp_runner.models.loading import default_cache_dir

        cache_root = default_cache_dir()
    dtype = next(model.parameters()).dtype
    if mode == "native-bf16" and dtype != torch.float32:
        raise ConfigError(
            f"model.backend=native-bf16 stores a float32 model's linear weights as bfloat16 and multiplies in "
            f"float32; this model is {str(dtype).replace('torch.', '')}: set model.dtype=float32, or another backend"
        )
    reasons = {}
    if mode in ("auto", "native"):
        reasons["native"] = native_unavailable_reason(model, cache_root)
    if mode == "native-bf16":
        reasons["native-bf16"] = native_unavailable_reason(model, cache_root, torch.bfloat16)
    if mode in ("auto", "onednn"):
        reasons["onednn"] = unavailable_reason(model)
    usable = [KERNELS[key] for key, reason in reasons.items() if reason is None]
    ms: dict[str, float] = {}
    if len(usable) > 1:
        ms = {key: round(value, 2) for key, value in time_kernels(model, usable).items()}
    if agree is not None and mode == "auto":
        ms = agree(ms)  # a collective: every rank calls it, whatever it could measure or use
    if not usable:
        why = "; ".join(f"{KERNELS[key].label}: {reason}" for key, reason in reasons.items())
        if mode == "auto":
            return PrepackChoice(mode, 0, why)
        raise ConfigError(f"model.backend={mode}: {why}; use model.backend=auto or torch")
    measured = [k for k in usable if k.key in ms]
    if len(measured) > 1:
        kernel = min(measured, key=lambda k: ms[k.key])
        why = "measured: " + " vs ".join(f"{k.label} {ms[k.key]:.1f} ms" for k in measured)
        why += " (largest linear, 1+8 rows" + (", rank 0's)" if agree is not None else ")")
    else:
        kernel, why = usable[0], "the one that works here" if mode == "auto" else "as set"
    layers, products = prepack_linears(model, kernel=kernel, huge_pages=huge_pages)
    granted = linear_kernels(model).endswith(HUGE_PAGES_SUFFIX)
    note = ""
    if huge_pages and not granted:
        note = f"{kernel.label}'s weights are opaque tensors" if kernel.packed_shape is None else f"THP: {thp_mode()}"
    return PrepackChoice(mode, layers, why, products, kernel.key, ms, granted, note)


def linear_kernels(model: torch.nn.Module) -> str:
    """The kernels' name of ``model``'s packed linears (``onednn-prepacked``, ``native-packed``, ``-fused`` when
    siblings share a product), else ``torch``."""
    packed = [m for m in model.modules() if isinstance(m, (PackedLinear, SharedInputProduct))]
    if not packed:
        return "torch"
    fused = any(isinstance(m, SharedInputProduct) for m in packed)
    return kernels_name(packed[0].kernel, fused, packed[0].huge_pages)


def packed_choice(model: torch.nn.Module) -> PrepackChoice | None:
    """What a model packed before holds (``prepack_linears`` called directly: tests, benchmarks), as
    ``apply_prepack`` describes it; None for a model with no packed layer."""
    packed = [m for m in model.modules() if isinstance(m, (PackedLinear, SharedInputProduct))]
    if not packed:
        return None
    layers = sum(isinstance(m, (PackedLinear, ProductSlice)) for m in model.modules())
    kernel, huge = packed[0].kernel, packed[0].huge_pages
    return PrepackChoice("", layers, "packed before the adapter was built", len(packed), kernel.key, huge_pages=huge)


def kernels_name(kernel: LinearKernel, fused: bool, huge_pages: bool) -> str:
    """The packed layers' kernels as the calibration and compile records key them: the kernel's (fused) name,
    and ``HUGE_PAGES_SUFFIX`` where its weights lie in huge pages (their own cost curve)."""
    return (kernel.fused_name if fused else kernel.name) + (HUGE_PAGES_SUFFIX if huge_pages else "")

"""lp_runner's native CPU kernels (``csrc/``: the product, the attention, whole decoder layers): built on first use
with the machine's C compiler, as one library.

Why: a CPU forward of a few rows is bound by reading the weights, and neither torch's linear (MKL re-packs the
weight on every call) nor oneDNN's prepacked inner product reads them at the machine's bandwidth at 1-8 rows:
on a 2-core x86 CPU (2 threads, the embedded model's linears, ``benchmarks/linear_kernels.py``) oneDNN reads 14-19
GB/s, this kernel 24-32 GB/s at every row count from 1 to 8 (docs/results.md, "Native products"). Its weight layout,
blocks of 32 output columns each stored as one contiguous run over the input dimension, lets one pass over the
weights serve several rows from registers (8 with AVX-512, 3 with AVX2, 2 with 4-float vectors: the source's
register tile per instruction set).

Build: ``cc -O3 -march=native -fopenmp -shared -fPIC csrc/*.c`` into the cache folder (``~/.cache/lp_runner/native``),
named by a hash of every source (``csrc/*.c`` and its header), the compiler's version, the CPU's flags and any extra
flags, so a shared home
directory across different CPUs keeps one library per kind of CPU. ``$LP_RUNNER_NATIVE_CFLAGS`` adds flags
after those (``-mno-avx512f`` builds the AVX2 register tile on an AVX-512 machine): how this project tests and
measures the instruction sets it does not run on (``tests/backends/cpu/test_native_isa.py``,
``benchmarks/native_isa.py``).
A process builds into a private temporary name and renames it into place (ranks of one node may build at once).
Without a compiler, or on a build or probe failure, the kernel is unavailable and the CPU backend says why
(``model.backend: auto`` falls back to oneDNN's products).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lp_runner.backends.cpu.ops import define_op
from lp_runner.errors import first_line

SOURCE_DIR = Path(__file__).with_name("csrc")  # the kernels' sources: one C file per kernel and their header
SOURCES = tuple(sorted(SOURCE_DIR.glob("*.[ch]")))
LIBRARY = "lp_runner's native kernels"  # how messages name the library
BLOCK = 32  # output columns per packed block (NB in the source)
BUILD_TIMEOUT_S = 120.0
EXTRA_FLAGS_ENV = "LP_RUNNER_NATIVE_CFLAGS"  # extra compiler flags, appended (tests and benchmarks: other ISAs)


@dataclass(frozen=True)
class SegmentTable:
    """``csrc/lp_native.h``'s ``struct segments``: the generations of a round as the C entries take them. Segment b
    holds round rows ``start[b]`` .. ``start[b + 1] - 1``, its key j is buffer slot ``base[b] + j`` for j below
    ``width[b]``, and its mask rows (``width[b]`` floats each) start at float ``moff[b]`` of the flat mask.

    Example: two generations of 2 and 3 rows, regions at slots 0 and 512, 100 and 40 keys visible ->
    start (0, 2, 5), base (0, 512), width (100, 40), moff (0, 200); the flat mask holds 2 x 100 + 3 x 40 floats."""

    start: torch.Tensor  # [n + 1] int64
    base: torch.Tensor  # [n] int64
    width: torch.Tensor  # [n] int64
    moff: torch.Tensor  # [n] int64
    mask_size: int  # floats of the flat mask: sum of rows x width

    @classmethod
    def of(cls, rows: list[int], base: list[int], width: list[int]) -> SegmentTable:
        """From each segment's row count, first slot and key count (the mask's rows packed in segment order)."""
        start, moff, offset = [0], [], 0
        for r, w in zip(rows, width, strict=True):
            start.append(start[-1] + r)
            moff.append(offset)
            offset += r * w
        fields = (start, base, width, moff)
        table = torch.tensor([v for f in fields for v in f], dtype=torch.long).split([len(f) for f in fields])
        return cls(*table, offset)

    @property
    def count(self) -> int:
        return self.base.shape[0]

    def pointers(self) -> tuple[int, int, int, int, int]:
        return (self.count, *(t.data_ptr() for t in (self.start, self.base, self.width, self.moff)))


class NativeUnavailable(RuntimeError):
    """The native kernel cannot be built or loaded here; the message says why."""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeUnavailable("no C compiler (cc, gcc or $CC) on PATH")
    return cc


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for); the machine name where /proc has none."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def extra_flags() -> tuple[str, ...]:
    """``$LP_RUNNER_NATIVE_CFLAGS``, split as a shell would."""
    return tuple(shlex.split(os.environ.get(EXTRA_FLAGS_ENV, "")))


def sources_at(path: Path) -> tuple[Path, ...]:
    """The sources of a version of the kernels at ``path``: a folder's ``*.c`` and ``*.h`` (a ``csrc`` checked out
    from another revision), or one C file (a revision from before the kernels were split by file)."""
    return tuple(sorted(path.glob("*.[ch]"))) if path.is_dir() else (path,)


def _library_path(cache_root: Path, cc: str, flags: tuple[str, ...], sources: tuple[Path, ...]) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    code = b"".join(s.name.encode() + b"\0" + s.read_bytes() for s in sources)  # every file, by name and content
    ident = code + version.encode() + _cpu_flags().encode() + " ".join(flags).encode()
    return cache_root / "native" / f"lp_native_gemm-{hashlib.sha256(ident).hexdigest()[:16]}.so"


def build(cache_root: Path, flags: tuple[str, ...] | None = None, sources: tuple[Path, ...] = SOURCES) -> Path:
    """The compiled library for these sources, compiler, CPU and extra ``flags`` (default: ``extra_flags()``):
    from the cache, else built now. ``sources``: another version of the kernels (``sources_at``: a benchmark's
    baseline); its C files are compiled into one library, its headers found beside them."""
    cc = _compiler()
    flags = extra_flags() if flags is None else flags
    target = _library_path(cache_root, cc, flags, sources)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    files = [str(s) for s in sources if s.suffix == ".c"]
    cmd = [cc, "-O3", "-march=native", *flags, "-fopenmp", "-shared", "-fPIC", *files, "-lm", "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise NativeUnavailable(f"{Path(cc).name} could not build {LIBRARY}: {first_line(proc.stderr)}")
        os.replace(tmp, target)
    except subprocess.TimeoutExpired:
        raise NativeUnavailable(f"building {LIBRARY} took over {BUILD_TIMEOUT_S:g} s") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def library(cache_root: str, flags: tuple[str, ...] = ()):
    """The built library, loaded, with its entry points typed (one per root and flags for the process)."""
    return open_library(build(Path(cache_root), flags))


def open_library(path: Path):
    """A built copy of the kernels (these, or another version a benchmark builds), loaded and typed."""
    lib = ctypes.CDLL(str(path))
    lib.lp_native_gemm_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.lp_native_gemm_f32.restype = ctypes.c_int
    lib.lp_native_attention_f32.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 7 + [ctypes.c_float, ctypes.c_int]
    lib.lp_native_attention_f32.restype = ctypes.c_int
    lib.lp_native_llama_layer.argtypes = (
        ([ctypes.c_void_p] * 3 + [ctypes.c_float] + [ctypes.c_void_p] * 12 + [ctypes.c_long] * 2)
        + [ctypes.c_void_p] * 2
        + [ctypes.c_long] * 7
        + [ctypes.c_float, ctypes.c_int]
    )
    lib.lp_native_llama_layer.restype = ctypes.c_int
    # on bfloat16 weights (older sources lack them): the float32 entries' arguments, the weights' pointers aside
    for bf16, twin in (
        ("lp_native_gemm_bf16w", lib.lp_native_gemm_f32),
        ("lp_native_llama_layer_bf16w", lib.lp_native_llama_layer),
    ):
        if hasattr(lib, bf16):
            getattr(lib, bf16).argtypes, getattr(lib, bf16).restype = twin.argtypes, ctypes.c_int
    if hasattr(lib, "lp_native_llama_layers"):  # a model's layers in one call (older sources lack it)
        lib.lp_native_llama_layers.argtypes = (
            [ctypes.c_void_p, ctypes.c_long]
            + [ctypes.c_void_p] * 7
            + [ctypes.c_long] * 7
            + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        )
        lib.lp_native_llama_layers.restype = ctypes.c_int
    if hasattr(lib, "lp_native_llama_layers_segments"):  # a batched round's generations (older sources lack it)
        lib.lp_native_llama_layers_segments.argtypes = (
            lib.lp_native_llama_layers.argtypes + [ctypes.c_long] + [ctypes.c_void_p] * 4
        )
        lib.lp_native_llama_layers_segments.restype = ctypes.c_int
    if hasattr(lib, "lp_native_attention_segments_f32"):
        lib.lp_native_attention_segments_f32.argtypes = (
            lib.lp_native_attention_f32.argtypes + [ctypes.c_long] + [ctypes.c_void_p] * 4
        )
        lib.lp_native_attention_segments_f32.restype = ctypes.c_int
    if hasattr(lib, "lp_native_silu_gate_f32"):  # the layer's activation, for its test (older sources lack it)
        lib.lp_native_silu_gate_f32.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2
        lib.lp_native_silu_gate_f32.restype = ctypes.c_int
    return lib


NOT_LOADED = "the native kernel was not loaded (lp_runner.backends.cpu.native.load)"


@dataclass(frozen=True)
class Routed:
    """The entry points every native call goes to: one loaded library's (``route``), or none (``UNLOADED``)."""

    fn: Any = None  # the product (``load``)
    attention: Any = None  # the attention, checked as the product is
    layer: Any = None  # one decoder layer: the probed product and attention composed (tests: vs transformers')
    layers: Any = None  # a model's decoder layers in one call (None: a build of an older source; ``LayerStack`` loops)
    layers_segments: Any = None  # the same over a batched round's segments (None: an older source; no native batches)
    attention_segments: Any = None  # the attention over segments (its tests)
    fn_bf16: Any = None  # the product and the layer on weights stored as bfloat16 (None: ``bf16_reason`` says why)
    layer_bf16: Any = None
    bf16_reason: str = NOT_LOADED
    build: str = ""  # the library's file name: a hash of its sources, compiler, CPU and flags (``build_id``)

    @classmethod
    def of(cls, lib) -> Routed:
        fn_bf16 = getattr(lib, "lp_native_gemm_bf16w", None)
        layer_bf16 = getattr(lib, "lp_native_llama_layer_bf16w", None)
        has_bf16 = fn_bf16 is not None and layer_bf16 is not None
        return cls(
            fn=lib.lp_native_gemm_f32,
            attention=lib.lp_native_attention_f32,
            layer=lib.lp_native_llama_layer,
            layers=getattr(lib, "lp_native_llama_layers", None),
            layers_segments=getattr(lib, "lp_native_llama_layers_segments", None),
            attention_segments=getattr(lib, "lp_native_attention_segments_f32", None),
            fn_bf16=fn_bf16,
            layer_bf16=layer_bf16,
            bf16_reason="" if has_bf16 else "this build of the native kernel has no product on bfloat16 weights",
            build=Path(lib._name).stem,
        )


UNLOADED = Routed()
# The process's one piece of state here: which loaded library (``library``, cached per build) the calls go to. A
# library is loaded into a process once and stays (ctypes cannot unload it); routing to it is what ``load`` does.
_ROUTED = UNLOADED


def routed() -> Routed:
    """The entry points native calls go to now (``UNLOADED``'s None before ``load``)."""
    return _ROUTED


def route(lib) -> None:
    """Send every native call to ``lib`` (``load``; benchmarks swapping builds of the kernels in one process)."""
    global _ROUTED
    _ROUTED = Routed.of(lib)


def _unroute() -> None:
    """No native calls (a build that failed its probe)."""
    global _ROUTED
    _ROUTED = dataclasses.replace(UNLOADED, bf16_reason="the native kernel failed its probe")


def _no_bf16(reason: str) -> None:
    """No native calls on bfloat16 weights, for ``reason`` (the float32 ones may stay)."""
    global _ROUTED
    _ROUTED = dataclasses.replace(_ROUTED, fn_bf16=None, layer_bf16=None, bf16_reason=reason)


def bf16_unavailable_reason() -> str | None:
    """Why the loaded kernel cannot multiply by weights stored as bfloat16 (``model.backend=native-bf16``), or
    None when it can."""
    return _ROUTED.bf16_reason or None


def build_id() -> str:
    """Which build of the kernels runs (empty before ``load``): part of the calibration key, so a new version of
    the kernels' sources (``csrc``), another compiler or other flags measure their own cost curve instead of reusing one
    measured on other code."""
    return _ROUTED.build


def load(cache_root: Path) -> None:
    """Build (or find) and load the kernel, then check it against torch's linear on a probe; raises
    ``NativeUnavailable`` saying why it cannot be used."""
    try:
        route(library(str(cache_root), extra_flags()))
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"cannot build or load {LIBRARY} ({first_line(exc)})") from None
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 70, generator=generator)  # a partial last block and a K that is no multiple of 16
    bias = torch.randn(40, generator=generator)
    x = torch.randn(11, 70, generator=generator)  # more than one block of 8 rows
    with torch.inference_mode():
        got = product(x, pack(weight), bias, 40)
        expected = torch.nn.functional.linear(x, weight, bias)
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
        _unroute()
        raise NativeUnavailable(f"{LIBRARY}' product disagrees with torch's linear on a probe")
    q, k, v = (torch.randn(2, n, 24, generator=generator) for n in (6, 9, 9))  # 2 heads, 3 rows x 2 groups
    mask = torch.zeros(3, 9).masked_fill(torch.rand(3, 9, generator=generator) < 0.4, torch.finfo(torch.float32).min)
    mask[:, 0] = 0.0  # every row sees a key
    with torch.inference_mode():
        got = attention(q, k, v, mask, 0.3)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(2, 1), scale=0.3)
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        _unroute()
        raise NativeUnavailable(f"{LIBRARY}' attention disagrees with torch's sdpa on a probe")
    if _ROUTED.fn_bf16 is not None:  # bfloat16 storage: the float32 product on the rounded weights, bit for bit
        with torch.inference_mode():
            got = product(x, pack(weight, torch.bfloat16), bias, 40)
            expected = product(x, pack(weight.to(torch.bfloat16)), bias, 40)
        if not torch.equal(got, expected):  # the float32 product stays: it passed its own probe
            _no_bf16(f"{LIBRARY}' product on bfloat16 weights differs from its float32 one on a probe")


STORAGE = (torch.float32, torch.bfloat16)  # how ``pack`` can store the weights


def packed_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """The shape ``pack`` gives an [out, in] weight."""
    return (-(-out_features // BLOCK), in_features, BLOCK)


def pack(weight: torch.Tensor, storage: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """[out, in] -> [ceil(out / BLOCK), in, BLOCK] in ``storage``, zero-padded columns: the kernel's layout.

    float32: p[block, k, c] = w[block * BLOCK + c, k]. bfloat16 (the weight rounded to nearest even, as
    ``Tensor.to`` rounds): each block's row of 32 holds columns c and c + 16 side by side in one 32-bit word, so
    the kernel widens them with a single integer op each (see ``csrc/gemm.c``); ``product`` then gives the
    float32 product on the rounded weight, bit for bit. ``out``: written in place (a slot of the model's arena,
    ``arena.py``) and returned; the whole blocks are copied straight from the weight, so packing holds no copy of
    it besides (the LM head's is 113 MB in the embedded model)."""
    if storage not in STORAGE:
        raise ValueError(f"native weights are stored as float32 or bfloat16, not {storage}")
    out_features, in_features = weight.shape
    shape = packed_shape(out_features, in_features)
    if out is None:
        out = torch.empty(shape, dtype=storage)
    elif tuple(out.shape) != shape or out.dtype != storage or not out.is_contiguous():
        raise ValueError(f"packing into {out.dtype} {list(out.shape)}: needs a contiguous {storage} {list(shape)}")
    full = out_features // BLOCK
    weight = weight.detach()
    _pack_blocks(weight[: full * BLOCK], out[:full], storage)
    if full < shape[0]:  # the last block's missing columns are zeros
        last = torch.zeros(BLOCK, in_features, dtype=weight.dtype)
        last[: out_features - full * BLOCK] = weight[full * BLOCK :]
        _pack_blocks(last, out[full:], storage)
    return out


def _pack_blocks(rows: torch.Tensor, dest: torch.Tensor, storage: torch.dtype) -> None:
    """rows [n * BLOCK, in] into dest [n, in, BLOCK], in ``pack``'s layout (copy_ rounds to ``storage``)."""
    n, in_features = dest.shape[0], dest.shape[1]
    if n == 0:
        return
    if storage == torch.float32:
        dest.copy_(rows.reshape(n, BLOCK, in_features).transpose(1, 2))
        return
    half = BLOCK // 2
    dest.view(n, in_features, half, 2).copy_(rows.reshape(n, 2, half, in_features).permute(0, 3, 2, 1))


def product(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """[R, in] x the packed weight (+ bias) -> [R, out] float32, on torch's current thread count; the packed
    weight's dtype says how ``pack`` stored it."""
    lib = _ROUTED
    fn = lib.fn_bf16 if packed.dtype == torch.bfloat16 else lib.fn
    if fn is None:
        raise NativeUnavailable(NOT_LOADED if lib.fn is None else lib.bf16_reason)
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    if rows.shape[0] == 0:
        return out
    in_features = packed.shape[1]
    if rows.dtype != torch.float32 or rows.shape[1] != in_features:
        raise ValueError(f"native product takes float32 [R, {in_features}] rows, not {rows.dtype} {list(rows.shape)}")
    ptr_bias = None if bias is None else bias.data_ptr()
    threads = torch.get_num_threads()
    if fn(
        rows.data_ptr(), packed.data_ptr(), ptr_bias, out.data_ptr(), rows.shape[0], out_features, in_features, threads
    ):
        raise ValueError(f"native product refused sizes R={rows.shape[0]} out={out_features} in={in_features}")
    return out


native_linear_op = define_op(  # the product as one opaque op for torch.compile (eager forwards call ``product``)
    "native_linear",
    "(Tensor rows, Tensor packed, Tensor? bias, int out_features) -> Tensor",
    lambda rows, packed, bias, out_features: product(rows, packed, bias, out_features),  # looked up per call
    lambda rows, packed, bias, out_features: rows.new_empty(rows.shape[0], out_features),
)


def attention(
    query: torch.Tensor,  # [H, M, D]: M packed rows per K/V head; row r reads mask row r % Q
    key: torch.Tensor,  # [H, C, D], slots contiguous (heads may be strided: a cache buffer's first C slots)
    value: torch.Tensor,  # [H, C, D], as key
    mask: torch.Tensor,  # [Q, C] additive: 0 visible, the dtype's min hidden
    scale: float,
) -> torch.Tensor:  # [H, M, D] float32
    """Softmax attention of a few packed rows over a K/V buffer, visible keys only, on torch's thread count.

    Why: torch's CPU sdpa (flash) costs 40-130 us per layer for a one- or two-row round over a few hundred keys,
    ~15% of a compiled one-row forward of the embedded model, while the arithmetic is a few microseconds; this
    loop skips the hidden keys (a static cache's unused slots among them) instead of scoring them."""
    if _ROUTED.attention is None:
        raise NativeUnavailable(NOT_LOADED)
    query, mask = query.contiguous(), mask.contiguous()
    key, value = (t if t.stride()[1:] == (t.shape[2], 1) else t.contiguous() for t in (key, value))  # slots in place
    heads, rows, dim = query.shape
    if key.shape != value.shape or key.shape[0] != heads or key.shape[2] != dim or mask.shape[1] != key.shape[1]:
        raise ValueError(
            f"native attention: query {list(query.shape)}, key {list(key.shape)}, value {list(value.shape)}, "
            f"mask {list(mask.shape)} do not fit"
        )
    out = torch.empty_like(query)
    args = (query, key, value, mask, out)
    if any(t.dtype != torch.float32 for t in args):
        raise ValueError("native attention takes float32 tensors")
    sizes = (heads, rows, mask.shape[0], key.shape[1], dim, key.stride(0), value.stride(0))
    status = _ROUTED.attention(*(t.data_ptr() for t in args), *sizes, float(scale), torch.get_num_threads())
    if status == -2:
        raise MemoryError(f"native attention could not allocate {key.shape[1]} scores per thread")
    if status:
        raise ValueError(f"native attention refused sizes {sizes}")
    return out


def attention_segments(
    query: torch.Tensor,  # [H, M, D]: M = groups x Q packed rows per K/V head; row r reads mask row r % Q
    key: torch.Tensor,  # [H, C, D] the whole buffer (slots contiguous)
    value: torch.Tensor,  # [H, C, D], as key
    mask: torch.Tensor,  # [mask_size] flat: each segment's [rows, width] additive rows, in segment order
    scale: float,
    segments: SegmentTable,
) -> torch.Tensor:  # [H, M, D] float32
    """``attention`` over a batched round's segments: each round row attends to its own segment's keys only,
    with the value a call of its segment alone gives, bit for bit (``csrc/attention.c``)."""
    if _ROUTED.attention_segments is None:
        raise NativeUnavailable(
            NOT_LOADED if _ROUTED.attention is None else "this build has no attention over segments"
        )
    query, mask = query.contiguous(), mask.contiguous()
    key, value = (t if t.stride()[1:] == (t.shape[2], 1) else t.contiguous() for t in (key, value))
    heads, rows, dim = query.shape
    q_rows = int(segments.start[-1])
    if mask.shape != (segments.mask_size,) or key.shape != value.shape or key.shape[0] != heads:
        raise ValueError(f"native attention over segments: mask {list(mask.shape)}, key {list(key.shape)} do not fit")
    out = torch.empty_like(query)
    args = (query, key, value, mask, out)
    if any(t.dtype != torch.float32 for t in args):
        raise ValueError("native attention takes float32 tensors")
    sizes = (heads, rows, q_rows, key.shape[1], dim, key.stride(0), value.stride(0))
    status = _ROUTED.attention_segments(
        *(t.data_ptr() for t in args), *sizes, float(scale), torch.get_num_threads(), *segments.pointers()
    )
    if status == -2:
        raise MemoryError("native attention over segments: out of memory")
    if status:
        raise ValueError(f"native attention over segments refused sizes {sizes} or its segments")
    return out


def llama_layer(
    hidden: torch.Tensor,  # [R, E], updated in place: the residual stream after the layer
    weights: tuple,  # native_layers.LayerWeights.as_args(): norms, epsilon, packed weights and biases
    cos: torch.Tensor,  # [R, D]
    sin: torch.Tensor,  # [R, D]
    slots: torch.Tensor,  # [R] int64: where each row's K/V goes
    mask: torch.Tensor,  # [R, C] additive
    keys: torch.Tensor,  # [H_kv, C, D] view of the layer's K buffer (slots contiguous), written at ``slots``
    values: torch.Tensor,  # [H_kv, C, D], as keys
    heads: int,
    intermediate: int,
    scale: float,
) -> None:
    """One Llama-family decoder layer on ``hidden`` in a single C call (``lp_native_llama_layer``, or its
    ``_bf16w`` twin where the packed weights are stored as bfloat16: all four are, one kernel packs a model)."""
    layer = _ROUTED.layer_bf16 if weights[3].dtype == torch.bfloat16 else _ROUTED.layer
    if layer is None:
        raise NativeUnavailable(NOT_LOADED if _ROUTED.layer is None else _ROUTED.bf16_reason)
    rows, embed = hidden.shape
    kv_heads, capacity, dim = keys.shape
    if (
        not all(t.is_contiguous() for t in (hidden, cos, sin, mask, slots))
        or keys.stride()[1:] != (dim, 1)
        or values.stride() != keys.stride()
        or cos.shape != (rows, dim)
        or sin.shape != cos.shape
        or mask.shape != (rows, capacity)
        or slots.shape != (rows,)
        or slots.dtype != torch.int64
    ):
        raise ValueError(
            f"native layer: hidden {list(hidden.shape)}, cos {list(cos.shape)}, mask {list(mask.shape)}, slots "
            f"{list(slots.shape)} and K/V {list(keys.shape)} do not fit (contiguous, K/V slots in place)"
        )
    ln1, ln2, eps, *packed = weights
    status = layer(
        hidden.data_ptr(),
        ln1.data_ptr(),
        ln2.data_ptr(),
        float(eps),
        *(None if t is None else t.data_ptr() for t in packed),
        cos.data_ptr(),
        sin.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        keys.stride(0),
        values.stride(0),
        slots.data_ptr(),
        mask.data_ptr(),
        capacity,
        rows,
        embed,
        heads,
        kv_heads,
        dim,
        intermediate,
        float(scale),
        torch.get_num_threads(),
    )
    if status == -2:
        raise MemoryError("native layer: out of memory")
    if status:
        raise ValueError(f"native layer refused sizes rows={rows} embed={embed} heads={heads}/{kv_heads} dim={dim}")


class LayerStack:
    """A model's decoder layers bound to one cache's K/V buffers, for ``lp_native_llama_layers``: every layer in a
    single C call, with the table of its weights' and buffers' addresses built once here instead of once a forward.

    Why: called layer by layer from Python, a forward of the embedded model lost 35-39 us between two layers (1.0-1.1
    ms of a 15-24 ms forward on a 2-core CPU; ``csrc/layers.c`` says why), and the per-layer checks and address
    look-ups cost about 0.2 ms more. The stack keeps the tensors whose addresses it holds alive; whoever keeps it
    (``native_layers``) builds a new one for other buffers (a grown cache gets new ones).

    ``layers``: per layer, ``native_layers.LayerWeights.as_args()``; ``keys``/``values``: per layer, ``[H_kv, C, D]``
    views of its buffers (slots contiguous; one size for all). A build of an older source without the stacked entry
    (a benchmark's ``--baseline``) runs ``llama_layer`` per layer on the same arguments."""

    POINTERS = 12  # per layer (LAYER_PTRS in csrc/layers.c)

    def __init__(
        self,
        layers: list[tuple],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        heads: int,
        intermediate: int,
        scale: float,
    ) -> None:
        if not layers or not (len(layers) == len(keys) == len(values)):
            raise ValueError(f"native layers: {len(layers)} layers, {len(keys)} K and {len(values)} V buffers")
        self.bf16 = layers[0][3].dtype == torch.bfloat16
        kv_heads, capacity, dim = keys[0].shape
        for k, v in zip(keys, values, strict=True):
            if k.shape != (kv_heads, capacity, dim) or v.shape != k.shape or k.stride()[1:] != (dim, 1):
                want = [kv_heads, capacity, dim]
                raise ValueError(f"native layers: K/V {list(k.shape)} and {list(v.shape)}, not {want} (slots in place)")
            if v.stride() != k.stride():
                raise ValueError("native layers: K and V buffers of one layer laid out differently")
        if any((args[3].dtype == torch.bfloat16) != self.bf16 for args in layers):
            raise ValueError("native layers: one weight storage for every layer")
        self.layers, self.keys, self.values = layers, keys, values  # kept alive: the table holds their addresses
        self.heads, self.intermediate, self.scale = heads, intermediate, float(scale)
        self.kv_heads, self.capacity, self.dim = kv_heads, capacity, dim
        self.embed = layers[0][0].shape[0]  # the first norm's weight: one value per hidden unit
        pointers = []
        for (ln1, ln2, _, *packed), k, v in zip(layers, keys, values, strict=True):
            pointers += [ln1.data_ptr(), ln2.data_ptr(), *(None if t is None else t.data_ptr() for t in packed)]
            pointers += [k.data_ptr(), v.data_ptr()]
        if len(pointers) != self.POINTERS * len(layers):
            raise ValueError(f"native layers: {len(pointers)} addresses for {len(layers)} layers")
        self._table = (ctypes.c_void_p * len(pointers))(*pointers)
        self._eps = (ctypes.c_float * len(layers))(*(float(args[2]) for args in layers))
        strides = [s for k, v in zip(keys, values, strict=True) for s in (k.stride(0), v.stride(0))]
        self._strides = (ctypes.c_long * len(strides))(*strides)

    def run(
        self,
        hidden: torch.Tensor,  # [R, E], updated in place: the residual stream after the last layer
        cos: torch.Tensor,  # [R, D]
        sin: torch.Tensor,  # [R, D]
        slots: torch.Tensor,  # [R] int64: where each row's K/V goes, in every layer's buffer
        masks: list[torch.Tensor],  # per layer, [R, C] additive (layers of one attention type share one)
        segments: SegmentTable | None = None,
    ) -> None:
        """Every layer on ``hidden``: the values ``llama_layer`` gives layer by layer, bit for bit. Every size,
        shape and slot is checked before any layer runs.

        ``segments``: the round's generations (``SegmentTable``): each mask is then the flat [mask_size] of every
        segment's rows over its own keys, and each row's K/V slot must lie in its segment's keys."""
        layers = self.layers
        if segments is not None:
            self._run_segments(hidden, cos, sin, slots, masks, segments)
            return
        if _ROUTED.layers is None:
            for args, mask, k, v in zip(layers, masks, self.keys, self.values, strict=True):
                llama_layer(hidden, args, cos, sin, slots, mask, k, v, self.heads, self.intermediate, self.scale)
            return
        if self.bf16 and _ROUTED.layer_bf16 is None:
            raise NativeUnavailable(_ROUTED.bf16_reason)
        rows, embed = hidden.shape
        unique = {id(m): m for m in masks}
        if not self._fits(hidden, cos, sin, slots, masks, (rows, self.capacity)):
            raise ValueError(
                f"native layers: hidden {list(hidden.shape)}, cos {list(cos.shape)}, slots {list(slots.shape)} and "
                f"masks {[list(m.shape) for m in unique.values()]} do not fit {len(layers)} layers of width "
                f"{self.embed} and K/V {[self.kv_heads, self.capacity, self.dim]} (float32, contiguous)"
            )
        status = _ROUTED.layers(*self._call_args(hidden, cos, sin, slots, masks))
        if status == -2:
            raise MemoryError("native layers: out of memory")
        if status:
            raise ValueError(
                f"native layers refused sizes rows={rows} embed={embed} heads={self.heads}/{self.kv_heads} "
                f"dim={self.dim} or a K/V slot outside the buffer"
            )

    def _fits(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        masks: list[torch.Tensor],
        mask_shape: tuple[int, ...],
    ) -> bool:
        """Whether a round's tensors are what the C entries read: one mask per layer of ``mask_shape``, float32
        and contiguous, rows of the stack's width, one K/V slot per row."""
        rows, embed = hidden.shape
        unique = {id(m): m for m in masks}.values()
        return (
            len(masks) == len(self.layers)
            and embed == self.embed
            and all(t.dtype == torch.float32 for t in (hidden, cos, sin))
            and all(t.is_contiguous() for t in (hidden, cos, sin, slots, *unique))
            and cos.shape == (rows, self.dim)
            and sin.shape == cos.shape
            and slots.shape == (rows,)
            and slots.dtype == torch.int64
            and all(m.shape == mask_shape and m.dtype == torch.float32 for m in unique)
        )

    def _call_args(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, masks: list[torch.Tensor]
    ) -> tuple:
        """The arguments both C entries (a round, a round over segments) take first: the checked tensors'
        addresses, the stack's table, the sizes and the threads."""
        rows, embed = hidden.shape
        addresses = (ctypes.c_void_p * len(masks))(*(m.data_ptr() for m in masks))
        return (
            hidden.data_ptr(), len(self.layers), self._table, self._eps, self._strides, addresses, cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), self.capacity, rows, embed, self.heads, self.kv_heads, self.dim,
            self.intermediate, self.scale, torch.get_num_threads(), int(self.bf16),
        )  # fmt: skip

    def _run_segments(
        self,
        hidden: torch.Tensor,  # [R, E]
        cos: torch.Tensor,  # [R, D]
        sin: torch.Tensor,  # [R, D]
        slots: torch.Tensor,  # [R] int64
        masks: list[torch.Tensor],  # per layer, [mask_size] flat
        segments: SegmentTable,
    ) -> None:
        if _ROUTED.layers_segments is None:
            raise NativeUnavailable(NOT_LOADED if _ROUTED.layers is None else "this build has no layers over segments")
        if self.bf16 and _ROUTED.layer_bf16 is None:
            raise NativeUnavailable(_ROUTED.bf16_reason)
        rows, embed = hidden.shape
        unique = {id(m): m for m in masks}
        if int(segments.start[-1]) != rows or not self._fits(hidden, cos, sin, slots, masks, (segments.mask_size,)):
            raise ValueError(
                f"native layers over segments: hidden {list(hidden.shape)}, slots {list(slots.shape)} and masks "
                f"{[list(m.shape) for m in unique.values()]} do not fit {segments.count} segments of "
                f"{int(segments.start[-1])} rows ({segments.mask_size} mask floats)"
            )
        status = _ROUTED.layers_segments(*self._call_args(hidden, cos, sin, slots, masks), *segments.pointers())
        if status == -2:
            raise MemoryError("native layers: out of memory")
        if status:
            raise ValueError(
                f"native layers over segments refused sizes rows={rows} capacity={self.capacity}, a segment outside "
                "the buffer, or a K/V slot outside its segment"
            )

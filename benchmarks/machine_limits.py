"""How fast a forward could be on this machine: the memory-bound and the compute-bound limit, measured.

A decoder forward of Q rows reads every weight once (and the cached K/V) and does about 2 * parameters * Q
floating-point operations. Its cost cannot fall below

    memory limit   = bytes read / copy bandwidth      (bandwidth: a large tensor copy, read + write bytes)
    compute limit  = 2 * parameters * Q / matmul rate  (rate: a large square matmul in the model's dtype)

whichever is larger. ``forward_cost.py`` prints every measured forward's distance to that bound, so a table
says how far the software is from the hardware, per row count. Both rates are measured here, at run
time, with the process's thread count: nothing is assumed about the CPU or GPU.
"""

from __future__ import annotations

import functools
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lp_runner.backends.adapter import ModelAdapter


@dataclass(frozen=True)
class MachineLimits:
    copy_gb_s: float  # bytes moved (read + write) per second by a large copy
    matmul_gflop_s: float  # a large square matmul in the dtype

    def memory_s(self, bytes_read: int) -> float:
        """Seconds to read ``bytes_read`` once at the copy bandwidth (a forward reads each weight once)."""
        return bytes_read / (self.copy_gb_s * 1e9)

    def compute_s(self, flops: float) -> float:
        return flops / (self.matmul_gflop_s * 1e9)

    def bound_s(self, bytes_read: int, flops: float) -> float:
        return max(self.memory_s(bytes_read), self.compute_s(flops))

    def best(self, other: MachineLimits) -> MachineLimits:
        """The higher of two measurements' rates: a shared machine's noise only ever lowers a measured rate, so a
        limit is the best rate seen (``forward_cost.py`` measures before and after its curve)."""
        return MachineLimits(max(self.copy_gb_s, other.copy_gb_s), max(self.matmul_gflop_s, other.matmul_gflop_s))


def _best_of(fn: Callable[[], object], sync: Callable[[], None] | None, reps: int) -> float:
    fn()
    if sync:
        sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        if sync:
            sync()
        best = min(best, time.perf_counter() - t)
    return best


@functools.cache  # a property of the device and dtype: sized once a process, not at every paired point
def matmul_size(device: torch.device, dtype: torch.dtype, largest: int, budget_s: float) -> int:
    """The side of the square matmul that times the rate: ``largest``, or on a CPU less where its matmul would
    take over ``budget_s``: from 256, the side doubles (up to ``largest``) while 8x the last timed matmul (the
    doubled side's work) fits the budget.

    Why: a CPU without bfloat16 instructions (an AVX2-only x86 CPU) multiplies bf16 matrices at
    about 1.3 GFLOP/s in this torch against 100+ in float32, so a 2048-square bf16 matmul took 14 s there, and
    ``gpu_check.sh``'s CPU smoke run of ``forward_cost.py --dtype bfloat16`` ran out of its 240 s in the limits
    alone. A GPU keeps ``largest`` (a smaller matmul is bound by its launch)."""
    if device.type == "cuda":
        return largest

    def square_s(n: int) -> float:
        a = torch.randn(n, n, device=device).to(dtype)
        return _best_of(lambda: a @ a, None, 1)

    n = min(256, largest)
    took = square_s(n)
    while n < largest and 8 * took <= budget_s:
        n = min(2 * n, largest)
        took = square_s(n)
    return n


def measure_limits(
    device: torch.device, dtype: torch.dtype, copy_bytes: int = 512 << 20, matmul_n: int = 2048, reps: int = 5
) -> MachineLimits:
    """The copy bandwidth (a ``copy_bytes`` buffer, far beyond any cache) and the matmul rate (``matmul_n``
    square, in ``dtype``, smaller where one would take over half a second: ``matmul_size``): the best of ``reps``
    runs each, as a limit should be."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = _best_of(lambda: dst.copy_(src), sync, reps)
    matmul_n = matmul_size(device, dtype, matmul_n, 0.5)
    a = torch.randn(matmul_n, matmul_n, device=device).to(dtype)
    b = torch.randn(matmul_n, matmul_n, device=device).to(dtype)
    mm_s = _best_of(lambda: a @ b, sync, reps)
    return MachineLimits(2 * copy_bytes / copy_s / 1e9, 2 * matmul_n**3 / mm_s / 1e9)


@dataclass(frozen=True)
class PairedRatio:
    """One forward against the limits measured right before it (``paired_ratios``)."""

    memory: float  # forward / memory-bound time at this moment's copy rate
    limit: float  # forward / the larger of the memory- and compute-bound times at this moment's rates
    compute_bound: bool  # whether the compute-bound time was the larger


def paired_ratios(
    forward: Callable[[], object],
    bytes_read: int,
    device: torch.device,
    reps: int = 9,
    flops: float | None = None,
    dtype: torch.dtype = torch.float32,
    copy_bytes: int = 512 << 20,
    matmul_n: int | None = None,
) -> list[PairedRatio]:
    """``forward``'s time against the limits of the moment, ``reps`` times: before each forward a copy (the
    memory-bound time of ``bytes_read``) and, with ``flops``, a square matmul of ``matmul_n`` in ``dtype`` (the
    compute-bound time of ``flops``) are timed.

    Why: this host's rates move within minutes (its copy rate between 24 and 52 GB/s while a one-row forward
    moved within 23-31 ms; its large-matmul rate between 158 and 188 GFLOP/s in one hour), so a limit measured at
    another moment than the forward says more about the moment than about the forward; and the matmul tells a
    forward that met slow cores from one whose arithmetic stopped overlapping its stream (the 8-row product
    before ``WHOLE_PREFETCH_ROWS``). Without ``flops`` only the copy is timed and ``limit`` equals ``memory``.
    ``matmul_n`` defaults to 1024 on a CPU (about 12 ms here: the rate of the moment, near a large matmul's; less
    where one would take over 50 ms, ``matmul_size``) and 4096 on a GPU (a smaller one is bound by its launch)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    n = matmul_n or (4096 if device.type == "cuda" else 1024)
    a = b = None
    if flops is not None:
        n = matmul_size(device, dtype, n, 0.05)
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        a @ b
    forward()
    ratios = []
    for _ in range(reps):
        compute_s = 0.0
        if a is not None:
            sync()
            t = time.perf_counter()
            a @ b
            sync()
            compute_s = flops / (2 * n**3 / (time.perf_counter() - t))
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        memory_s = bytes_read / (2 * copy_bytes / (time.perf_counter() - t))
        t = time.perf_counter()
        forward()
        sync()
        forward_s = time.perf_counter() - t
        ratios.append(PairedRatio(forward_s / memory_s, forward_s / max(memory_s, compute_s), compute_s > memory_s))
    return ratios


def forward_bytes(model: torch.nn.Module, kv_len: int, linear_weight_size: int = 0) -> int:
    """Bytes a one-token forward must read: every parameter once, and the K/V of ``kv_len`` cached positions
    (2 tensors x layers x K/V heads x head dim, in the model's dtype; heads and head dim as the adapter measures
    them from the layers' own cache, not as a config names them). ``linear_weight_size``: bytes per linear
    layer weight where the kernels store them in another dtype than the model's (2: ``model.backend=native-bf16``)."""
    linear = {id(m.weight) for m in model.modules() if type(m) is torch.nn.Linear}
    weights = sum(
        p.numel() * (linear_weight_size if linear_weight_size and id(p) in linear else p.element_size())
        for p in model.parameters()
    )
    cfg = model.config.get_text_config()
    heads, head_dim = ModelAdapter(model).kv_shape
    element = next(model.parameters()).element_size()
    return weights + 2 * cfg.num_hidden_layers * heads * head_dim * kv_len * element


def forward_flops(model: torch.nn.Module, rows: int, kv_len: int, logit_rows: int | None = None) -> float:
    """Floating-point operations of a forward of ``rows`` rows with the LM head on ``logit_rows`` of them (default:
    all): the matrix products, 2 per weight-matrix element per row (the input embedding is a lookup, norms and
    biases are no products) and 2 per head element per logit row, plus attention, 4 * layers * hidden * rows *
    (kv_len + rows) (exact where heads x head dim = hidden). A round computes the head only on the rows whose
    logits it uses, and the head is a fifth of this project's embedded model: counting it on every row overstated
    an 8-row forward's work by a fifth. ``tests/studies/test_studies.py`` checks it against torch's FLOP counter."""
    cfg = model.config.get_text_config()
    head = model.get_output_embeddings().weight
    embed = model.get_input_embeddings().weight
    body = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and p is not head and p is not embed)
    logit_rows = rows if logit_rows is None else logit_rows
    attention = 4.0 * cfg.num_hidden_layers * cfg.hidden_size * rows * (kv_len + rows)
    return 2.0 * body * rows + 2.0 * head.numel() * logit_rows + attention


def cpu_description() -> str:
    """``lscpu``'s model name with the family, model and widest vector extension: this project's figures travel
    with the CPU they ran on, and one model name ("AMD EPYC") covers CPUs whose forward costs differ."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    flags = set(fields.get("Flags", "").split())
    vector = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags), "")
    where = f"family {fields['CPU family']} model {fields['Model']}" if "CPU family" in fields else ""
    detail = ", ".join(x for x in (where, vector) if x)
    name = fields.get("Model name", "unknown")
    return f"{name} ({detail})" if detail else name

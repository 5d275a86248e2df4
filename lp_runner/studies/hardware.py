"""What a simulated device is made of: a forward-cost curve, an interconnect and a model shape (pure data).

Every figure here is a stated input of the simulation (``studies/simulate.py``), written into its report with
its source; none is measured by this package. A measured curve (``calibration`` file, ``tune --save-curve``, the
GPU check's rounds) replaces the roofline wherever one exists.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from lp_runner.errors import InputError
from lp_runner.limits import quote
from lp_runner.tuning.costmodel import CostCurve, CurvePoint, HostCost

# Named GPUs for the roofline: (memory bandwidth B/s, dense bf16 FLOP/s), from their vendors' data sheets
# (NVIDIA H100 SXM5: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16; H200: 4.8 TB/s HBM3e, same compute; A100 80GB SXM:
# 2.039 TB/s, 312 TFLOP/s).
GPUS: dict[str, tuple[float, float]] = {
    "H100-SXM": (3.35e12, 989e12),
    "H200": (4.8e12, 989e12),
    "A100-80GB-SXM": (2.039e12, 312e12),
}
# Achievable shares of those peaks, stated (``--bandwidth-fraction``, ``--flops-fraction`` override them): a
# decode forward streams its weights through kernels that sustain about 85% of the data-sheet bandwidth, and a
# large bf16 GEMM reaches about 70% of the data-sheet dense peak. Data-sheet peaks alone would price every forward
# faster than any kernel runs it and put the knee (where the matmuls catch up with the weights' read) at the wrong
# row count.
BANDWIDTH_FRACTION = 0.85
FLOPS_FRACTION = 0.70

# Host time per round where the curve carries none (a roofline): the engine's own, measured from its records on a
# CPU host (docs/results.md, "Host time per round": 226 us a round at 5.3 rows, 375 us at 92.1 rows, P = 1): the
# line through the two. A GPU server's host is another CPU, and its forward is not waited on the same way, so
# this is a stated stand-in, labelled in every report; ``--host-us`` gives another.
ENGINE_HOST_COST = HostCost(217e-6, 1.72e-6)
ENGINE_HOST_LABEL = (
    "the engine's host time measured on a CPU host (217 us a round + 1.72 us a row; docs/results.md, Host time "
    "per round), not a GPU server's"
)

# Model shapes (a Llama config's sizes). embedded: SmolLM2-135M-Instruct's config.json; llama-8b: Meta
# Llama-3-8B's config.json (GQA 32/8 heads, 128k vocabulary).
MODEL_SHAPES: dict[str, dict[str, int]] = {
    "embedded": {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
    },
    "llama-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 128256,
    },
}


@dataclass(frozen=True)
class Interconnect:
    """A link's all_gather cost for LP's tiny payload (a few hundred bytes a rank): a fixed part (the collective's
    launch and synchronisation) plus P - 1 ring steps, each a step latency plus one rank's payload over the link's
    one-direction bandwidth. The latency decides: the payload is far below any link's bandwidth-delay product."""

    name: str
    fixed_s: float  # once per all_gather, whatever P
    latency_s: float  # one ring step of a small all_gather
    bandwidth_Bps: float  # one direction, per GPU
    source: str

    def all_gather_s(self, world_size: int, payload_bytes: int) -> float:
        if world_size <= 1:
            return 0.0
        return self.fixed_s + (world_size - 1) * (self.latency_s + payload_bytes / self.bandwidth_Bps)


# NVLink: small-message collectives in one NVLink node, as nccl-tests measures them. NVIDIA/nccl-tests issue #123
# (all_reduce_perf, 8-128 bytes, ring, one DGX A100 node: 10 us at 2 GPUs to 33.7 us at 8, i.e. about 6 us fixed
# plus 2 us per ring step, an all_reduce taking 2 (P - 1) steps) and NVIDIA/nccl issue #1259 (H100 HGX node, small
# all_reduce about 6 us at 2 GPUs). An all_gather takes P - 1 steps: about 8 us at 2 GPUs and 20 us at 8, within
# the 10-20 us such figures give for one node. PCIe and InfiniBand: the order of a small step on each kind of link.
INTERCONNECTS: dict[str, Interconnect] = {
    "nvlink": Interconnect(
        "NVLink (one node)",
        6e-6,
        2e-6,
        450e9,
        "nccl-tests small-message collectives in one NVLink node (NVIDIA/nccl-tests#123, NVIDIA/nccl#1259): about "
        "6 us fixed + 2 us per ring step; 900 GB/s both directions",
    ),
    "pcie": Interconnect(
        "PCIe Gen5 x16", 0.0, 15e-6, 64e9, "PCIe 5.0 x16: 64 GB/s per direction; ~15 us per small step"
    ),
    "infiniband": Interconnect(
        "InfiniBand NDR 400 Gb/s (across nodes)", 0.0, 25e-6, 50e9, "NDR: 400 Gb/s = 50 GB/s per port; ~25 us per step"
    ),
}


def measured_interconnect(two_rank_us: float) -> Interconnect:
    """The measured 2-rank all_gather of one round (``benchmarks/scaling.py --collective-bench``), assumed to
    take P - 1 such steps at P ranks (the bandwidth term is in the measurement)."""
    return Interconnect(
        f"measured 2-rank all_gather, {two_rank_us:g} us", 0.0, 1e-6 * two_rank_us, float("inf"), "given"
    )


@dataclass(frozen=True)
class Roofline:
    """A forward of a model shape on a named GPU at its achievable memory and matmul limits, evaluated in closed
    form at the exact row count (no sampled points, no interpolation): ``CostCurve``'s pricing interface
    (``seconds``, ``host``, ``kv_lens``), so ``search.price`` replays rounds on it as on a measured curve.

    seconds(rows, logit_rows, kv) = max(bytes / (bandwidth x bandwidth_fraction), FLOPs / (peak x flops_fraction)),
    bytes = 2 x (body weights + LM head + layers x K/V width x (kv + rows)), FLOPs = 2 x body weights x rows +
    4 x layers x query width x rows x (kv + rows) + 2 x LM head x logit_rows. No launch or host cost: the host is
    priced apart (``HostCost``).

    Example: the llama-8b shape on an H200 reads 16 GB of weights (about 3.9 ms at 85% of 4.8 TB/s); its matmuls
    catch up with that read near 190 rows at 70% of the dense peak: flat to there (the knee), linear after."""

    gpu: str
    shape: tuple[tuple[str, int], ...]
    bandwidth_Bps: float
    peak_flops: float
    bandwidth_fraction: float = BANDWIDTH_FRACTION
    flops_fraction: float = FLOPS_FRACTION
    bytes_per_value: int = 2
    kv_len: int = 512  # the K/V length a call without one is priced at
    host: HostCost | None = None
    spread: float = 0.0

    @property
    def kv_lens(self) -> list[int]:
        return [self.kv_len]

    @property
    def points(self) -> tuple[CurvePoint, ...]:
        """A few points of the curve at powers of two (what a report or the preset's summary shows); pricing
        never reads them, it calls ``seconds`` at the exact row count."""
        rows = [2**k for k in range(11)]
        return tuple(CurvePoint(self.kv_len, q, self.seconds(q, 1), self.seconds(q, q)) for q in rows)

    @cached_property
    def _terms(self) -> tuple[int, int, int, int, int]:
        """(layers, K/V width, query width, body weights, LM head weights) of the shape, computed once."""
        sh = dict(self.shape)
        h, layers, vocab = sh["hidden_size"], sh["num_hidden_layers"], sh["vocab_size"]
        head_dim = sh.get("head_dim") or h // sh["num_attention_heads"]
        kv_width = 2 * sh["num_key_value_heads"] * head_dim  # keys and values per position and layer
        q_width = sh["num_attention_heads"] * head_dim
        per_layer = h * q_width * 2 + h * kv_width + 3 * h * sh["intermediate_size"]  # q, o; k, v; gate, up, down
        return layers, kv_width, q_width, layers * per_layer, h * vocab

    def seconds(self, rows: int, logit_rows: int | None = None, kv_len: int | None = None) -> float:
        if rows <= 0:
            return 0.0
        logit_rows = rows if logit_rows is None else min(max(logit_rows, 1), rows)
        kv = self.kv_len if kv_len is None else kv_len
        layers, kv_width, q_width, body, head = self._terms
        read = self.bytes_per_value * (body + head + layers * kv_width * (kv + rows))
        flops = 2 * body * rows + 4 * layers * q_width * rows * (kv + rows) + 2 * head * logit_rows
        return max(
            read / (self.bandwidth_Bps * self.bandwidth_fraction), flops / (self.peak_flops * self.flops_fraction)
        )

    def ratio(self, rows: int, kv_len: int | None = None) -> float:
        return self.seconds(rows, kv_len=kv_len) / self.seconds(1, kv_len=kv_len)

    def to_dict(self) -> dict:
        """What a report records of it: the GPU, its peaks and fractions, and a few points (``points``)."""
        return {
            "roofline": self.gpu,
            "bandwidth_Bps": self.bandwidth_Bps,
            "peak_flops": self.peak_flops,
            "bandwidth_fraction": self.bandwidth_fraction,
            "flops_fraction": self.flops_fraction,
            "points": [dataclasses.asdict(p) for p in self.points],
        }

    def label(self) -> str:
        return (
            f"roofline of {self.gpu} ({self.bandwidth_Bps / 1e12:.2f} TB/s x {self.bandwidth_fraction:g}, "
            f"{self.peak_flops / 1e12:.0f} dense bf16 TFLOP/s x {self.flops_fraction:g}; memory and matmul limits at "
            "the exact row count, no launch cost)"
        )


def roofline_curve(
    gpu: str,
    shape: dict,
    kv_lens: list[int],
    bytes_per_value: int = 2,
    bandwidth_fraction: float = BANDWIDTH_FRACTION,
    flops_fraction: float = FLOPS_FRACTION,
) -> tuple[Roofline, str]:
    """(Roofline, label) of ``shape`` on ``gpu`` (``Roofline``), priced at ``kv_lens[0]`` where a call gives no
    K/V length."""
    bandwidth, peak = GPUS[gpu]
    curve = Roofline(
        gpu, tuple(sorted(shape.items())), bandwidth, peak, bandwidth_fraction, flops_fraction, bytes_per_value,
        kv_lens[0] if kv_lens else 512,
    )  # fmt: skip
    return curve, curve.label()


def gpu_rounds_curve(data: dict) -> tuple[CostCurve, str]:
    """(CostCurve, label) from ``benchmarks/gpu_rounds.py buckets``' JSON: each bucket's captured round, logits on
    every row, at the measured K/V length (one length: the curve is flat in K/V length)."""
    kv = int(data["prefix"])
    points = tuple(
        CurvePoint(kv, int(rows), float(r["captured_ms"]) / 1e3, float(r["captured_ms"]) / 1e3)
        for rows, r in data["buckets"].items()
    )
    return CostCurve(points), (
        f"measured on {data['device_name']} ({data['model']}, {data['dtype']}, captured rounds after {kv} "
        "cached positions, benchmarks/gpu_rounds.py)"
    )


def _check_curve(curve: CostCurve, source: str) -> None:
    """A curve file's times finite and positive, its host time finite and non-negative: a NaN or a negated time
    would price every window at NaN or make rows pay for themselves."""
    bad = [
        p
        for p in curve.points
        if not (math.isfinite(p.body_s) and math.isfinite(p.all_s) and p.body_s > 0 and p.all_s > 0)
    ]
    if bad or any(p.rows < 1 or p.kv_len < 0 for p in curve.points):
        what = f"a time of {bad[0].body_s!r} s at {bad[0].rows} rows" if bad else "a row count below 1"
        raise InputError(f"--curve {source}: {what}; every forward time must be a positive number")
    host = curve.host
    if host is not None and not all(math.isfinite(x) and x >= 0 for x in (host.round_s, host.row_s)):
        raise InputError(f"--curve {source}: host time {host.to_dict()} must be finite and non-negative")


def curve_from_source(
    source: str,
    model_shape: str,
    kv_lens: list[int],
    bandwidth_fraction: float = BANDWIDTH_FRACTION,
    flops_fraction: float = FLOPS_FRACTION,
) -> tuple[CostCurve | Roofline, str, bool]:
    """``--curve``: ``roofline:NAME`` (a named GPU at ``model_shape``), or a file: a start-up calibration
    (``<cache>/calibration/curve-*.json``), a saved curve (``lp_runner tune --save-curve``) or the GPU check's
    rounds (``buckets.json``). Returns (curve, label, on a GPU: rounds run at the engine's row buckets).
    A measured curve is made monotone (``CostCurve.monotone``): no row count is priced below a smaller one's cost,
    so one noisy point cannot make rows pay for themselves. Bad input is one ``InputError``."""
    kind, _, arg = source.partition(":")
    if kind == "roofline":
        if arg not in GPUS:
            raise InputError(f"--curve {quote(source)}: unknown GPU; known: {', '.join(GPUS)}")
        curve, label = roofline_curve(
            arg,
            MODEL_SHAPES[model_shape],
            kv_lens,
            bandwidth_fraction=bandwidth_fraction,
            flops_fraction=flops_fraction,
        )
        return curve, label, True
    path = Path(source)
    try:
        data = json.loads(path.read_text())
        if "buckets" in data:
            curve, label = gpu_rounds_curve(data)
            on_gpu = True
        else:
            curve = CostCurve.from_dict(data.get("curve", data))
            host = " with its measured host time" if curve.host is not None else ""
            label, on_gpu = f"measured curve from {path.name}{host}", False
        _check_curve(curve, quote(source))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InputError(
            f"--curve {quote(source)}: not roofline:NAME ({', '.join(GPUS)}) nor a readable curve file "
            f"({quote(str(exc))})"
        ) from None
    monotone = curve.monotone()
    if monotone != curve:
        label += "; made monotone (a smaller row count's cost where a larger one measured cheaper)"
    return monotone, label, on_gpu

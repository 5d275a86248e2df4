"""What a simulated device is made of: a forward-cost curve, an interconnect and a model shape (pure data).

Every figure here is a stated input of the simulation (``studies/simulate.py``), written into its report with
its source; none is measured by this package. A measured curve (``calibration`` file, ``tune --save-curve``, the
GPU check's rounds) replaces the roofline wherever one exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lp_runner.errors import InputError
from lp_runner.tuning.costmodel import CostCurve, CurvePoint

# Named GPUs for the roofline: (memory bandwidth B/s, dense bf16 FLOP/s), from their vendors' data sheets
# (NVIDIA H100 SXM5: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16; H200: 4.8 TB/s HBM3e, same compute; A100 80GB SXM:
# 2.039 TB/s, 312 TFLOP/s).
GPUS: dict[str, tuple[float, float]] = {
    "H100-SXM": (3.35e12, 989e12),
    "H200": (4.8e12, 989e12),
    "A100-80GB-SXM": (2.039e12, 312e12),
}
ROOFLINE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

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
    """A link's all_gather cost: a ring of P ranks takes P - 1 steps, each a latency plus one rank's payload over
    the link's one-direction bandwidth. LP's payload is tiny (a few hundred bytes), so the latency decides."""

    name: str
    latency_s: float  # one step of a small all_gather
    bandwidth_Bps: float  # one direction, per GPU
    source: str

    def all_gather_s(self, world_size: int, payload_bytes: int) -> float:
        if world_size <= 1:
            return 0.0
        return (world_size - 1) * (self.latency_s + payload_bytes / self.bandwidth_Bps)


# Latencies are the order of a small-message all_gather step as nccl-tests report it for each kind of link (not
# measured here); bandwidths are the links' data-sheet figures, one direction.
INTERCONNECTS: dict[str, Interconnect] = {
    "nvlink": Interconnect(
        "NVLink 4 (one node)", 8e-6, 450e9, "H100 SXM data sheet: 900 GB/s both directions; ~8 us per small step"
    ),
    "pcie": Interconnect("PCIe Gen5 x16", 15e-6, 64e9, "PCIe 5.0 x16: 64 GB/s per direction; ~15 us per small step"),
    "infiniband": Interconnect(
        "InfiniBand NDR 400 Gb/s (across nodes)", 25e-6, 50e9, "NDR: 400 Gb/s = 50 GB/s per port; ~25 us per step"
    ),
}


def measured_interconnect(two_rank_us: float) -> Interconnect:
    """The measured 2-rank all_gather of one round (``benchmarks/scaling.py --collective-bench``), assumed to
    take P - 1 such steps at P ranks (the bandwidth term is in the measurement)."""
    return Interconnect(f"measured 2-rank all_gather, {two_rank_us:g} us", 1e-6 * two_rank_us, float("inf"), "given")


def roofline_curve(gpu: str, shape: dict, kv_lens: list[int], bytes_per_value: int = 2) -> tuple[CostCurve, str]:
    """(CostCurve, label): a forward of ``shape`` on ``gpu`` at its memory and matmul limits, max(bytes /
    bandwidth, FLOPs / peak) per (rows, K/V length): the weights and the cached K/V read once, 2 FLOPs per weight
    per row plus attention's 4 per cached position per row and layer; the LM head on one row (``body_s``) or
    every row (``all_s``). No launch, sync or host cost: a lower bound on a real forward.

    Example: on an H200 the llama-8b shape reads 16 GB of weights (3.3 ms) and its matmuls catch up with that
    read near 200 rows: the forward is flat to there (the knee) and linear after."""
    bandwidth, peak = GPUS[gpu]
    h, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    head_dim = shape.get("head_dim") or h // shape["num_attention_heads"]
    kv_width = 2 * shape["num_key_value_heads"] * head_dim  # keys and values per position and layer
    q_width = shape["num_attention_heads"] * head_dim
    per_layer = h * q_width * 2 + h * kv_width + 3 * h * shape["intermediate_size"]  # q, o; k, v; gate, up, down
    body_weights, head = layers * per_layer, h * vocab

    def seconds(rows: int, kv: int, logit_rows: int) -> float:
        read = bytes_per_value * (body_weights + head + layers * kv_width * (kv + rows))
        flops = 2 * body_weights * rows + 4 * layers * q_width * rows * (kv + rows) + 2 * head * logit_rows
        return max(read / bandwidth, flops / peak)

    points = tuple(CurvePoint(kv, q, seconds(q, kv, 1), seconds(q, kv, q)) for kv in kv_lens for q in ROOFLINE_ROWS)
    return CostCurve(points), (
        f"roofline of {gpu} ({bandwidth / 1e12:.2f} TB/s, {peak / 1e12:.0f} dense bf16 TFLOP/s; memory and "
        "matmul limits only, no launch or host cost: a lower bound on the forward)"
    )


def gpu_rounds_curve(data: dict) -> tuple[CostCurve, str]:
    """(CostCurve, label) from ``benchmarks/gpu_rounds.py buckets``' JSON: each bucket's captured round, logits on
    every row, at the measured K/V length (one length: the curve is flat in K/V length)."""
    kv = int(data["prefix"])
    points = tuple(
        CurvePoint(kv, int(rows), r["captured_ms"] / 1e3, r["captured_ms"] / 1e3) for rows, r in data["buckets"].items()
    )
    return CostCurve(points), (
        f"measured on {data['device_name']} ({data['model']}, {data['dtype']}, captured rounds after {kv} "
        "cached positions, benchmarks/gpu_rounds.py)"
    )


def curve_from_source(source: str, model_shape: str, kv_lens: list[int]) -> tuple[CostCurve, str]:
    """``--curve``: ``roofline:NAME`` (a named GPU at ``model_shape``), or a file: a start-up calibration
    (``<cache>/calibration/curve-*.json``), a saved curve (``lp_runner tune --save-curve``) or the GPU check's
    rounds (``buckets.json``). Bad input is one ``InputError``."""
    kind, _, arg = source.partition(":")
    if kind == "roofline":
        if arg not in GPUS:
            raise InputError(f"--curve {source!r}: unknown GPU; known: {', '.join(GPUS)}")
        return roofline_curve(arg, MODEL_SHAPES[model_shape], kv_lens)
    path = Path(source)
    try:
        data = json.loads(path.read_text())
        if "buckets" in data:
            return gpu_rounds_curve(data)
        curve = CostCurve.from_dict(data.get("curve", data))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(
            f"--curve {source!r}: not roofline:NAME ({', '.join(GPUS)}) nor a readable curve file ({exc})"
        ) from None
    host = " with its measured host time" if curve.host is not None else ""
    return curve, f"measured curve from {path.name}{host}"

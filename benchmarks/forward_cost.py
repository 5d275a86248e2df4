"""Cost of one target forward versus packed rows Q (and K/V length), through lp_runner's own adapter.

This is the curve that decides whether lookahead can win on a device: a round of Q rows must buy more tokens
than Q rows cost relative to one. Timings are medians of repeated forwards on a fixed cached prefix, with the
LM head computed for one row (``head=last``) or all rows (``head=all``), as a lookahead round computes it only
for the rows whose logits are used. Measured by ``lp_runner.tuning.costmodel.measure_curve`` (repetitions interleaved
over Q, so a drifting machine bends no part of the curve; CUDA synchronised around each forward), the same
function ``lp_runner tune`` calibrates with.

Every point also shows its distance to this machine's limit (``machine_limits.py``: weights and K/V bytes over
the measured copy bandwidth, or FLOPs over the measured matmul rate, whichever is larger; each rate the better of
a measurement before and one after the curve), so the table says how far the forward is from the hardware, per
row count. The paired columns time each forward right after a copy and a 1024-square matmul (medians of the
pairs' ratios; ``machine_limits.paired_ratios``): this host's bandwidth moves by 2x within minutes and its
matmul rate by a fifth, so a limit measured at another moment says more about the moment than about the forward.
"x limit, paired" is the distance to the larger of the two limits of the forward's own moment, and "compute-bound
pairs" counts the pairs whose compute limit was the larger. FLOPs count the LM head on one row, as the ms column
runs it. ``--compile`` measures the compiled static-shape forward
(``model.compile: on``) instead of the eager one, after its compilation (reported).

    python benchmarks/forward_cost.py --out results/forward_cost            # embedded model, 2 threads
    python benchmarks/forward_cost.py --model /path/to/folder --prefix 300 1000
    python benchmarks/forward_cost.py --random-llama 1b --device cuda --dtype bfloat16 --out results/gpu/forward_cost

``--random-llama 1b`` builds a ~1.2B-parameter Llama-shaped model (Llama-3.2-1B shapes) with random weights
instead of loading one: a forward's cost does not depend on the weight values, so no checkpoint is needed.
``--random-llama tiny`` is a few-layer toy of the same family, for a quick CPU smoke test.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.forward_timing import scratch_region  # noqa: E402
from benchmarks.machine_limits import (  # noqa: E402
    cpu_description,
    forward_bytes,
    forward_flops,
    measure_limits,
    paired_ratios,
)
from lp_runner.backends.adapter import ModelAdapter  # noqa: E402
from lp_runner.backends.cpu.prepack import apply_prepack  # noqa: E402
from lp_runner.backends.staging import Rows  # noqa: E402
from lp_runner.device import synchronizer  # noqa: E402
from lp_runner.models.loading import load_model_and_tokenizer, resolve_model_path  # noqa: E402
from lp_runner.tuning.costmodel import measure_curve  # noqa: E402

DEFAULT_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 56, 64, 96, 120)

# LlamaConfig keyword sets for --random-llama. "1b" has Llama-3.2-1B's shapes (1.24B parameters, tied head).
RANDOM_LLAMA: dict[str, dict[str, int | bool]] = {
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
}


def build_random_llama(size: str, dtype: torch.dtype, device: str | torch.device):
    """A Llama-shaped causal LM with random weights, created directly on ``device`` in ``dtype``.

    ``from_config`` takes ``dtype=`` in transformers 5.x (and late 4.x) and ``torch_dtype=`` in older 4.x; an
    unknown keyword reaches the model's ``__init__`` as a TypeError, so try one, then the other.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**RANDOM_LLAMA[size])
    torch.manual_seed(0)
    model = None
    for kw in ("dtype", "torch_dtype"):
        try:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", **{kw: dtype})
            break
        except TypeError:
            continue
    if model is None:
        raise RuntimeError("AutoModelForCausalLM.from_config accepts neither dtype= nor torch_dtype=")
    if next(model.parameters()).dtype != dtype:  # a transformers that ignored the keyword: cast the weights only
        model = model.to(dtype=dtype)
    return model.to(device).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument(
        "--random-llama",
        choices=sorted(RANDOM_LLAMA),
        help="build a Llama-shaped model with random weights instead of loading --model",
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix", type=int, nargs="+", default=[300])
    ap.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--compile", action="store_true", help="the compiled static-shape forward (model.compile: on)")
    ap.add_argument(
        "--prepack", default="off", choices=("off", "auto", "native", "onednn", "native-bf16"),
        help="the linear layers as model.backend runs them (auto: the faster packed kernel on a CPU, measured; "
        "native-bf16: the memory limit counts the linear weights' bfloat16 bytes)",
    )  # fmt: skip
    ap.add_argument("--out", default="results/forward_cost")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.random_llama:
        model = build_random_llama(args.random_llama, getattr(torch, args.dtype), args.device)
        folder = f"random-llama-{args.random_llama}"
    else:
        path = resolve_model_path(args.model)
        model, _, folder = load_model_and_tokenizer(path, dtype=args.dtype, device=args.device)
    stock = model  # the limits count the checkpoint's weights and FLOPs, whatever kernels run them ...
    weight_size = 2 if args.prepack == "native-bf16" else 0  # ... in the bytes the kernels store them in
    if args.prepack != "off":
        model = copy.deepcopy(stock)
        print(f"linear layers: {apply_prepack(model, args.prepack).kernels}", flush=True)
    adapter = ModelAdapter(model)
    rows = sorted({1, *args.rows})  # Q=1 is every ratio's reference
    sync = synchronizer(adapter.device)
    compile_s = adapter.compile([max(args.prefix) + max(rows)]) if args.compile else 0.0
    before = measure_limits(adapter.device, adapter.dtype)
    curve = measure_curve(adapter, args.prefix, rows, reps=args.reps, sync=sync)
    after = measure_limits(adapter.device, adapter.dtype)
    limits = before.best(after)  # the machine's rates are the best seen around the curve (one slow moment lowers one)
    print(json.dumps({"copy_gb_s before/after": [round(x.copy_gb_s, 1) for x in (before, after)]}), flush=True)
    print(json.dumps({"copy_gb_s": round(limits.copy_gb_s, 1), "matmul_gflop_s": round(limits.matmul_gflop_s, 1)}))
    paired = {}  # (prefix, rows) -> the forwards against the limits of their moments (``paired_ratios``)
    for kv_len in args.prefix:
        cache = scratch_region(adapter, kv_len + max(rows))
        prefix_ids = torch.arange(kv_len) % adapter.vocab_size
        tril = torch.ones(kv_len, kv_len, dtype=torch.bool).tril()
        adapter.run([Rows.of(prefix_ids, torch.arange(kv_len), tril, torch.tensor([kv_len - 1]))], [cache])
        for q in rows:

            def forward(q=q, cache=cache, kv_len=kv_len):
                vis = torch.ones(q, q, dtype=torch.bool).tril()
                adapter.run(
                    [Rows.of(torch.arange(q), torch.arange(kv_len, kv_len + q), vis, torch.tensor([q - 1]))], [cache]
                )
                cache.crop(kv_len)

            paired[(kv_len, q)] = paired_ratios(
                forward,
                forward_bytes(stock, kv_len, weight_size),
                adapter.device,
                reps=args.reps + 4,
                flops=forward_flops(stock, q, kv_len, logit_rows=1),
                dtype=adapter.dtype,
            )
    curves = []
    for p in curve.points:
        one = next(q for q in curve.points if q.kv_len == p.kv_len and q.rows == 1)
        flops = forward_flops(stock, p.rows, p.kv_len, logit_rows=1)  # as body_s runs it: the head on one row
        bound = limits.bound_s(forward_bytes(stock, p.kv_len, weight_size), flops)
        pairs = paired[(p.kv_len, p.rows)]
        row = {
            "prefix": p.kv_len,
            "rows": p.rows,
            "ms_head_last": round(1e3 * p.body_s, 2),
            "ms_head_all": round(1e3 * p.all_s, 2),
            "ratio_head_all": round(p.all_s / one.all_s, 3),
            "limit_ms": round(1e3 * bound, 2),
            "x_limit": round(p.body_s / bound, 2),  # the forward as a round runs it (head on the rows it uses)
            "x_limit_paired": round(statistics.median(r.limit for r in pairs), 2),
            "x_memory_limit_paired": round(statistics.median(r.memory for r in pairs), 2),
            "compute_bound_pairs": f"{sum(r.compute_bound for r in pairs)}/{len(pairs)}",
        }
        curves.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "date": date.today().isoformat(),
        "model": str(folder),
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "cpu": cpu_description(),
        "compiled": args.compile,
        "linear": adapter.backend.kernels,
        "compile_s": round(compile_s, 1),
        "copy_gb_s": round(limits.copy_gb_s, 2),
        "matmul_gflop_s": round(limits.matmul_gflop_s, 1),
        "weights_mb": round(forward_bytes(stock, 0, weight_size) / 1e6, 1),
        "parameters": sum(p.numel() for p in stock.parameters()),
        "x_label": "packed rows Q",
        "y_label": "forward ms",
        "curves": curves,
        "curve": curve.to_dict(),  # lp_runner.tuning.costmodel.CostCurve.from_dict() reads this back (tune --curve)
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    md = [
        f"{report['date']}, {report['cpu']}, {args.device}, {args.dtype}, {args.threads} threads, "
        f"{'compiled (compile ' + str(report['compile_s']) + ' s)' if args.compile else 'eager'}, "
        f"linear layers {report['linear']}; "
        f"weights {report['weights_mb']} MB, copy bandwidth {report['copy_gb_s']} GB/s, "
        f"matmul {report['matmul_gflop_s']} GFLOP/s. limit: max(bytes / bandwidth, FLOPs / matmul rate).",
        "",
        "| prefix | rows Q | ms (head on 1 row) | ms (head on all rows) | ratio to Q=1 | limit ms | x limit "
        "| x limit, paired | x memory limit, paired | compute-bound pairs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    md += [
        f"| {c['prefix']} | {c['rows']} | {c['ms_head_last']} | {c['ms_head_all']} | {c['ratio_head_all']} "
        f"| {c['limit_ms']} | {c['x_limit']} | {c['x_limit_paired']} | {c['x_memory_limit_paired']} "
        f"| {c['compute_bound_pairs']} |"
        for c in curves
    ]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for prefix in args.prefix:
            pts = [c for c in curves if c["prefix"] == prefix]
            ax.plot([c["rows"] for c in pts], [c["ms_head_all"] for c in pts], marker="o", label=f"prefix {prefix}")
            ax.plot([c["rows"] for c in pts], [c["limit_ms"] for c in pts], ls="--", label=f"machine limit, {prefix}")
        ax.set_xlabel(report["x_label"])
        ax.set_ylabel(report["y_label"])
        ax.set_title(f"forward cost, {args.dtype}, {args.device}, {args.threads} threads")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()

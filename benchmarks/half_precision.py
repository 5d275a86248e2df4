"""How often lp_runner in bfloat16 differs from HF greedy and from its own one-row decoding, and why.

    python benchmarks/half_precision.py                                   # bench16, 128 new tokens, bfloat16, CPU
    python benchmarks/half_precision.py --prompt-set heldout24 --out benchmarks/results/half_precision_heldout

A correctness count, not a timing: per prompt, the outputs of

    hf-fp32      HF greedy ``generate`` in float32 (context: what half precision changes at all)
    hf-greedy    HF greedy ``generate`` in the half dtype: the usual oracle
    engine-only  lp_runner's one-row decoding (nothing verified, no window): the engine's own reference
    default      configs/default.yaml as the runner runs it (auto preset, padded rounds)
    wide         the same with lookahead.preset=off: the Jacobi window and 7 candidates, many rows per round

are compared with ``agreement.compare``: identical, or the first differing step and the margin there
between the two tokens in the reference's own teacher-forced logits, in ulps of the dtype, and whether it is
within ``TOLERANCE_ULPS``. The tolerance itself is checked: for each prompt, HF's incremental logits are compared
with one teacher-forced forward of the same sequence (two valid computations of the same rows), and the largest
shift of any logit and of the top-two gap, in ulps, is reported.

Writes ``<out>.json`` (every comparison) and ``<out>.md`` (the table in docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.compare import _answer, _engine_runner, config_policy  # noqa: E402
from benchmarks.machine_limits import cpu_description  # noqa: E402
from benchmarks.prompt_sets import bench16, heldout24  # noqa: E402
from lp_runner.backends.adapter import ModelAdapter  # noqa: E402
from lp_runner.config import GenerationConfig, LookaheadConfig  # noqa: E402
from lp_runner.decoding.engine import LookaheadEngine  # noqa: E402
from lp_runner.decoding.verify.agreement import TOLERANCE_ULPS, compare, prefill_logits, ulp  # noqa: E402
from lp_runner.jobs.prompts import encode, spec_from_obj  # noqa: E402
from lp_runner.models.loading import embedded_model_dir, fetch_embedded_model, load_model_and_tokenizer  # noqa: E402


def _commit() -> str:
    repo = Path(__file__).resolve().parent.parent
    run = lambda *cmd: subprocess.run(cmd, cwd=repo, capture_output=True, text=True).stdout.strip()  # noqa: E731
    head = run("git", "rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if run("git", "status", "--porcelain", "--untracked-files=no") else "")


COMMIT = _commit()  # read at start-up: the code that runs, even if the tree changes during the run
ENGINE_ONLY = LookaheadConfig(7, 5, 0, False, lookahead_branch=False, context_lookup=False)
CONFIG_FILES = {
    "default": "default=configs/default.yaml",
    "wide": "wide=configs/default.yaml+lookahead.preset=off+advanced.lookahead_branch=true",
}
# (method, reference): each pair compared per prompt
PAIRS = [
    ("hf-greedy", "hf-fp32"),
    ("engine-only", "hf-greedy"),
    ("default", "engine-only"),
    ("default", "hf-greedy"),
    ("wide", "engine-only"),
    ("wide", "hf-greedy"),
]


@torch.inference_mode()
def hf_greedy(model, ids: list[int], max_new: int, eos: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy generate: (new tokens, their incremental logits [S, vocab] in the model's dtype)."""
    x = torch.tensor([ids])  # [1, T]
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
        pad_token_id=eos, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    return out.sequences[0, len(ids) :].tolist(), torch.stack([z[0] for z in out.logits])  # [S, vocab]


def rounding_noise(adapter: ModelAdapter, ids: list[int], new: list[int], incremental: torch.Tensor) -> dict:
    """Largest shift between HF's incremental logits and one teacher-forced forward of the same sequence, in ulps
    of each step's top-1 logit: of any logit, and of the gap between the incremental top two."""
    tokens = [*ids, *new]
    q = len(tokens)
    rows = torch.arange(len(ids) - 1, q - 1)  # [S]: the rows that predict new tokens 0..S-1
    visibility = torch.ones(q, q, dtype=torch.bool).tril()  # [Q, Q] causal
    forced = adapter.forward(torch.tensor(tokens), torch.arange(q), visibility, adapter.new_cache(), rows).float()
    inc = incremental.float()  # [S, vocab]
    top2 = inc.topk(2, dim=-1)  # values, indices: [S, 2]
    units = torch.tensor([ulp(v, adapter.dtype) for v in top2.values[:, 0].tolist()])  # [S]
    logit_shift = ((inc - forced).abs().amax(-1) / units).max().item()
    gap_inc = top2.values[:, 0] - top2.values[:, 1]  # [S]
    pair = forced.gather(1, top2.indices)  # [S, 2]
    gap_shift = ((gap_inc - (pair[:, 0] - pair[:, 1])).abs() / units).max().item()
    return {"max_logit_shift_ulps": logit_shift, "max_gap_shift_ulps": gap_shift}


def cell(c: dict) -> str:
    if c["identical"]:
        return "="
    if c["margin_ulps"] is None:
        return f"@{c['position']} (length)"
    text = f"@{c['position']} ({c['margin_ulps']:.1f} ulp)"
    return text if c["within_tolerance"] else f"**{text} OUT**"


def markdown(report: dict) -> str:
    head = ["prompt", *(f"{m} vs {r}" for m, r in PAIRS)]
    lines = [
        f"{report['date']}, commit {report['commit']}, CPU `{report['cpu']}`, torch {report['torch']}, "
        f"{report['dtype']}, {report['threads']} threads, {report['max_new_tokens']} new tokens, "
        f"{report['prompts']}; tolerance "
        f"{report['tolerance_ulps']:g} ulps. `=`: identical; `@i (m ulp)`: first difference at new token i, the "
        "reference's top-two margin there m ulps (within tolerance unless marked OUT). hf-greedy vs hf-fp32: "
        "position only (no half-precision margin applies).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for p in report["prompts_detail"]:
        row = [p["id"]]
        for m, r in PAIRS:
            c = p["comparisons"][f"{m} vs {r}"]
            if r == "hf-fp32":  # position only: a bfloat16 margin says nothing about float32 logits
                row.append("=" if c["identical"] else f"@{c['position']}")
            else:
                row.append(cell(c))
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| pair | identical | differ, within tolerance | differ, outside | first difference (median) |"]
    lines.append("|---|---|---|---|---|")
    for name, s in report["summary"].items():
        lines.append(
            f"| {name} | {s['identical']}/{s['prompts']} | {s['within']} | {s['outside']} | {s['median_position']} |"
        )
    n = report["noise"]
    lines += [
        "",
        f"Rounding noise (HF incremental vs one teacher-forced forward, same tokens): any logit moves at most "
        f"{n['max_logit_shift_ulps']:.2f} ulps, the top-two gap at most {n['max_gap_shift_ulps']:.2f} ulps.",
    ]
    return "\n".join(lines) + "\n"


def summarize(detail: list[dict]) -> dict:
    out = {}
    for m, r in PAIRS:
        name = f"{m} vs {r}"
        cs = [p["comparisons"][name] for p in detail]
        diffs = sorted(c["position"] for c in cs if not c["identical"])
        out[name] = {
            "prompts": len(cs),
            "identical": sum(c["identical"] for c in cs),
            "within": sum((not c["identical"]) and c["within_tolerance"] for c in cs),
            "outside": sum((not c["identical"]) and not c["within_tolerance"] for c in cs),
            "median_position": diffs[len(diffs) // 2] if diffs else None,
        }
        if r == "hf-fp32":  # no half-precision margin: count differences only
            out[name]["within"] = out[name]["outside"] = None
    return out


def write_report(args, folder, policies, detail, noise, total) -> dict:
    report = {
        "date": date.today().isoformat(),
        "cpu": cpu_description(),  # lscpu: name, family/model, vector ISA
        "machine": platform.machine(),
        "torch": torch.__version__,
        "commit": COMMIT,  # the engine's rounding depends on its forward path: results travel with the code
        "dtype": args.dtype,
        "threads": args.threads,
        "model": str(folder),
        "max_new_tokens": args.max_new_tokens,
        "prompts": f"{args.prompt_set}, {len(detail)} of {total} prompts"
        + (f" (--limit {args.limit})" if args.limit else ""),
        "tolerance_ulps": TOLERANCE_ULPS,
        "configs": {
            "engine-only": "LookaheadConfig(7, 5, 0, lookahead_branch=False, context_lookup=False)",
            **{k: v.split("=", 1)[1] for k, v in CONFIG_FILES.items()},
        },  # fmt: skip
        "policies": {name: policy.describe() for name, policy in policies.items()},
        "noise": noise,
        "summary": summarize(detail),
        "prompts_detail": detail,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(markdown(report))
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/half_precision")
    ap.add_argument("--prompt-set", choices=("bench16", "heldout24"), default="bench16")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    # 1 thread: on a shared 2-core machine OpenMP threads spin against other load (tests/test_embedded_exact.py)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    fetch_embedded_model()
    fp32, tok, folder = load_model_and_tokenizer(embedded_model_dir())
    half, _, _ = load_model_and_tokenizer(embedded_model_dir(), dtype=dtype)
    eos = tok.eos_token_id
    if args.prompt_set == "heldout24":  # second turns carry fp32 greedy answers, as in compare.py
        prompts = heldout24(lambda messages: _answer(fp32, tok, messages, args.max_new_tokens))
    else:
        prompts = bench16()
    # HumanEval and MT-bench alternate, so a run stopped early (the report is rewritten after every prompt)
    # still counts both kinds of text
    code, chat = [p for p in prompts if p["set"] == "humaneval"], [p for p in prompts if p["set"] != "humaneval"]
    prompts = [p for pair in zip(code, chat, strict=False) for p in pair] + code[len(chat) :] + chat[len(code) :]
    if args.limit:
        prompts = prompts[: args.limit]

    adapter = ModelAdapter(half)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    runners = {"engine-only": _engine_runner(LookaheadEngine(adapter, ENGINE_ONLY, gen, eos_ids=[eos]))}
    policies = {}
    for key, spec in CONFIG_FILES.items():
        name, policy = config_policy(spec, adapter, half, recalibrate=False)
        engine = LookaheadEngine(adapter, policy.lookahead, gen, [eos], None, policy.row_plan)
        runners[key] = _engine_runner(engine, policy)
        policies[name] = policy

    detail, noise = [], {"max_logit_shift_ulps": 0.0, "max_gap_shift_ulps": 0.0}
    for i, p in enumerate(prompts):
        ids = encode(tok, spec_from_obj({k: v for k, v in p.items() if k != "set"}, p["id"]))
        outs: dict[str, list[int]] = {"hf-fp32": hf_greedy(fp32, ids, args.max_new_tokens, eos)[0]}
        outs["hf-greedy"], logits = hf_greedy(half, ids, args.max_new_tokens, eos)
        settings = {}
        for name, run in runners.items():
            row = run(ids)
            outs[name] = row["out"]
            if "setting" in row:
                settings[name] = row["setting"]
        shift = rounding_noise(adapter, ids, outs["hf-greedy"], logits)
        for k, v in shift.items():
            noise[k] = max(noise[k], v)
        comparisons = {}
        for m, r in PAIRS:
            # against float32, the margin is in float32 ulps: bfloat16 output is not float32 output with ties
            model_r, dtype_r = (fp32, torch.float32) if r == "hf-fp32" else (half, dtype)
            steps = prefill_logits(ModelAdapter(model_r), ids, outs[r])
            comparisons[f"{m} vs {r}"] = compare(outs[r], outs[m], steps, dtype_r).to_dict()
        detail.append(
            {
                "id": p["id"],
                "set": p["set"],
                "prompt_tokens": len(ids),
                "new_tokens": {k: len(v) for k, v in outs.items()},
                "settings": settings,
                "rounding_noise": shift,
                "comparisons": comparisons,
            }
        )
        report = write_report(args, folder, policies, detail, noise, len(prompts))
        print(f"prompt {i + 1}/{len(prompts)} {p['id']}: " + ", ".join(cell(c) for c in comparisons.values()),
              file=sys.stderr, flush=True)  # fmt: skip

    print(markdown(report))


if __name__ == "__main__":
    main()

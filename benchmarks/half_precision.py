"""How often lp_runner in half precision differs from HF greedy and from its own one-row decoding, and why; and
the tolerance that tells a tie from a bug, measured for the model on the device.

    python benchmarks/half_precision.py                                   # bench16, 128 new tokens, bfloat16, CPU
    python benchmarks/half_precision.py --device cuda --limit 8           # the tolerance on a GPU
    python benchmarks/half_precision.py --prompt-set heldout24 --out benchmarks/results/half_precision_heldout

A correctness count, not a timing: per prompt, the outputs of

    hf-fp32      HF greedy ``generate`` in float32 with TF32 off (the exactness oracle; context: what half
                 precision changes at all)
    hf-greedy    HF greedy ``generate`` in the half dtype: the usual oracle
    engine-only  lp_runner's one-row decoding (nothing verified, no window): the engine's own reference
    default      configs/default.yaml as the runner runs it (auto preset, padded rounds)
    wide         the same with lookahead.preset=off: the Jacobi window and 7 candidates, many rows per round

are compared with ``agreement.compare``: at every difference, are the two tokens the reference's teacher-forced
top two, and is their margin within the tolerance (logit units)? After each such tie the method runs again from
the reference's prefix (teacher-forced from it), so every later step is compared too. hf-greedy against hf-fp32:
first difference only (no half-precision tie applies to float32 logits).

The tolerance (unless ``--tolerance`` is given): for each prompt, HF's incremental logits are compared with one
teacher-forced forward of the same sequence (two valid computations of the same rows); the largest shift of the
top-two gap over every prompt and step, times ``agreement.TOLERANCE_FACTOR``, in logit units. It is measured for
the model on ``--device`` before any comparison, and reported beside the counts; ``agreement.MEASURED_TOLERANCES``
keeps the values the tests use.

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
from benchmarks.forward_timing import scratch_region  # noqa: E402
from benchmarks.machine_limits import cpu_description  # noqa: E402
from benchmarks.prompt_sets import bench16, heldout24  # noqa: E402
from lp_runner.backends.adapter import ModelAdapter  # noqa: E402
from lp_runner.backends.staging import Rows  # noqa: E402
from lp_runner.config import GenerationConfig, LookaheadConfig  # noqa: E402
from lp_runner.decoding.engine import LookaheadEngine  # noqa: E402
from lp_runner.decoding.verify.agreement import TOLERANCE_FACTOR, compare, first_difference, prefill_logits  # noqa: E402
from lp_runner.device import set_fp32_precision  # noqa: E402
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
    x = torch.tensor([ids], device=model.device)  # [1, T]
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
        pad_token_id=eos, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    return out.sequences[0, len(ids) :].tolist(), torch.stack([z[0] for z in out.logits])  # [S, vocab]


def rounding_noise(adapter: ModelAdapter, ids: list[int], new: list[int], incremental: torch.Tensor) -> dict:
    """Largest shift between HF's incremental logits and one teacher-forced forward of the same sequence, in logit
    units: of any logit, and of the gap between the incremental top two."""
    tokens = [*ids, *new]
    q = len(tokens)
    rows = torch.arange(len(ids) - 1, q - 1)  # [S]: the rows that predict new tokens 0..S-1
    visibility = torch.ones(q, q, dtype=torch.bool).tril()  # [Q, Q] causal
    forced = adapter.run(
        [Rows.of(torch.tensor(tokens), torch.arange(q), visibility, rows)], [scratch_region(adapter)]
    ).float()
    inc = incremental.float().to(forced.device)  # [S, vocab]
    top2 = inc.topk(2, dim=-1)  # values, indices: [S, 2]
    logit_shift = (inc - forced).abs().amax(-1).max().item()
    gap_inc = top2.values[:, 0] - top2.values[:, 1]  # [S]
    pair = forced.gather(1, top2.indices)  # [S, 2]
    gap_shift = (gap_inc - (pair[:, 0] - pair[:, 1])).abs().max().item()
    return {"max_logit_shift": logit_shift, "max_gap_shift": gap_shift}


def cell(c: dict) -> str:
    if c["identical"]:
        return "="
    first = c["ties"][0]
    if first["other_token"] is None:
        return f"@{first['position']} (length)"
    ties = f", {len(c['ties'])} differences" if len(c["ties"]) > 1 else ""
    text = f"@{first['position']} ({abs(first['margin']):.3f}{ties})"
    if c["exact"]:
        return text
    bad = next((t for t in c["ties"] if not (t["top_two"] and t["within_tolerance"])), None)
    why = "unfinished" if bad is None else ("not top two" if not bad["top_two"] else "beyond tolerance")
    return f"**{text} OUT at {bad['position'] if bad else '?'}: {why}**"


def markdown(report: dict) -> str:
    head = ["prompt", *(f"{m} vs {r}" for m, r in PAIRS)]
    lines = [
        f"{report['date']}, commit {report['commit']}, {report['device_name']}, torch {report['torch']}, "
        f"{report['dtype']}, {report['threads']} threads, {report['max_new_tokens']} new tokens, "
        f"{report['prompts']}; tolerance {report['tolerance']:.3f} logit units ({report['tolerance_source']}). "
        "`=`: identical; `@i (m, k differences)`: first difference at new token i, the reference's teacher-forced "
        "top-two margin there m; every difference a top-two tie within the tolerance, each method resumed from "
        "the reference after each, unless marked OUT. hf-greedy vs hf-fp32: first difference only.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for p in report["prompts_detail"]:
        row = [p["id"]]
        for m, r in PAIRS:
            c = p["comparisons"][f"{m} vs {r}"]
            if r == "hf-fp32":  # position only: a half-precision tie says nothing about float32 logits
                row.append("=" if c["identical"] else f"@{c['position']}")
            else:
                row.append(cell(c))
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| pair | identical | differ, all ties | differ, not | first difference (median) |"]
    lines.append("|---|---|---|---|---|")
    for name, s in report["summary"].items():
        lines.append(
            f"| {name} | {s['identical']}/{s['prompts']} | {s['within']} | {s['outside']} | {s['median_position']} |"
        )
    n = report["noise"]
    lines += [
        "",
        f"Rounding noise (HF incremental vs one teacher-forced forward, same tokens): any logit moves at most "
        f"{n['max_logit_shift']:.3f}, the top-two gap at most {n['max_gap_shift']:.3f} (logit units).",
    ]
    return "\n".join(lines) + "\n"


def summarize(detail: list[dict]) -> dict:
    out = {}
    for m, r in PAIRS:
        name = f"{m} vs {r}"
        cs = [p["comparisons"][name] for p in detail]
        diffs = sorted(c["position"] for c in cs if not c["identical"])
        ties = r != "hf-fp32"  # against float32, differences are counted only: no half-precision tie applies
        out[name] = {
            "prompts": len(cs),
            "identical": sum(c["identical"] for c in cs),
            "within": sum((not c["identical"]) and c["exact"] for c in cs) if ties else None,
            "outside": sum((not c["identical"]) and not c["exact"] for c in cs) if ties else None,
            "median_position": diffs[len(diffs) // 2] if diffs else None,
        }
    return out


def write_report(args, folder, policies, detail, noise, tolerance, total) -> dict:
    device = torch.device(args.device)
    report = {
        "date": date.today().isoformat(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU `{cpu_description()}`",
        "machine": platform.machine(),
        "torch": torch.__version__,
        "commit": COMMIT,  # the engine's rounding depends on its forward path: results travel with the code
        "dtype": args.dtype,
        "threads": args.threads,
        "model": str(folder),
        "max_new_tokens": args.max_new_tokens,
        "prompts": f"{args.prompt_set}, {len(detail)} of {total} prompts"
        + (f" (--limit {args.limit})" if args.limit else ""),
        "tolerance": tolerance,
        "tolerance_source": "as given" if args.tolerance else f"{TOLERANCE_FACTOR:g} x the largest gap shift measured",
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
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where the tolerance is measured")
    ap.add_argument("--tolerance", type=float, default=0.0, help="logit units (default: measured here first)")
    # 1 thread: on a shared 2-core machine OpenMP threads spin against other load (tests/test_embedded_exact.py)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    set_fp32_precision(False)  # the float32 reference is IEEE float32 on a GPU too

    fetch_embedded_model()
    fp32, tok, folder = load_model_and_tokenizer(embedded_model_dir(), device=args.device)
    half, _, _ = load_model_and_tokenizer(embedded_model_dir(), dtype=dtype, device=args.device)
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
    engines = {"engine-only": LookaheadEngine(adapter, ENGINE_ONLY, gen, eos_ids=[eos])}
    runners = {"engine-only": _engine_runner(engines["engine-only"])}
    policies = {}
    for key, spec in CONFIG_FILES.items():
        name, policy = config_policy(spec, adapter, half, recalibrate=False)
        engines[key] = LookaheadEngine(adapter, policy.lookahead, gen, [eos], None, policy.row_plan)
        runners[key] = _engine_runner(engines[key], policy)
        policies[name] = policy

    # the tolerance first: HF's own rounding noise on every prompt, on this device
    encoded = [encode(tok, spec_from_obj({k: v for k, v in p.items() if k != "set"}, p["id"])) for p in prompts]
    hf_half, noise_per_prompt = [], []
    noise = {"max_logit_shift": 0.0, "max_gap_shift": 0.0}
    for ids in encoded:
        out, logits = hf_greedy(half, ids, args.max_new_tokens, eos)
        hf_half.append(out)
        noise_per_prompt.append(shift := rounding_noise(adapter, ids, out, logits))
        for k, v in shift.items():
            noise[k] = max(noise[k], v)
    tolerance = args.tolerance or TOLERANCE_FACTOR * noise["max_gap_shift"]
    print(f"tolerance {tolerance:.3f} logit units (rounding noise {noise})", file=sys.stderr, flush=True)

    def resume(method: str, ids: list[int], reference: list[int]):
        """``method`` run again from the prompt and the reference's first k tokens: its new tokens."""
        if method == "hf-greedy":
            return lambda k: hf_greedy(half, ids + reference[:k], args.max_new_tokens - k, eos)[0]
        return lambda k: engines[method].generate(ids + reference[:k]).output_ids

    detail = []
    for i, (p, ids) in enumerate(zip(prompts, encoded, strict=True)):
        outs: dict[str, list[int]] = {"hf-fp32": hf_greedy(fp32, ids, args.max_new_tokens, eos)[0]}
        outs["hf-greedy"] = hf_half[i]
        settings = {}
        for name, run in runners.items():
            row = run(ids)
            outs[name] = row["out"]
            if "setting" in row:
                settings[name] = row["setting"]
        comparisons = {}
        for m, r in PAIRS:
            if r == "hf-fp32":  # first difference only: float32 logits have no half-precision ties
                at = first_difference(outs[r], outs[m])
                comparisons[f"{m} vs {r}"] = {"identical": at is None, "position": at}
                continue
            steps = prefill_logits(adapter, ids, outs[r])
            got = compare(outs[r], outs[m], steps, tolerance, resume(m, ids, outs[r]))
            comparisons[f"{m} vs {r}"] = got.to_dict()
        detail.append(
            {
                "id": p["id"],
                "set": p["set"],
                "prompt_tokens": len(ids),
                "new_tokens": {k: len(v) for k, v in outs.items()},
                "settings": settings,
                "rounding_noise": noise_per_prompt[i],
                "comparisons": comparisons,
            }
        )
        report = write_report(args, folder, policies, detail, noise, tolerance, len(prompts))
        cells = [
            cell(c) if "ties" in c else ("=" if c["identical"] else f"@{c['position']}") for c in comparisons.values()
        ]
        print(f"prompt {i + 1}/{len(prompts)} {p['id']}: " + ", ".join(cells), file=sys.stderr, flush=True)

    print(markdown(report))


if __name__ == "__main__":
    main()

"""Side by side in one process: HF greedy generate, HF prompt lookup, and lp_runner configurations.

Same model, prompts and threads for every method; after one warm-up generation each, the methods run
interleaved prompt by prompt (a drifting shared machine then slows every method alike), and every lp_runner
output is checked against HF greedy (a mismatch is reported, not hidden).

    python benchmarks/compare.py --out results/compare            # 8 HumanEval + 8 MT-bench, 128 new tokens
    python benchmarks/compare.py --configs lean-g2 --limit 4        # a quicker look
    python benchmarks/compare.py --config-file tuned=configs/tuned-cpu.yaml --lp 2:configs/default.yaml
    python benchmarks/compare.py --sample --configs "" --config-file default=configs/default.yaml

``--sample``: every method samples (temperature 1, no top-k/top-p) instead of decoding greedily, against HF
sampling ``generate``; outputs then differ by construction (exactness of the distribution is what
``tests/decoding/test_sampling_e2e.py`` checks), so the table's ``exact`` column is left empty.

Writes ``<out>.json`` (every figure), ``<out>.md`` (the tables in docs/results.md and the README) and
``<out>.png`` (the plots).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' oracles (``helpers``)

from helpers import bf16_rounded_linears  # noqa: E402

from benchmarks.machine_limits import cpu_description  # noqa: E402
from benchmarks.prompt_sets import bench16, calibration8, heldout24  # noqa: E402
from lp_runner.backends.adapter import ModelAdapter  # noqa: E402
from lp_runner.backends.cpu import native  # noqa: E402
from lp_runner.backends.cpu.prepack import (  # noqa: E402
    KERNELS,
    NATIVE_BF16_KERNEL,
    ONEDNN,
    apply_prepack,
    prepack_linears,
)
from lp_runner.config import GenerationConfig, LookaheadConfig, load_config  # noqa: E402
from lp_runner.decoding.engine import LookaheadEngine  # noqa: E402
from lp_runner.jobs.prompts import encode, spec_from_obj  # noqa: E402
from lp_runner.models.loading import (  # noqa: E402
    default_cache_dir,
    embedded_model_dir,
    fetch_embedded_model,
    load_model_and_tokenizer,
    weights_checksum,
)
from lp_runner.parallel.comm import SoloCommunicator  # noqa: E402
from lp_runner.tuning.acceptance import fingerprint  # noqa: E402
from lp_runner.tuning.policy import RoundPolicy  # noqa: E402

PLAIN = dict(context_lookup=False)  # Lookahead Decoding alone: Jacobi pool (+ its repair by committed text)
CONFIGS: dict[str, LookaheadConfig] = {
    "la-4-3-4": LookaheadConfig(4, 3, 4, False, **PLAIN),
    "la-4-3-4+prompt": LookaheadConfig(4, 3, 4, True, **PLAIN),
    "la-7-5-7": LookaheadConfig(7, 5, 7, False, **PLAIN),
    "la-7-5-7+prompt": LookaheadConfig(7, 5, 7, True, **PLAIN),
    "la-15-5-15": LookaheadConfig(15, 5, 15, False, **PLAIN),
    "la-15-5-15+prompt": LookaheadConfig(15, 5, 15, True, **PLAIN),
    # the Jacobi pool alone, without repair by the committed text (the published algorithm's pool)
    "la-7-5-7-pure": LookaheadConfig(7, 5, 7, False, pool_from_output=False, context_lookup=False),
    # context lookup + Jacobi pool under one budget (configs/lookahead.yaml)
    "ctx-7-5-7": LookaheadConfig(7, 5, 7, False),
    "ctx-15-5-15": LookaheadConfig(15, 5, 15, False),
    "ctx-2-3-2": LookaheadConfig(2, 3, 2, False),
    # context lookup + prompt/output pool, no window rows (configs/default.yaml: the CPU default)
    "lean-g1": LookaheadConfig(7, 5, 1, True, lookahead_branch=False),
    "lean-g2": LookaheadConfig(7, 5, 2, True, lookahead_branch=False),
    # the tuner's first choice: one candidate on at most 2 rows, whatever the match length
    "cap2": LookaheadConfig(7, 5, 1, True, lookahead_branch=False, max_verify_rows=2),
    # ... plus the cap lifted after a 3-token match (context proposals up to 10 tokens)
    "cap2-long": LookaheadConfig(7, 5, 1, True, lookahead_branch=False, max_verify_rows=2, long_match_ngram=3),
    # nothing to verify: one-row decoding through lp_runner's own forward and K/V cache, so a table shows how much
    # of a speedup is the engine's forward itself rather than the tokens that verification adds
    "engine-only": LookaheadConfig(7, 5, 0, False, lookahead_branch=False, context_lookup=False),
}


SAMPLING = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)  # --sample: the same for every method
ROUNDED_BASE = "hf-greedy bf16-rounded"  # HF greedy on the model native-bf16 computes (--bf16-weights)


def hf_generate(model, ids: list[int], max_new: int, eos: int, **kw) -> list[int]:
    x = torch.tensor([ids])
    kw.setdefault("do_sample", False)
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos, **kw,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


def baseline_name(sample: bool) -> str:
    """The HF method every speedup is relative to: plain generate, greedy or sampling like the methods."""
    return "hf-sample" if sample else "hf-greedy"


def run_lp_cli(
    config: str, prompts: list[dict], workers: int, threads: int, max_new: int, sample: bool = False
) -> list[dict]:
    """LP through the real CLI (torchrun, gloo), ``threads`` per rank; a short warm-up prompt goes first and is
    dropped (it absorbs each rank's start-up). Returns one row per prompt, in the rows format of ``main``."""
    with tempfile.TemporaryDirectory() as tmp:
        pfile, ofile = Path(tmp) / "prompts.jsonl", Path(tmp) / "out.jsonl"
        warm = {"id": "warmup", "prompt": "def f(x):"}
        pfile.write_text("".join(json.dumps(p) + "\n" for p in [warm, *prompts]))
        cmd = [
            sys.executable, "-m", "lp_runner", "--config", config, "--prompts", str(pfile), "--output", str(ofile),
            "--set", f"parallel.workers={workers}", "--set", f"model.threads={threads}",
            "--set", f"generation.max_new_tokens={max_new}", "--set", "advanced.progress=false",
        ]  # fmt: skip
        for key, value in (SAMPLING if sample else {}).items():
            cmd += ["--set", f"generation.{key}={str(value).lower()}"]
        repo = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS=str(threads))
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in ofile.read_text().splitlines()][1:]
    return [
        {
            "tokens": r["new_tokens"], "seconds": r["seconds"], "forwards": r["forwards"], "rows": r["stats"]["rows"],
            "rounds": r["stats"]["rounds"], "host_s": r["stats"]["host_s"], "forward_s": r["stats"]["forward_s"],
            "sources": r["stats"].get("sources", {}), "out": r["output_ids"],
        }
        for r in records
    ]  # fmt: skip


def _answer(model, tok, messages: list[dict], max_new: int) -> str:
    """The model's greedy reply to a chat (the first turn a second-turn prompt carries)."""
    ids = encode(tok, spec_from_obj({"id": "turn1", "messages": messages}, "turn1"))
    return tok.decode(hf_generate(model, ids, max_new, tok.eos_token_id), skip_special_tokens=True)


def _hf_row(model, ids: list[int], max_new: int, eos: int, **kw) -> dict:
    t = time.perf_counter()
    out = hf_generate(model, ids, max_new, eos, **kw)
    row = {"tokens": len(out), "seconds": time.perf_counter() - t, "out": out}
    if "prompt_lookup_num_tokens" not in kw:
        row["forwards"] = len(out)  # plain generate: one forward per new token
    return row


def _engine_runner(engine: LookaheadEngine, policy: RoundPolicy | None = None):
    """One method: the engine, and (for a config file) the policy the runner would use, adapting between prompts
    exactly as ``worker.run_prompts`` does."""

    def run(ids: list[int]) -> dict:
        res = engine.generate(ids)
        s = res.stats
        row = {
            "tokens": len(res.output_ids), "seconds": s.seconds, "forwards": s.forwards, "rows": s.rows,
            "padded_rows": s.padded_rows, "rounds": s.rounds, "host_s": s.host_s, "forward_s": s.forward_s,
            "sources": s.sources, "out": res.output_ids,
        }  # fmt: skip
        if policy is not None:
            row["setting"] = policy.describe()["setting"]
            if policy.observe(ids, res.output_ids):
                engine.set_lookahead(policy.lookahead)
        return row

    return run


def config_policy(spec: str, adapter, model, recalibrate: bool) -> tuple[str, RoundPolicy]:
    """``NAME=PATH[+section.key=value...]`` -> (name, the policy the runner builds for that config here)."""
    name, _, rest = spec.partition("=")
    path, *overrides = rest.split("+")
    cfg = load_config(path, [*overrides, *(["advanced.recalibrate=true"] if recalibrate else [])])
    log = lambda m: print(f"{name}: {m}", file=sys.stderr, flush=True)  # noqa: E731
    policy = RoundPolicy.build(
        cfg,
        adapter,
        SoloCommunicator(),
        default_cache_dir(),
        lambda: weights_checksum(model),
        log,
        model_fingerprint=fingerprint(model),  # the stock model's: the adapter's may be repacked
    )
    if policy.calibration is not None:
        log(f"calibration {policy.calibration.source} in {policy.calibration.seconds:.2f} s")
    if policy.auto is not None:
        choice = policy.auto.choice
        log(f"auto preset: {policy.describe()['setting']} ({choice.reason}; acceptance: {choice.acceptance})")
    return name, policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/compare")
    ap.add_argument("--model", default="embedded", help="embedded, qwen-coder (benchmarks/real_model.py) or a path")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names from CONFIGS")
    ap.add_argument("--baselines", default="greedy,prompt_lookup")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts of each set")
    ap.add_argument("--prompt-set", choices=("bench16", "calibration8", "heldout24"), default="bench16")
    ap.add_argument("--recalibrate", action="store_true", help="config files: measure the curve again (first use)")
    ap.add_argument("--sample", action="store_true", help="sample (temperature 1) instead of greedy decoding")
    ap.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
        help="every method in this dtype (HF greedy too); in half precision 'exact' is token identity with HF "
        "greedy in that dtype, which rounding-level ties may break (see benchmarks/half_precision.py)",
    )  # fmt: skip
    ap.add_argument(
        "--config-file", action="append", default=[], metavar="NAME=PATH",
        help="also run a YAML config as the runner would (calibration and auto preset included), e.g. "
        "auto=configs/default.yaml or nopad=configs/default.yaml+advanced.pad_rows=false; repeatable",
    )  # fmt: skip
    ap.add_argument(
        "--lp", action="append", default=[], metavar="P:CONFIG",
        help="also run LP through the CLI under torchrun: P workers with threads/P threads each, e.g. "
        "2:configs/default.yaml; repeatable",
    )  # fmt: skip
    ap.add_argument(
        "--prepack", default="auto", choices=("auto", "native", "onednn", "off"),
        help="lp_runner's linear layers as the runner runs them (model.backend, default auto: the faster packed "
        "kernel on a CPU, measured); the HF and llama.cpp baselines always run the stock model",
    )  # fmt: skip
    ap.add_argument(
        "--torch-linear", default="", metavar="NAMES",
        help="comma-separated CONFIGS names (or config-file names) also run with torch's own linear layers "
        "(model.backend: torch), as '<name> torch-linear': the prepacking's gain side by side",
    )  # fmt: skip
    ap.add_argument(
        "--unfused", default="", metavar="NAMES",
        help="comma-separated CONFIGS names (or config-file names) also run prepacked without sibling fusion "
        "(one product per linear layer), as '<name> unfused': the fusion's gain side by side",
    )  # fmt: skip
    ap.add_argument(
        "--onednn", default="", metavar="NAMES",
        help="comma-separated CONFIGS names (or config-file names) also run on oneDNN's prepacked products "
        "(apply_prepack onednn), as '<name> onednn': the native product's gain side by side",
    )  # fmt: skip
    ap.add_argument(
        "--bf16-weights", default="", metavar="NAMES",
        help="comma-separated CONFIGS names (or config-file names) also run on native products with the linear "
        "weights rounded to bfloat16 (model.backend: native-bf16), as '<name> bf16-weights'; their exactness is "
        "against HF greedy on the model with those rounded weights, run as 'hf-greedy bf16-rounded'",
    )  # fmt: skip
    ap.add_argument(
        "--compiled", default="", metavar="NAMES",
        help="comma-separated CONFIGS names (or config-file names) also run through the compiled static-shape "
        "forward (model.compile: on), as '<name> compiled'; the compile time is in the report",
    )  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.model == "embedded":
        fetch_embedded_model()
        source = embedded_model_dir()
    elif args.model == "qwen-coder":
        from benchmarks.real_model import qwen_coder_gguf

        source = qwen_coder_gguf()
    else:
        source = Path(args.model)
    model, tok, folder = load_model_and_tokenizer(source, dtype=args.dtype)
    eos = tok.eos_token_id
    if args.prompt_set == "heldout24":
        prompts = heldout24(lambda messages: _answer(model, tok, messages, args.max_new_tokens))
    else:
        prompts = bench16() if args.prompt_set == "bench16" else calibration8()
    if args.limit:
        prompts = [p for s in ("humaneval", "mtbench") for p in [q for q in prompts if q["set"] == s][: args.limit]]
    encoded = [
        (p["set"], encode(tok, spec_from_obj({k: v for k, v in p.items() if k != "set"}, p["id"]))) for p in prompts
    ]
    stock_adapter = ModelAdapter(model)  # HF's own linear layers, for --torch-linear
    packed_model = copy.deepcopy(model)  # the baselines keep the stock model
    prepack = apply_prepack(packed_model, args.prepack)
    print(f"lp_runner's linear layers: {prepack.kernels} ({prepack.reason})", file=sys.stderr, flush=True)
    args.prepack_kernels = prepack.kernels
    adapter = ModelAdapter(packed_model)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, **(SAMPLING if args.sample else {}))
    hf_kw = dict(SAMPLING) if args.sample else {}
    base = baseline_name(args.sample)

    # Every method as a callable on one prompt; methods run interleaved, prompt by prompt, so a slow drift of a
    # shared machine hits every method alike instead of whichever happened to run during it.
    runners: dict[str, object] = {}
    for name in args.baselines.split(","):
        if name == "greedy":
            runners[base] = lambda ids: _hf_row(model, ids, args.max_new_tokens, eos, **hf_kw)
        elif name == "prompt_lookup":
            runners["hf-prompt-lookup"] = lambda ids: _hf_row(
                model, ids, args.max_new_tokens, eos, prompt_lookup_num_tokens=10, **hf_kw
            )
        elif name == "llamacpp":  # llama.cpp greedy on the same fp32 weights (benchmarks/llamacpp_ref.py)
            from benchmarks.llamacpp_ref import f32_gguf, llamacpp_runner, same_weights

            if args.sample or args.dtype != "float32":
                raise SystemExit("--baselines llamacpp: fp32 greedy only (it runs the same fp32 weights)")
            if args.model != "embedded" and source.suffix != ".gguf":
                raise SystemExit("--baselines llamacpp: a GGUF model only (embedded, qwen-coder or a .gguf path)")
            f32 = f32_gguf(None if args.model == "embedded" else source, log=lambda m: print(m, file=sys.stderr))
            checked = same_weights(model, f32)
            print(f"llama.cpp: {f32} ({checked} tensors equal to HF's)", file=sys.stderr, flush=True)
            runners["llama.cpp"] = llamacpp_runner(args.threads, args.max_new_tokens, eos, f32)
    settings = {name: CONFIGS[name] for name in args.configs.split(",") if name}
    for name, la in settings.items():
        runners[name] = _engine_runner(LookaheadEngine(adapter, la, gen, eos_ids=[eos]))
    policies: dict[str, dict] = {}
    for item in args.config_file:
        name, policy = config_policy(item, adapter, model, args.recalibrate)
        engine = LookaheadEngine(adapter, policy.lookahead, gen, [eos], None, policy.row_plan)
        runners[name] = _engine_runner(engine, policy)
        policies[name] = policy
    # the same configs on other forwards, side by side: torch's own linear (model.backend: torch), prepacked without
    # sibling fusion (what the default ran before it), and compiled (model.compile: on)
    variants = [("torch-linear", args.torch_linear, stock_adapter)]
    if args.unfused:
        unfused_model = copy.deepcopy(model)
        prepack_linears(unfused_model, fuse=False, kernel=KERNELS[prepack.kernel])
        variants.append(("unfused", args.unfused, ModelAdapter(unfused_model)))
    if args.onednn:
        onednn_model = copy.deepcopy(model)
        prepack_linears(onednn_model, kernel=ONEDNN)
        variants.append(("onednn", args.onednn, ModelAdapter(onednn_model)))
    if args.bf16_weights:  # the oracle: HF greedy on the float32 model with the linear weights rounded
        if args.sample or args.dtype != "float32":
            raise SystemExit("--bf16-weights: fp32 greedy only (native-bf16 multiplies in float32)")
        rounded_model = bf16_rounded_linears(model)
        runners[ROUNDED_BASE] = lambda ids: _hf_row(rounded_model, ids, args.max_new_tokens, eos)
        bf16_model = copy.deepcopy(model)
        prepack_linears(bf16_model, kernel=NATIVE_BF16_KERNEL)
        variants.append(("bf16-weights", args.bf16_weights, ModelAdapter(bf16_model)))
    compile_s = None
    if args.compiled:
        fast = ModelAdapter(packed_model)  # its own adapter: the eager variants' stay eager
        compile_s = fast.compile([max(len(ids) for _, ids in encoded) + args.max_new_tokens + 64])
        print(f"compiled in {compile_s:.1f} s", file=sys.stderr, flush=True)
        variants.append(("compiled", args.compiled, fast))
    for suffix, names, variant_adapter in variants:
        for name in filter(None, names.split(",")):
            if name in settings:
                engine = LookaheadEngine(variant_adapter, settings[name], gen, eos_ids=[eos])
                runners[f"{name} {suffix}"] = _engine_runner(engine)
            elif name in policies:  # as the runner with that forward: its own curve, its own auto choice
                spec = next(item for item in args.config_file if item.partition("=")[0] == name)
                label, policy = config_policy(f"{name} {suffix}={spec.partition('=')[2]}", variant_adapter, model,
                                              args.recalibrate)  # fmt: skip
                engine = LookaheadEngine(variant_adapter, policy.lookahead, gen, [eos], None, policy.row_plan)
                runners[label] = _engine_runner(engine, policy)
                policies[label] = policy
            else:
                raise SystemExit(f"--{suffix}: {name!r} is neither in --configs nor a --config-file name")
    for run in runners.values():
        run(encoded[0][1][:16])  # warm-up
    methods: dict[str, list[dict]] = {name: [] for name in runners}
    for i, (set_name, ids) in enumerate(encoded):
        for name, run in runners.items():
            torch.manual_seed(i)  # HF sampling draws from torch's global generator; lp_runner from its own seed
            methods[name].append({"set": set_name, **run(ids)})
        print(f"prompt {i + 1}/{len(encoded)} done", file=sys.stderr, flush=True)
    outputs = {name: [r["out"] for r in rows] for name, rows in methods.items()}
    for name, rows in methods.items():
        # bf16-weights rows against HF on the rounded model; everything else (that rounded model too: does rounding
        # change HF's own output?) against HF greedy on the stock model
        reference = outputs.get(ROUNDED_BASE if name.endswith(" bf16-weights") else "hf-greedy")
        for i, r in enumerate(rows):
            out = r.pop("out")
            if name not in (base, "hf-prompt-lookup") and not args.sample:  # llama.cpp too: identical to HF?
                r["exact"] = reference is None or out == reference[i]

    for item in args.lp:
        workers, _, config = item.partition(":")
        p = int(workers)
        rows = run_lp_cli(config, [{k: v for k, v in q.items() if k != "set"} for q in prompts], p,
                          max(args.threads // p, 1), args.max_new_tokens, args.sample)  # fmt: skip
        for r, (set_name, _) in zip(rows, encoded, strict=True):
            r["set"] = set_name
        for i, r in enumerate(rows):
            out = r.pop("out")
            if not args.sample:
                r["exact"] = reference is None or out == reference[i]
        name = f"LP P={p} {Path(config).stem}"
        methods[name] = rows
        print(f"{name} done", file=sys.stderr, flush=True)

    report = summarize(methods, args, folder)
    if compile_s is not None:
        report["compile_s"] = round(compile_s, 1)
    for name, policy in policies.items():
        report["methods"][name]["policy"] = policy.describe()
        if policy.auto is not None:
            report["methods"][name]["choices"] = [c.to_dict() for c in policy.auto.history]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(report, out.with_suffix(".png"))
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def _agg(rows: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    secs = sum(r["seconds"] for r in rows)
    d = {"tokens": tokens, "seconds": round(secs, 3), "tokens_per_s": round(tokens / secs, 3)}
    if all("forwards" in r for r in rows):
        d["tokens_per_forward"] = round(tokens / sum(r["forwards"] for r in rows), 3)
    if all("rows" in r for r in rows):
        d["mean_rows"] = round(sum(r["rows"] for r in rows) / sum(r["rounds"] for r in rows), 1)
        d["mean_padded_rows"] = round(sum(r.get("padded_rows", 0) for r in rows) / sum(r["rounds"] for r in rows), 1)
        d["host_share"] = round(sum(r["host_s"] for r in rows) / secs, 4)
    if all("exact" in r for r in rows):  # lp_runner methods and llama.cpp
        d["exact"] = all(r["exact"] for r in rows)
        d["identical"] = f"{sum(r['exact'] for r in rows)}/{len(rows)}"  # prompts token-identical to the base
    return d


def summarize(methods: dict[str, list[dict]], args, folder) -> dict:
    report = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads".strip(),
        "cpu": cpu_description(),  # lscpu: name, family/model, vector ISA
        "dtype": args.dtype,
        "model": str(folder),
        "max_new_tokens": args.max_new_tokens,
        "prompts": f"{args.prompt_set}" + (f", first {args.limit} of each set" if args.limit else ""),
        "order": "interleaved: every method on prompt 1, then every method on prompt 2, ... (LP runs after)",
        "torch": torch.__version__,
        "decoding": "sampling (temperature 1, no top-k / top-p)" if args.sample else "greedy",
        "lp_runner_linear": args.prepack_kernels,  # model.backend of the lp_runner rows (baselines: stock)
        "native_build": native.build_id(),  # the native kernels' library (source, compiler, CPU, flags hash)
        "native_cflags": " ".join(native.extra_flags()),  # $LP_RUNNER_NATIVE_CFLAGS: e.g. the AVX2 tile here
        "methods": {},
    }
    base = report["baseline"] = baseline_name(args.sample)
    greedy = {s: _agg([r for r in methods[base] if s in (r["set"], "all")]) for s in ("humaneval", "mtbench")}
    greedy["all"] = _agg(methods[base])
    for name, rows in methods.items():
        entry = {"all": _agg(rows)}
        for s in ("humaneval", "mtbench"):
            entry[s] = _agg([r for r in rows if r["set"] == s])
        for key in ("all", "humaneval", "mtbench"):
            entry[key]["speedup"] = round(entry[key]["tokens_per_s"] / greedy[key]["tokens_per_s"], 3)
        srcs: dict[str, dict[str, int]] = {}
        for r in rows:
            for k, v in r.get("sources", {}).items():
                d = srcs.setdefault(k, {})
                for kk, vv in v.items():
                    d[kk] = d.get(kk, 0) + vv
        if srcs:
            entry["sources"] = srcs
        report["methods"][name] = entry
    return report


def plot(report: dict, path: Path) -> None:
    """Speedup over HF greedy per method and prompt set (left) and tokens per forward (right); the axes labels
    are recorded in ``report["plot"]`` so the JSON says what the picture shows."""
    report["plot"] = {
        "file": path.name,
        "left": {"x_label": "method", "y_label": f"speedup vs {_base_label(report)} (tokens/s ratio)"},
        "right": {"x_label": "method", "y_label": "tokens per forward"},
    }
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    names = list(report["methods"])
    sets = ("all", "humaneval", "mtbench")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.27
    for k, s in enumerate(sets):
        xs = [i + (k - 1) * width for i in range(len(names))]
        ax1.bar(xs, [report["methods"][n][s]["speedup"] for n in names], width, label=s)
        ax2.bar(xs, [report["methods"][n][s].get("tokens_per_forward", 0) for n in names], width, label=s)
    for ax, side in ((ax1, "left"), (ax2, "right")):
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_xlabel(report["plot"][side]["x_label"])
        ax.set_ylabel(report["plot"][side]["y_label"])
        ax.legend(fontsize=8)
    ax1.axhline(1.0, color="gray", lw=0.8)
    fig.suptitle(f"{report['date']}, {report['machine']}, fp32, {report['max_new_tokens']} new tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _base_label(report: dict) -> str:
    return "HF sampling" if report.get("baseline") == baseline_name(True) else "HF greedy"


def markdown(report: dict) -> str:
    lines = [
        f"{report['date']}, {report.get('cpu', '')} ({report['machine']}), {report.get('dtype', 'float32')}, "
        f"{report['max_new_tokens']} new tokens, "
        + (f"compiled in {report['compile_s']} s, " if "compile_s" in report else "")
        + f"prompts: {report.get('prompts', 'bench16')}, {report.get('decoding', 'greedy')}, "
        + f"lp_runner's linear layers {report.get('lp_runner_linear', 'torch')} (baselines: stock model), "
        + (f"native kernels built with `{report['native_cflags']}`, " if report.get("native_cflags") else "")
        + "methods interleaved per prompt",
        "",
        f"| method | tok/s | speedup vs {_base_label(report)} | HumanEval speedup | MT-bench speedup | tokens/forward "
        "(HE / MT) | mean rows | host share | exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, e in report["methods"].items():
        a, he, mt = e["all"], e["humaneval"], e["mtbench"]
        tpf = (
            f"{a['tokens_per_forward']:.2f} ({he['tokens_per_forward']:.2f} / {mt['tokens_per_forward']:.2f})"
            if "tokens_per_forward" in a
            else "-"
        )
        host = f"{100 * a['host_share']:.1f}%" if "host_share" in a else "-"
        lines.append(
            f"| {name} | {a['tokens_per_s']:.2f} | {a['speedup']:.2f}x | {he['speedup']:.2f}x | {mt['speedup']:.2f}x "
            f"| {tpf} | {a.get('mean_rows', '-')} | {host} | {a.get('identical', a.get('exact', '-'))} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

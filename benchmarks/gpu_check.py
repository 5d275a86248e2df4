"""Helpers for ``benchmarks/gpu_check.sh`` (the prepared check for one lease of a GPU machine).

    python benchmarks/gpu_check.py env --out RES/env.json [--require-cuda]
    python benchmarks/gpu_check.py make-model --size 1b --device cuda --dtype bfloat16 --out DIR --prompts P.jsonl
    python benchmarks/gpu_check.py cli-json --records RES/cli_compiled.jsonl --status ok --out RES/cli_compiled.json
    torchrun --standalone --nproc-per-node=1 benchmarks/gpu_check.py nccl-probe --backend nccl --out RES/nccl.json
    python benchmarks/gpu_check.py summarize --res RES

``env`` fails with one line when torch or transformers is missing or too old. ``make-model`` saves a random-weight
Llama with a small byte-level BPE tokenizer (trained here on a few sentences; the target machine has no network)
into a folder ``python -m lp_runner`` loads like any local model. ``cli-json`` reduces a CLI run's records (even a
cut run's) to its figures: host us and forward ms per round, tokens/s, whether the forward was compiled.
``nccl-probe`` forms a process group through lp_runner's own ``init_process_group`` and times
``TorchCommunicator.all_gather`` (the CLI with one rank uses no process group, so this is what exercises NCCL
there). ``summarize`` needs only the standard library, so it writes ``gpu_check_summary.md`` from whatever JSON
the steps left even when torch could not be imported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MIN_TRANSFORMERS = os.environ.get("GPU_CHECK_MIN_TRANSFORMERS", "5.17")
MAX_TESTED_TRANSFORMERS = "5.25"  # pyproject: transformers>=5.17,<5.25

# Prompts for the CLI runs. "warmup" goes first (CUDA/cuBLAS start-up) and is left out of the summary figures.
PROMPTS = [
    {"id": "warmup", "prompt": "Hello, world."},
    {
        "id": "code",
        "prompt": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    },
    {"id": "prose", "prompt": "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the"},
    {"id": "list", "prompt": "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,"},
    {"id": "chat", "prompt": "Question: what is lookahead decoding?\nAnswer: it guesses several tokens and verifies"},
]

# Text the tokenizer's byte-level BPE is trained on (a handful of merges is enough: the weights are random).
_TOKENIZER_TEXT = [p["prompt"] for p in PROMPTS] + [
    "import torch\nfrom transformers import AutoModelForCausalLM\n",
    "for i in range(10):\n    print(i * i)\n",
    "Lookahead decoding verifies n-grams guessed by Jacobi iteration in the same forward pass.",
]


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def cmd_env(args: argparse.Namespace) -> int:
    info: dict = {"date": datetime.now().isoformat(timespec="seconds"), "python": platform.python_version()}
    info["platform"] = platform.platform()
    try:
        import torch
    except ImportError as exc:
        print(f"error: torch is not importable ({exc}); this check needs the machine's preinstalled torch")
        return 2
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["cudnn"] = torch.backends.cudnn.version()
        try:
            version = torch.cuda.nccl.version()  # a tuple in recent torch, an int in old ones
            info["nccl"] = ".".join(str(x) for x in version) if isinstance(version, tuple) else str(version)
        except Exception as exc:  # torch built without NCCL
            info["nccl"] = f"unavailable ({type(exc).__name__})"
        info["bf16_supported"] = torch.cuda.is_bf16_supported()
    try:
        import transformers
    except ImportError as exc:
        print(f"error: transformers is not importable ({exc}); lp_runner needs transformers>={MIN_TRANSFORMERS}")
        return 2
    info["transformers"] = transformers.__version__
    for name in ("tokenizers", "accelerate", "yaml", "tqdm", "matplotlib"):
        try:
            module = __import__(name)
            info[name] = getattr(module, "__version__", "present")
        except ImportError:
            info[name] = None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(info, indent=2) + "\n")
    for key, value in info.items():
        print(f"{key}: {value}")
    if _version_tuple(transformers.__version__) < _version_tuple(MIN_TRANSFORMERS):
        print(
            f"error: transformers {transformers.__version__} is too old; lp_runner needs >= {MIN_TRANSFORMERS} "
            "(set GPU_CHECK_MIN_TRANSFORMERS to try anyway)"
        )
        return 2
    if _version_tuple(transformers.__version__) >= _version_tuple(MAX_TESTED_TRANSFORMERS):
        print(
            f"note: transformers {transformers.__version__} is newer than lp_runner's tested range "
            f"(<{MAX_TESTED_TRANSFORMERS})"
        )
    missing = [name for name in ("tokenizers", "yaml", "tqdm") if info[name] is None]
    if missing:
        print(f"error: missing Python packages needed by lp_runner: {', '.join(missing)}")
        return 2
    if args.require_cuda and not info["cuda_available"]:
        print(f"error: torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda})")
        return 2
    return 0


def build_tokenizer(vocab_size: int):
    """A byte-level BPE trained on a few sentences, as a transformers fast tokenizer (works offline).

    Its vocabulary (a few hundred tokens) is smaller than the model's: ids the random model emits beyond it
    decode to nothing, which only affects the (meaningless) text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 400),
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TOKENIZER_TEXT * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def cmd_make_model(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.forward_cost import build_random_llama

    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_random_llama(args.size, getattr(torch, args.dtype), args.device)
    build_s = time.perf_counter() - t0
    tokenizer = build_tokenizer(model.config.vocab_size)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id = eos
        cfg.eos_token_id = eos
        cfg.pad_token_id = eos
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if args.prompts:
        Path(args.prompts).parent.mkdir(parents=True, exist_ok=True)
        Path(args.prompts).write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    params = sum(p.numel() for p in model.parameters())
    size_gb = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 1e9
    if args.json:
        info = {"size": args.size, "parameters": params, "dtype": args.dtype, "device": args.device}
        info.update(build_s=round(build_s, 2), saved_gb=round(size_gb, 3), complete=True)
        Path(args.json).write_text(json.dumps(info, indent=2) + "\n")
    print(
        f"random Llama '{args.size}': {params / 1e9:.3f}B parameters, {args.dtype} on {args.device}, built in "
        f"{build_s:.1f}s, saved to {out} ({size_gb:.2f} GB, total {time.perf_counter() - t0:.1f}s); "
        f"tokenizer vocab {len(tokenizer)}"
    )
    return 0


def cmd_nccl_probe(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from lp_runner.device import bind, gpu_count, local_world_size, place, resolve_dist_backend
    from lp_runner.parallel.comm import TorchCommunicator, init_process_group, strings_group

    placement = place(args.device, "float32")  # the rank's device as the CLI resolves it, bound as it binds it
    bind(placement)
    backend = resolve_dist_backend(args.backend, args.device, local_world_size(), gpu_count())
    t0 = time.perf_counter()
    init_process_group(backend, 60.0, placement.device)
    init_s = time.perf_counter() - t0
    comm = TorchCommunicator(placement.collective_device(backend), None, strings_group(60.0), 60.0)
    result: dict = {
        "backend": backend,
        "world_size": comm.world_size,
        "device": str(comm.device),
        "init_s": round(init_s, 3),
        "strings": comm.all_gather_strings(f"rank{comm.rank}"),
        "all_gather_us": {},
    }
    ok = result["strings"] == [f"rank{r}" for r in range(comm.world_size)]
    for length in args.lengths:
        payload = torch.arange(length, dtype=torch.long)
        for _ in range(10):
            comm.all_gather(payload)
        times = []
        for _ in range(args.iters):
            start = time.perf_counter()
            got = comm.all_gather(payload)  # [P, L] on CPU: includes the copies a real round makes
            times.append(time.perf_counter() - start)
        ok = ok and bool((got == payload.unsqueeze(0)).all())
        result["all_gather_us"][str(length)] = round(1e6 * statistics.median(times), 1)
    result["ok"] = ok
    dist.destroy_process_group()
    if comm.rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result))
    return 0 if ok else 1


def cmd_cli_json(args: argparse.Namespace) -> int:
    """A CLI run's figures from its records, as far as they go (a cut run's records are its finished prompts),
    with how the job's forward ran (``policy.compile``: compiled or not, compile seconds, capture seconds)."""
    path = Path(args.records)
    result: dict = {"status": args.status, "records": str(path.name)}
    result["figures"] = _cli_figures(path)
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        lines = []
    policy = next((r["policy"] for r in lines if isinstance(r.get("policy"), dict)), {})
    result["compile"] = policy.get("compile")
    result["complete"] = args.status == "ok"
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


# ----------------------------------------------------------------------------------------------------------
# Summary (standard library only)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _cli_figures(path: Path) -> dict | None:
    """Totals over a CLI output JSONL, the warm-up prompt left out."""
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    records = [r for r in records if r.get("id") != "warmup"]
    if not records:
        return None
    stats = [r.get("stats", {}) for r in records]

    def total(key: str) -> float:
        return sum(float(s.get(key, 0) or 0) for s in stats)

    new, fwd, secs = sum(r["new_tokens"] for r in records), sum(r["forwards"] for r in records), total("seconds")
    return {
        "prompts": len(records),
        "new_tokens": new,
        "forwards": fwd,
        "seconds": round(secs, 3),
        "tokens_per_s": round(new / secs, 2) if secs else 0.0,
        "tokens_per_forward": round(new / fwd, 3) if fwd else 0.0,
        "ms_per_forward": round(1e3 * total("forward_s") / fwd, 2) if fwd else 0.0,
        "forward_share": round(total("forward_s") / secs, 3) if secs else 0.0,
        "host_share": round(total("host_s") / secs, 3) if secs else 0.0,
        "comm_share": round(total("comm_s") / secs, 3) if secs else 0.0,
        "mean_rows": round(total("rows") / total("rounds"), 2) if total("rounds") else 0.0,
        "rounds": int(total("rounds")),
        "host_us_per_round": round(1e6 * total("host_s") / total("rounds"), 1) if total("rounds") else None,
        "forward_ms_per_round": round(1e3 * total("forward_s") / total("rounds"), 3) if total("rounds") else None,
    }


def _load_peaks(path: Path) -> list[float] | None:
    """Each rank's peak host memory at load (MiB) from a CLI output's first record, or None."""
    try:
        first = json.loads(path.read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None
    return first.get("run", {}).get("device", {}).get("load_peak_host_mib_ranks")


STEP_JSONS = {  # the JSON each step of gpu_check.sh leaves, in the order it runs
    "env": ["env.json"],
    "core": ["probe.json", "identity.json", "buckets.json"],
    "make-model": ["make_model.json"],
    "cli-compiled": ["cli_compiled.json"],
    "nccl-probe": ["nccl_probe.json"],
    "buckets-8b-full": ["buckets_8b_full.json"],
    "speed": ["speed.json"],
    "cli-two-ranks": ["cli_two-ranks.json"],
}


def cmd_summarize(args: argparse.Namespace) -> int:
    res = Path(args.res)
    md = [f"# GPU check ({'smoke run' if args.smoke else 'GPU'}), {datetime.now().isoformat(timespec='seconds')}", ""]
    md += [
        "Everything below is also in gpu_check.tar.gz (every step's JSON, logs, steps.tsv). A JSON with "
        "`complete: false` is what its step wrote before it was cut; its `stage` says where.",
        "",
    ]
    steps = res / "steps.tsv"
    if steps.is_file():
        md += ["## Steps", "", "| step | status | exit | seconds | timeout s |", "|---|---|---|---|---|"]
        for line in steps.read_text().splitlines()[1:]:  # below the header line
            md.append("| " + " | ".join(line.split("\t")) + " |")
        md.append("")
    env = _read_json(res / "env.json")
    if env and "status" not in env:
        md += ["## Environment", ""] + [f"- {k}: {v}" for k, v in env.items()] + [""]
    smi = res / "logs" / "nvidia-smi.log"
    if smi.is_file():
        md += ["## nvidia-smi", "", "```", smi.read_text(errors="replace").rstrip()[-4000:], "```", ""]
    md += probe_section(_read_json(res / "probe.json"))
    md += identity_section(_read_json(res / "identity.json"))
    buckets = _read_json(res / "buckets.json")
    if buckets and "buckets" in buckets:
        md += head("## Rounds per row bucket: eager vs captured (Llama-3-8B shape, 4 layers)", buckets)
        md += bucket_lines(buckets) + prefill_lines(buckets)
    cli = _read_json(res / "cli_compiled.json")
    if cli and cli.get("figures"):
        md += cli_section("The CLI's default job, model.compile: on", cli)
    probe = _read_json(res / "nccl_probe.json")
    if probe and "all_gather_us" in probe:
        lat = ", ".join(f"L={k}: {v} us" for k, v in probe.get("all_gather_us", {}).items())
        md += [
            "## Process group probe (torchrun, one rank)",
            "",
            f"backend {probe.get('backend')}, world size {probe.get('world_size')}, device {probe.get('device')}, "
            f"init {probe.get('init_s')} s, TorchCommunicator.all_gather median per call ({lat}), "
            f"results correct: {probe.get('ok')}",
            "",
        ]
    full = _read_json(res / "buckets_8b_full.json")
    if full and "buckets" in full:
        md += head("## Rounds per row bucket: eager vs captured (Llama-3-8B, 32 layers)", full) + bucket_lines(full)
    md += speed_section(_read_json(res / "speed.json"))
    two = _read_json(res / "cli_two-ranks.json")
    if two and two.get("figures"):
        md += cli_section("Two ranks sharing the one device over gloo (CLI)", two)
        peaks = _load_peaks(res / "cli_two-ranks.jsonl")
        if peaks:
            md += [
                "Peak host memory of each rank right after loading the model (MiB): "
                + ", ".join(f"rank {r}: {mib:.0f}" for r, mib in enumerate(peaks)),
                "",
            ]
    missing = [f"{name}: {f}" for name, files in STEP_JSONS.items() for f in files if not (res / f).is_file()]
    if missing:
        md += ["## Missing JSON", "", *[f"- {m}" for m in missing], ""]
    text = "\n".join(md) + "\n"
    (res / "gpu_check_summary.md").write_text(text)
    print(text)
    return 0


def head(title: str, data: dict) -> list[str]:
    return [title, "", f"{data.get('model')}, {data.get('dtype')} on {data.get('device_name')}", ""]


def partial(data: dict) -> list[str]:
    if data.get("complete"):
        return []
    error = f" ({data['error']})" if data.get("error") else ""
    return [
        f"**Partial**: the step stopped during its {data.get('stage')} part{error}; what follows is what it wrote.",
        "",
    ]


def probe_section(probe: dict | None) -> list[str]:
    """TF32 flags after ``device.bind`` and the float32 compile."""
    if not probe or "flags" not in probe:
        return []
    flags = ", ".join(f"{k} = {v}" for k, v in probe["flags"].items())
    compiled = "ok" if probe.get("compile_error") is None else f"failed: {probe['compile_error']}"
    return ["## TF32 and compile probe (device.bind)", "", *partial(probe),
            f"- placement: {probe.get('placement')}", f"- flags after bind: {flags}",
            f"- a float32 matmul compiled: {compiled} ({probe.get('compile_s')} s; largest difference from eager "
            f"{probe.get('max_abs_diff_vs_eager')}); ok: {probe.get('ok')}", ""]  # fmt: skip


def identity_section(identity: dict | None) -> list[str]:
    """fp32 (TF32 off) identity with HF greedy, eager and captured, at two settings."""
    if not identity or "runs" not in identity:
        return []
    md = head("## HF-greedy identity in fp32 (TF32 off)", identity) + partial(identity)
    for name, r in identity["runs"].items():
        differ = ", ".join(f"prompt {k} at token {i}" for k, i in r["first_difference"].items())
        md.append(
            f"- {name} ({r.get('setting')}): identical to HF greedy on {r['identical']} of {identity.get('prompts')} "
            f"prompts{'; first difference: ' + differ if differ else ''}"
        )
    return md + compile_line(identity) + [""]


def prefill_lines(data: dict) -> list[str]:
    """The long prefill's peaks (engine eager, captured, HF generate) and the capacity sweep."""
    md: list[str] = []
    p = data.get("prefill")
    if p:
        md += [
            f"Peak device memory of a {p.get('tokens')}-token prefill (chunks of {p.get('chunk_rows')} rows): "
            "`torch.cuda.max_memory_allocated`, reset before the call; added: the peak less what was allocated before.",
            "",
            "| path | before MiB | peak MiB | added MiB | seconds |",
            "|---|---|---|---|---|",
        ]
        for path in ("eager", "captured", "hf"):
            r = p.get(path, {})
            cells = [r.get(k) for k in ("before_mib", "peak_mib", "added_mib", "seconds")]
            md.append(
                f"| {'HF generate' if path == 'hf' else 'engine ' + path} | " + " | ".join(map(str, cells)) + " |"
            )
        md.append("")
    sweep = data.get("capacity_sweep")
    if sweep:
        sizes = ", ".join(f"{slots} slots: {ms} ms" for slots, ms in sweep["sizes"].items())
        md += [
            f"- Capacity sweep, {sweep['rows']} rows after {sweep['prefix']} cached positions, captured: {sizes} "
            f"(ratio {sweep['ratio']}; about 1 when the round's K/V writes are in place)",
            "",
        ]
    captures = data.get("captures")
    if captures:
        md += ["- CUDA graphs recorded (and recorded again) as each part started: "
               + ", ".join(f"{stage}: {c}" for stage, c in captures.items()), ""]  # fmt: skip
    return md


def cli_section(title: str, data: dict) -> list[str]:
    f = data["figures"]
    comp = data.get("compile") or {}
    return [
        f"## {title}",
        "",
        *(
            [f"**Partial**: the run's status is {data.get('status')}; these are its finished prompts.", ""]
            if not data.get("complete")
            else []
        ),  # fmt: skip
        f"- {f['prompts']} prompts (warm-up left out), {f['new_tokens']} new tokens, {f['rounds']} rounds: "
        f"host {f['host_us_per_round']} us and forward {f['forward_ms_per_round']} ms per round, "
        f"{f['tokens_per_s']} tokens/s, {f['tokens_per_forward']} tokens/forward (random weights)",
        f"- forward: {comp}",
        "",
    ]


def speed_section(speed: dict | None) -> list[str]:
    if not speed or "runs" not in speed:
        return []
    md = head("## Tokens/s against HF greedy", speed)
    md += [
        f"{speed.get('prompts')} prompts after a warm-up one, {speed.get('new_tokens')} new tokens each; "
        f"capture warm-up {speed.get('warm_up_s')} s (not in the figures).",
        "",
        "| run | tokens/s | x HF greedy | same tokens as HF greedy |",
        "|---|---|---|---|",
    ]
    for name, r in speed.get("runs", {}).items():
        md.append(f"| {name} | {r['tokens_per_s']} | {r['vs_hf_greedy']} | {r['same_as_hf_greedy']} |")
    return md + [""] + compile_line(speed) + [""]


def bucket_lines(data: dict) -> list[str]:
    """A buckets JSON's table (wall, device and host time per round, eager and captured), the job's arena check
    and torch's compile counts; a step stopped before its end says where."""
    md = partial(data)
    md += [
        f"After {data.get('prefix')} cached positions, median of {data.get('reps')} rounds each; warm-up (compile "
        f"and capture) {data.get('warm_up_s')} s. Host us: {data.get('host_us_method')}.",
        "",
        "| rows | eager ms | eager device ms | eager host us | captured ms | captured device ms | captured host us "
        "| speed-up | capture s | argmax same | logit max diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rows, r in data.get("buckets", {}).items():
        cells = [rows] + [r.get(k) for k in ("eager_ms", "eager_device_ms", "eager_host_us", "captured_ms")]
        cells += [r.get(k) for k in ("captured_device_ms", "captured_host_us", "speedup", "capture_s", "argmax_same")]
        cells.append(r.get("logit_max_abs_diff"))
        md.append("| " + " | ".join(str(c) for c in cells) + " |")
    md.append("")
    job = data.get("job")
    if job:
        md.append(
            f"- One job of two prompts ({' and '.join(map(str, job['prompt_tokens']))} tokens, {job['new_tokens']} "
            f"new each, {job['setting']}; alone each would get an arena of {' and '.join(map(str, job['arena_slots']))}"
            f" slots), warmed up at the longer one: arena allocations {job['arena_allocations_before']} before, "
            f"{job['arena_allocations_after']} after (ok: {job['ok']}); capture s before {job['capture_s_before']}, "
            f"after {job['capture_s_after']}; seconds captured {job['captured_s']}, eager {job['eager_s']}; tokens "
            f"eager = captured on {job['same_tokens_eager_captured']}"
        )
    md += compile_line(data) + [""]
    return md


def compile_line(data: dict) -> list[str]:
    """torch's counts over a rounds step (``gpu_probes.compile_check``), as one line; none if it has none."""
    check = data.get("compile")
    if not check:
        return []
    return [
        f"- torch's counts over the step: {check['compilations']} compilation(s), {check['cudagraph_skips']} "
        f"CUDA-graph skip(s) (ok: {check['ok']}; one compilation and, on CUDA, no skip expected)"
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("env", help="versions and devices; one-line failure when something is missing")
    p.add_argument("--out", required=True)
    p.add_argument("--require-cuda", action="store_true")
    p = sub.add_parser("make-model", help="save a random-weight Llama + tokenizer folder")
    p.add_argument("--size", default="1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", help="also write the CLI prompts JSONL here")
    p.add_argument("--json", help="write what was made here (parameters, seconds)")
    p = sub.add_parser("nccl-probe", help="process group + all_gather timing (run under torchrun)")
    p.add_argument("--backend", default="nccl")
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 512])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", required=True)
    p = sub.add_parser("cli-json", help="a CLI run's figures from its records")
    p.add_argument("--records", required=True)
    p.add_argument("--status", default="ok", help="the step's status (ok, timeout, failed)")
    p.add_argument("--out", required=True)
    p = sub.add_parser("summarize", help="write gpu_check_summary.md from what the steps left in --res")
    p.add_argument("--res", required=True)
    p.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    handler = {"env": cmd_env, "make-model": cmd_make_model, "nccl-probe": cmd_nccl_probe}
    handler.update({"cli-json": cmd_cli_json, "summarize": cmd_summarize})
    return handler[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

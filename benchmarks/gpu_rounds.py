"""Rounds on a GPU (steps of ``benchmarks/gpu_check.sh``): eager vs captured rounds per row bucket, the default
job and the engine against HF greedy in tokens/s, and HF-greedy identity in fp32 through eager and captured rounds.

    python benchmarks/gpu_rounds.py buckets  --device cuda --dtype bfloat16 --out OUT/rounds_buckets.json
    python benchmarks/gpu_rounds.py speed    --device cuda --dtype bfloat16 --out OUT/rounds_speed.json
    python benchmarks/gpu_rounds.py identity --device cuda --out OUT/rounds_identity.json

The model: ``--model-dir`` (a local folder, e.g. the embedded model's, real weights; its prompts from
``--prompts``, a JSONL of ``{"prompt": text}`` or ``{"messages": [...]}``) or, without one, random weights in
``--shape`` (``embedded``: the embedded model's architecture, so its kernels and launch counts are the real
model's; ``tiny`` for the CPU smoke run) with seeded repetitive token prompts. Every JSON says which
(``model``), and the device's name.

* ``buckets``: one bucketed adapter eager, one compiled (``model.compile``: CUDA graphs on a GPU; on a CPU the same
  compiled code without the capture), each bucket's round timed after a cached prefix (median of ``--reps``, the
  device synchronised around each), the capture seconds per bucket, and whether both give the same argmax row by
  row (in bf16 the two may round a near-tie differently; the fp32 identity below is the exactness check).
* ``speed``: tokens/s over the prompts (the first is a warm-up, left out) of HF greedy ``generate``, HF prompt
  lookup, the engine alone (one row a round: no candidates, no window) eager and captured, and the default job
  (``lookahead.preset: auto``, the calibration made here) eager and captured; each run's tokens compared with HF
  greedy's.
* ``identity``: fp32 (TF32 off), the default job eager and captured against HF greedy, prompt by prompt; exits 1
  on any difference.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lp_runner.backends.adapter import ModelAdapter, causal, crop  # noqa: E402
from lp_runner.config import Config, GenerationConfig, LookaheadConfig  # noqa: E402
from lp_runner.decoding.engine import LookaheadEngine  # noqa: E402
from lp_runner.device import synchronizer  # noqa: E402
from lp_runner.models.loading import weights_checksum  # noqa: E402
from lp_runner.parallel.comm import SoloCommunicator  # noqa: E402
from lp_runner.tuning.calibrate import device_name  # noqa: E402
from lp_runner.tuning.policy import RoundPolicy  # noqa: E402

# The embedded model's architecture (its config.json): random weights in this shape run the same kernels.
EMBEDDED_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
SHAPES = {"embedded": EMBEDDED_SHAPE, "tiny": TINY_SHAPE}
# the engine alone: one row a round, no candidates, no window, no padding (what gpu_check's cli-greedy runs)
ENGINE_ONLY = LookaheadConfig(
    verification_set_size=0, lookahead_branch=False, context_lookup=False, preset="off", pad_rows=False
)


def load_model(args: argparse.Namespace, dtype: torch.dtype):
    """(model, label, tokenizer or None): the folder's model, or random weights in ``args.shape``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if args.model_dir:
        from transformers import AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype, attn_implementation="sdpa")
        return (
            model.to(args.device).eval(),
            f"{args.model_dir} (real weights)",
            AutoTokenizer.from_pretrained(args.model_dir),
        )
    config = LlamaConfig(**SHAPES[args.shape], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.eval(), f"random weights in the {args.shape} model's shape", None


def prompts(args: argparse.Namespace, tokenizer, vocab: int) -> list[list[int]]:
    """Token ids of each prompt: ``--prompts`` (text or chat messages) through the folder's tokenizer, else seeded
    repetitive ids (a block repeated, then a tail: context lookup and the window find candidates, as in real text)."""
    if tokenizer is not None and args.prompts:
        records = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        out = []
        for rec in records[: args.limit + 1]:  # a text prompt, or chat messages through the model's template
            if "messages" in rec:
                ids = tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True, tokenize=True)
                out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
            else:
                out.append(tokenizer(rec["prompt"])["input_ids"])
        return out
    gen = torch.Generator().manual_seed(44)
    out = []
    for _ in range(args.limit + 1):
        block = torch.randint(0, vocab, (16,), generator=gen).tolist()
        out.append(block * 3 + torch.randint(0, vocab, (8,), generator=gen).tolist())
    return out


@torch.inference_mode()
def hf_greedy(model, ids: list[int], new: int, prompt_lookup: int = 0) -> list[int]:
    """HF greedy ``generate``, the whole budget (no EOS): the oracle; with ``prompt_lookup``, HF's prompt lookup.
    Every setting in one generation config (HF refuses a config and loose settings together in the future)."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.pad_token_id = None, 0
    config.max_new_tokens = config.min_new_tokens = new
    config.do_sample, config.num_beams = False, 1
    if prompt_lookup:
        config.prompt_lookup_num_tokens = prompt_lookup
    x = torch.tensor([ids], device=model.device)
    out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
    return out[0, len(ids) :].tolist()


def engine_for(model, adapter: ModelAdapter, la: LookaheadConfig | None, new: int, cache: Path) -> LookaheadEngine:
    """The engine with ``la``, or (None) the default job's setting: the auto preset from this device's curve."""
    gen = GenerationConfig(max_new_tokens=new, stop_on_eos=False)
    if la is not None:
        return LookaheadEngine(adapter, la, gen, [])
    cfg = Config()
    policy = RoundPolicy.build(cfg, adapter, SoloCommunicator(), cache, lambda: weights_checksum(model))
    return LookaheadEngine(adapter, policy.lookahead, gen, [], None, policy.row_plan)


def timed_run(run, items: list[list[int]], sync) -> tuple[list[list[int]], float]:
    """Outputs of ``run`` per prompt and the seconds of all but the first (a warm-up)."""
    outs, total = [], 0.0
    for k, ids in enumerate(items):
        if sync:
            sync()
        start = time.perf_counter()
        outs.append(run(ids))
        if sync:
            sync()
        if k:
            total += time.perf_counter() - start
    return outs, total


def _write(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")


def _header(args: argparse.Namespace, label: str, dtype: torch.dtype) -> dict:
    device = torch.device(args.device)
    return {"device": str(device), "device_name": device_name(device), "dtype": str(dtype), "model": label}


# --------------------------------------------------------------------------------------------------- buckets


@torch.inference_mode()
def cmd_buckets(args: argparse.Namespace) -> int:
    dtype = getattr(torch, args.dtype)
    model, label, _ = load_model(args, dtype)
    sync = synchronizer(torch.device(args.device))
    eager = ModelAdapter(model, bucketed=True)
    captured = ModelAdapter(model, bucketed=True, compile=True)
    warm_s = captured.rounds.warm_up(args.prefix + 64, max_rows=args.warm_rows)
    result = {**_header(args, label, dtype), "prefix": args.prefix, "reps": args.reps, "warm_up_s": round(warm_s, 2)}
    caches = {}
    prefix = torch.arange(args.prefix) % 97
    for adapter in (eager, captured):
        caches[id(adapter)] = cache = adapter.new_cache(args.prefix + max(args.rows), fixed=True)
        adapter.forward(prefix, torch.arange(args.prefix), causal(args.prefix), cache, torch.tensor([0]))
    rows_out = {}
    for rows in args.rows:
        ids = (torch.arange(rows) * 7) % 97
        pos = torch.arange(args.prefix, args.prefix + rows)
        times: dict[int, list[float]] = {id(eager): [], id(captured): []}
        argmax = {}
        for rep in range(args.reps + 1):  # the first is a warm-up (a new K/V width is recorded there)
            for adapter in (eager, captured):
                if sync:
                    sync()
                start = time.perf_counter()
                logits = adapter.forward(ids, pos, causal(rows), caches[id(adapter)], torch.arange(rows))
                if sync:
                    sync()
                if rep:
                    times[id(adapter)].append(time.perf_counter() - start)
                argmax[id(adapter)] = logits.argmax(-1).tolist()
                crop(caches[id(adapter)], args.prefix)
        eager_ms = 1e3 * statistics.median(times[id(eager)])
        captured_ms = 1e3 * statistics.median(times[id(captured)])
        same = sum(a == b for a, b in zip(argmax[id(eager)], argmax[id(captured)], strict=True))
        rows_out[str(rows)] = {
            "eager_ms": round(eager_ms, 3),
            "captured_ms": round(captured_ms, 3),
            "speedup": round(eager_ms / captured_ms, 2),
            "capture_s": round(captured.rounds.capture_s.get(rows, 0.0), 3),
            "argmax_same": f"{same}/{rows}",
        }
        print(f"{rows:4d} rows: eager {eager_ms:8.3f} ms  captured {captured_ms:8.3f} ms  argmax same {same}/{rows}")
    for adapter in (eager, captured):
        adapter.release_cache(caches[id(adapter)])
    result["buckets"] = rows_out
    _write(args.out, result)
    return 0


# ----------------------------------------------------------------------------------------------------- speed


def cmd_speed(args: argparse.Namespace) -> int:
    dtype = getattr(torch, args.dtype)
    model, label, tokenizer = load_model(args, dtype)
    items = prompts(args, tokenizer, model.config.vocab_size)
    sync = synchronizer(torch.device(args.device))
    cache = Path(args.cache_dir)
    eager = ModelAdapter(model, bucketed=True)
    captured = ModelAdapter(model, bucketed=True, compile=True)
    warm_s = captured.rounds.warm_up(max(len(p) for p in items) + args.new + 64, max_rows=args.warm_rows)
    result = {**_header(args, label, dtype), "new_tokens": args.new, "prompts": len(items) - 1}
    result["warm_up_s"] = round(warm_s, 2)
    runs = {
        "hf-greedy": lambda ids: hf_greedy(model, ids, args.new),
        "hf-prompt-lookup": lambda ids: hf_greedy(model, ids, args.new, prompt_lookup=10),
    }
    for name, adapter, la in (
        ("engine-only-eager", eager, ENGINE_ONLY),
        ("engine-only-captured", captured, ENGINE_ONLY),
        ("default-eager", eager, None),
        ("default-captured", captured, None),
    ):
        engine = engine_for(model, adapter, la, args.new, cache)
        runs[name] = lambda ids, engine=engine: engine.generate(ids).output_ids
    reference = None
    table = {}
    for name, run in runs.items():
        outs, seconds = timed_run(run, items, sync)
        if reference is None:
            reference = outs
        new = sum(len(o) for o in outs[1:])
        same = sum(a == b for a, b in zip(outs[1:], reference[1:], strict=True))
        table[name] = {
            "tokens_per_s": round(new / seconds, 1) if seconds else 0.0,
            "seconds": round(seconds, 3),
            "same_as_hf_greedy": f"{same}/{len(outs) - 1}",
        }
        print(f"{name:22s} {table[name]['tokens_per_s']:9.1f} tokens/s  same as HF greedy: {same}/{len(outs) - 1}")
    base = table["hf-greedy"]["tokens_per_s"] or 1.0
    for row in table.values():
        row["vs_hf_greedy"] = round(row["tokens_per_s"] / base, 2)
    result["runs"] = table
    _write(args.out, result)
    return 0


# -------------------------------------------------------------------------------------------------- identity


def cmd_identity(args: argparse.Namespace) -> int:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: TF32 matmuls round to 10 mantissa bits
    torch.backends.cudnn.allow_tf32 = False
    model, label, tokenizer = load_model(args, torch.float32)
    items = prompts(args, tokenizer, model.config.vocab_size)
    cache = Path(args.cache_dir)
    oracle = [hf_greedy(model, ids, args.new) for ids in items]
    eager = ModelAdapter(model, bucketed=True)
    captured = ModelAdapter(model, bucketed=True, compile=True)
    captured.rounds.warm_up(max(len(p) for p in items) + args.new + 64, max_rows=args.warm_rows)
    result = {**_header(args, label, torch.float32), "new_tokens": args.new, "prompts": len(items)}
    ok = True
    for name, adapter in (("default-eager", eager), ("default-captured", captured)):
        engine = engine_for(model, adapter, None, args.new, cache)
        outs = [engine.generate(ids).output_ids for ids in items]
        differ = {
            k: next((i for i, (x, y) in enumerate(zip(o, r, strict=False)) if x != y), min(len(o), len(r)))
            for k, (o, r) in enumerate(zip(outs, oracle, strict=True))
            if o != r
        }
        result[name] = {"identical": len(items) - len(differ), "first_difference": differ}
        ok = ok and not differ
        print(f"{name}: identical to HF greedy on {len(items) - len(differ)} of {len(items)} prompts")
    result["ok"] = ok
    _write(args.out, result)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, handler in (("buckets", cmd_buckets), ("speed", cmd_speed), ("identity", cmd_identity)):
        p = sub.add_parser(name)
        p.set_defaults(handler=handler)
        p.add_argument("--device", default="cuda")
        p.add_argument("--dtype", default="bfloat16", help="buckets, speed (identity is fp32)")
        p.add_argument("--model-dir", default="", help="a local model folder (default: random weights)")
        p.add_argument("--shape", choices=sorted(SHAPES), default="embedded", help="random weights' shape")
        p.add_argument("--prompts", default="", help="JSONL of {'prompt': text} for --model-dir")
        p.add_argument("--limit", type=int, default=4, help="prompts measured (after one warm-up)")
        p.add_argument("--new", type=int, default=128, help="new tokens per prompt")
        p.add_argument("--prefix", type=int, default=512, help="buckets: cached positions before each round")
        p.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 256, 512])
        p.add_argument("--reps", type=int, default=21)
        p.add_argument("--warm-rows", type=int, default=512, help="buckets captured before timing (others at use)")
        p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "lp_runner"), help="calibration cache")
        p.add_argument("--out", required=True)
    args = ap.parse_args()
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())

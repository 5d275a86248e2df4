"""Rounds on a GPU (steps of ``benchmarks/gpu_check.sh``): the decisive checks in one process (``core``), a
model's bucket timings alone (``buckets``) and tokens/s against HF greedy (``speed``).

    python benchmarks/gpu_rounds.py core    --device cuda --shape llama8b --out-dir RESULTS
    python benchmarks/gpu_rounds.py buckets --device cuda --shape llama8b-full --out RESULTS/buckets_8b_full.json
    python benchmarks/gpu_rounds.py speed   --device cuda --dtype bfloat16 --out RESULTS/speed.json

The model: ``--model-dir`` (a local folder, real weights; its prompts from ``--prompts``, a JSONL of
``{"prompt": text}`` or ``{"messages": [...]}``) or, without one, random weights in ``--shape`` (``llama8b``:
Llama-3-8B's architecture cut to 4 layers, built from its config in seconds; ``llama8b-full``: all 32 layers;
``embedded``: the embedded model's architecture; ``tiny`` and ``llama8b-tiny`` for the CPU smoke run) with seeded
repetitive token prompts. Every JSON says which (``model``), and the device's name. Every JSON is written as the
step goes (``complete``: false and the ``stage`` it is in until the end; written whole or not at all), so a step
stopped by its timeout keeps what it measured.

* ``core``, in one process so that the parts share the process's compile state, each part its own JSON:
  - ``probe.json``: the rank's placement bound through ``device.bind`` (``model.dtype: auto``), every TF32 flag
    read back (none may raise), a float32 matmul compiled and compared with eager;
  - ``identity.json``: fp32 with TF32 off, HF greedy against the engine eager and captured, at the auto preset's
    setting and at W 7, N 5, G 7; ``ok`` false on any difference;
  - ``buckets.json``: the ``buckets`` measurements below in ``--dtype``.
  A part that fails is recorded in its JSON (``error``) and the next part runs; exit 1 if any failed.
* ``buckets``: one bucketed adapter eager, one compiled (``model.compile``: CUDA graphs on a GPU; on a CPU the same
  compiled code without the capture), warmed up once at the largest K/V arena the step's rounds need below but the
  long prefill's. Then, in this order:
  - each bucket's round timed after a cached prefix (median of ``--reps``, the device synchronised around each),
    its device time (CUDA events) and host time per round (wall minus device: ``gpu_probes.RoundTimer``), the
    capture seconds per bucket, whether both give the same argmax row by row and the largest difference of
    their logits (in bf16 the two may round differently; the fp32 identity is the exactness check);
  - a job of two prompts (``--job-tokens``; the second needs a larger arena than the first alone would have
    had) through one engine each: the arena's allocations (``KVArena.allocations``) and the capture
    seconds before and after; the count must stay 1 (the warm-up sized the arena for the job's longest prompt);
  - a ``--prefill-tokens`` prompt (8k, cached in chunks of ``PREFILL_CHUNK_ROWS`` rows) through the engine eager
    and captured (the captured adapter warmed up at that prompt's arena first, as a job does) and through HF's
    own ``generate``: the peak device memory of each (``torch.cuda.max_memory_allocated``, reset before);
  - torch's counts over those parts: one compilation of the round, and on CUDA no skipped CUDA-graph capture
    (``gpu_probes.compile_check``); the CUDA graphs recorded as each part starts (``captures``: recorded and
    recorded again, from inductor's cudagraph tree);
  - a capacity sweep: one bucket's captured round at two arena sizes (``capacity_sweep``).
  Exits 1 when the arena grew during the job or the counts are not those.
* ``speed``: tokens/s over the prompts (the first is a warm-up, left out) of HF greedy ``generate``, HF prompt
  lookup, the engine alone (one row a round: no candidates, no window) eager and captured, and the default job
  (``lookahead.preset: auto``, the calibration made here) eager and captured; each run's tokens compared with HF
  greedy's; torch's counts too (``compile``), exit 1 when they are not one compilation and no skipped capture.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.forward_timing import scratch_region  # noqa: E402
from benchmarks.gpu_probes import (  # noqa: E402
    RoundTimer,
    capture_counts,
    compile_check,
    compile_counts,
    host_us,
    peak_memory,
)
from lp_runner.backends.adapter import ModelAdapter, causal  # noqa: E402
from lp_runner.backends.kv_cache import MIN_CAPACITY, static_capacity  # noqa: E402
from lp_runner.backends.staging import Rows  # noqa: E402
from lp_runner.config import Config, GenerationConfig, LookaheadConfig  # noqa: E402
from lp_runner.decoding.engine import LookaheadEngine  # noqa: E402
from lp_runner.decoding.scheduler import PREFILL_CHUNK_ROWS  # noqa: E402
from lp_runner.device import (  # noqa: E402
    bind,
    fp32_precision_readings,
    place,
    set_fp32_precision,
    synchronizer,
)
from lp_runner.errors import first_line  # noqa: E402
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
# Llama-3-8B's architecture (hidden 4096, 32 query heads on 8 K/V heads, MLP 14336, vocabulary 128256, rope theta
# 500000, untied head) cut to 4 layers: the 8B's per-layer kernels and its head, built from the config in seconds
LLAMA8B_SHAPE = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# the same proportions cut for the CPU smoke run: 4 query heads per K/V head, MLP 3.5x, untied head, theta 500000
LLAMA8B_TINY_SHAPE = dict(
    LLAMA8B_SHAPE,
    hidden_size=128,
    intermediate_size=448,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1024,
    max_position_embeddings=4096,
)
# the whole Llama-3-8B: 32 layers (16 GB of bf16 weights), the check's last step, run if time is left
LLAMA8B_FULL_SHAPE = dict(LLAMA8B_SHAPE, num_hidden_layers=32)
SHAPES = {
    "embedded": EMBEDDED_SHAPE,
    "tiny": TINY_SHAPE,
    "llama8b": LLAMA8B_SHAPE,
    "llama8b-tiny": LLAMA8B_TINY_SHAPE,
    "llama8b-full": LLAMA8B_FULL_SHAPE,
}
# the engine alone: one row a round, no candidates, no window, no padding (what gpu_check's cli-greedy runs)
ENGINE_ONLY = LookaheadConfig(
    verification_set_size=0, lookahead_branch=False, context_lookup=False, preset="off", pad_rows=False
)
# the buckets step's job: the default knobs as written (W 7, N 5, G 7; rounds of up to ~100 rows, several buckets
# and K/V widths), without the tuner (its calibration is the speed step's)
JOB_SETTING = LookaheadConfig(preset="off", pad_rows=False)
PREFILL_NEW_TOKENS = 4  # generated after the long prompt: its peak memory is the prefill's
SWEEP_ROWS = 8  # the capacity sweep's bucket: a small round, where a copy of whole layers would show most
SWEEP_FACTOR = 4  # its larger arena, in multiples of the smaller


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
    label = f"random weights in the {args.shape} model's shape ({config.num_hidden_layers} layers)"
    return model.eval(), label, None


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


def _write(path: str | Path, result: dict) -> None:
    """The JSON written whole or not at all (a temporary file renamed over it): a step killed while writing leaves
    the previous version, never a truncated file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)


def _header(args: argparse.Namespace, label: str, dtype: torch.dtype) -> dict:
    device = torch.device(args.device)
    return {"device": str(device), "device_name": device_name(device), "dtype": str(dtype), "model": label}


# --------------------------------------------------------------------------------------------------- buckets


def token_prompt(length: int, vocab: int, seed: int) -> list[int]:
    """``length`` seeded token ids: a block of 16 repeated (the window and context lookup find candidates in it)."""
    block = torch.randint(0, vocab, (16,), generator=torch.Generator().manual_seed(seed)).tolist()
    return (block * (length // 16 + 1))[:length]


def job_capacities(args, captured: ModelAdapter) -> list[int]:
    """Each job prompt's capacity (``LookaheadEngine.capacity``: prompt, new tokens, one round) under the job's
    setting."""
    engine = LookaheadEngine(captured, JOB_SETTING, GenerationConfig(max_new_tokens=args.new), [])
    return [engine.capacity(n) for n in args.job_tokens]


def arena_slots(adapter: ModelAdapter, capacity: int) -> int:
    """The slots of the job arena a generation of ``capacity`` positions needs (``ModelAdapter.arena``: its
    region, the ladder's top past its capacity, to the next power of two and ``MIN_CAPACITY`` more), priced by a
    small scratch arena of the adapter's (the job arena is left as it is)."""
    with adapter.arena(scratch=True) as arena:
        return static_capacity(arena.slots([capacity])) + MIN_CAPACITY


def arena_allocations(adapter: ModelAdapter) -> int:
    """The tensors the adapter's job arena has been allocated as (one more each time a job grew it)."""
    with adapter.arena() as arena:
        return arena.allocations


def warm_up(adapter: ModelAdapter, capacity: int, max_rows: int) -> float:
    """The captured adapter's warm-up at a job of ``capacity`` positions, on its job arena (as a job starts): its
    compilation (``ModelAdapter.compile``) the first time, its warm-up at that size after."""
    if not adapter.compiled:
        return adapter.compile([capacity], max_rows=max_rows)
    return adapter.warm_up([capacity], max_rows=max_rows)


class Report:
    """The step's JSON, rewritten after each part: ``complete`` false and the ``stage`` it is in until ``done``, so
    a step stopped by its timeout leaves what it measured; ``compile``: torch's counts since ``counts``."""

    def __init__(self, path: str, result: dict, counts: dict, device: torch.device) -> None:
        self.path, self.result, self.counts, self.device = path, result, counts, device

    def save(self, stage: str, compiled: bool = True) -> dict:
        """Write the JSON at ``stage`` (the part about to run, or ``done``), with the CUDA graphs recorded so far
        as that part starts (``captures``); ``compiled``: a compiled round has run (before that, counts mean
        nothing)."""
        check = compile_check(self.counts, compile_counts(), self.device) if compiled else None
        self.result.setdefault("captures", {})[stage] = capture_counts(self.device)
        self.result.update(stage=stage, complete=stage == "done", compile=check)
        _write(self.path, self.result)
        return self.result


def bucket_times(args, eager: ModelAdapter, captured: ModelAdapter, timer: RoundTimer) -> dict:
    """Each bucket's round eager and captured after ``--prefix`` cached positions: wall ms, device ms and host us
    (``gpu_probes.RoundTimer``), capture seconds and argmax agreement; printed as they come."""
    caches = {}
    prefix = torch.arange(args.prefix) % 97
    need = args.prefix + max(args.rows)
    lent = contextlib.ExitStack()  # each adapter's job arena, handed back at the end
    for adapter in (eager, captured):
        caches[id(adapter)] = cache = lent.enter_context(adapter.arena([need])).region(need)
        adapter.run([Rows.of(prefix, torch.arange(args.prefix), causal(args.prefix), torch.arange(1))], [cache])
    rows_out = {}
    for rows in args.rows:
        ids = (torch.arange(rows) * 7) % 97
        pos = torch.arange(args.prefix, args.prefix + rows)

        def run(adapter: ModelAdapter, rows=rows, ids=ids, pos=pos) -> torch.Tensor:
            return adapter.run([Rows.of(ids, pos, causal(rows), torch.arange(rows))], [caches[id(adapter)]])

        walls: dict[int, list[float]] = {id(eager): [], id(captured): []}
        devices: dict[int, list[float | None]] = {id(eager): [], id(captured): []}
        ahead = {id(eager): True, id(captured): True}
        argmax, last = {}, {}
        for rep in range(args.reps + 1):  # the first is a warm-up (a new K/V width is recorded there)
            for adapter in (eager, captured):
                seconds, logits = timer.wall(lambda adapter=adapter: run(adapter))
                if rep:
                    walls[id(adapter)].append(seconds)
                argmax[id(adapter)] = logits.argmax(-1).tolist()
                last[id(adapter)] = logits.float().clone()  # [rows, vocab]: a captured output is overwritten
                caches[id(adapter)].crop(args.prefix)
        for adapter in (eager, captured):  # the host twice as far ahead as a whole round takes
            spin = 2 * statistics.median(walls[id(adapter)])
            for _ in range(args.reps):
                seconds, issued, _ = timer.device_time(lambda adapter=adapter: run(adapter), spin)
                devices[id(adapter)].append(seconds)
                ahead[id(adapter)] = ahead[id(adapter)] and issued
                caches[id(adapter)].crop(args.prefix)
        row = {}
        for name, adapter in (("eager", eager), ("captured", captured)):
            device_s = devices[id(adapter)]
            row[f"{name}_ms"] = round(1e3 * statistics.median(walls[id(adapter)]), 3)
            row[f"{name}_device_ms"] = None if None in device_s else round(1e3 * statistics.median(device_s), 3)
            row[f"{name}_host_us"] = host_us(walls[id(adapter)], device_s)
            row[f"{name}_host_ahead"] = ahead[id(adapter)]
        same = sum(a == b for a, b in zip(argmax[id(eager)], argmax[id(captured)], strict=True))
        row["speedup"] = round(row["eager_ms"] / row["captured_ms"], 2)
        row["capture_s"] = round(captured.rounds.capture_s.get(rows, 0.0), 3)
        row["argmax_same"] = f"{same}/{rows}"
        row["logit_max_abs_diff"] = round((last[id(eager)] - last[id(captured)]).abs().max().item(), 6)
        rows_out[str(rows)] = row
        print(
            f"{rows:4d} rows: eager {row['eager_ms']:8.3f} ms (host {row['eager_host_us']} us)  captured "
            f"{row['captured_ms']:8.3f} ms (host {row['captured_host_us']} us)  argmax same {same}/{rows}"
        )
    lent.close()
    return rows_out


def job_check(args, eager: ModelAdapter, captured: ModelAdapter, timer: RoundTimer, vocab: int) -> dict:
    """Two prompts in one job, the second needing a larger arena than the first: the captured adapter's arena
    allocations and capture seconds before and after (warmed up at the job's longest prompt, the arena must not
    grow: ``ok``), each prompt's seconds on either adapter, and whether their tokens agree (bf16: near-ties)."""
    gen = GenerationConfig(max_new_tokens=args.new, stop_on_eos=False)
    items = [token_prompt(n, vocab, seed) for seed, n in enumerate(args.job_tokens)]
    rounds = captured.rounds  # its capture seconds per bucket
    result = {"prompt_tokens": list(args.job_tokens), "new_tokens": args.new, "setting": "W 7, N 5, G 7 (preset off)"}
    result["arena_slots"] = [arena_slots(captured, c) for c in job_capacities(args, captured)]  # each prompt alone
    result["arena_allocations_before"] = arena_allocations(captured)
    result["capture_s_before"] = {str(k): round(v, 3) for k, v in rounds.capture_s.items()}
    outputs = {}
    for name, adapter in (("captured", captured), ("eager", eager)):
        engine = LookaheadEngine(adapter, JOB_SETTING, gen, [])
        seconds = []
        for ids in items:
            t, res = timer.wall(lambda engine=engine, ids=ids: engine.generate(ids))
            seconds.append(round(t, 3))
            outputs.setdefault(name, []).append(res.output_ids)
        result[f"{name}_s"] = seconds
    result["arena_allocations_after"] = arena_allocations(captured)
    result["capture_s_after"] = {str(k): round(v, 3) for k, v in rounds.capture_s.items()}
    same = sum(a == b for a, b in zip(outputs["eager"], outputs["captured"], strict=True))
    result["same_tokens_eager_captured"] = f"{same}/{len(items)}"
    result["ok"] = result["arena_allocations_after"] == result["arena_allocations_before"] == 1
    print(
        f"job of {args.job_tokens} tokens: arena allocations {result['arena_allocations_before']} -> "
        f"{result['arena_allocations_after']}, captured {result['captured_s']} s, tokens same {same}/{len(items)}"
    )
    return result


def prefill_peaks(args, eager: ModelAdapter, captured: ModelAdapter, timer: RoundTimer, vocab: int) -> dict:
    """A ``--prefill-tokens`` prompt (at most the model's context less ``PREFILL_NEW_TOKENS``) through the engine
    alone, eager and captured: the peak device memory of each (``gpu_probes.peak_memory``), its seconds, and the
    captured adapter's warm-up at that prompt's arena (as a job's start-up does) with its allocations after."""
    limit = captured.max_positions or args.prefill_tokens + PREFILL_NEW_TOKENS
    tokens = min(args.prefill_tokens, limit - PREFILL_NEW_TOKENS)
    ids = token_prompt(tokens, vocab, seed=7)
    gen = GenerationConfig(max_new_tokens=PREFILL_NEW_TOKENS, stop_on_eos=False)
    result: dict = {"tokens": tokens, "chunk_rows": PREFILL_CHUNK_ROWS, "new_tokens": PREFILL_NEW_TOKENS}
    outputs = {}
    for name, adapter in (("eager", eager), ("captured", captured)):
        engine = LookaheadEngine(adapter, ENGINE_ONLY, gen, [])
        warm_s = warm_up(adapter, engine.capacity(tokens), args.warm_rows) if adapter.compiled else 0
        (seconds, res), memory = peak_memory(lambda e=engine: timer.wall(lambda: e.generate(ids)), timer.device)
        outputs[name] = res.output_ids
        result[name] = {**memory, "seconds": round(seconds, 3), "warm_up_s": round(warm_s, 2)}
        result[name]["arena_allocations"] = arena_allocations(adapter)
        print(
            f"{tokens}-token prefill, {name}: peak {memory['peak_mib']} MiB (+{memory['added_mib']}), {seconds:.2f} s"
        )
    result["same_tokens_eager_captured"] = outputs["eager"] == outputs["captured"]
    model = eager.model  # HF's own greedy generate on the same prompt: the peak the engine's is set beside
    (seconds, out), memory = peak_memory(
        lambda: timer.wall(lambda: hf_greedy(model, ids, PREFILL_NEW_TOKENS)), timer.device
    )
    result["hf"] = {**memory, "seconds": round(seconds, 3)}
    result["same_tokens_as_hf"] = out == outputs["eager"]
    print(f"{tokens}-token prefill, HF generate: peak {memory['peak_mib']} MiB (+{memory['added_mib']})")
    return result


def capacity_sweep(args, captured: ModelAdapter, timer: RoundTimer) -> dict:
    """One bucket's captured round after the same ``--prefix`` cached positions, in a region of an arena of its
    own at two sizes (the smallest that holds it, and one of ``SWEEP_FACTOR`` times its slots): a round whose K/V writes
    are in place costs the same at both; one that copies whole layers costs in proportion to the arena."""
    rows = min(max(args.rows), SWEEP_ROWS)
    ids, pos = (torch.arange(rows) * 7) % 97, torch.arange(args.prefix, args.prefix + rows)
    prefix = torch.arange(args.prefix) % 97
    result: dict = {"rows": rows, "prefix": args.prefix, "sizes": {}}
    need = args.prefix + rows
    for _ in range(2):
        region = scratch_region(captured, need)
        captured.run([Rows.of(prefix, torch.arange(args.prefix), causal(args.prefix), torch.arange(1))], [region])
        walls = []
        for rep in range(args.reps + 1):  # the first records this arena's graph
            seconds, _ = timer.wall(
                lambda r=region: captured.run([Rows.of(ids, pos, causal(rows), torch.arange(rows))], [r])
            )
            if rep:
                walls.append(seconds)
            region.crop(args.prefix)
        slots = region.arena.capacity
        need = SWEEP_FACTOR * slots  # the next arena: SWEEP_FACTOR times this one
        result["sizes"][str(slots)] = round(1e3 * statistics.median(walls), 3)
        print(f"capacity sweep: {rows} rows on an arena of {slots} slots: {result['sizes'][str(slots)]} ms")
    small, large = result["sizes"].values()
    result["ratio"] = round(large / small, 3) if small else None
    return result


@torch.inference_mode()
def buckets_part(args: argparse.Namespace, model, label: str, dtype: torch.dtype, out: str | Path) -> bool:
    """The buckets measurements on ``model`` (see the module doc), the JSON at ``out`` rewritten after each part;
    whether the arena stayed put during the job and torch's counts are one compilation and no skipped capture.
    The capacity sweep comes last and outside the counts: its arenas of their own are new graphs by design."""
    device = torch.device(args.device)
    counts = compile_counts()  # before this part compiles: its rounds must add one compilation
    vocab = model.config.get_text_config().vocab_size
    timer = RoundTimer(device)
    eager = ModelAdapter(model, bucketed=True)
    captured = ModelAdapter(model, bucketed=True)  # compiled by its warm-up (``warm_up``)
    first, second = job_capacities(args, captured)
    if arena_slots(captured, second) <= arena_slots(captured, first):  # else the job check passes whatever happens
        raise SystemExit(f"--job-tokens {args.job_tokens}: the second prompt must need a larger arena than the first")
    result = {**_header(args, label, dtype), "prefix": args.prefix, "reps": args.reps}
    result["host_us_method"] = (
        "wall time (device synchronised around the round) minus device time (CUDA events around the round's "
        "kernels, queued behind a spin kernel so that no launch waits on the host); medians"
    )
    report = Report(str(out), result, counts, device)
    report.save("warm-up", compiled=False)
    warm_capacity = max(args.prefix + max(args.rows), first, second)  # the bucket timings' cache and the job's
    result["warm_up_s"] = round(warm_up(captured, warm_capacity, args.warm_rows), 2)
    report.save("buckets")
    result["buckets"] = bucket_times(args, eager, captured, timer)
    report.save("job")
    result["job"] = job_check(args, eager, captured, timer, vocab)
    report.save("prefill")
    if args.prefill_tokens:
        result["prefill"] = prefill_peaks(args, eager, captured, timer, vocab)
    check = report.save("capacity-sweep")["compile"]
    print(f"compilations {check['compilations']}, CUDA-graph skips {check['cudagraph_skips']}: ok {check['ok']}")
    result["capacity_sweep"] = capacity_sweep(args, captured, timer)
    result["compile"] = check  # the rounds' counts, the sweep's new arenas left out
    result.setdefault("captures", {})["done"] = capture_counts(device)
    result.update(stage="done", complete=True)
    _write(out, result)
    return bool(check["ok"] and result["job"]["ok"])


@torch.inference_mode()
def cmd_buckets(args: argparse.Namespace) -> int:
    dtype = getattr(torch, args.dtype)
    model, label, _ = load_model(args, dtype)
    return 0 if buckets_part(args, model, label, dtype, args.out) else 1


# ------------------------------------------------------------------------------------------------------ core


def probe_part(args: argparse.Namespace, out: Path) -> bool:
    """TF32 and compile through ``device.bind``: the rank's placement (``model.dtype: auto``, as a job binds it),
    every TF32 flag read back (none may raise: inductor reads the legacy one while compiling, and a raise there
    sends the job's compiled rounds to eager), then a float32 matmul compiled and compared with eager."""
    device = torch.device(args.device)
    placement = place(args.device, "auto")
    bind(placement)
    result: dict = {**_header(args, "a float32 matmul", torch.float32), "placement": placement.describe()}
    result["flags"] = flags = fp32_precision_readings()
    _write(out, {**result, "complete": False, "stage": "compile"})
    a, b = torch.randn(256, 256, device=device), torch.randn(256, 256, device=device)  # [256, 256] each
    start = time.perf_counter()
    try:
        got = torch.compile(lambda x, y: torch.relu(x @ y), fullgraph=True)(a, b)
        result["compile_error"] = None
        result["max_abs_diff_vs_eager"] = (got - torch.relu(a @ b)).abs().max().item()
    except Exception as exc:  # the probe's point: report, never stop the process before the identity part
        result["compile_error"] = first_line(exc)
    result["compile_s"] = round(time.perf_counter() - start, 2)
    result["ok"] = result["compile_error"] is None and "raises" not in flags.values()
    result.update(complete=True, stage="done")
    _write(out, result)
    print(f"probe: flags {flags}; compile {'ok' if result['compile_error'] is None else result['compile_error']}")
    return result["ok"]


@torch.inference_mode()
def identity_part(args: argparse.Namespace, out: Path) -> bool:
    """fp32 with TF32 off (IEEE matmuls: the exactness oracle), HF greedy against the engine eager and captured, at
    the auto preset's setting (calibrated here) and at W 7, N 5, G 7 (``JOB_SETTING``: rounds of up to ~100 rows);
    the JSON rewritten after each run. Whether every output is identical and the counts are one compilation."""
    set_fp32_precision(False)
    device = torch.device(args.device)
    model, label, tokenizer = load_model(args, torch.float32)
    items = prompts(args, tokenizer, model.config.vocab_size)
    result: dict = {**_header(args, label, torch.float32), "new_tokens": args.new, "prompts": len(items)}
    result.update(tf32=fp32_precision_readings(), runs={}, complete=False, stage="hf-greedy")
    _write(out, result)
    oracle = [hf_greedy(model, ids, args.new) for ids in items]
    counts = compile_counts()
    eager = ModelAdapter(model, bucketed=True)
    captured = ModelAdapter(model, bucketed=True)  # compiled by its warm-up (``warm_up``)
    result["stage"] = "warm-up"
    _write(out, result)
    result["warm_up_s"] = round(warm_up(captured, max(len(p) for p in items) + args.new + 64, args.warm_rows), 2)
    ok = True
    for setting, la in (("preset", None), ("W7-N5-G7", JOB_SETTING)):
        for path, adapter in (("eager", eager), ("captured", captured)):
            name = f"{setting}-{path}"
            result["stage"] = name
            _write(out, result)
            engine = engine_for(model, adapter, la, args.new, Path(args.cache_dir))
            outs = [engine.generate(ids).output_ids for ids in items]
            differ = {
                k: next((i for i, (x, y) in enumerate(zip(o, r, strict=False)) if x != y), min(len(o), len(r)))
                for k, (o, r) in enumerate(zip(outs, oracle, strict=True))
                if o != r
            }
            knobs = engine.la
            result["runs"][name] = {
                "identical": len(items) - len(differ),
                "first_difference": differ,
                "setting": f"W {knobs.window_size}, N {knobs.ngram_size}, G {knobs.verification_set_size}",
            }
            ok = ok and not differ
            print(f"identity {name}: identical to HF greedy on {len(items) - len(differ)} of {len(items)} prompts")
    result["compile"] = check = compile_check(counts, compile_counts(), device)
    result["captures"] = capture_counts(device)
    result.update(ok=ok, complete=True, stage="done")
    _write(out, result)
    return ok and check["ok"]


def cmd_core(args: argparse.Namespace) -> int:
    """The check's decisive parts in one process (the compile probe, the fp32 identity, the bf16 buckets), each
    its own JSON under ``--out-dir``, written as it goes. A failed part is recorded and the next one runs."""
    out = Path(args.out_dir)
    ok = True
    for name, part in (
        ("probe", lambda: probe_part(args, out / "probe.json")),
        ("identity", lambda: identity_part(args, out / "identity.json")),
        ("buckets", lambda: buckets_part(args, *_bf16_model(args), out / "buckets.json")),
    ):
        try:
            ok = part() and ok
        except Exception as exc:  # the next part still runs; the JSON says where this one stopped
            print(f"error: the {name} part failed: {first_line(exc)}", flush=True)
            _mark_failed(out / f"{name}.json", name, exc)
            ok = False
    return 0 if ok else 1


def _bf16_model(args: argparse.Namespace) -> tuple:
    """(model, label, dtype) for the buckets part: ``--dtype`` (bf16 on a GPU), TF32 as ``device.bind`` sets it."""
    dtype = getattr(torch, args.dtype)
    set_fp32_precision(torch.device(args.device).type == "cuda")
    model, label, _ = load_model(args, dtype)
    return model, label, dtype


def _mark_failed(path: Path, name: str, exc: BaseException) -> None:
    """The part's JSON with its error (what it wrote before, if anything, kept)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {"step": name}
    data.update(complete=False, error=first_line(exc))
    _write(path, data)


# ----------------------------------------------------------------------------------------------------- speed


def cmd_speed(args: argparse.Namespace) -> int:
    dtype = getattr(torch, args.dtype)
    counts = compile_counts()
    model, label, tokenizer = load_model(args, dtype)
    items = prompts(args, tokenizer, model.config.vocab_size)
    sync = synchronizer(torch.device(args.device))
    cache = Path(args.cache_dir)
    eager = ModelAdapter(model, bucketed=True)
    captured = ModelAdapter(model, bucketed=True)  # compiled by its warm-up (``warm_up``)
    warm_s = warm_up(captured, max(len(p) for p in items) + args.new + 64, args.warm_rows)
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
    result["compile"] = check = compile_check(counts, compile_counts(), torch.device(args.device))
    _write(args.out, result)
    print(f"compilations {check['compilations']}, CUDA-graph skips {check['cudagraph_skips']}: ok {check['ok']}")
    return 0 if check["ok"] else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, handler in (("core", cmd_core), ("buckets", cmd_buckets), ("speed", cmd_speed)):
        p = sub.add_parser(name)
        p.set_defaults(handler=handler)
        p.add_argument("--device", default="cuda")
        p.add_argument("--dtype", default="bfloat16", help="buckets, speed (core's identity part is fp32)")
        p.add_argument("--model-dir", default="", help="a local model folder (default: random weights)")
        p.add_argument("--shape", choices=sorted(SHAPES), default="embedded", help="random weights' shape")
        p.add_argument("--prompts", default="", help="JSONL of {'prompt': text} for --model-dir")
        p.add_argument("--limit", type=int, default=4, help="prompts measured (after one warm-up)")
        p.add_argument("--new", type=int, default=128, help="new tokens per prompt")
        p.add_argument("--prefix", type=int, default=512, help="buckets: cached positions before each round")
        p.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 256, 512])
        p.add_argument("--reps", type=int, default=21)
        p.add_argument("--warm-rows", type=int, default=512, help="buckets captured before timing (others at use)")
        p.add_argument("--job-tokens", type=int, nargs=2, default=[64, 1200], help="buckets: the job's two prompts")
        p.add_argument("--prefill-tokens", type=int, default=8192, help="buckets: the long prompt (0: none)")
        p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "lp_runner"), help="calibration cache")
        if name == "core":
            p.add_argument("--out-dir", required=True, help="probe.json, identity.json, buckets.json go here")
        else:
            p.add_argument("--out", required=True)
    args = ap.parse_args()
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())

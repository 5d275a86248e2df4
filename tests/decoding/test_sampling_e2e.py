"""Sampling end to end: the joint distribution of the first 3 generated tokens equals the model's, exactly.

A tiny Llama with an 8-token vocabulary and a sharpened LM head (so the distribution is far from uniform and a
biased verifier would show) gives the exact joint p(x1, x2, x3 | prompt) by enumeration with plain HF forwards and
HF's own warpers. lp_runner draws many samples with a repetitive prompt and the prompt pool plus context lookup,
so candidates are verified from the first round on (asserted). The total-variation distance between the empirical
and exact joints must stay under E[TV] + t, where E[TV] <= 1/2 sum_k sqrt(p_k (1 - p_k) / n) and, by McDiarmid
(one sample moves TV by at most 1/n), P(TV > E[TV] + t) <= exp(-2 n t^2): t is set for a 1e-6 false-failure rate.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from dist_helpers import env_with_repo, read_jsonl, torchrun_cmd
from helpers import tiny_model
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.config import GenerationConfig, LookaheadConfig
from lp_runner.decoding.engine import LookaheadEngine
from lp_runner.decoding.verify.sampling import warp_logits

VOCAB = 8
WORDS = [f"w{i}" for i in range(VOCAB)]
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]  # repetitive: the prompt pool and context lookup propose candidates
SETTINGS = dict(temperature=0.8, top_k=6, top_p=0.95)
FALSE_FAILURE = 1e-6


def _model() -> LlamaForCausalLM:
    model = tiny_model(
        "llama", 11, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=0,
    )  # fmt: skip
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # sharpen: logits of a few units instead of ~0
    return model


def exact_joint(model: LlamaForCausalLM) -> dict[tuple[int, int, int], float]:
    """p(x1, x2, x3 | PROMPT) under the warped target, by enumeration with plain batched HF forwards."""

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:  # [B, V]
        with torch.no_grad():
            logits = model(torch.tensor(prefixes)).logits[:, -1]  # [B, V]
        return warp_logits(logits, **SETTINGS)

    joint = {}
    p1 = next_probs([PROMPT])[0]
    seconds = [PROMPT + [a] for a in range(VOCAB)]
    p2 = next_probs(seconds)  # [V, V]
    thirds = [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]
    p3 = next_probs(thirds).reshape(VOCAB, VOCAB, VOCAB)
    for a, b, c in itertools.product(range(VOCAB), repeat=3):
        joint[(a, b, c)] = float(p1[a] * p2[a, b] * p3[a, b, c])
    return joint


def tv_bound(p: dict, n: int) -> float:
    expected = 0.5 * sum(math.sqrt(q * (1 - q) / n) for q in p.values())
    return expected + math.sqrt(math.log(1 / FALSE_FAILURE) / (2 * n))


def tv(p: dict, counts: dict, n: int) -> float:
    keys = set(p) | set(counts)
    return 0.5 * sum(abs(p.get(k, 0.0) - counts.get(k, 0) / n) for k in keys)


def test_single_worker_sampling_matches_exact_joint():
    model = _model()
    p = exact_joint(model)
    assert max(p.values()) > 0.05  # far from uniform (1/512): a biased verifier would show
    gen = GenerationConfig(max_new_tokens=3, do_sample=True, seed=1234, **SETTINGS)
    engine = LookaheadEngine(ModelAdapter(model), LookaheadConfig(3, 4, 3, True), gen, eos_ids=[])
    n = 6000
    counts: dict[tuple, int] = {}
    verified = rounds = accepted = 0
    for _ in range(n):
        res = engine.generate(PROMPT)
        counts[tuple(res.output_ids)] = counts.get(tuple(res.output_ids), 0) + 1
        verified += res.stats.verified_rounds
        rounds += res.stats.rounds
        accepted += res.stats.accepted_tokens
    # Guard: verification happened inside the enumerated positions, and accepted tokens.
    assert verified / rounds > 0.5, verified / rounds
    assert accepted / n > 0.3, accepted / n
    distance, bound = tv(p, counts, n), tv_bound(p, n)
    print(f"TV {distance:.4f} bound {bound:.4f} verified share {verified / rounds:.2f} accepted/gen {accepted / n:.2f}")
    assert distance < bound


def test_seeded_sampling_is_reproducible():
    model = _model()
    gen = GenerationConfig(max_new_tokens=12, do_sample=True, seed=7, **SETTINGS)
    runs = [LookaheadEngine(ModelAdapter(model), LookaheadConfig(3, 4, 3), gen, eos_ids=[]) for _ in range(2)]
    a = [runs[0].generate(PROMPT).output_ids for _ in range(3)]
    b = [runs[1].generate(PROMPT).output_ids for _ in range(3)]
    assert a == b
    assert len({tuple(x) for x in a}) > 1  # successive generations use fresh streams


def test_keyed_sampling_does_not_depend_on_earlier_generations():
    """A job keys each prompt's streams by its id, so ``--resume`` (which skips the prompts already written)
    samples the remaining prompts exactly as the uninterrupted run did."""
    model = _model()
    gen = GenerationConfig(max_new_tokens=12, do_sample=True, seed=7, **SETTINGS)
    full = LookaheadEngine(ModelAdapter(model), LookaheadConfig(3, 4, 3), gen, eos_ids=[])
    outputs = {key: full.generate(PROMPT, sample_key=key).output_ids for key in ("a", "b", "c")}
    resumed = LookaheadEngine(ModelAdapter(model), LookaheadConfig(3, 4, 3), gen, eos_ids=[])
    assert resumed.generate(PROMPT, sample_key="c").output_ids == outputs["c"]  # "a" and "b" never ran here
    assert len({tuple(x) for x in outputs.values()}) > 1  # the keys name different streams


def _tiny_folder(path: Path) -> Path:
    """The same tiny model with a word-level tokenizer, so the CLI can load it: "w1 w2" -> [1, 2]."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")
    _model().save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.mark.slow
def test_lp_two_workers_sampling_matches_exact_joint(tmp_path):
    folder = _tiny_folder(tmp_path / "tiny8")
    p = exact_joint(_model())
    n = 2500
    text = " ".join(WORDS[t] for t in PROMPT)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": text}) + "\n" for i in range(n)))
    out = tmp_path / "o.jsonl"
    args = [
        "--prompts", str(prompts), "--output", str(out), "--set", f"model.path={folder}",
        "--set", "generation.do_sample=true", "--set", "generation.max_new_tokens=3",
        "--set", f"generation.temperature={SETTINGS['temperature']}", "--set", f"generation.top_k={SETTINGS['top_k']}",
        "--set", f"generation.top_p={SETTINGS['top_p']}", "--set", "generation.seed=99",
        "--set", "lookahead.window_size=3", "--set", "lookahead.ngram_size=4",
        "--set", "lookahead.verification_set_size=3", "--set", "model.threads=1", "--set", "advanced.progress=false",
        "--set", "lookahead.preset=off",  # the window under LP, as written
    ]  # fmt: skip
    proc = subprocess.run(torchrun_cmd(2, *args), env=env_with_repo(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(out)
    assert len(records) == n and records[0]["prompt_ids"] == PROMPT and records[0]["workers"] == 2
    counts: dict[tuple, int] = {}
    for r in records:
        counts[tuple(r["output_ids"])] = counts.get(tuple(r["output_ids"]), 0) + 1
    verified = sum(r["stats"]["verified_rounds"] for r in records) / sum(r["stats"]["rounds"] for r in records)
    assert verified > 0.5
    assert sum(r["stats"]["accepted_tokens"] for r in records) / n > 0.3
    distance, bound = tv(p, counts, n), tv_bound(p, n)
    print(f"P=2 TV {distance:.4f} bound {bound:.4f}")
    assert distance < bound

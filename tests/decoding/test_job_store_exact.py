"""The job store's proposals are verified like any other: a job's outputs equal HF greedy, prompt after prompt,
while the store (``lookahead.pool_scope: job``) grows from the earlier ones."""

from __future__ import annotations

import pytest
from dist_helpers import run_job
from helpers import hf_greedy, humaneval_prompts, tiny_model

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.config import GenerationConfig, LookaheadConfig
from lp_runner.decoding.engine import LookaheadEngine


@pytest.mark.parametrize("family", ["llama"])
def test_tiny_job_is_exact(family):
    """A 4-prompt job on a tiny random model: every output equals HF greedy, and the store's candidates were
    verified (its second and later prompts repeat earlier text)."""
    model = tiny_model(family)
    base = [5, 9, 3, 7, 11, 2, 8]
    prompts = [base, [4, *base], base[2:], [1, 1, *base]]
    la = LookaheadConfig(window_size=3, ngram_size=3, verification_set_size=3, pool_scope="job")
    engine = LookaheadEngine(ModelAdapter(model), la, GenerationConfig(max_new_tokens=24), [])
    verified = 0
    for prompt in prompts:
        res = engine.generate(prompt)
        assert res.output_ids == hf_greedy(model, prompt, 24)
        verified += res.stats.sources.get("job", {}).get("verified", 0)
    assert verified > 0 and engine.store is not None and engine.store.generations == len(prompts)


@pytest.mark.slow
def test_embedded_job_matches_hf_greedy(embedded):
    """The embedded SmolLM2 on a 3-prompt job (HumanEval, small max_new_tokens), window off and on: outputs equal
    HF greedy, and the store's candidates were verified and some accepted."""
    model, tokenizer = embedded
    eos = [tokenizer.eos_token_id]
    prompts = [tokenizer(p)["input_ids"] for p in humaneval_prompts(3)]
    refs = [hf_greedy(model, p, 32, eos) for p in prompts]
    for la in (
        LookaheadConfig(lookahead_branch=False, verification_set_size=2, pool_scope="job"),
        LookaheadConfig(window_size=4, ngram_size=4, verification_set_size=3, pool_scope="job"),
    ):
        engine = LookaheadEngine(ModelAdapter(model), la, GenerationConfig(max_new_tokens=32), eos)
        job = {"verified": 0, "accepted": 0}
        for prompt, ref in zip(prompts, refs, strict=True):
            res = engine.generate(prompt)
            assert res.output_ids == ref
            for key in job:
                job[key] += res.stats.sources.get("job", {}).get(key, 0)
        assert job["verified"] > 0 and job["accepted"] > 0, job


def _cli(*args: str, timeout: float = 600):
    return run_job(list(args), timeout=timeout, check=False, HF_HUB_OFFLINE="1")


def test_cli_pool_files_need_job_scope(tmp_path):
    proc = _cli("--prompt", "hi", "--pool-out", str(tmp_path / "p.json"), "--set", "lookahead.pool_scope=prompt")
    assert proc.returncode == 2 and "need lookahead.pool_scope=job" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_cli_pool_out_then_pool_in(embedded, tmp_path):
    """A job saves its store (--pool-out); a second job starts from it (--pool-in) and saves both jobs' outputs;
    a damaged file is refused in one line before any prompt runs."""
    import json  # (``embedded``: the model is fetched before the CLI runs)

    prompts = tmp_path / "a.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(humaneval_prompts(2)))
    )
    common = ["--set", "lookahead.pool_scope=job", "--set", "generation.max_new_tokens=16", "--set", "model.threads=1"]
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    proc = _cli("--prompts", str(prompts), "--pool-out", str(first), *common)
    assert proc.returncode == 0, proc.stderr
    saved = json.loads(first.read_text())
    assert saved["generations"] == 2 and saved["num_tokens"] == 32
    proc = _cli("--prompt", "def add(a, b):", "--pool-in", str(first), "--pool-out", str(second), *common)
    assert proc.returncode == 0, proc.stderr
    both = json.loads(second.read_text())
    assert both["generations"] == 3 and both["sequences"][:2] == saved["sequences"]
    first.write_text(first.read_text()[:-10])  # truncated
    proc = _cli("--prompt", "def add(a, b):", "--pool-in", str(first), *common)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and "truncated" in lines[-1] and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_cli_resume_rebuilds_the_store(embedded, tmp_path):
    """--resume starts the job store from the records already written: the resumed job ends with the store (and
    the records) of the job run without interruption."""
    import json

    specs = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(humaneval_prompts(3))]
    all_prompts, first_only = tmp_path / "all.jsonl", tmp_path / "first.jsonl"
    all_prompts.write_text("".join(json.dumps(s) + "\n" for s in specs))
    first_only.write_text("".join(json.dumps(s) + "\n" for s in specs[:2]))
    common = ["--set", "lookahead.pool_scope=job", "--set", "generation.max_new_tokens=16", "--set", "model.threads=1"]
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    proc = _cli("--prompts", str(all_prompts), "--output", str(whole), "--pool-out", str(tmp_path / "w.json"), *common)
    assert proc.returncode == 0, proc.stderr
    proc = _cli("--prompts", str(first_only), "--output", str(resumed), *common)  # the "interrupted" job
    assert proc.returncode == 0, proc.stderr
    proc = _cli(
        "--prompts", str(all_prompts), "--output", str(resumed), "--resume", "--pool-out", str(tmp_path / "r.json"),
        *common,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    store_whole, store_resumed = (json.loads((tmp_path / f).read_text()) for f in ("w.json", "r.json"))
    assert store_whole["generations"] == 3
    assert store_resumed["sequences"] == store_whole["sequences"]
    outputs = [
        {r["id"]: r["output_ids"] for r in map(json.loads, f.read_text().splitlines())} for f in (whole, resumed)
    ]
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_lp_job_store_replicas_agree(tmp_path):
    """P = 2 under torchrun with pool_scope=job: the replicated coordinators read identical stores (a diverging
    plan fails the round's digest check), outputs and forwards equal P = 1's, and the store's candidates were
    verified and accepted."""
    import subprocess

    from dist_helpers import env_with_repo, make_tiny_folder, read_jsonl, torchrun_cmd, write_prompts

    model = make_tiny_folder(tmp_path / "llama", "llama", seed=3)
    texts = ["the same opening words 1", "another prompt 2"] * 2  # repeated: the store knows what follows
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": f"p{i}", "prompt": t} for i, t in enumerate(texts)])
    results = {}
    for nproc in (1, 2):
        out = tmp_path / f"out{nproc}.jsonl"
        args = [
            "--prompts", str(prompts), "--output", str(out), "--set", f"model.path={model}",
            "--set", "model.threads=1", "--set", "lookahead.pool_scope=job", "--set", "lookahead.preset=off",
            "--set", "lookahead.window_size=4", "--set", "lookahead.ngram_size=4",
            "--set", "lookahead.verification_set_size=3", "--set", "generation.max_new_tokens=32",
            "--set", "advanced.progress=false",
        ]  # fmt: skip
        proc = subprocess.run(torchrun_cmd(nproc, *args), env=env_with_repo(), capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[nproc] = read_jsonl(out)
    for single, multi in zip(results[1], results[2], strict=True):
        assert multi["output_ids"] == single["output_ids"] and multi["forwards"] == single["forwards"]
    job = [r["stats"]["sources"].get("job", {}) for r in results[2]]
    assert sum(j.get("verified", 0) for j in job) > 0 and sum(j.get("accepted", 0) for j in job) > 0, job


def test_sampling_reads_no_store():
    """Sampling keeps a prompt's sample a function of its prompt, seed and id: under pool_scope=job the engine
    makes no store when sampling, so earlier generations cannot change which draws decide a prompt's tokens."""
    model = tiny_model("llama")
    la = LookaheadConfig(window_size=3, ngram_size=3, verification_set_size=3, pool_scope="job")
    gen = GenerationConfig(max_new_tokens=12, do_sample=True, seed=1)
    warm = LookaheadEngine(ModelAdapter(model), la, gen, [])
    warm.generate([5, 9, 3, 7], sample_key="a")
    after = warm.generate([5, 9, 3], sample_key="b").output_ids
    alone = LookaheadEngine(ModelAdapter(model), la, gen, []).generate([5, 9, 3], sample_key="b").output_ids
    assert after == alone and warm.store is None

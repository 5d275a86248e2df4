"""A prompt longer than one round: cached in chunks of at most ``PREFILL_CHUNK_ROWS`` rows before its first round,
token-identical to HF greedy, on every path a round can take (its own cache, a batch's slot cache, bucketed static
rounds), and nothing a round builds grows with the square of the prompt.

The oracle is HF greedy ``generate`` on the whole prompt in one forward; chunking is exact because every row of a
round sees the round's ordinary rows whole, so caching the leading ones first gives every row the same keys.
"""

from __future__ import annotations

import pytest
from helpers import hf_greedy, make_engine, random_prompt, tiny_model

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.config import LookaheadConfig
from lp_runner.decoding.layout import max_round_rows
from lp_runner.decoding.scheduler import PREFILL_CHUNK_ROWS, Job

LONG = 2 * PREFILL_CHUNK_ROWS + 137  # two chunks, then a round of 137 ordinary rows and the window's
CONTEXT = 2048


def _spy_rows(monkeypatch) -> list[int]:
    """Every forward's row count, recorded on the way into the real forward (nothing replaced)."""
    rows: list[int] = []
    real = ModelAdapter.run

    def run(self, rounds, regions):
        for r in rounds:
            assert r.visibility.shape == (len(r.input_ids), len(r.input_ids))
        rows.append(sum(len(r.input_ids) for r in rounds))
        return real(self, rounds, regions)

    monkeypatch.setattr(ModelAdapter, "run", run)
    return rows


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral-sliding"])
def test_long_prompt_is_chunked_and_exact(family, monkeypatch):
    """Two chunks of PREFILL_CHUNK_ROWS, then rounds: HF greedy's tokens, and no forward of the prompt's length."""
    model = tiny_model(family, max_position_embeddings=CONTEXT)
    prompt = random_prompt(LONG, seed=11)
    engine = make_engine(model, 5, 4, 5, max_new_tokens=24)
    rows = _spy_rows(monkeypatch)
    result = engine.generate(prompt)
    assert result.output_ids == hf_greedy(model, prompt, 24)
    assert result.stats.prefill_chunks == 2
    assert rows[:2] == [PREFILL_CHUNK_ROWS, PREFILL_CHUNK_ROWS]  # the chunks: ordinary rows only
    assert max(rows) <= PREFILL_CHUNK_ROWS + max_round_rows(LookaheadConfig(window_size=5, ngram_size=4))
    assert result.stats.forwards == result.stats.rounds + 2
    assert result.stats.accepted_tokens > 0  # lookahead verified something: not plain decoding


def test_long_prompt_in_a_batch(monkeypatch):
    """A long prompt joining a batch: its chunks run alone on its region of the job's arena, then its first round
    rides with the other generation's; both outputs are HF greedy's."""
    model = tiny_model("llama", max_position_embeddings=CONTEXT)
    prompts = [random_prompt(40, seed=3), random_prompt(LONG, seed=12)]
    engine = make_engine(model, 5, 4, 5, max_new_tokens=20)
    rows = _spy_rows(monkeypatch)
    done = {}
    jobs = iter([Job(p, tag=i) for i, p in enumerate(prompts)])
    engine.run(lambda: next(jobs, None), lambda job, result: done.__setitem__(job.tag, result), batch=2)
    for i, prompt in enumerate(prompts):
        assert done[i].output_ids == hf_greedy(model, prompt, 20), i
    assert done[1].stats.prefill_chunks == 2 and done[0].stats.prefill_chunks == 0
    assert max(rows) < LONG


def test_long_prompt_on_bucketed_rounds():
    """The static, bucketed path a GPU runs (here on the CPU, eager): chunks at the ladder's top bucket."""
    model = tiny_model("llama", max_position_embeddings=CONTEXT)
    prompt = random_prompt(LONG, seed=13)
    engine = make_engine(model, 5, 4, 5, max_new_tokens=20)
    engine.adapter = ModelAdapter(model, bucketed=True)
    result = engine.generate(prompt)
    assert result.output_ids == hf_greedy(model, prompt, 20)
    assert result.stats.prefill_chunks == 2


def test_visibility_masks_are_cached_without_the_prompt():
    """The layout's mask cache is keyed by the round without its ordinary rows: prompts of many lengths add no
    entries of their size (one per window shape)."""
    from lp_runner.decoding import layout

    layout._visibility.cache_clear()
    for n in range(1, 300, 7):
        _ = layout.compile_round(list(range(n)), 0, [[1, 2], [3, 4, 5]], (0, 3), [[7, 8]]).visibility  # its mask made
    info = layout._visibility.cache_info()
    assert info.currsize == 1 and info.hits == len(range(1, 300, 7)) - 1, info


def _peak_rss_of(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd`` to its end; (its peak resident memory in bytes, its stderr), read from its own rusage."""
    import os
    import subprocess

    from dist_helpers import env_with_repo

    proc = subprocess.Popen(cmd, env=env_with_repo(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = proc.stderr.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, stderr[-3000:]
    return usage.ru_maxrss * 1024, stderr


@pytest.mark.slow
def test_prompt_of_8k_tokens_on_the_embedded_model(tmp_path):
    """A 7,900-token prompt on the embedded model (context 8,192) through the CLI: HF greedy's tokens, and the peak
    host memory it adds over a short prompt's run is its K/V and a chunk's transients, not a structure of the
    prompt's square (a whole-prompt round added about 1 GB here, two thirds of it masks and scores)."""
    import json

    from dist_helpers import hf_greedy_of, lp_runner_cmd, read_jsonl
    from helpers import humaneval_prompts
    from transformers import AutoConfig, AutoTokenizer

    from lp_runner.models.loading import fetch_embedded_model

    folder = fetch_embedded_model()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "".join(humaneval_prompts(80))
    ids = tokenizer(text).input_ids
    assert len(ids) > 7900
    text = tokenizer.decode(ids[:7900])
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"id": "long", "prompt": text}) + "\n")
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"id": "short", "prompt": "def add(a, b):"}) + "\n")

    def run(prompt_file, out):
        return _peak_rss_of(lp_runner_cmd(
            "--config", "configs/default.yaml", "--set", "lookahead.preset=off", "--set", "advanced.pad_rows=false",
            "--set", "generation.max_new_tokens=16", "--set", "advanced.progress=false",
            "--prompts", str(prompt_file), "--output", str(out),
        ))  # fmt: skip

    long_peak, _ = run(prompts, tmp_path / "long_out.jsonl")
    short_peak, _ = run(short, tmp_path / "short_out.jsonl")
    (record,) = read_jsonl(tmp_path / "long_out.jsonl")
    assert len(record["prompt_ids"]) > 7800
    assert record["output_ids"] == hf_greedy_of(folder, record["prompt_ids"], 16)
    assert record["stats"]["prefill_chunks"] == (len(record["prompt_ids"]) - 1) // PREFILL_CHUNK_ROWS

    config = AutoConfig.from_pretrained(folder)
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4 * 8192  # fp32, full context
    added = long_peak - short_peak
    print(f"peak host memory: short prompt {short_peak / 2**30:.2f} GiB, 7,900 tokens {long_peak / 2**30:.2f} GiB")
    assert added < kv_bytes + 192 * 2**20, (added, kv_bytes)

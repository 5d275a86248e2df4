"""Compiled static-shape rounds (``model.compile``): the same tokens as eager rounds and HF greedy, and the choice.

Oracles: the eager adapter's logits for the same round (compiled kernels reorder float sums: equal to rounding,
the same argmax), HF greedy ``generate`` for whole generations on the three tiny families, row counts on both
sides of every padding bucket; the pure ``decide`` against hand-computed cases; a real CLI run on a tiny model
folder for the record that ``on`` writes and ``auto`` reads. Compiling takes tens of seconds per model on two
cores: the compiling tests are slow.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_helpers import REPO, make_tiny_folder, write_prompts
from helpers import FAMILIES, compiled_adapter, hf_greedy, job_region, one_round, random_prompt, tiny_model

from lp_runner.backends.adapter import ModelAdapter, causal
from lp_runner.backends.cpu.prepack import apply_prepack, native_unavailable_reason
from lp_runner.backends.staging import Rows
from lp_runner.config import GenerationConfig, LookaheadConfig
from lp_runner.decoding.engine import LookaheadEngine
from lp_runner.models.loading import default_cache_dir
from lp_runner.tuning.compile_choice import CompileRecord, decide
from lp_runner.tuning.costmodel import RowPlan

BUCKETS = (2, 4, 8, 16, 32)  # a padding plan: every round runs at the next of these


def bucket_plan() -> RowPlan:
    targets = tuple(next(b for b in (*BUCKETS, q) if b >= q) for q in range(1, 65))
    return RowPlan(kv_lens=(10_000,), targets=(targets,))


def test_decide() -> None:
    record = CompileRecord(compile_s=60.0, eager_s=0.050, compiled_s=0.040)  # 10 ms saved per round
    assert decide("off", record, 10**6) == (False, "off")
    assert decide("on", None, 1) == (True, "on")
    compiled, why = decide("auto", None, 10**6)
    assert not compiled and "no measurement" in why and "model.compile=on" in why
    compiled, why = decide("auto", record, 5000)  # 50 s saved < 60 s compiling
    assert not compiled and "eager" in why and "60 s" in why and "50 s" in why
    compiled, why = decide("auto", record, 7000)  # 70 s saved > 60 s
    assert compiled and "compiled" in why
    assert not decide("auto", CompileRecord(1.0, 0.040, 0.050), 10**6)[0]  # slower compiled: never
    compiled, why = decide("auto", record, 0)  # a worker that does not know the job (a Ray actor)
    assert not compiled and "not known" in why


def test_auto_on_cuda_captures_a_long_first_job_then_decides_from_its_record() -> None:
    """On CUDA compiling is capturing (bucketed rounds): without a record a job of FIRST_CAPTURE_TOKENS or more
    captures, which measures; a shorter one, or any on a CPU, stays eager; with a record the device type does not
    matter, the record's pay test decides."""
    from lp_runner.tuning.compile_choice import FIRST_CAPTURE_TOKENS

    compiled, why = decide("auto", None, FIRST_CAPTURE_TOKENS, "cuda")
    assert compiled and "captured" in why and "records" in why
    assert not decide("auto", None, FIRST_CAPTURE_TOKENS - 1, "cuda")[0]
    assert not decide("auto", None, 10**6, "cpu")[0]
    assert not decide("auto", None, 0, "cuda")[0]  # the job's length unknown: never
    record = CompileRecord(compile_s=30.0, eager_s=0.004, compiled_s=0.001)  # 3 ms saved per round
    assert not decide("auto", record, 9000, "cuda")[0]  # 27 s < 30 s
    assert decide("auto", record, 11000, "cuda")[0]  # 33 s > 30 s
    assert decide("off", None, 10**6, "cuda") == (False, "off")


def test_the_record_times_rounds_on_generation_caches() -> None:
    """``measure_record`` times one adapter's eager and compiled round functions in its job arena, the one whose
    rounds replay captured graphs (a scratch region's run eager, which would time eager twice); the arena is handed
    back after, its regions freed."""
    from lp_runner.tuning.compile_choice import measure_record

    model = tiny_model("llama", vocab_size=128)  # the record's prefix reads token ids up to 96
    adapter = ModelAdapter(model, bucketed=True)
    record = measure_record(adapter, compile_s=1.0)
    assert record.eager_s > 0 and record.compiled_s > 0
    with adapter.arena() as arena:  # handed back: the next holder gets it
        assert arena.allocations == 1 and not arena.regions
        with adapter.arena() as other:  # lent now: a second holder gets its own
            assert other is not arena


@pytest.mark.slow
def test_one_adapter_compiles_and_keeps_its_eager_rounds(tiny) -> None:
    """``compile`` turns the adapter's own rounds compiled (no second adapter), its eager round function kept for
    ``run(eager=True)``: both give the same logits on one job arena, and a failed compilation leaves the adapter
    eager, as it was."""
    model = tiny("llama")
    adapter = ModelAdapter(model)
    eager_rounds, backend = adapter.rounds, adapter.backend

    def failing(compiled: ModelAdapter) -> list[list[int]]:
        assert compiled.compiled  # asked once the adapter is compiled (a calibration is keyed by it)
        raise RuntimeError("no compiler here")

    with pytest.raises(RuntimeError, match="no compiler here"):
        adapter.compile([64], failing)
    assert (adapter.rounds, adapter.backend, adapter.compiled, adapter.bucketed) == (
        eager_rounds,
        backend,
        False,
        False,
    )
    torch._dynamo.reset()
    assert adapter.compile([64]) > 0
    assert adapter.compiled and adapter.bucketed and adapter.rounds is not eager_rounds
    assert adapter.rounds.compiled is not None and not adapter.backend.whole_layers  # transformers' layers
    graph = adapter.rounds.compiled
    replays = []
    adapter.rounds.compiled = lambda *args: replays.append(1) or graph(*args)  # a spy: the graph still runs
    prefix = random_prompt(20, seed=2)
    logits = []
    with adapter.arena([24, 24]) as arena:
        for eager in (False, True):
            region = arena.region(24)
            adapter.run([Rows(prefix, range(20), causal(20), [19])], [region], eager=eager)
            logits.append(adapter.run([Rows([3, 4], [20, 21], causal(2), [0, 1])], [region], eager=eager).clone())
    assert len(replays) == 2  # the compiled side's two rounds, and none of the eager side's
    torch.testing.assert_close(logits[0], logits[1])


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_rounds_equal_eager_rounds_and_hf_greedy(tiny, family: str) -> None:
    model = tiny(family)
    torch._dynamo.reset()  # this test counts compilations: none left from other tests' models
    eager, (compiled, warm_s) = ModelAdapter(model), compiled_adapter(model)
    assert warm_s > 0
    with torch._dynamo.config.patch(error_on_recompile=True):  # the warm-up's graph serves every later round
        _compiled_rounds_equal_eager_rounds_and_hf_greedy(model, eager, compiled)


@pytest.mark.slow
def test_native_kernels_compile_one_graph_for_every_round(tiny) -> None:
    """A model on the native kernels (its products custom ops inside the graph) compiles one graph for every
    round: every bucket, against its eager rounds and HF greedy, under ``error_on_recompile``."""
    stock = tiny("llama")
    if native_unavailable_reason(stock, default_cache_dir()) is not None:
        pytest.skip("no native kernel here")
    model = copy.deepcopy(stock)
    apply_prepack(model, "native")
    torch._dynamo.reset()
    eager, (compiled, warm_s) = ModelAdapter(model), compiled_adapter(model)
    assert compiled.rounds.compiled is not None
    assert warm_s > 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        _compiled_rounds_equal_eager_rounds_and_hf_greedy(stock, eager, compiled)


@pytest.mark.slow
def test_two_models_of_one_class_run_their_own_graphs() -> None:
    """Two Llamas of different sizes and norm epsilons share dynamo's cache (one class, one forward): every round of
    each must run its own graph. Rounds alternate between the models, each in its own job arena, against their
    eager rounds. The second model's epsilon failed its compilation on torch 2.7 (``constant_floats``)."""
    models = [
        tiny_model("llama"),
        tiny_model("llama", seed=1, hidden_size=96, num_attention_heads=6, rms_norm_eps=1e-5),
    ]
    torch._dynamo.reset()
    pairs = [(ModelAdapter(m), compiled_adapter(m)[0]) for m in models]
    caches = {}
    lent = contextlib.ExitStack()
    for eager, compiled in pairs:
        for adapter in (eager, compiled):
            caches[id(adapter)] = lent.enter_context(job_region(adapter, 64))
            one_round(adapter, torch.arange(20), torch.arange(20), causal(20), caches[id(adapter)], torch.tensor([19]))
    for rows in (1, 2, 5, 9):
        for eager, compiled in pairs:
            got, want = (
                one_round(adapter, torch.arange(rows), torch.arange(20, 20 + rows), causal(rows), caches[id(adapter)],
                                torch.arange(rows))
                for adapter in (compiled, eager)
            )  # fmt: skip
            torch.testing.assert_close(got, want, msg=f"{rows} rows")
            for adapter in (eager, compiled):
                caches[id(adapter)].crop(20)
    lent.close()


def _compiled_rounds_equal_eager_rounds_and_hf_greedy(model, eager: ModelAdapter, compiled: ModelAdapter) -> None:
    # single rounds on both sides of every bucket: rows = bucket and bucket + 1 (one row runs as two)
    prefix = random_prompt(40, seed=5)
    caches = {}
    lent = contextlib.ExitStack()
    for adapter in (eager, compiled):
        caches[id(adapter)] = lent.enter_context(job_region(adapter, 128))
        one_round(adapter, torch.tensor(prefix), torch.arange(40), causal(40), caches[id(adapter)], torch.tensor([39]))
    for rows in sorted({1, *BUCKETS, *(b + 1 for b in BUCKETS)}):
        ids = torch.tensor(random_prompt(rows, seed=rows))
        if rows % 2:  # tensors made in inference mode too (as the engine's later rounds pass): one graph for both
            with torch.inference_mode():
                ids = ids.clone()
        got, want = (
            one_round(adapter, ids, torch.arange(40, 40 + rows), causal(rows), caches[id(adapter)], torch.arange(rows))
            for adapter in (compiled, eager)
        )
        torch.testing.assert_close(got, want, msg=f"{rows} rows")
        assert torch.equal(got.argmax(-1), want.argmax(-1)), rows
        for adapter in (eager, compiled):
            caches[id(adapter)].crop(40)
    lent.close()
    # whole generations: window and candidates, padded to the buckets, against HF greedy
    la = LookaheadConfig(window_size=4, ngram_size=3, verification_set_size=4)
    prompt = random_prompt(12, 3) * 2
    engine = LookaheadEngine(compiled, la, GenerationConfig(max_new_tokens=40), [], row_plan=bucket_plan())
    result = engine.generate(prompt)
    assert result.output_ids == hf_greedy(model, prompt, 40)
    assert result.stats.forwards < 40  # candidates were accepted: multi-row rounds ran


@pytest.mark.slow
def test_compiled_embedded_model_equals_hf_greedy(embedded) -> None:
    model, tokenizer = embedded
    compiled, _ = compiled_adapter(model)
    la = LookaheadConfig(window_size=5, ngram_size=4, verification_set_size=5)
    engine = LookaheadEngine(compiled, la, GenerationConfig(max_new_tokens=48), [], row_plan=bucket_plan())
    for text in ("def fibonacci(n):\n    ", "The three primary colors are"):
        ids = tokenizer(text)["input_ids"]
        assert engine.generate(ids).output_ids == hf_greedy(model, ids, 48), text


@pytest.mark.slow
def test_cli_compile_on_records_and_auto_reads_it(tmp_path: Path) -> None:
    """``on`` compiles and records this device's figures; ``auto`` then decides from them and says why."""
    folder = make_tiny_folder(tmp_path / "model")
    proc, rec = _run_cli(tmp_path, folder, "on", "on.jsonl", 16)
    assert rec["policy"]["compile"]["compiled"] is True and rec["policy"]["compile"]["compile_s"] > 0
    assert "forward compiled (model.compile=on; compiled in" in proc.stderr
    records = list((tmp_path / "cache" / "compile").glob("record-*.json"))
    assert len(records) == 1
    saved = json.loads(records[0].read_text())["record"]
    assert saved["compile_s"] > 0 and saved["eager_s"] > 0 and saved["compiled_s"] > 0
    proc, rec = _run_cli(tmp_path, folder, "auto", "auto.jsonl", 16)  # 16 tokens never pay for a compilation
    assert rec["policy"]["compile"]["compiled"] is False
    assert f"compiling took {saved['compile_s']:.0f} s here" in rec["policy"]["compile"]["reason"]
    assert "forward auto: eager (compiling took" in proc.stderr


@pytest.mark.slow
def test_cli_compile_failure_falls_back_to_eager(tmp_path: Path) -> None:
    """No usable C++ compiler (inductor's CPU backend needs one): one warning line, the job runs eager, the
    record and the summary say why."""
    folder = make_tiny_folder(tmp_path / "model")
    proc, rec = _run_cli(tmp_path, folder, "on", "o.jsonl", 8, CXX=str(tmp_path / "no-such-compiler"))
    warnings = [
        ln for ln in proc.stderr.splitlines() if ln.startswith("warning: model.compile: on: compilation failed")
    ]
    assert len(warnings) == 1, proc.stderr
    assert rec["policy"]["compile"]["compiled"] is False and "compilation failed" in rec["policy"]["compile"]["reason"]
    assert rec["new_tokens"] == 8
    assert "forward on: compilation failed" in proc.stderr  # the summary says it ran eager, and why


def _run_cli(
    tmp_path: Path, folder: Path, mode: str, out: str, max_new: int, **env: str
) -> tuple[subprocess.CompletedProcess, dict]:
    """One prompt through ``python -m lp_runner`` on ``folder`` with ``model.compile=mode``, the cache (and so the
    compile record and inductor's kernels) under ``tmp_path``; the run must succeed. Returns it and its record."""
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "def add(a, b):"}])
    proc = subprocess.run(
        [sys.executable, "-m", "lp_runner", "--prompts", str(prompts), "--output", str(tmp_path / out)]
        + ["--set", f"model.path={folder}", "--set", f"model.compile={mode}", "--set", "model.threads=1"]
        + ["--set", f"generation.max_new_tokens={max_new}"],
        cwd=REPO,
        env={**os.environ, "LP_RUNNER_CACHE": str(tmp_path / "cache"), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads((tmp_path / out).read_text().splitlines()[0])


@pytest.mark.slow
def test_a_compiled_job_compiles_and_grows_nothing_after_start_up(tiny_dir, tmp_path: Path, monkeypatch) -> None:
    """A compiled CPU job (``model.compile: on``, the auto preset calibrating on the compiled forward into an empty
    cache): start-up compiles, warms every (bucket, K/V width) pair up and sizes the arena for the calibration
    before it; the job's rounds then compile nothing (dynamo's counter and the round function's own), run no
    shape the warm-up did not (on CUDA each would be a graph recorded mid-job) and never regrow the arena. The
    prompt is long enough for rounds of a few rows to read a K/V width past the smallest."""
    from lp_runner.config import load_config
    from lp_runner.jobs.prompts import PromptSpec
    from lp_runner.jobs.worker import run_prompts, start_worker

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # restored after the test
    threads = torch.get_num_threads()
    cfg = load_config(
        None,
        [f"model.path={tiny_dir}", "model.compile=on", "model.threads=1", f"advanced.cache_dir={tmp_path / 'cache'}"]
        + ["generation.max_new_tokens=48", "lookahead.preset=auto"],
    )
    # ~300 tokens: rounds after it read 512 slots, and the job's arena (1,024 slots and the spare) is smaller than
    # the calibration's (2,048): unsized, the calibration after the warm-up would grow it
    long = " ".join(f"w{k % 37}" for k in range(110))
    specs = [PromptSpec(id="long", prompt=long, where="test"), PromptSpec(id="short", prompt="w1 w2 w3", where="t")]
    try:
        worker = start_worker(cfg, specs)
        adapter = worker.adapter
        assert adapter.compiled and worker.policy.calibration.source == "measured"  # the calibration ran here

        def counts() -> tuple:
            with adapter.arena() as arena:
                pass
            return (*adapter.rounds.counts(), arena.allocations, torch._dynamo.utils.counters["stats"]["unique_graphs"])

        started = counts()
        records = run_prompts(worker, worker.prompts)  # tokenized once, at start-up
        assert counts() == started  # compilations, shapes run compiled, arena tensors, dynamo graphs
    finally:
        torch.set_num_threads(threads)
    assert started[0] > 0 and started[1] > len(adapter.rounds.ladder.rows)  # guard: compiled, several widths
    assert 256 < max(len(r["prompt_ids"]) for r in records) < 350
    for rec in records:
        want = hf_greedy(adapter.model, rec["prompt_ids"], 48, [adapter.model.generation_config.eos_token_id])
        assert rec["output_ids"] == want

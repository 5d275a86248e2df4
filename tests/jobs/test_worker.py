"""The prompt loop of one worker (``jobs.worker.run_prompts``) and the auto preset it drives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import AMD_MS, curve_from_ms

from lp_runner.config import LookaheadConfig, load_config
from lp_runner.tuning import preset
from lp_runner.tuning.acceptance import shipped_prior
from lp_runner.tuning.costmodel import RowPlan
from lp_runner.tuning.policy import RoundPolicy
from lp_runner.tuning.preset import AutoPreset

PROMPTS = ["def add(a, b):", "The capital of France is", "Once upon a time", "import numpy as np", "x = [1, 2"]


@pytest.mark.parametrize("count, later, searches", [(3, 0, 0), (4, 0, 1), (3, None, 1)])
def test_a_job_re_chooses_only_while_enough_prompts_are_left(embedded, monkeypatch, count, later, searches) -> None:
    """The worker tells the auto preset how many prompts are still to start: with a threshold crossed after the
    second prompt (2 observed), a job of 3 prompts (1 left) skips the search and one of 4 (2 left) runs it; a
    worker that does not know what follows (``later=None``: Ray groups taking prompts in turn) always runs it.
    Every output is the model's greedy one either way."""
    from lp_runner.backends.adapter import ModelAdapter
    from lp_runner.jobs.prompts import PromptSpec
    from lp_runner.jobs.worker import Worker, run_prompts
    from lp_runner.parallel.comm import SoloCommunicator

    new_tokens = 24
    monkeypatch.setattr(preset, "ADAPT_AFTER_TOKENS", (new_tokens + 1,))  # crossed by the second prompt's output
    cfg = load_config(None, [f"generation.max_new_tokens={new_tokens}", "model.threads=1"])
    curve = curve_from_ms(AMD_MS)
    auto = AutoPreset(LookaheadConfig(preset="auto"), (), curve, RowPlan.from_curve(curve), prior=shipped_prior())
    model, tokenizer = embedded
    worker = Worker(cfg, SoloCommunicator(), ModelAdapter(model), tokenizer, Path("embedded"), torch.device("cpu"), 0.0)
    worker.policy = RoundPolicy(auto.lookahead, None, None, auto)
    specs = [PromptSpec(id=str(k), prompt=p, where="test") for k, p in enumerate(PROMPTS[:count])]
    records = run_prompts(worker, worker.prepare(specs), later=later)
    assert len(auto.history) - 1 == searches
    for rec in records:
        expect = model.generate(torch.tensor([rec["prompt_ids"]]), max_new_tokens=new_tokens, do_sample=False)
        assert rec["output_ids"] == expect[0, len(rec["prompt_ids"]) :].tolist()

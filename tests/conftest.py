"""Shared fixtures: tiny random models per family, the embedded SmolLM2 model, HumanEval prompts.

The plain functions (the oracle ``hf_greedy``, ``run_lookahead``, ``tiny_model``) live in ``helpers.py`` so test
modules can import them; the fixtures here only wrap them with caching and thread settings.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import humaneval_prompts, shared_tiny_model
from transformers import PreTrainedModel

# The machine is shared (2 cores): one intra-op thread keeps tiny-model tests fast and predictable.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny() -> Callable[..., PreTrainedModel]:
    """``tiny(family, seed=0)`` -> a cached random fp32 tiny causal LM (tests must not mutate its weights)."""

    return shared_tiny_model


@pytest.fixture(scope="session")
def embedded() -> tuple[PreTrainedModel, object]:
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, loaded exactly as the runner loads it."""
    from lp_runner.loading import fetch_embedded_model, load_model_and_tokenizer

    folder = fetch_embedded_model()
    model, tokenizer, _ = load_model_and_tokenizer(folder, dtype=torch.float32, device="cpu")
    return model, tokenizer


@pytest.fixture(scope="session")
def humaneval() -> Callable[[int], list[str]]:
    """``humaneval(n)`` -> the first n HumanEval prompts."""
    return humaneval_prompts


@pytest.fixture
def native_routing(monkeypatch):
    """lp_runner.native's routed library (its entry points and build id) restored after the test, which may
    ``native.route`` another build."""
    from lp_runner import native

    for name in ("_FN", "_ATTENTION", "_LAYER", "_BUILD"):
        monkeypatch.setattr(native, name, getattr(native, name))
    return native

"""Shared fixtures: tiny random models per family, the embedded SmolLM2 model, HumanEval prompts.

The plain functions (the oracle ``hf_greedy``, ``run_lookahead``, ``tiny_model``) live in ``helpers.py`` so test
modules can import them; the fixtures here only wrap them with caching and thread settings.
"""

from __future__ import annotations

import os
from collections.abc import Callable

# Before torch loads libgomp: the suite runs on two pytest-xdist workers (README), so a test's 2-thread job shares
# the cores with the other worker, and OpenMP threads that spin-wait at every barrier then run up to 8x slower
# (test_embedded_exact's docstring). Passive waiting sleeps instead; it changes no result, only waiting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import humaneval_prompts, remember_greedy, shared_tiny_model  # noqa: E402
from transformers import PreTrainedModel  # noqa: E402

# The machine is shared (2 cores): one intra-op thread keeps tiny-model tests fast and predictable.
torch.set_num_threads(1)

# The files that took longest (durations of the whole suite in one process),
# long first. Under pytest-xdist (README: -n 2 --dist loadfile --no-loadscope-reorder) a worker that runs low takes
# the next whole file in collection order: the long ones go first and the short ones fill the end, so the workers
# finish together instead of one idling while the other runs a long file it picked up last. Files that launch
# jobs of several processes (torchrun, Ray) alternate with files that run in the test process, so the two workers
# less often run two multi-process jobs at once on two cores.
LONGEST_FIRST = (
    "test_gpu_check.py",  # ~10 min: the smoke whole and cut (torch.compile, torchrun), within its own budget
    "test_ray.py",  # 538 s, a Ray cluster
    "test_embedded_exact.py",  # 353 s, in process
    "test_faults.py",  # 484 s, torchrun
    "test_half_precision.py",  # 236 s, in process
    "test_lp.py",  # 271 s, torchrun
    "test_prepack.py",  # 308 s, mostly in process
    "test_groups.py",  # 210 s, torchrun
    "test_compile.py",  # 268 s, mostly in process
    "test_job_store_exact.py",  # 191 s
    "test_sampling_e2e.py",  # 134 s
    "test_config_cli.py",  # 129 s
    "test_native_layers.py",  # 77 s
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files of LONGEST_FIRST first, in its order; the rest after them in their own order (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def tiny() -> Callable[..., PreTrainedModel]:
    """``tiny(family, seed=0)`` -> a cached random fp32 tiny causal LM (tests must not mutate its weights)."""

    return shared_tiny_model


@pytest.fixture(scope="session")
def embedded() -> tuple[PreTrainedModel, object]:
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, loaded exactly as the runner loads it."""
    from lp_runner.models.loading import fetch_embedded_model, load_model_and_tokenizer

    folder = fetch_embedded_model()
    model, tokenizer, _ = load_model_and_tokenizer(folder, dtype=torch.float32, device="cpu")
    return remember_greedy(model), tokenizer  # the oracle's outputs on it are computed once per prompt


@pytest.fixture(scope="session")
def humaneval() -> Callable[[int], list[str]]:
    """``humaneval(n)`` -> the first n HumanEval prompts."""
    return humaneval_prompts


@pytest.fixture
def native_routing(monkeypatch):
    """lp_runner.backends.cpu.native's routed library (its entry points and build id) restored after the test, which may
    ``native.route`` another build."""
    from lp_runner.backends.cpu import native

    monkeypatch.setattr(native, "_ROUTED", native.routed())
    return native


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Llama saved as a folder the CLI loads (the embedded tokenizer, seed 3), shared by every job test."""
    from dist_helpers import make_tiny_folder

    return make_tiny_folder(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=3)

"""The family matrix: lookahead output equals HF greedy on tiny random models of every popular family.

Each family is built from its transformers config with small dims (``helpers.MATRIX``), in memory, nothing
downloaded. Sliding-window families get a window of 8 positions, so a 12-token prompt plus 40 new tokens (and
rounds of up to 66 rows) runs several windows past it: every packed row must see exactly the keys its own
position sees in one-row decoding. ALiBi families are refused up front with one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from dist_helpers import REPO
from helpers import MATRIX, WINDOW, hf_greedy, one_round, random_prompt, run_lookahead, scratch_region, tiny_model

from lp_runner.backends.adapter import ModelAdapter, UnsupportedModelError
from lp_runner.config import LookaheadConfig
from lp_runner.errors import LPError

PROMPT_LEN = 12
NEW_TOKENS = 40
REFUSED = ("falcon-alibi", "bloom")  # ALiBi: no per-row mask reaches the position bias
SLIDING = ("mistral-sliding", "qwen2-hybrid", "gemma2", "gemma3-text", "phi3-sliding", "starcoder2-sliding")
SLIDING += ("cohere2-hybrid", "mixtral-sliding")
EXACT = [family for family in MATRIX if family not in REFUSED]
MODES = {
    "default": {},  # the runner's default sources: Jacobi window, pool, context lookup, pool repair
    "jacobi": {"context_lookup": False, "pool_from_output": False},  # the published algorithm: window and pool only
}
DEFAULT = LookaheadConfig()  # W, N, G as a user who sets nothing gets them
VERSION = transformers.__version__


@pytest.mark.parametrize("family", EXACT, ids=[f"{f}-transformers{VERSION}" for f in EXACT])
def test_family_is_exact(family: str) -> None:
    model = tiny_model(family)
    adapter = ModelAdapter(model)
    assert any(adapter.mask_windows.values()) == (family in SLIDING), adapter.mask_windows  # the window is on
    accepted = 0
    for seed in (0, 1):
        prompt = random_prompt(PROMPT_LEN, seed)
        expected = hf_greedy(model, prompt, NEW_TOKENS)
        for mode, sources in MODES.items():
            W, N, G = DEFAULT.window_size, DEFAULT.ngram_size, DEFAULT.verification_set_size
            result = run_lookahead(model, prompt, W, N, G, True, NEW_TOKENS, **sources)
            assert result.output_ids == expected, f"{family} {mode} prompt {seed}"
            accepted += result.stats.accepted_tokens
    assert accepted > 0, "no candidate was ever accepted: the test would pass vacuously"
    if family in SLIDING:
        assert PROMPT_LEN + NEW_TOKENS >= 6 * WINDOW


@pytest.mark.parametrize("family", REFUSED)
def test_alibi_family_is_refused_in_one_line(family: str) -> None:
    model = tiny_model(family)
    with pytest.raises(UnsupportedModelError) as info:
        ModelAdapter(model)
    message = str(info.value)
    assert isinstance(info.value, LPError)  # the CLI prints it as one 'error:' line, without a traceback
    assert "\n" not in message
    assert message.startswith(f"{type(model).__name__} cannot run under lp_runner")
    assert "ALiBi" in message


@pytest.mark.parametrize("family", ["mistral-sliding", "qwen2-hybrid", "gemma3-text", "gemma2"])
@torch.inference_mode()
def test_packed_rows_see_their_own_window(family: str) -> None:
    """One packed round against isolated forwards of each row's visible sequence (HF masks the window itself).

    20 cached positions, then a live key at 20, two siblings at 21 that must not see each other and a child of
    the second at 22: the siblings share a position but not a sequence, and each row's window ends at its own
    position, so row 3 loses key 14 that rows 1 and 2 still see.
    """
    model = tiny_model(family)
    adapter = ModelAdapter(model)
    prefix = random_prompt(20, seed=7)
    cache = scratch_region(adapter)
    one_round(
        adapter, torch.tensor(prefix), torch.arange(20), torch.ones(20, 20).tril().bool(), cache, torch.tensor([19])
    )
    tokens = [5, 9, 17, 33]
    positions = [20, 21, 21, 22]
    parents = [[0], [0, 1], [0, 2], [0, 2, 3]]  # in-round rows each row sees (itself included)
    visibility = torch.zeros(4, 4, dtype=torch.bool)  # [Q, Q]
    for row, seen in enumerate(parents):
        visibility[row, seen] = True
    got = one_round(adapter, torch.tensor(tokens), torch.tensor(positions), visibility, cache, torch.arange(4))
    assert cache.length == 24  # every position is kept: the window is a mask, not a rolling buffer
    for row, seen in enumerate(parents):
        sequence = prefix + [tokens[k] for k in seen]
        assert len(sequence) == positions[row] + 1
        want = model(input_ids=torch.tensor([sequence])).logits[0, -1]  # [vocab]
        torch.testing.assert_close(got[row], want, atol=1e-5, rtol=1e-5, msg=f"{family} row {row}")


# ---------------------------------------------------------------------------------------------------------
# Loaded as a user loads them: a local folder, through load_model_and_tokenizer and the command line


def _save_folder(family: str, folder: Path) -> Path:
    from helpers import save_tiny_tokenizer  # a real word-level tokenizer (64 tokens, within the vocab)

    tiny_model(family).save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


def test_family_without_sdpa_loads_with_eager_attention_and_is_exact(tmp_path: Path) -> None:
    """Gemma 2 has no sdpa path in transformers 5.24 (attention softcapping): the loader falls back to eager, which
    takes the engine's per-row 4-D float masks (one per layer type) like sdpa does. transformers 5.17 still
    offers sdpa for Gemma 2 (its sdpa path drops the softcapping, for HF generate too): loaded as sdpa there."""
    from transformers import Gemma2ForCausalLM

    from lp_runner.models.loading import load_model_and_tokenizer

    logged: list[str] = []
    model, _, _ = load_model_and_tokenizer(_save_folder("gemma2", tmp_path / "gemma2"), log=logged.append)
    if Gemma2ForCausalLM._supports_sdpa:
        assert model.config._attn_implementation == "sdpa" and logged == []
    else:
        assert model.config._attn_implementation == "eager"
        assert logged == ["Gemma2ForCausalLM has no sdpa attention in transformers; using eager attention"]
    prompt = random_prompt(PROMPT_LEN, 0, vocab=60)
    result = run_lookahead(model, prompt, 5, 4, 5, True, NEW_TOKENS)
    assert result.output_ids == hf_greedy(model, prompt, NEW_TOKENS)
    assert result.stats.accepted_tokens > 0


def test_alibi_model_from_a_folder_is_one_error_line_on_the_command_line(tmp_path: Path) -> None:
    folder = _save_folder("bloom", tmp_path / "bloom")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lp_runner", "--prompt", "w1 w2 w3", "--set", f"model.path={folder}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr  # a user error, not a crash
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "BloomForCausalLM cannot run under lp_runner" in errors[0], proc.stderr

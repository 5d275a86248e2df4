"""The native product on bfloat16-stored weights (``model.backend=native-bf16``).

Its definition: the float32 product on the weights rounded to bfloat16. Oracles: the float32 native product of
the same build on those rounded weights, bit for bit (every instruction set this CPU builds); the layout's
definition, element by element; HF greedy ``generate`` on the float32 model whose linear weights are rounded to
bfloat16 (its biases, norms and embedding kept), token for token, on the three tiny families and the embedded
model, window on and off, with the native layers running.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_helpers import env_with_repo, make_tiny_folder, write_prompts
from helpers import (
    FAMILIES,
    bf16_rounded_linears,
    code_and_chat_ids,
    compiled_adapter,
    hf_greedy,
    one_round,
    random_prompt,
    run_lookahead,
    scratch_region,
    stand_in_builds,
)
from transformers import AutoModelForCausalLM

from lp_runner.backends.adapter import ModelAdapter, causal
from lp_runner.backends.cpu import native
from lp_runner.backends.cpu.prepack import (
    KERNELS,
    NATIVE_BF16_FUSED,
    PackedLinear,
    SharedInputProduct,
    apply_prepack,
    native_unavailable_reason,
    prepack_linears,
)
from lp_runner.config import GenerationConfig, LookaheadConfig, load_config
from lp_runner.decoding.engine import LookaheadEngine
from lp_runner.errors import ConfigError
from lp_runner.models.loading import default_cache_dir

NATIVE_REASON = native_unavailable_reason(torch.nn.Linear(2, 2), default_cache_dir())
# skipped only where the native kernel itself is unavailable: where it runs, its bfloat16 twin must too
pytestmark = pytest.mark.skipif(NATIVE_REASON is not None, reason=f"no native kernel: {NATIVE_REASON}")
BUILDS = {"default": (), **{name: flags for name, (flags, _) in stand_in_builds().items()}}


def _bf16_model(stock: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(stock)
    prepack_linears(model, kernel=KERNELS["native-bf16"])
    return model


def test_the_bf16_product_runs_wherever_the_float32_one_does() -> None:
    """The kernel's load probe finds the bfloat16 product equal to the float32 one on rounded weights (else it
    disables it, and ``model.backend=native-bf16`` would be refused with that reason)."""
    assert native.bf16_unavailable_reason() is None
    assert native_unavailable_reason(torch.nn.Linear(2, 2), default_cache_dir(), torch.bfloat16) is None


def test_the_oracle_rounds_the_linear_weights_and_nothing_else(tiny) -> None:
    """``bf16_rounded_linears``: every linear weight rounded to bfloat16 (and changed: the test model's weights
    are not already bfloat16 values), the tied embedding, norms and biases as they were, the input untouched."""
    stock = tiny("qwen2")  # q/k/v biases
    before = {k: v.clone() for k, v in stock.state_dict().items()}
    rounded = bf16_rounded_linears(stock)
    linears = {n for n, m in stock.named_modules() if type(m) is torch.nn.Linear}
    assert linears
    for name, value in rounded.state_dict().items():
        module, _, kind = name.rpartition(".")
        original = before[name]
        if module in linears and kind == "weight":
            assert torch.equal(value, original.to(torch.bfloat16).float()) and not torch.equal(value, original), name
        else:
            assert torch.equal(value, original), name
    assert all(torch.equal(v, before[k]) for k, v in stock.state_dict().items())


def test_the_layout_is_its_definition() -> None:
    """Block b's row k holds, in 32-bit word i, column b*32 + i (low half) and b*32 + 16 + i (high half), each
    the weight rounded to bfloat16; a partial last block is zero-padded."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(45, 7, generator=gen)
    packed = native.pack(weight, torch.bfloat16)
    assert packed.dtype == torch.bfloat16 and packed.shape == (2, 7, 32)
    rounded = weight.to(torch.bfloat16)
    for b in range(2):
        for k in range(7):
            for i in range(16):
                for half, column in ((0, b * 32 + i), (1, b * 32 + 16 + i)):
                    want = rounded[column, k] if column < 45 else torch.tensor(0.0, dtype=torch.bfloat16)
                    assert packed[b, k, 2 * i + half].view(torch.int16) == want.view(torch.int16), (b, k, i, half)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        native.pack(weight, torch.float16)


@pytest.mark.parametrize("build", list(BUILDS))
def test_product_is_the_float32_product_on_the_rounded_weights(build: str, native_routing) -> None:
    """Row counts across every tile and chunk boundary (AVX-512 8, AVX2 3, SSE2 2; chunked passes past one tile),
    partial blocks, inner sizes below, at and past a 64-k chunk, with and without bias: bit for bit the float32
    product of the same build, and each row alone its own bits."""
    native.route(native.library(str(default_cache_dir()), BUILDS[build]))
    gen = torch.Generator().manual_seed(1)
    for out_features, in_features in ((40, 70), (70, 67), (96, 130), (33, 64)):
        weight = torch.randn(out_features, in_features, generator=gen)
        bias = torch.randn(out_features, generator=gen)
        halves, floats = native.pack(weight, torch.bfloat16), native.pack(weight.to(torch.bfloat16))
        for rows in (1, 2, 3, 4, 7, 8, 9, 16, 17, 25, 65):
            x = torch.randn(rows, in_features, generator=gen)
            for b in (None, bias):
                got = native.product(x, halves, b, out_features)
                assert torch.equal(got, native.product(x, floats, b, out_features)), (out_features, rows)
            assert torch.equal(got[rows - 1 :], native.product(x[rows - 1 :], halves, bias, out_features))
    torch.testing.assert_close(  # and the float32 product is a product: torch's linear on the rounded weight
        got, torch.nn.functional.linear(x, weight.to(torch.bfloat16).float(), bias), rtol=1e-5, atol=1e-4
    )


def test_packing_halves_the_weights_and_names_its_own_kernels(tiny) -> None:
    stock = tiny("llama")
    model = _bf16_model(stock)
    packed = [m for m in model.modules() if isinstance(m, (PackedLinear, SharedInputProduct))]
    assert packed and all(m.packed_weight.dtype == torch.bfloat16 for m in packed)
    adapter = ModelAdapter(model)
    assert adapter.backend.kernels == NATIVE_BF16_FUSED + "-layers"
    assert adapter.backend.whole_layers == stock.config.num_hidden_layers


@pytest.mark.parametrize("family", FAMILIES)
def test_rounds_are_the_float32_rounds_of_the_rounded_model(tiny, family: str) -> None:
    """A prefill and rounds of 1-8 rows through the native layers: logits and K/V bit for bit those of the float32
    native kernel on the model with rounded weights (same layer code, products equal bit for bit)."""
    stock = tiny(family)
    halves = ModelAdapter(_bf16_model(stock))
    floats_model = bf16_rounded_linears(stock)
    prepack_linears(floats_model, kernel=KERNELS["native"])
    floats = ModelAdapter(floats_model)
    assert halves.backend.whole_layers == floats.backend.whole_layers == stock.config.num_hidden_layers
    caches = [scratch_region(a, 64) for a in (halves, floats)]
    prefix = torch.tensor(random_prompt(40, seed=1))
    logits = [
        one_round(a, prefix, torch.arange(40), causal(40), c, torch.tensor([39]))
        for a, c in zip((halves, floats), caches, strict=True)
    ]
    assert torch.equal(*logits)
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 2, 3, 8):
        ids = torch.randint(0, 50, (rows,), generator=gen)
        vis = (torch.rand(rows, rows, generator=gen) < 0.5) | torch.eye(rows, dtype=torch.bool)
        vis = vis.tril()
        positions = 40 + vis.sum(1) - 1
        logits = [
            one_round(a, ids, positions, vis, c, torch.arange(rows))
            for a, c in zip((halves, floats), caches, strict=True)
        ]
        assert torch.equal(*logits), rows
        for a, b in zip(caches[0].arena.layers(), caches[1].arena.layers(), strict=True):
            assert torch.equal(a.keys[:, :, : 40 + rows], b.keys[:, :, : 40 + rows])
            assert torch.equal(a.values[:, :, : 40 + rows], b.values[:, :, : 40 + rows])
        for cache in caches:
            cache.crop(40)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_equals_hf_greedy_on_the_rounded_model(tiny, family: str) -> None:
    """The whole engine, native layers and all, on bfloat16-stored weights: HF greedy on the float32 model with
    those weights rounded, token for token (window on and off)."""
    stock = tiny(family)
    model, oracle = _bf16_model(stock), bf16_rounded_linears(stock)
    assert ModelAdapter(model).backend.whole_layers == stock.config.num_hidden_layers
    for seed in range(3):
        prompt = random_prompt(24, seed=seed)
        expected = hf_greedy(oracle, prompt, 40)
        assert run_lookahead(model, prompt, W=4, N=3, G=4).output_ids == expected, (family, seed, "window")
        assert run_lookahead(model, prompt, W=1, N=4, G=3, lookahead_branch=False).output_ids == expected


def test_backend_asks_for_it_and_auto_never_chooses_it(tiny) -> None:
    """``model.backend=native-bf16`` packs with it; ``auto`` keeps the model's weights (never rounds them); a model
    that is not float32 is refused with a reason naming the dtype; the config takes the value."""
    choice = apply_prepack(copy.deepcopy(tiny("llama")), "native-bf16")
    assert choice.kernel == "native-bf16" and choice.kernels == NATIVE_BF16_FUSED and choice.layers
    auto = apply_prepack(copy.deepcopy(tiny("llama")), "auto")
    assert auto.kernel != "native-bf16"
    with pytest.raises(
        ConfigError, match="native-bf16 stores a float32 model.*this model is bfloat16: set model.dtype=float32"
    ):
        apply_prepack(copy.deepcopy(tiny("llama")).to(torch.bfloat16), "native-bf16")
    assert load_config(None, ["model.backend=native-bf16"]).model.backend == "native-bf16"
    with pytest.raises(ConfigError, match="model.backend"):
        load_config(None, ["model.backend=native-fp16"])


@pytest.mark.slow
def test_embedded_model_equals_hf_greedy_on_its_rounded_weights(embedded, humaneval) -> None:
    """The embedded model on bfloat16-stored weights: code and chat, window on and off, against HF greedy on the
    float32 model with its linear weights rounded."""
    stock, tokenizer = embedded
    model, oracle = _bf16_model(stock), bf16_rounded_linears(stock)
    prompts = code_and_chat_ids(tokenizer, humaneval(2), "Name three rivers in Europe and one fact about each.")
    eos = [tokenizer.eos_token_id]
    for kwargs in ({"W": 5, "N": 4, "G": 5}, {"W": 1, "N": 5, "G": 1, "lookahead_branch": False}):
        for ids in prompts:
            expected = hf_greedy(oracle, ids, 64, eos)
            assert run_lookahead(model, ids, max_new_tokens=64, eos_ids=eos, **kwargs).output_ids == expected


@pytest.mark.slow
def test_cli_runs_the_rounded_model_and_refuses_to_resume_across_it(tmp_path: Path) -> None:
    """``--set model.backend=native-bf16`` through the CLI: HF greedy on the tiny checkpoint with its linear
    weights rounded, the summary and record naming the kernels and the rounding; a ``--resume`` of that file
    on the float32 weights is refused by name (its tokens came from another model)."""
    folder = make_tiny_folder(tmp_path / "model", "llama", seed=3)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "def add(a, b):"}])
    out = tmp_path / "o.jsonl"

    def cli(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "lp_runner", "--prompts", str(prompts), "--output", str(out)]
            + ["--set", f"model.path={folder}", "--set", "model.threads=1", "--set", "generation.max_new_tokens=24"]
            + ["--set", "model.compile=off", *extra],
            env={**env_with_repo(), "LP_RUNNER_CACHE": str(tmp_path / "cache")},
            capture_output=True,
            text=True,
            timeout=600,
        )

    proc = cli("--set", "model.backend=native-bf16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "forward: linear layers native, bfloat16 weights (" in proc.stderr
    record = json.loads(out.read_text().splitlines()[0])
    assert record["policy"]["backend"]["linear_kernels"] == NATIVE_BF16_FUSED
    assert record["config"]["model"]["linear_weights"] == "bfloat16"
    stock = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert record["output_ids"] == hf_greedy(bf16_rounded_linears(stock), record["prompt_ids"], 24)
    resumed = cli("--resume", "--set", "model.backend=auto")
    assert resumed.returncode == 2
    assert "model.linear_weights: 'bfloat16' in the file, '(unset)' now" in resumed.stderr


@pytest.mark.slow
def test_compiled_rounds_equal_hf_greedy_on_the_rounded_model(tiny) -> None:
    """``model.compile`` over bfloat16-stored weights: the opaque native op dispatches on the packed dtype inside
    the compiled graph too."""
    stock = tiny("llama")
    compiled, warm_s = compiled_adapter(_bf16_model(stock))
    assert compiled.backend.kernels == NATIVE_BF16_FUSED and warm_s > 0
    oracle = bf16_rounded_linears(stock)
    la = LookaheadConfig(window_size=4, ngram_size=3, verification_set_size=4)
    engine = LookaheadEngine(compiled, la, GenerationConfig(max_new_tokens=32), [])
    for seed in range(2):
        prompt = random_prompt(20, seed=seed)
        assert engine.generate(prompt).output_ids == hf_greedy(oracle, prompt, 32), seed

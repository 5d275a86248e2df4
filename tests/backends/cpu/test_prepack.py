"""Packed linear layers (the CPU backend, ``model.backend``: oneDNN's inner product or lp_runner's native product):
the same products, the same tokens, and the choice.

Oracles: ``torch.nn.functional.linear`` on the original weights (equal to fp32 rounding) and the packed product of
each row computed alone (bit for bit: a row's product does not depend on the rows beside it); HF greedy
``generate`` on the *unpacked* model for whole generations (the three tiny families and the embedded model, with
and without the Jacobi window); a real CLI run for what the summary and the records say, and that the weights
checksum (what ``--resume`` compares) is the checkpoint's, packed or not.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_helpers import REPO, make_tiny_folder, write_prompts
from helpers import FAMILIES, code_and_chat_ids, compiled_adapter, hf_greedy, random_prompt, run_lookahead

from lp_runner.backends import detect_backend, select_backend
from lp_runner.backends.adapter import ModelAdapter
from lp_runner.backends.cpu import native, prepack
from lp_runner.backends.cpu.native_layers import NATIVE_LAYERS_SUFFIX
from lp_runner.backends.cpu.prepack import (
    KERNELS,
    ONEDNN,
    PackedLinear,
    ProductSlice,
    SharedInputProduct,
    apply_prepack,
    linear_kernels,
    native_unavailable_reason,
    prepack_linears,
    unavailable_reason,
)
from lp_runner.config import GenerationConfig, LookaheadConfig
from lp_runner.decoding.engine import LookaheadEngine
from lp_runner.errors import ConfigError
from lp_runner.models.loading import default_cache_dir, weights_checksum
from lp_runner.tuning.calibrate import calibration_key

pytestmark = pytest.mark.skipif(unavailable_reason(torch.nn.Linear(2, 2)) is not None, reason="no oneDNN here")
# the native product is built here (tests need a C compiler, as torch.compile's inductor does)
NATIVE_REASON = native_unavailable_reason(torch.nn.Linear(2, 2), default_cache_dir())
# oneDNN's bfloat16 inner product needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: an AVX2-only CPU (this project
# has met an AMD EPYC without AVX-512) cannot run it, and prepacking says so (``unavailable_reason``)
BF16_REASON = unavailable_reason(torch.nn.Linear(2, 2, dtype=torch.bfloat16))
KERNEL_KEYS = ["onednn", "native"]


@pytest.fixture(params=KERNEL_KEYS)
def kernel(request) -> prepack.LinearKernel:
    if request.param == "native" and NATIVE_REASON is not None:
        pytest.fail(f"the native product is unavailable here: {NATIVE_REASON}")
    return KERNELS[request.param]


@pytest.mark.parametrize(
    "dtype,kernel_key", [(torch.float32, "onednn"), (torch.bfloat16, "onednn"), (torch.float32, "native")]
)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_torch_linear_and_each_row_alone(dtype: torch.dtype, kernel_key: str, bias: bool) -> None:
    if dtype == torch.bfloat16 and BF16_REASON is not None:
        pytest.skip(BF16_REASON)
    gen = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(576, 1536, bias=bias, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(1536, 576, generator=gen) * 0.02)
        if bias:
            linear.bias.copy_(torch.randn(1536, generator=gen))
    packed = PackedLinear(linear, KERNELS[kernel_key])
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    with torch.inference_mode():
        for rows in (1, 2, 3, 8, 9, 17, 33):  # the native product takes rows 8 at a time
            x = torch.randn(1, rows, 576, generator=gen).to(dtype)  # [B, Q, in] as a decoder layer passes it
            got = packed(x)
            assert got.shape == (1, rows, 1536) and got.dtype == dtype
            torch.testing.assert_close(got, torch.nn.functional.linear(x, linear.weight, linear.bias), **tol)
            alone = torch.cat([packed(x[:, i : i + 1]) for i in range(rows)], dim=1)
            assert torch.equal(got, alone), f"{rows} rows: a row's product depends on the rows beside it"


def test_native_product_in_chunks_keeps_each_rows_bits() -> None:
    """More rows than one register tile walk each block in chunks of 64 inner elements, every row group per chunk
    (and groups of up to 8 tiles at a time), their sums stored and reloaded between chunks; one tile's rows or
    fewer take the whole inner size in one pass. Oracle: each row alone (the one-pass path), bit for bit, and
    torch's linear; inner sizes below, at and across the chunk, row counts across the groups of every ISA's tile
    (AVX-512 8 rows, groups of 64; AVX2 3, 24; 4-float 2, 16)."""
    if NATIVE_REASON is not None:
        pytest.fail(f"the native product is unavailable here: {NATIVE_REASON}")
    gen = torch.Generator().manual_seed(11)
    for in_features in (40, 64, 67, 200):
        weight, bias = torch.randn(70, in_features, generator=gen), torch.randn(70, generator=gen)
        packed = native.pack(weight)
        for rows in (4, 9, 17, 25, 65, 70):
            x = torch.randn(rows, in_features, generator=gen)
            got = native.product(x, packed, bias, 70)
            torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
            alone = torch.cat([native.product(x[r : r + 1], packed, bias, 70) for r in range(rows)])
            assert torch.equal(got, alone), (in_features, rows)


def _count_linears(model: torch.nn.Module) -> int:
    return sum(type(m) is torch.nn.Linear for m in model.modules())


@pytest.mark.parametrize("family", FAMILIES)
def test_prepack_replaces_every_linear_and_leaves_the_rest(tiny, family: str, kernel) -> None:
    model = copy.deepcopy(tiny(family))  # the shared tiny model must not be mutated
    linears, embedding = _count_linears(model), model.get_input_embeddings().weight.detach().clone()
    choice = apply_prepack(model, kernel.key)
    assert choice.layers == linears > 0 and _count_linears(model) == 0
    assert choice.kernels == linear_kernels(model) == kernel.fused_name
    layers = NATIVE_LAYERS_SUFFIX if kernel.key == "native" else ""  # its decoder layers run natively too
    assert ModelAdapter(model).backend.kernels == kernel.fused_name + layers
    assert torch.equal(model.get_input_embeddings().weight, embedding)  # a tied embedding keeps its weights
    layers = model.config.num_hidden_layers
    products = linears - 3 * layers  # per decoder layer q/k/v -> 1 product, gate/up -> 1
    described = {
        "mode": kernel.key,
        "kernels": kernel.fused_name,
        "label": kernel.label,
        "layers": linears,
        "products": products,
        "reason": "as set",
    }
    assert choice.describe() == described
    assert sum(isinstance(m, SharedInputProduct) for m in model.modules()) == 2 * layers
    assert ModelAdapter(tiny(family)).backend.kernels == "torch"


def test_auto_times_the_kernels_that_work_and_takes_the_faster(tiny) -> None:
    """``auto`` with both kernels usable measures them on the model's largest linear and names the figures."""
    model = copy.deepcopy(tiny("llama"))
    choice = apply_prepack(model, "auto")
    assert choice.reason.startswith("measured: native ") and " vs oneDNN-prepacked " in choice.reason
    assert set(choice.measured_ms) == {"native", "onednn"} and all(ms > 0 for ms in choice.measured_ms.values())
    assert choice.kernel == min(choice.measured_ms, key=choice.measured_ms.get)
    assert choice.describe()["measured_ms"] == choice.measured_ms  # in every record
    assert choice.kernels == linear_kernels(model) == KERNELS[choice.kernel].fused_name


def test_a_group_packs_with_the_kernel_rank_0_measured_faster(tiny) -> None:
    """``agree`` (the runner: rank 0's timings over the LP group) decides for every rank, whatever it measured;
    it is called once, also where nothing can be packed (it is a collective)."""
    seen = []

    def rank0(ms):
        seen.append(dict(ms))
        return {"native": 9.0, "onednn": 1.0}

    choice = apply_prepack(copy.deepcopy(tiny("llama")), "auto", agree=rank0)
    assert len(seen) == 1 and set(seen[0]) == {"native", "onednn"}
    assert choice.kernel == "onednn" and choice.measured_ms == {"native": 9.0, "onednn": 1.0}
    assert choice.reason.endswith("(largest linear, 1+8 rows, rank 0's)")
    half = copy.deepcopy(tiny("llama")).to(torch.float16)
    assert apply_prepack(half, "auto", agree=rank0).kernels == "torch" and len(seen) == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_siblings_give_the_bits_of_separate_products(tiny, family: str, kernel) -> None:
    """q/k/v and gate/up as one product each: logits bit for bit those of one product per layer (so fusing changes
    no token), at every row count; each shared product runs once per forward and holds nothing after it."""
    separate, fused = copy.deepcopy(tiny(family)), copy.deepcopy(tiny(family))
    assert prepack_linears(separate, fuse=False, kernel=kernel) == (_count_linears(tiny(family)),) * 2
    assert linear_kernels(separate) == kernel.name
    prepack_linears(fused, kernel=kernel)
    shared = [m for m in fused.modules() if isinstance(m, SharedInputProduct)]
    calls = []
    for m in shared:
        m.product = (lambda original: lambda *a, **k: calls.append(1) or original(*a, **k))(m.product)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 2, 3, 8, 17):
            ids = torch.randint(0, fused.config.vocab_size, (1, rows), generator=gen)
            calls.clear()
            got = fused(ids).logits
            assert len(calls) == len(shared), f"{rows} rows: a sibling missed the shared product"
            assert torch.equal(got, separate(ids).logits), f"{family}, {rows} rows"
    assert all(m._input is None and m._slices == () for m in shared)  # nothing held between forwards


def test_shared_product_recomputes_for_another_or_a_changed_input(kernel) -> None:
    """The memo serves a sibling only the product of the very tensor it is given, unchanged since."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.nn.Linear(16, 8, bias=True), torch.nn.Linear(16, 4, bias=True)
    with torch.no_grad():
        for lin in (a, b):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen))
    shared = SharedInputProduct([a, b], kernel)
    first, second = ProductSlice(shared, 0), ProductSlice(shared, 1)
    x, y = torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen)
    with torch.no_grad():  # not inference mode: its tensors count no in-place changes
        torch.testing.assert_close(first(x), a(x))
        torch.testing.assert_close(second(y), b(y))  # another tensor: not x's product
        torch.testing.assert_close(first(x), a(x))
        x.mul_(2)  # the same tensor, changed in place
        torch.testing.assert_close(second(x), b(x))
        torch.testing.assert_close(second(x), b(x))  # asked twice: computed again, not a stale slice


def test_backends_torch_auto_native_and_what_cannot_be_packed(tiny) -> None:
    """``model.backend``: ``torch`` leaves the model alone; ``auto`` on a model no CPU kernel takes runs torch's
    kernels and says why; ``native`` fails in one line with the reason."""
    cpu = torch.device("cpu")
    model = copy.deepcopy(tiny("llama"))
    plain = select_backend("torch", model, cpu)
    assert (plain.name, plain.kernels, plain.whole_layers) == ("torch", "torch", 0) and _count_linears(model) > 0
    assert plain.summary() == "forward: torch's linear layers, transformers' decoder layers; model.backend=torch"
    half = copy.deepcopy(tiny("llama")).to(torch.float16)
    auto = apply_prepack(half, "auto")
    assert auto.layers == 0 and auto.kernels == "torch"
    assert "native: float16 weights (the native product: float32)" in auto.reason
    assert "oneDNN-prepacked: float16 weights" in auto.reason
    assert _count_linears(half) > 0  # left as it was
    fallback = select_backend("auto", half, cpu)
    assert (fallback.name, fallback.kernels) == ("torch", "torch") and _count_linears(half) > 0
    assert fallback.summary().endswith(
        f"model.backend=auto: lp_runner's CPU kernels cannot run it here ({auto.reason})"
    )
    with pytest.raises(
        ConfigError, match=r"^model.backend=native: native: float16 weights .* use model.backend=auto or torch$"
    ):
        select_backend("native", half, cpu)
    bf16 = copy.deepcopy(tiny("llama")).to(torch.bfloat16)
    with pytest.raises(
        ConfigError, match=r"model.backend=native: native: bfloat16 weights \(the native product: float32\)"
    ):
        apply_prepack(bf16, "native")
    auto = apply_prepack(bf16, "auto")
    if BF16_REASON is None:
        assert auto.kernels == ONEDNN.fused_name  # the one kernel that takes bfloat16
    else:  # a CPU whose oneDNN has no row-independent bfloat16 product: neither kernel, each named with its reason
        assert (auto.layers, auto.kernels) == (0, "torch")
        assert "native: bfloat16 weights (the native product: float32)" in auto.reason
        assert f"oneDNN-prepacked: {BF16_REASON}" in auto.reason


def test_without_a_compiler_auto_keeps_onednn_and_says_why(tiny, tmp_path, monkeypatch) -> None:
    """A machine without a working C compiler: the native build fails with the compiler's first line, ``native``
    refuses, and ``auto`` packs with oneDNN."""
    monkeypatch.setenv("CC", "false")
    with pytest.raises(native.NativeUnavailable, match=r"false could not build lp_runner's native kernels"):
        native.build(tmp_path)
    assert not list((tmp_path / "native").glob("*.so*"))  # no half-written library left behind
    model = copy.deepcopy(tiny("llama"))
    with pytest.raises(ConfigError, match=r"model.backend=native: native: false could not build lp_runner's native"):
        apply_prepack(model, "native", tmp_path)
    choice = apply_prepack(model, "auto", tmp_path)
    assert (choice.kernel, choice.reason) == ("onednn", "the one that works here")


def test_the_native_library_is_built_once_per_source_compiler_and_cpu(tmp_path) -> None:
    first = native.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native.build(tmp_path) == first and first.stat().st_mtime_ns == stamp  # found, not rebuilt
    assert first.parent == tmp_path / "native" and first.name.startswith("lp_native_gemm-")


def test_every_source_file_names_the_build(tmp_path) -> None:
    """The kernels are one library built from every file of ``csrc`` (one C file per kernel and their header): a
    copy of them names the same build, and a change to any one file, the header included, names another (so the
    calibration key's build id moves with it)."""
    copy_dir = tmp_path / "csrc"
    copy_dir.mkdir()
    for source in native.SOURCES:
        (copy_dir / source.name).write_bytes(source.read_bytes())
    assert {s.suffix for s in native.SOURCES} == {".c", ".h"} and len(native.SOURCES) >= 4
    cc = native._compiler()
    path = native._library_path(tmp_path, cc, (), native.sources_at(copy_dir))
    assert path == native._library_path(tmp_path, cc, (), native.SOURCES)
    names = {path.name}
    for source in native.SOURCES:
        edited = copy_dir / source.name
        edited.write_bytes(source.read_bytes() + b"\n/* another version */\n")
        names.add(native._library_path(tmp_path, cc, (), native.sources_at(copy_dir)).name)
        edited.write_bytes(source.read_bytes())
    assert len(names) == len(native.SOURCES) + 1


def test_resume_may_change_the_kernels() -> None:
    """``model.backend`` is how the model runs, not which tokens it gives: the records' digest leaves it out (as it
    leaves out threads), so a job started on the CPU kernels resumes on ``torch`` and the reverse; the dtype stays
    in, and so does the rounding of ``native-bf16``."""
    from lp_runner.config import load_config
    from lp_runner.jobs.output import output_digest, output_settings, settings_diff

    packed, plain = load_config(None, []), load_config(None, ["model.backend=torch"])
    assert output_digest(packed) == output_digest(plain)
    assert output_digest(packed) == output_digest(load_config(None, ["model.backend=native"]))
    assert output_digest(packed) != output_digest(load_config(None, ["model.dtype=bfloat16"]))
    # native-bf16 rounds the linear weights: another model's tokens, so a resume across it is refused by name
    rounded = load_config(None, ["model.backend=native-bf16"])
    assert output_digest(rounded) != output_digest(packed)
    assert settings_diff(output_settings(packed), output_settings(rounded)) == [
        "model.linear_weights: '(unset)' in the file, 'bfloat16' now"
    ]


def test_calibration_and_compile_records_are_per_kernel(tiny) -> None:
    """A prepacked forward has its own cost curve: its calibration (and compile record) key, which takes the
    backend's key fields, differs from torch's and from the other kernels'."""
    from lp_runner.tuning.compile_choice import record_key

    cpu = torch.device("cpu")
    torch_key = calibration_key(cpu, torch.float32, "abc", backend=select_backend("torch", tiny("llama"), cpu).key())
    assert torch_key == calibration_key(cpu, torch.float32, "abc")  # the default: torch's kernels
    keys = {}
    for mode in ("onednn", "native"):
        model = copy.deepcopy(tiny("llama"))
        apply_prepack(model, mode)
        keys[mode] = calibration_key(cpu, torch.float32, "abc", backend=detect_backend(model).key())
        assert record_key(cpu, torch.float32, "abc", detect_backend(model).key()) == keys[mode]
    assert keys["onednn"]["kernels"] == ONEDNN.fused_name and keys["onednn"]["build"] == ""
    assert keys["native"]["kernels"] == KERNELS["native"].fused_name + NATIVE_LAYERS_SUFFIX
    assert keys["native"]["build"] == native.build_id() != ""
    assert len({json.dumps(k, sort_keys=True) for k in (torch_key, *keys.values())}) == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_prepacked_engine_equals_hf_greedy_on_the_unpacked_model(tiny, family: str, kernel) -> None:
    stock = tiny(family)
    model = copy.deepcopy(stock)
    assert prepack_linears(model, kernel=kernel)[0] > 0
    for seed in range(3):
        prompt = random_prompt(24, seed=seed)
        expected = hf_greedy(stock, prompt, 40)
        assert run_lookahead(model, prompt, W=4, N=3, G=4).output_ids == expected, (family, seed, "window")
        assert run_lookahead(model, prompt, W=1, N=4, G=3, lookahead_branch=False).output_ids == expected


@pytest.mark.slow
def test_prepacked_embedded_model_equals_hf_greedy(embedded, humaneval, kernel) -> None:
    """The embedded model, packed, against HF greedy on the stock model: code and chat, window on and off."""
    stock, tokenizer = embedded
    model = copy.deepcopy(stock)
    assert prepack_linears(model, kernel=kernel)[0] == _count_linears(stock)
    prompts = code_and_chat_ids(tokenizer, humaneval(3), "Give three tips for a good night's sleep.")
    settings = (
        LookaheadConfig(window_size=5, ngram_size=4, verification_set_size=5),
        LookaheadConfig(window_size=1, ngram_size=5, verification_set_size=2, lookahead_branch=False),
    )
    for la in settings:
        eos = [tokenizer.eos_token_id]  # the chat answer may end before the budget
        engine = LookaheadEngine(ModelAdapter(model), la, GenerationConfig(max_new_tokens=64), eos)
        for ids in prompts:
            expected = hf_greedy(stock, ids, 64, eos)
            assert engine.generate(ids).output_ids == expected, (la.lookahead_branch, ids[:8])


@pytest.mark.slow
def test_compiled_prepacked_rounds_equal_hf_greedy(tiny, monkeypatch, kernel) -> None:
    """``model.compile`` over packed linears: inductor calls the packed product as an external kernel."""
    stock = tiny("llama")
    model = copy.deepcopy(stock)
    _, products = prepack_linears(model, kernel=kernel)
    compiled, warm_s = compiled_adapter(model)
    assert warm_s > 0
    la = LookaheadConfig(window_size=4, ngram_size=3, verification_set_size=4)
    engine = LookaheadEngine(compiled, la, GenerationConfig(max_new_tokens=32), [])
    for seed in range(2):
        prompt = random_prompt(20, seed=seed)
        assert engine.generate(prompt).output_ids == hf_greedy(stock, prompt, 32), seed
    # the compiled graph shares each sibling group's product too (one call per product, not one per sibling)
    calls = []
    module, name = (prepack, "_onednn_product") if kernel is ONEDNN else (native, "product")
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or original(*a))
    forwards = engine.generate(random_prompt(20, seed=5)).stats.forwards
    assert forwards > 0 and len(calls) == forwards * products, (len(calls), forwards, products)


def _run_cli(
    tmp_path: Path, folder: Path, mode: str, out: str, *extra: str
) -> tuple[subprocess.CompletedProcess, dict]:
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "def add(a, b):"}])
    proc = subprocess.run(
        [sys.executable, "-m", "lp_runner", "--prompts", str(prompts), "--output", str(tmp_path / out)]
        + ["--set", f"model.path={folder}", "--set", f"model.backend={mode}", "--set", "model.threads=1"]
        + ["--set", "generation.max_new_tokens=12", "--set", "model.compile=off", *extra],
        cwd=REPO,
        env={**os.environ, "LP_RUNNER_CACHE": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads((tmp_path / out).read_text().splitlines()[0])


@pytest.mark.slow
def test_cli_says_which_kernels_ran_and_keeps_the_checkpoints_checksum(tmp_path: Path) -> None:
    folder = make_tiny_folder(tmp_path / "model")
    packed_proc, packed = _run_cli(tmp_path, folder, "auto", "packed.jsonl")
    torch_proc, plain = _run_cli(tmp_path, folder, "torch", "plain.jsonl")
    pre = packed["policy"]["backend"]
    chosen = next(k for k in KERNELS.values() if k.label == pre["label"])  # auto: the faster, measured
    assert (
        pre["name"] == "cpu" and pre["linear_kernels"] == chosen.fused_name and pre["reason"].startswith("measured: ")
    )
    assert pre["kernels"] == chosen.fused_name + ("-layers" if pre["native_layers"] else "")  # the forward's
    assert 0 < pre["products"] < pre["layers"]
    assert f"forward: linear layers {pre['label']} (" in packed_proc.stderr and pre["summary"] in packed_proc.stderr
    line = "forward: torch's linear layers, transformers' decoder layers; model.backend=torch"
    assert plain["policy"]["backend"] == {"name": "torch", "mode": "torch", "kernels": "torch", "reason": "",
                                          "summary": line}  # fmt: skip
    assert line in torch_proc.stderr and "linear layers torch" not in torch_proc.stderr
    assert packed["output_ids"] == plain["output_ids"]
    # native products: decoder layers native by default, transformers' layers with advanced.native_layers=false
    layers_proc, layers = _run_cli(tmp_path, folder, "native", "layers.jsonl")
    _, unlayered = _run_cli(tmp_path, folder, "native", "unlayered.jsonl", "--set", "advanced.native_layers=false")
    assert layers["policy"]["backend"]["native_layers"] == 2 and unlayered["policy"]["backend"]["native_layers"] == 0
    assert layers["policy"]["backend"]["kernels"] == unlayered["policy"]["backend"]["kernels"] + "-layers"
    assert ", decoder layers native (2, one call a round); model.backend=native" in layers_proc.stderr
    assert layers["output_ids"] == unlayered["output_ids"] == plain["output_ids"]
    # the checkpoint's checksum either way: a --resume may change model.backend
    from transformers import AutoModelForCausalLM

    assert packed["weights_checksum"] == plain["weights_checksum"]
    assert packed["weights_checksum"] == weights_checksum(AutoModelForCausalLM.from_pretrained(folder))
    # each kernel has its own calibrated curve (native products with and without native layers: two)
    curves = 3 if chosen.key == "native" else 4
    assert len(list((tmp_path / "cache" / "calibration").glob("curve-*.json"))) == curves


def test_a_product_whose_rows_depend_on_each_other_is_refused_for_packing() -> None:
    """The probe behind ``unavailable_reason``: a product that rounds differently with more rows beside a row (as
    oneDNN's bfloat16 one does on a CPU with AMX tiles) is named; one that multiplies each row on its own is not."""

    class PerRow(torch.nn.Module):
        def __init__(self, linear: torch.nn.Linear) -> None:
            super().__init__()
            self.linear = linear

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, Q, in] -> [B, Q, out], each row alone
            return torch.cat([self.linear(x[:, i : i + 1]) for i in range(x.shape[1])], dim=1)

    class Neighbourly(PerRow):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # a row's bits move with the row count
            return super().forward(x) * (1 + 1e-3 * (x.shape[1] - 1))

    assert prepack.row_dependence(torch.float32, PerRow) is None
    reason = prepack.row_dependence(torch.float32, Neighbourly)
    assert reason is not None and "depends on the rows beside it" in reason

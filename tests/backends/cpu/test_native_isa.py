"""The native kernels as other CPUs build them (``csrc/`` picks its register tile by instruction set).

An AVX-512 machine builds and runs the AVX2 tile (``-mno-avx512f``), and any x86-64 machine the SSE2 one
(``-march=x86-64``: 4-float vectors, no FMA), through ``$LP_RUNNER_NATIVE_CFLAGS`` / ``native.library``.
Oracles: the default build's bits for the builds with FMA (every output is the same sum in the same order
whatever the tile), torch's linear to fp32 rounding for the one without, and HF greedy ``generate`` for whole
generations on each build. Where this CPU has no other build to stand in for, the tests are skipped.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_helpers import REPO, make_tiny_folder, write_prompts
from helpers import hf_greedy, one_round, random_prompt, run_lookahead, scratch_region, stand_in_builds

from lp_runner.backends.adapter import ModelAdapter, causal
from lp_runner.backends.cpu import native
from lp_runner.backends.cpu.prepack import KERNELS, native_unavailable_reason, prepack_linears
from lp_runner.models.loading import default_cache_dir

NATIVE_REASON = native_unavailable_reason(torch.nn.Linear(2, 2), default_cache_dir())
OTHER_BUILDS = stand_in_builds()  # name -> (extra flags, same bits as the default build)
pytestmark = [
    pytest.mark.skipif(NATIVE_REASON is not None, reason=f"no native kernel: {NATIVE_REASON}"),
    pytest.mark.skipif(not OTHER_BUILDS, reason="this CPU stands in for no other instruction set"),
]
BUILD_NAMES = list(OTHER_BUILDS) or ["none"]


def _lib(flags: tuple[str, ...]):
    return native.library(str(default_cache_dir()), flags)


@pytest.fixture
def routed_to(native_routing):
    """Route lp_runner's native calls to the library built with the given flags, for the test's duration."""

    def route(flags: tuple[str, ...]) -> None:
        native.route(_lib(flags))

    return route


def _product(lib, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.empty(x.shape[0], n)
    status = lib.lp_native_gemm_f32(
        x.data_ptr(), packed.data_ptr(), bias.data_ptr(), out.data_ptr(), x.shape[0], n, x.shape[1], 2
    )
    assert status == 0
    return out


@pytest.mark.parametrize("build", BUILD_NAMES)
def test_products_of_every_tile_size(build: str) -> None:
    """Row counts across every tile boundary (AVX-512 passes of 8 rows, AVX2 of 3, SSE2 of 2), a partial last
    block and an odd inner size: the default build's bits (FMA builds), torch's linear to fp32 rounding."""
    flags, bitwise = OTHER_BUILDS[build]
    default, other = _lib(()), _lib(flags)
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(70, 67, generator=gen), torch.randn(70, generator=gen)
    packed = native.pack(weight)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 16, 17):
        x = torch.randn(rows, 67, generator=gen)
        got, want = _product(other, x, packed, bias, 70), _product(default, x, packed, bias, 70)
        if bitwise:
            assert torch.equal(got, want), rows
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
        for r in range(rows):  # a row's result does not depend on the rows beside it
            assert torch.equal(got[r : r + 1], _product(other, x[r : r + 1], packed, bias, 70)), (rows, r)


@pytest.mark.parametrize("build", BUILD_NAMES)
def test_attention_on_each_build(build: str, routed_to) -> None:
    """The attention kernel for head sizes of every path (16-lane groups: 1, 2, 3, 4 and 8 of them, specialised
    or not; 40: the scalar path), tasks of 1-4 rows, hidden keys, with and without a prefix of keys every row sees
    (read without mask checks): the default build's bits (FMA builds), torch's sdpa to fp32 rounding."""
    flags, bitwise = OTHER_BUILDS[build]
    gen = torch.Generator().manual_seed(5)
    hidden = torch.finfo(torch.float32).min
    for dim, kv_heads, queries, groups, keys, seen in (  # seen: keys every row sees (a cached prefix)
        (16, 2, 5, 2, 40, 0),
        (32, 2, 3, 3, 50, 0),
        (48, 1, 4, 2, 33, 0),
        (64, 3, 8, 3, 70, 0),
        (64, 3, 8, 3, 90, 49),
        (128, 2, 2, 4, 90, 0),
        (128, 2, 3, 4, 80, 64),
        (40, 2, 3, 2, 30, 0),
    ):
        q = torch.randn(kv_heads, queries * groups, dim, generator=gen)
        k, v = (torch.randn(kv_heads, keys, dim, generator=gen) for _ in range(2))
        mask = torch.zeros(queries, keys).masked_fill(torch.rand(queries, keys, generator=gen) < 0.3, hidden)
        mask[:, 0] = 0.0
        mask[:, :seen] = 0.0
        out = {}
        for name in ("default", build):
            routed_to(() if name == "default" else flags)
            out[name] = native.attention(q, k, v, mask, dim**-0.5)
        if bitwise:
            assert torch.equal(out[build], out["default"]), dim
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.repeat(groups, 1), scale=dim**-0.5
        )
        torch.testing.assert_close(out[build], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("build", BUILD_NAMES)
def test_rounds_on_each_build(tiny, build: str, routed_to) -> None:
    """Whole native rounds (decoder layers, attention, the model loop) of 1-9 rows over a cached prefix on the
    other build: the default build's logits bit for bit (FMA builds), else to fp32 rounding, argmax equal."""
    flags, bitwise = OTHER_BUILDS[build]
    model = copy.deepcopy(tiny("llama"))
    prepack_linears(model, kernel=KERNELS["native"])
    adapter = ModelAdapter(model)
    assert adapter.backend.whole_layers == model.config.num_hidden_layers
    prefix = torch.tensor(random_prompt(30, seed=3))
    logits: dict[str, list[torch.Tensor]] = {}
    for name in ("default", build):
        routed_to(() if name == "default" else flags)
        cache = scratch_region(adapter, 48)
        one_round(adapter, prefix, torch.arange(30), causal(30), cache, torch.tensor([29]))
        logits[name] = []
        for rows in (1, 3, 4, 9):
            ids = torch.randint(0, 50, (rows,), generator=torch.Generator().manual_seed(rows))
            positions = torch.arange(30, 30 + rows)
            logits[name].append(one_round(adapter, ids, positions, causal(rows), cache, torch.arange(rows)))
            cache.crop(30)
    for got, want in zip(logits[build], logits["default"], strict=True):
        if bitwise:
            assert torch.equal(got, want)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("build", BUILD_NAMES)
def test_generations_on_each_build_are_hf_greedy(tiny, build: str, routed_to) -> None:
    """The engine on native products and layers built for the other instruction set: HF greedy's tokens
    (window on and off)."""
    flags, _ = OTHER_BUILDS[build]
    routed_to(flags)
    stock = tiny("llama")
    model = copy.deepcopy(stock)
    prepack_linears(model, kernel=KERNELS["native"])
    for seed, window in ((1, True), (2, False)):
        prompt = random_prompt(16, seed=seed)
        got = run_lookahead(model, prompt, W=4, N=3, G=3, max_new_tokens=30, lookahead_branch=window)
        assert got.output_ids == hf_greedy(stock, prompt, 30), window


@pytest.mark.slow
def test_cli_builds_from_the_flags_in_the_environment(tmp_path: Path) -> None:
    """``$LP_RUNNER_NATIVE_CFLAGS`` reaches the build: a job on the AVX2 build (or the x86-64 one) writes the
    default build's tokens and a library of its own name in the cache."""
    name = next(iter(OTHER_BUILDS))
    flags, _ = OTHER_BUILDS[name]
    folder = make_tiny_folder(tmp_path / "model")
    prompts = write_prompts(tmp_path / "p.jsonl", [{"id": "a", "prompt": "def add(a, b):"}])
    records = {}
    for label, env_flags in (("default", ""), (name, " ".join(flags))):
        out = tmp_path / f"{label}.jsonl"
        proc = subprocess.run(
            [sys.executable, "-m", "lp_runner", "--prompts", str(prompts), "--output", str(out)]
            + ["--set", f"model.path={folder}", "--set", "model.backend=native", "--set", "model.threads=1"]
            + ["--set", "generation.max_new_tokens=16", "--set", "model.compile=off"],
            cwd=REPO,
            env={**os.environ, "LP_RUNNER_CACHE": str(tmp_path / "cache"), native.EXTRA_FLAGS_ENV: env_flags},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        assert "decoder layers native (" in proc.stderr
        records[label] = json.loads(out.read_text().splitlines()[0])
    assert records[name]["output_ids"] == records["default"]["output_ids"]
    assert len(list((tmp_path / "cache" / "native").glob("lp_native_gemm-*.so"))) == 2  # one per flags


CROSS_CC, QEMU = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
HARNESS = Path(__file__).with_name("native_harness.c")


def _harness_outputs(tmp_path: Path, name: str, compiler: list[str], runner: list[str]) -> list[str]:
    exe = tmp_path / name
    sources = [str(s) for s in native.SOURCES if s.suffix == ".c"]
    cmd = [*compiler, "-O3", "-fopenmp", "-I", str(native.SOURCE_DIR), str(HARNESS), *sources, "-lm", "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    proc = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300, check=True)
    return proc.stdout.split()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="compares an aarch64 build with this x86-64 one")
@pytest.mark.skipif(not (CROSS_CC and QEMU), reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt)")
def test_an_aarch64_build_gives_this_machines_bits(tmp_path: Path) -> None:
    """The NEON tile (4-float vectors, 2 rows x 8), cross-built for aarch64 and run under qemu: products of 1-17
    rows, attention for every head-size path and a whole decoder layer (K/V written included) print the same
    bits as this machine's own build (``tests/native_harness.c``). A development check: CI has no cross tools."""
    cc = shutil.which("cc") or "gcc"
    here = _harness_outputs(tmp_path, "native", [cc, "-march=native"], [])
    arm = _harness_outputs(tmp_path, "aarch64", [CROSS_CC, "-march=armv8-a"], [QEMU, "-L", "/usr/aarch64-linux-gnu"])
    assert len(here) == len(arm) == 15606
    differing = [i for i, (a, b) in enumerate(zip(here, arm, strict=True)) if a != b]
    assert not differing, (len(differing), differing[:5])

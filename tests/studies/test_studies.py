"""The study instruments produce what they promise: plots exist with the axes their JSON names, and the forward
cost benchmark's curve reads back into the cost model the tuner uses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_helpers import REPO, env_with_repo

pytest.importorskip("matplotlib")

from benchmarks import compare, scaling  # noqa: E402
from lp_runner.tuning.costmodel import CostCurve  # noqa: E402


def _entry(speedup: float, tpf: float | None) -> dict:
    d = {"tokens_per_s": 10 * speedup, "speedup": speedup}
    if tpf is not None:
        d["tokens_per_forward"] = tpf
    return d


def test_compare_plot_and_axes(tmp_path):
    report = {
        "date": "2026-11-30",
        "machine": "test",
        "max_new_tokens": 8,
        "methods": {
            "hf-greedy": {s: _entry(1.0, 1.0) for s in ("all", "humaneval", "mtbench")},
            "hf-prompt-lookup": {s: _entry(1.1, None) for s in ("all", "humaneval", "mtbench")},
            "lean-g2": {s: _entry(1.3, 1.8) for s in ("all", "humaneval", "mtbench")},
        },
    }
    png = tmp_path / "c.png"
    compare.plot(report, png)
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert report["plot"]["left"] == {"x_label": "method", "y_label": "speedup vs HF greedy (tokens/s ratio)"}
    assert report["plot"]["right"]["y_label"] == "tokens per forward"
    assert "| lean-g2 | 13.00 | 1.30x |" in compare.markdown(report)


def test_scaling_plot_and_simulated_labels(tmp_path):
    report = {
        "date": "2026-11-30",
        "wng": [15, 5, 15],
        "prompts": 2,
        "max_new_tokens": 8,
        "collective": {"all_gather_us": 300.0},
        "setups": {
            "P1-1thread": {"workers": 1, "threads_per_worker": 1, "token_ms": 100.0, "tokens_per_s": 10.0},
            "P2-1thread-each": {"workers": 2, "threads_per_worker": 1, "token_ms": 80.0, "tokens_per_s": 12.5},
        },
        "simulation": {
            "simulated": True,
            "inputs": {
                "curve_threads": 1,
                "host_us_per_round": 500.0,
                "allgather_2_rank_us": 300.0,
                "comm_assumption": "ring",
            },
            "validation": {"p1_forward_ms_per_round_measured": 210.0, "p1_forward_ms_per_round_predicted": 200.0},
            "x_label": "workers P",
            "y_label": "per-token latency (ms)",
            "points": [
                {
                    "workers": p,
                    "simulated": True,
                    "token_ms": 100.0 / p**0.5,
                    "round_ms": 200.0 / p**0.5,
                    "rows_max_rank": 80.0 / p,
                    "comm_ms_per_round": 0.3 * (p - 1),
                }
                for p in range(1, 5)
            ],  # fmt: skip
        },
    }
    png = tmp_path / "s.png"
    scaling.plot(report, png)
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    md = scaling.markdown({**report, "setups": {}})
    assert "**Simulated**" in md and "| 4 | 50.0 | 0.50x |" in md
    assert "forward 210.0 ms/round measured, 200.0 predicted" in md
    assert all(p["simulated"] for p in report["simulation"]["points"])


def test_scaling_throughput_view_labels_measured_and_simulated(tmp_path):
    """Job tokens/s vs D x P: measured setups (a stored report's one-group rate; a D=2 setup with its job line)
    and every split D x P <= 4 simulated from the per-token latency at P (100 / sqrt(P) ms), by hand: 4 devices
    give D=4 x P=1 40, D=2 x P=2 28.28 and D=1 x P=4 20 tokens/s. Points of another setting reach the table only."""
    report = {
        "date": "2026-12-01",
        "wng": [15, 5, 15],
        "prompts": 2,
        "max_new_tokens": 8,
        "collective": {"all_gather_us": 300.0},
        "setups": {
            "P1-1thread": {"workers": 1, "threads_per_worker": 1, "token_ms": 100.0, "tokens_per_s": 10.0},
            "D2P1-1thread-each": {
                "groups": 2, "workers": 1, "threads_per_worker": 1, "token_ms": 110.0, "tokens_per_s": 9.0,
                "job_tokens_per_s": 17.5,
            },
            "D2P1-no-job-line": {
                "groups": 2, "workers": 1, "threads_per_worker": 1, "token_ms": 1.0, "tokens_per_s": 1.0,
            },
        },
        "identical_outputs": True,
        "p2_token_latency_vs_p1_1thread": 1.0,
        "p2_token_latency_vs_p1_2threads": 1.0,
        "simulation": {
            "inputs": {
                "curve_threads": 1, "host_us_per_round": 1.0, "allgather_2_rank_us": 1.0, "comm_assumption": "-",
            },
            "x_label": "workers P",
            "y_label": "per-token latency (ms)",
            "points": [{"workers": p, "simulated": True, "token_ms": 100.0 / p**0.5, "round_ms": 1.0,
                        "rows_max_rank": 1.0, "comm_ms_per_round": 0.0} for p in range(1, 5)],
        },
    }  # fmt: skip
    other = {"date": "2026-12-01", "prompts": 16, "config": "configs/default.yaml", "setups": [
        {"setup": "D=2 x P=1, 1 thread", "groups": 2, "workers": 1, "threads_per_rank": 1, "job_tokens_per_s": 26.7},
    ]}  # fmt: skip
    view = scaling.throughput(report, other)
    assert (view["x_label"], view["y_label"]) == ("devices D x P", "job tokens/s")
    assert {p["label"] for p in view["points"]} == {"measured", "simulated"}
    measured = {
        (p["setup"], p["groups"], p["workers"]): p["tokens_per_s"] for p in view["points"] if p["label"] == "measured"
    }
    assert measured == {  # the D=2 setup without a job line has no job rate: left out, not guessed
        ("P1-1thread", 1, 1): 10.0, ("D2P1-1thread-each", 2, 1): 17.5, ("D=2 x P=1, 1 thread", 2, 1): 26.7,
    }  # fmt: skip
    sim = {(p["groups"], p["workers"]): p["tokens_per_s"] for p in view["points"] if p["label"] == "simulated"}
    assert sorted(sim) == sorted([(1, 1), (2, 1), (1, 2), (3, 1), (1, 3), (4, 1), (2, 2), (1, 4)])
    assert [sim[(4, 1)], sim[(2, 2)], sim[(1, 4)]] == pytest.approx([40.0, 2000 / (100 / 2**0.5), 20.0], abs=1e-2)
    four = view["best_simulated"][3]
    assert (four["lowest_latency"]["workers"], four["highest_throughput"]["groups"]) == (4, 4)
    report["throughput"] = view
    md = scaling.markdown({**report, "setups": {}})  # the measured-setup table needs fields these lack
    assert "**Throughput view**" in md and "| D=2 x P=1 | 2 | 1 | 17.50 | 1.75x | 110.0 | measured |" in md
    assert "| D=2 x P=2 | 4 | 1 | 28.28 | 2.83x | 70.7 | simulated |" in md
    assert "| 4 | D=1 x P=4, 50.0 ms/token | D=4 x P=1, 40.00 tokens/s |" in md
    png = tmp_path / "t.png"
    scaling.plot(report, png)
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_forward_cost_benchmark_writes_curve_plot_and_axes(tmp_path):
    out = tmp_path / "fc"
    cmd = [
        sys.executable, str(REPO / "benchmarks/forward_cost.py"), "--random-llama", "tiny", "--rows", "1", "3",
        "--prefix", "8", "16", "--reps", "2", "--threads", "1", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env_with_repo())
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.with_suffix(".json").read_text())
    assert (data["x_label"], data["y_label"]) == ("packed rows Q", "forward ms")
    assert sorted((c["prefix"], c["rows"]) for c in data["curves"]) == [(8, 1), (8, 3), (16, 1), (16, 3)]
    curve = CostCurve.from_dict(data["curve"])  # what `lp_runner tune --curve` reads
    assert curve.kv_lens == [8, 16] and curve.seconds(2, kv_len=12) > 0
    assert out.with_suffix(".png").stat().st_size > 1000
    md = out.with_suffix(".md").read_text()
    assert "copy bandwidth" in md and "| prefix | rows Q |" in md
    # every point's distance to the machine limit: the limit is positive and below the measured forward
    assert data["copy_gb_s"] > 0 and data["matmul_gflop_s"] > 0
    for c in data["curves"]:
        assert c["limit_ms"] > 0 and c["x_limit"] > 1, c
        # each forward against the limits timed right before it (a copy and a matmul): never below them
        assert c["x_limit_paired"] > 1 and c["x_memory_limit_paired"] >= c["x_limit_paired"], c
        bound, pairs = c["compute_bound_pairs"].split("/")
        assert int(pairs) == 2 + 4 and 0 <= int(bound) <= int(pairs), c  # reps + 4 pairs
    assert "| x limit, paired | x memory limit, paired | compute-bound pairs |" in md


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("rows, logit_rows", [(1, 1), (6, 1), (6, 6)])
def test_forward_flops_equal_torch_flop_counter(tied, rows, logit_rows):
    """The compute limit's FLOPs are the forward's matrix products as torch counts them (eager attention, whose
    products are matmuls; heads x head dim = hidden in the tiny model, where the attention term is exact)."""
    from helpers import tiny_model
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.machine_limits import forward_flops

    model = tiny_model("llama", 0, tie_word_embeddings=tied, attn_implementation="eager")
    ids = torch.randint(0, model.config.vocab_size, (1, rows))
    with FlopCounterMode(display=False) as counter:
        model(ids, logits_to_keep=logit_rows)
    assert forward_flops(model, rows, 0, logit_rows=logit_rows) == counter.get_total_flops()


def test_matmul_size_fits_the_budget_and_stops_at_the_largest():
    """The limits' matmul is as large as asked where it is quick, and only shrinks where one would run past its
    budget (a CPU without bf16 instructions: 2048-square bf16 took 14 s there)."""
    from benchmarks.machine_limits import matmul_size

    cpu = torch.device("cpu")
    assert matmul_size(cpu, torch.float32, 512, budget_s=60.0) == 512  # quick: the largest, never beyond
    assert matmul_size(cpu, torch.float32, 128, budget_s=60.0) == 128  # a largest under the first size
    assert matmul_size(cpu, torch.float32, 4096, budget_s=0.0) == 256  # no budget: the first size
    assert matmul_size(cpu, torch.float32, 600, budget_s=60.0) == 600  # not a power of two: still the largest


def test_perfect_choice_bound_verifies_every_sources_first_proposal():
    """``global_pool.FirstOfEachCoordinator`` (the G=1 bound): each source's first proposal is a candidate of the
    round, so the simulation keeps whichever verifies longest; on a job where the store knows the answer and the
    prompt's own text misleads, the bound reaches the store's continuation while the shipped G=1 order (context
    first at equal match length) does not."""
    import dataclasses

    from benchmarks import global_pool
    from lp_runner.decoding.coordinator import Coordinator
    from lp_runner.decoding.job_store import JobPool

    la = dataclasses.replace(global_pool.SETTINGS["G1"], pool_scope="job", pool_max_tokens=1000)
    store = JobPool(1000)
    store.add((), (7, 8, 9, 10, 11, 12))  # an earlier output: 7 8 is followed by 9 10 11 12
    history = [5, 7, 8, 3, 5, 7, 8]  # the prompt's own text: 7 8 was followed by 3
    plans = {}
    for name, cls in (("bound", global_pool.FirstOfEachCoordinator), ("shipped", Coordinator)):
        coord = cls(la, 1, history[:4], store=store)
        coord.observe((), history, 3)
        plans[name] = coord.plan(history, None)
    assert {p.source for p in plans["bound"].proposals} >= {"context", "job"}
    assert (9, 10, 11, 12) in [c[:4] for c in plans["bound"].candidates]
    assert [p.source for p in plans["shipped"].proposals] == ["context"]  # G=1: the context index's, first
    rows = [
        {"set": "mtbench", "prompt_ids": [5, 7, 8, 3, 1], "output_ids": [7, 8, 9, 10, 11, 12, 2]},
        {"set": "mtbench", "prompt_ids": [5, 7, 8, 3, 1], "output_ids": [7, 8, 9, 10, 11, 12, 2]},
    ]
    bound_run = global_pool.simulate_job(la, rows, JobPool(1000), coordinator=global_pool.FirstOfEachCoordinator)
    shipped_run = global_pool.simulate_job(la, rows, JobPool(1000))
    assert bound_run[0] == shipped_run[0]  # the first prompt: an empty store, the same candidates
    assert bound_run[1][1] < shipped_run[1][1]  # the second: the store's continuation wins, fewer forwards


def test_native_isa_compares_every_build_with_the_first_one():
    """`native_isa.py --builds avx2 --baseline OLD.c` has no build named 'default': the first build is the reference
    (it raised KeyError). Two loads of the same build, on a tiny model whose linears take the native product:
    the same bits, and each row count priced in its own one-row forwards."""
    from helpers import tiny_model

    from benchmarks import native_isa
    from lp_runner.backends.cpu import native
    from lp_runner.backends.cpu.prepack import NATIVE_KERNEL, native_unavailable_reason, prepack_linears
    from lp_runner.models.loading import default_cache_dir

    model = tiny_model("llama")
    if (reason := native_unavailable_reason(model, default_cache_dir())) is not None:
        pytest.skip(reason)
    prepack_linears(model, kernel=NATIVE_KERNEL)
    lib = native.library(str(default_cache_dir()), native.extra_flags())
    libs = {"first": lib, "second": native.open_library(Path(lib._name))}
    forwards = native_isa.time_forwards(libs, model, [1, 3], reps=2, prefix=4)
    assert [row["rows"] for row in forwards] == [1, 3]
    assert all(row["second bits equal"] and row["max |logit second - first|"] == 0.0 for row in forwards)
    assert forwards[0]["first x one row"] == forwards[0]["second x one row"] == 1.0
    assert forwards[1]["ms second / first"] > 0
    result = {"date": "d", "device": "cpu", "threads": 1, "reps": 2, "baseline": "", "forwards": forwards}
    result |= {
        "builds": {"first": [], "second": []},
        "products": [{"rows": 1, **{f"{k} {n}": 1.0 for k in ("ms", "GB/s") for n in libs}}],
    }
    text = native_isa.markdown(result)
    assert "| second / first | logits equal to first |" in text and "second: bits" in text


def test_attention_kernels_times_a_baseline_build_beside_this_one():
    """`attention_kernels.py --baseline OLD.c` times another build of the kernels in the same loop, routing each in
    before its calls, and compares the outputs: two loads of the same build give the same bits, sdpa's output to
    fp32 rounding, and the process is left routed to this source's build."""
    from benchmarks import attention_kernels
    from lp_runner.backends.cpu import native
    from lp_runner.models.loading import default_cache_dir

    try:
        lib = native.library(str(default_cache_dir()), native.extra_flags())
    except native.NativeUnavailable as exc:
        pytest.skip(str(exc))
    libs = {"native": lib, "native@base": native.open_library(Path(lib._name))}
    gen = torch.Generator().manual_seed(0)
    rows, keys, hidden = 2, 40, torch.finfo(torch.float32).min
    query = torch.randn(3, 3 * rows, 64, generator=gen)
    key, value = (torch.randn(3, keys, 64, generator=gen) for _ in range(2))
    mask = torch.zeros(rows, keys)
    mask[:, 30:] = hidden
    mask[1, 29] = hidden
    quartile, outputs = attention_kernels._time_kernels(query, key, value, mask, 3, 0.125, calls=3, libs=libs)
    assert set(quartile) == {"native", "native@base", "sdpa"} and all(t > 0 for t in quartile.values())
    assert torch.equal(outputs["native"], outputs["native@base"])
    torch.testing.assert_close(outputs["native"], outputs["sdpa"], rtol=1e-4, atol=1e-5)
    assert native.routed().attention is lib.lp_native_attention_f32


def test_roofline_curve_is_flat_until_matmuls_outrun_the_weights_read() -> None:
    """A named GPU's roofline for the embedded model's shape: 1 to 64 rows cost the weights' read (equal to
    rounding), 512 rows cost more (the matmuls dominate); the label names the GPU and its two limits; a longer
    K/V costs more; the LM head on every row costs more than on one."""
    from benchmarks.gpu_rounds import EMBEDDED_SHAPE

    curve, label = scaling.roofline_curve("H100-SXM", EMBEDDED_SHAPE, [256, 4096])
    assert "H100-SXM" in label and "3.35 TB/s" in label and "989" in label and "exact row count" in label
    one, sixty_four = curve.seconds(1, 1, 256), curve.seconds(64, 1, 256)
    assert sixty_four < 1.02 * one and curve.seconds(512, 1, 256) > 1.5 * one
    assert curve.seconds(1, 1, 4096) > one
    assert curve.seconds(512, 512, 256) > curve.seconds(512, 1, 256)
    values = one * 3.35e12 * curve.bandwidth_fraction / 2  # one row reads bytes at the bandwidth; bf16: 2 bytes
    assert 1.3e8 < values < 1.45e8  # the embedded model's ~135M weights and 256 positions of K/V


def test_gpu_curve_reads_the_gpu_checks_captured_rounds(tmp_path) -> None:
    """``--curve gpu:`` reads ``gpu_rounds.py buckets``' JSON: each bucket's captured round at its rows, the device
    named in the label; a simulated report on it says so and puts the paper's reported figures beside it, and a
    report on this CPU's curve does not."""
    data = {
        "device_name": "NVIDIA H200", "dtype": "torch.bfloat16", "model": "random weights, the embedded shape",
        "prefix": 512, "buckets": {"2": {"captured_ms": 1.0}, "64": {"captured_ms": 1.1}, "512": {"captured_ms": 3.0}},
    }  # fmt: skip
    path = tmp_path / "buckets.json"
    path.write_text(json.dumps(data))
    curve, label = scaling.curve_for(f"gpu:{path}", {}, [512])
    assert "NVIDIA H200" in label and "captured" in label
    assert curve.seconds(2, 2, 512) == pytest.approx(1e-3) and curve.seconds(512, 512, 512) == pytest.approx(3e-3)
    assert scaling.curve_for("cpu", {}, [512]) is None
    with pytest.raises(SystemExit, match="roofline:NAME"):
        scaling.curve_for("roofline:nonesuch", {}, [512])
    points = [{"workers": p, "token_ms": 10.0 / p, "round_ms": 20.0, "rows_max_rank": 8.0, "comm_ms_per_round": 0.1}
              for p in (1, 2)]  # fmt: skip
    inputs = {"curve_threads": 1, "host_us_per_round": 50.0, "allgather_2_rank_us": 300.0, "comm_assumption": "ring"}
    report = {"date": "d", "wng": [7, 5, 7], "prompts": 1, "max_new_tokens": 8, "collective": {"all_gather_us": 1},
              "setups": {}}  # fmt: skip
    on_gpu = scaling.markdown({**report, "simulation": {"inputs": {**inputs, "curve_source": label}, "points": points}})
    assert f"forward-cost curve: {label}" in on_gpu and "as the Lookahead paper reports them" in on_gpu
    assert "up to ~4x with 8 GPUs" in on_gpu
    on_cpu = scaling.markdown({**report, "simulation": {"inputs": inputs, "points": points}})
    assert "Lookahead paper" not in on_cpu and "this CPU, measured" in on_cpu

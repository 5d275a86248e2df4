"""A rank's device (``lp_runner.device``) and how the start-up path uses it on a multi-GPU node.

What runs here for real: the placement rules, the CLI's parent-side checks, the loader's straight-to-device path
(onto ``meta``, a device that is not the host), a gloo pair for the bounded wait. What cannot run on this CPU
machine (CUDA, NCCL) is a recorded stand-in: ``torch.cuda`` and ``torch.distributed`` calls are replaced by
recorders, and the tests assert the order of the calls and the devices and groups they carry — the defects a
review of the never-run GPU path found: no ``set_device`` (every rank's object collectives on GPU 0), start-up
strings over NCCL, a stalled NCCL peer waited for without a bound, syncs of the wrong GPU, and a full host copy of
the model per rank.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import REPO, env_with_repo, free_port

from lp_runner.config import load_config
from lp_runner.device import (
    Placement,
    bind,
    check_placement,
    fp32_precision_readings,
    resolve_device,
    resolve_dist_backend,
    resolve_dtype,
    synchronizer,
)
from lp_runner.errors import ConfigError, DistributedError

CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


# ---------------------------------------------------------------- the rules (pure)


@pytest.mark.parametrize(
    "spec, local_rank, gpus, expected",
    [
        ("auto", 0, 0, CPU),  # no CUDA: the host
        ("auto", 1, 8, CUDA1),  # torchrun on an 8-GPU node: each rank its own GPU
        ("cuda", 1, 2, CUDA1),
        ("cuda:0", 1, 1, CUDA0),  # explicit: every local rank on GPU 0 (shared over gloo)
        ("cpu", 3, 8, CPU),
    ],
)
def test_resolve_device(spec, local_rank, gpus, expected) -> None:
    assert resolve_device(spec, local_rank, gpus) == expected


@pytest.mark.parametrize(
    "spec, local_rank, gpus, message",
    [
        ("cuda:3", 0, 1, "model.device=cuda:3 but this node has 1 GPU (cuda:0..cuda:0)"),
        ("cuda", 2, 2, "local rank 2 has no GPU of its own: this node has 2 GPUs"),  # more local ranks than GPUs
        ("auto", 1, 1, "local rank 1 has no GPU of its own: this node has 1 GPU"),
        ("cuda", 0, 0, "model.device=cuda but CUDA is not available on this machine"),
    ],
)
def test_unplaceable_devices_are_one_line_config_errors(spec, local_rank, gpus, message) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_device(spec, local_rank, gpus)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "backend, spec, local_ranks, gpus, expected",
    [
        ("auto", "auto", 8, 8, "nccl"),  # a GPU per rank
        ("auto", "cuda:0", 2, 1, "gloo"),  # two ranks share GPU 0: NCCL would refuse
        ("auto", "cpu", 2, 8, "gloo"),
        ("auto", "auto", 2, 0, "gloo"),
        ("gloo", "auto", 8, 8, "gloo"),  # as set
        ("nccl", "cuda:0", 1, 1, "nccl"),
    ],
)
def test_resolve_dist_backend(backend, spec, local_ranks, gpus, expected) -> None:
    assert resolve_dist_backend(backend, spec, local_ranks, gpus) == expected


@pytest.mark.parametrize(
    "spec, local_ranks, gpus, message",
    [
        ("auto", 2, 0, "parallel.dist_backend=nccl needs CUDA devices, and this machine has none; use gloo"),
        ("cpu", 2, 4, "needs the model on GPUs (model.device=cpu)"),
        ("cuda:0", 2, 2, "puts the 2 ranks of this node on one GPU"),
    ],
)
def test_nccl_without_a_gpu_per_rank_is_a_config_error(spec, local_ranks, gpus, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_dist_backend("nccl", spec, local_ranks, gpus)


def test_check_placement_covers_every_local_rank() -> None:
    check_placement("cuda", "auto", 4, 4)
    with pytest.raises(ConfigError, match="local rank 4 has no GPU"):
        check_placement("cuda", "auto", 5, 4)  # five ranks on a 4-GPU node: the fifth has none
    check_placement("cuda:0", "gloo", 2, 1)  # two ranks sharing one GPU over gloo (benchmarks/gpu_check.sh)


@pytest.mark.parametrize(
    "spec, device, bf16, expected",
    [
        ("auto", CPU, False, (torch.float32, False, "auto: float32 on a CPU")),
        ("auto", CUDA0, True, (torch.bfloat16, True, "auto: bfloat16 on CUDA")),
        ("auto", CUDA0, False, (torch.float16, True, "auto: float16 on CUDA (no bfloat16 on this GPU)")),
        ("float32", CUDA0, True, (torch.float32, False, "as set")),  # written out: IEEE fp32, no TF32
        ("bfloat16", CPU, False, (torch.bfloat16, False, "as set")),
    ],
)
def test_resolve_dtype(spec, device, bf16, expected) -> None:
    assert resolve_dtype(spec, device, bf16) == expected


def test_auto_dtype_is_the_default_and_float32_on_this_cpu() -> None:
    from lp_runner.device import place

    cfg = load_config(None, [])
    assert cfg.model.dtype == "auto"
    placement = place(cfg.model.device, cfg.model.dtype)
    if not torch.cuda.is_available():
        assert (placement.device, placement.dtype, placement.tf32) == (CPU, torch.float32, False)


# ---------------------------------------------------------------- recorded stand-in of CUDA and NCCL


class FakeGroup:
    def __init__(self, backend: str, ranks: list[int] | None) -> None:
        self.backend, self.ranks = backend, ranks

    def __repr__(self) -> str:
        return f"FakeGroup({self.backend}, {self.ranks})"


class StalledWork:
    """An NCCL all_gather whose peer never joins: queued, never completed (``wait`` does not block the host)."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        return True


class Node:
    """A 2-GPU node as rank ``rank`` of 2 sees it: every torch.cuda / torch.distributed call is recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, rank: int = 1, gpus: int = 2) -> None:
        self.calls: list[tuple] = []
        self.initialized = False
        self.world = FakeGroup("nccl", None)
        mp = monkeypatch
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: gpus)
        mp.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
        mp.setattr(torch.cuda, "set_device", lambda d: self.calls.append(("set_device", torch.device(d))))
        mp.setattr(torch.cuda, "synchronize", lambda d=None: self.calls.append(("synchronize", d)))
        mp.setattr(torch.cuda, "get_device_name", lambda d=None: "Stand-in GPU")
        mp.setattr(dist, "is_initialized", lambda: self.initialized)
        mp.setattr(dist, "init_process_group", self._init)
        mp.setattr(dist, "new_group", self._new_group)
        mp.setattr(dist, "get_backend", lambda group=None: (group or self.world).backend)
        mp.setattr(dist, "get_rank", lambda group=None: rank)
        mp.setattr(dist, "get_world_size", lambda group=None: 2)
        mp.setattr(dist, "all_gather_object", self._all_gather_object)
        mp.setattr(dist, "all_gather_into_tensor", self._all_gather_into_tensor)
        mp.setattr(dist, "all_gather_single", self._all_gather_into_tensor, raising=False)
        for name, value in dict(RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=2).items():
            mp.setenv(name, str(value))
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", "29500")

    def _init(self, backend, timeout=None, device_id=None, **kwargs):
        self.calls.append(("init_process_group", backend, device_id))
        self.initialized = True

    def _new_group(self, ranks=None, timeout=None, backend=None, **kwargs):
        group = FakeGroup(backend or self.world.backend, ranks)
        self.calls.append(("new_group", group.backend, ranks))
        return group

    def _all_gather_object(self, out, obj, group=None):
        self.calls.append(("all_gather_object", group or self.world))
        out[:] = [obj] * len(out)

    def _all_gather_into_tensor(self, out, local, group=None, async_op=False):
        self.calls.append(("all_gather_into_tensor", group or self.world, out.device, local.device, async_op))
        return StalledWork()


def _new_fp32_flags() -> list:
    """The per-backend ``fp32_precision`` flag holders this torch has (none before the per-backend API)."""
    backends = torch.backends
    holders = [backends, backends.cuda.matmul, backends.cudnn, backends.mkldnn]
    holders += [getattr(backends.cudnn, op, None) for op in ("conv", "rnn")]
    holders += [getattr(backends.mkldnn, op, None) for op in ("matmul", "conv", "rnn")]
    return [h for h in holders if h is not None and hasattr(h, "fp32_precision")]


@pytest.fixture
def tf32_flags():
    """Puts back this process's TF32 state (legacy records first, then every per-backend flag) after a test."""
    legacy = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    new = [(holder, holder.fp32_precision) for holder in _new_fp32_flags()]
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(legacy[0])
        torch.backends.cudnn.allow_tf32 = legacy[1]
        for holder, value in new:
            holder.fp32_precision = value


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch, tf32_flags):
    return Node(monkeypatch)


def _only_new_api_tf32() -> None:
    """What the old ``bind`` left on torch >= 2.9: the per-backend flag alone, the legacy record disagreeing."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "tf32"


def _generic_tf32() -> None:
    """A caller's ``torch.backends.fp32_precision = "tf32"`` (transformers' ``enable_tf32`` on torch >= 2.9)."""
    if hasattr(torch.backends, "fp32_precision"):
        torch.backends.fp32_precision = "tf32"


def _conv_ieee() -> None:
    """cuDNN's conv and rnn flags set apart by the per-backend API."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):
        conv.fp32_precision = "ieee"


@pytest.mark.parametrize("before", [lambda: None, _only_new_api_tf32, _generic_tf32, _conv_ieee])
@pytest.mark.parametrize("tf32", [True, False])
def test_binding_leaves_every_tf32_reader_in_agreement(node: Node, before, tf32: bool) -> None:
    """After ``bind`` the legacy record (which inductor reads on torch 2.9-2.10 while it compiles) and every
    per-backend flag state the same choice, whatever state the process was in before, so no reader raises."""
    before()
    bind(Placement(CUDA0, torch.bfloat16 if tf32 else torch.float32, tf32, "as set"))
    precision = "tf32" if tf32 else "ieee"
    expected: dict[str, object] = {
        "get_float32_matmul_precision": "high" if tf32 else "highest",
        "cuda.matmul.allow_tf32": tf32,
        "cudnn.allow_tf32": tf32,
    }
    readings = fp32_precision_readings()
    expected.update({name: precision for name in readings if name.endswith(".fp32_precision")})
    assert readings == expected
    assert node.calls == [("set_device", CUDA0)]


def test_the_per_backend_flag_alone_is_what_broke_compiles(tf32_flags) -> None:
    """The state the old ``bind`` left: on a torch with the per-backend API, the legacy reading raises (inductor's
    compile failed on it); the test above is only meaningful where this holds."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has no per-backend fp32_precision flags")
    _only_new_api_tf32()
    assert fp32_precision_readings()["get_float32_matmul_precision"] == "raises"


class StopAtLoad(Exception):
    pass


def test_a_rank_binds_its_gpu_before_any_cuda_or_distributed_call(node: Node, monkeypatch) -> None:
    """Rank 1 of a 2-GPU node: ``set_device(cuda:1)`` first, then the NCCL group bound to cuda:1, then a gloo
    group for the start-up strings; the model is loaded onto cuda:1 in bfloat16 (``model.dtype: auto``)."""
    from lp_runner.jobs import worker as runner

    def load(path, *, dtype, device, allow_pickle):
        node.calls.append(("load", torch.device(device), dtype))
        raise StopAtLoad

    monkeypatch.setattr(runner, "load_model_and_tokenizer", load)
    monkeypatch.setattr(runner, "resolve_model_path", lambda spec, cache: Path(spec))
    with pytest.raises(StopAtLoad):
        runner.start_worker(load_config(None, ["model.path=/nowhere", "parallel.workers=2", "model.threads=1"]))
    assert node.calls == [
        ("set_device", CUDA1),
        ("init_process_group", "nccl", CUDA1),
        ("new_group", "gloo", None),  # the world on gloo: every start-up string goes there
        ("load", CUDA1, torch.bfloat16),
    ]
    assert torch.get_float32_matmul_precision() == "high"  # auto on CUDA: TF32 for float32 matmuls


def test_float32_written_out_keeps_ieee_matmuls(node: Node) -> None:
    bind(Placement(CUDA0, torch.float32, False, "as set"))
    assert node.calls == [("set_device", CUDA0)]
    assert (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32) == ("highest", False)


def test_d_groups_on_nccl_get_gloo_twins_for_strings(node: Node) -> None:
    """D=2 x P=2 on NCCL: each LP group has a gloo twin (its start-up strings), and the world one gloo group."""
    from lp_runner.parallel.groups import form_groups, group_layout

    node.initialized = True
    handles = form_groups(group_layout(4, 3, 2, 2), 10.0)  # world rank 3: rank 1 of group 1
    assert [c for c in node.calls if c[0] == "new_group"] == [
        ("new_group", "nccl", [0, 1]),
        ("new_group", "gloo", [0, 1]),
        ("new_group", "nccl", [2, 3]),
        ("new_group", "gloo", [2, 3]),
        ("new_group", "gloo", None),
    ]
    assert (handles.group.backend, handles.group.ranks) == ("nccl", [2, 3])
    assert (handles.group_strings.backend, handles.group_strings.ranks) == ("gloo", [2, 3])
    assert handles.control.backend == "gloo"


def test_round_exchange_on_the_device_and_strings_on_gloo(node: Node) -> None:
    """Start-up strings go to the gloo twin; the round's all_gather runs on the NCCL group with both tensors on
    the communicator's device (``meta`` here: a device that is not the host), issued asynchronously."""
    from lp_runner.parallel.comm import TorchCommunicator

    nccl, gloo = FakeGroup("nccl", [0, 1]), FakeGroup("gloo", [0, 1])
    comm = TorchCommunicator(torch.device("meta"), nccl, gloo, timeout_s=0.3)
    assert comm.all_gather_strings("digest") == ["digest", "digest"]
    assert node.calls == [("all_gather_object", gloo)]
    node.calls.clear()
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"no answer within parallel.timeout_s=0.3 s"):
        comm.all_gather(torch.zeros(5, dtype=torch.long))  # the stand-in's peer never joins
    elapsed = time.monotonic() - start
    meta = torch.device("meta")
    assert node.calls == [("all_gather_into_tensor", nccl, meta, meta, True)]
    assert 0.3 <= elapsed < 2.0  # bounded: not NCCL's watchdog, not a hang


def test_calibration_syncs_the_ranks_own_gpu(node: Node, monkeypatch) -> None:
    """The curve is timed with a sync of the adapter's GPU (cuda:1), never the current one (no argument)."""
    from types import SimpleNamespace

    from lp_runner.tuning import calibrate
    from lp_runner.tuning.costmodel import CostCurve

    seen = {}

    def measure(adapter, kvs, rows, reps, sync, head_rows, tick, max_spread, max_reps, budget_s, clock):
        seen["sync"] = sync
        return CostCurve.linear(0.01, 0.001)

    monkeypatch.setattr(calibrate, "measure_curve", measure)
    calibrate.measure_quick(SimpleNamespace(device=CUDA1))
    seen["sync"]()
    assert node.calls == [("synchronize", CUDA1)]
    assert synchronizer(CPU) is None


def test_no_module_syncs_or_binds_cuda_on_its_own() -> None:
    """Every CUDA sync, set_device and current-device use goes through lp_runner.device."""
    offenders = []
    for path in sorted((REPO / "lp_runner").rglob("*.py")):
        if path.name == "device.py":
            continue
        text = path.read_text()
        for needle in ("cuda.synchronize", "cuda.set_device", "cuda.current_device", "allow_tf32"):
            if needle in text:
                offenders.append(f"{path.relative_to(REPO)}: {needle}")
    assert offenders == []


# ---------------------------------------------------------------- the real parts


def test_bounded_wait_polls_a_real_stalled_gloo_peer(tmp_path: Path) -> None:
    """``wait_bounded``'s polling (NCCL's way: the host is not blocked by ``wait``) on a real gloo pair whose
    rank 1 never joins the collective: rank 0 raises within the bound, without gloo's own timeout (60 s)."""
    script = tmp_path / "stall.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, time, json
            from datetime import timedelta
            import torch, torch.distributed as dist
            from lp_runner.errors import DistributedError
            from lp_runner.parallel.comm import wait_bounded
            dist.init_process_group("gloo", timeout=timedelta(seconds=60))
            if dist.get_rank() == 1:
                time.sleep(30)  # stalled: never joins
                sys.exit(0)
            out = torch.empty(4, dtype=torch.long)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            work = gather(out, torch.zeros(2, dtype=torch.long), async_op=True)
            start = time.monotonic()
            try:
                wait_bounded(work, 1.5, host_blocks=False)
                print(json.dumps({"raised": False}))
            except DistributedError as exc:
                print(json.dumps({"raised": True, "s": time.monotonic() - start, "msg": str(exc)}), flush=True)
            os._exit(0)
            """
        )
    )
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=env_with_repo(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        out, err = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["raised"], err
    assert 1.5 <= result["s"] < 5.0
    assert "parallel.timeout_s=1.5 s" in result["msg"]


@pytest.mark.slow
def test_loading_onto_another_device_never_builds_the_model_on_the_host(tmp_path: Path) -> None:
    """The real loader onto ``meta`` (a device that is not the host), converting the float32 checkpoint to
    bfloat16 on the way: the process's peak memory grows by about one tensor (the largest: the 113 MB embedding),
    a fraction of the checkpoint's 538 MB. Built on the host first and then moved, the conversion materialises
    the whole model there (measured: 870 MB more)."""
    from lp_runner.models.loading import fetch_embedded_model

    folder = fetch_embedded_model()
    model_mib = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / (1 << 20)
    code = textwrap.dedent(
        f"""
        import json, torch
        from lp_runner.device import peak_host_mib
        from lp_runner.models.loading import load_model_and_tokenizer
        import transformers  # imported before the baseline: only the load counts
        before = peak_host_mib()
        model, _, _ = load_model_and_tokenizer({str(folder)!r}, dtype=torch.bfloat16, device="meta")
        print(json.dumps({{"grew": peak_host_mib() - before, "device": str(next(model.parameters()).device)}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], env=env_with_repo(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["device"] == "meta"
    assert result["grew"] < 0.35 * model_mib, (result, model_mib)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages of a machine without CUDA")
@pytest.mark.parametrize(
    "sets, message",
    [
        (["parallel.dist_backend=nccl"], "error: parallel.dist_backend=nccl needs CUDA devices"),
        (["model.device=cuda"], "error: model.device=cuda but CUDA is not available on this machine"),
    ],
)
def test_self_launch_refuses_unplaceable_ranks_before_starting_any(tmp_path: Path, sets, message) -> None:
    """``parallel.workers=2``: the parent checks placement and exits 2 with one line; no rank starts (no rank
    prefix, no torchrun output)."""
    args = [sys.executable, "-m", "lp_runner", "--prompt", "hi", "--set", "parallel.workers=2"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, env=env_with_repo(), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line
    assert proc.stderr.startswith(message), proc.stderr


def test_ray_gpu_actors_size_threads_to_their_reservation() -> None:
    from lp_runner.jobs.ray import actor_threads

    assert actor_threads(0, {"CPU": 4.0, "GPU": 1.0}) == 4  # not the node's 64 cores
    assert actor_threads(0, {"CPU": 0.5, "GPU": 1.0}) == 1  # never 0
    assert actor_threads(0, {"CPU": 2.0}) == 0  # a CPU actor: its share of the node's cores, as before
    assert actor_threads(6, {"CPU": 4.0, "GPU": 1.0}) == 6  # model.threads as set

"""The device a rank runs on: which one, binding it, its dtype, the host threads beside it, synchronising on it,
and which device each collective uses. Every other module asks here instead of calling ``torch.cuda`` itself.

Why one module: on a node of several GPUs each rank must use its own GPU for everything — the model, the round's
tensors, NCCL's communicator and the GPU timings — and torch has two notions of "the" GPU that must agree: the
device a tensor is created on (``cuda:k``) and the *current* device (``torch.cuda.set_device``), which NCCL's
object collectives, ``torch.cuda.synchronize()`` without an argument and libraries such as cuBLAS fall back to. A
rank that names ``cuda:3`` for its model but never binds it works on GPU 0 wherever something uses the current
device. So a rank resolves its ``Placement`` once (``place``), binds it (``bind``) before any CUDA or distributed
call, and hands the same ``torch.device`` to every consumer; ``synchronizer`` syncs that device and no other.

Placement rules (``resolve_device``, ``check_placement``, ``resolve_dist_backend``; pure, tested on tables):

* ``model.device: auto`` is ``cuda`` where CUDA is available, else ``cpu``; ``cuda`` means ``cuda:LOCAL_RANK``
  (torchrun starts one rank per GPU; a Ray GPU actor sees only its own GPU, as ``cuda:0``);
  ``cuda:N`` puts every local rank on GPU N (several ranks may share one GPU over gloo).
* More local ranks than GPUs under ``cuda``, a ``cuda:N`` past the node's GPUs, CUDA asked for on a machine
  without it, and NCCL with two ranks on one GPU (NCCL refuses that) are configuration errors: one line, exit 2,
  found by the self-launching parent before any rank starts, and by each rank before it joins a group.
* ``parallel.dist_backend: auto`` is NCCL when every local rank has a GPU of its own, else gloo.

Precision (``resolve_dtype``): ``model.dtype: auto`` is bfloat16 on a CUDA device that supports it (float16 on
one that does not), float32 on a CPU, where lp_runner's exact fp32 kernels run. float32 matmuls on CUDA may use
TF32 unless ``model.dtype: float32`` is written out, which keeps IEEE fp32 (and so token identity with greedy
``generate`` in fp32). What each dtype guarantees is ``docs/design.md`` section 3.3.

Threads (``resolve_threads``): torch's default (every core, or ``OMP_NUM_THREADS``, which torchrun sets to 1 for
several ranks) is wrong both ways on a shared node; a rank takes its share of the cores it may run on.
"""

from __future__ import annotations

import os
import resource
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lp_runner.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Placement:
    """Where one rank runs and in what precision; made once at start-up by ``place``."""

    device: torch.device  # the model, the round's tensors and (under NCCL) the round exchange
    dtype: torch.dtype  # the model's weights and activations
    tf32: bool  # float32 matmuls on this CUDA device may use TF32
    why: str  # how the dtype was chosen, for the summary: "auto: bfloat16 on CUDA", "as set"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    def collective_device(self, dist_backend: str) -> torch.device:
        """Where the round exchange's tensors live: NCCL moves GPU memory, gloo host memory."""
        return self.device if dist_backend == "nccl" else torch.device("cpu")

    def describe(self) -> dict:
        """For records and the summary."""
        return {"dtype": self.dtype_name, "tf32": self.tf32, "dtype_choice": self.why}

    def precision_caveat(self) -> str | None:
        """The line a half-precision run prints at start-up (None in float32): what its output is exact to, as the
        README's precision table says it, where the user sees it (the summary's "bfloat16 (as set)" does not)."""
        if self.dtype not in (torch.bfloat16, torch.float16):
            return None
        name = self.dtype_name
        return (
            f"model.dtype {name} ({self.why}): outputs may differ from float32 greedy decoding where the top two "
            f"tokens nearly tie in {name} (docs/design.md 3.3); float32 on a CPU is token-identical"
        )


# ---------------------------------------------------------------- pure rules


def resolve_device(spec: str, local_rank: int, gpus: int) -> torch.device:
    """``model.device`` for the rank ``local_rank`` of its node, on a node with ``gpus`` CUDA devices.

    ``resolve_device("auto", 1, 8)`` -> cuda:1; ``("auto", 0, 0)`` -> cpu; ``("cuda:3", 0, 8)`` -> cuda:3;
    ``("cuda", 2, 2)`` -> ConfigError (3 local ranks or more, 2 GPUs)."""
    if spec == "auto":
        spec = "cuda" if gpus > 0 else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if gpus == 0:
        raise ConfigError(f"model.device={spec} but CUDA is not available on this machine; use model.device=cpu")
    if spec == "cuda":
        if local_rank >= gpus:
            raise ConfigError(
                f"local rank {local_rank} has no GPU of its own: this node has {gpus} GPU{'s' * (gpus != 1)} "
                f"(model.device=cuda gives each local rank one); start at most {gpus} ranks per node, or share "
                "one GPU with model.device=cuda:N and parallel.dist_backend=gloo"
            )
        return torch.device("cuda", local_rank)
    index = int(spec.split(":", 1)[1])
    if index >= gpus:
        raise ConfigError(
            f"model.device={spec} but this node has {gpus} GPU{'s' * (gpus != 1)} (cuda:0..cuda:{gpus - 1})"
        )
    return torch.device("cuda", index)


def resolve_dist_backend(dist_backend: str, device_spec: str, local_ranks: int, gpus: int) -> str:
    """``parallel.dist_backend`` for ``local_ranks`` ranks per node: NCCL only where each has a GPU of its own.

    ``("auto", "auto", 8, 8)`` -> nccl; ``("auto", "cuda:0", 2, 1)`` -> gloo (two ranks share GPU 0);
    ``("auto", "cpu", 2, 8)`` -> gloo; ``("nccl", "cpu", 2, 0)`` -> ConfigError."""
    own_gpus = _own_gpus(device_spec, local_ranks, gpus)
    if dist_backend == "auto":
        return "nccl" if own_gpus else "gloo"
    if dist_backend == "nccl" and not own_gpus:
        if gpus == 0:
            raise ConfigError(
                "parallel.dist_backend=nccl needs CUDA devices, and this machine has none; use gloo or auto"
            )
        if device_spec == "cpu":
            raise ConfigError("parallel.dist_backend=nccl needs the model on GPUs (model.device=cpu); use gloo")
        raise ConfigError(
            f"parallel.dist_backend=nccl needs one GPU per rank, but model.device={device_spec} puts the "
            f"{local_ranks} ranks of this node on one GPU; use model.device=cuda, or parallel.dist_backend=gloo"
        )
    return dist_backend


def _own_gpus(device_spec: str, local_ranks: int, gpus: int) -> bool:
    """Every local rank has a GPU no other rank uses."""
    if gpus == 0 or device_spec == "cpu":
        return False
    if device_spec in ("auto", "cuda"):
        return local_ranks <= gpus
    return local_ranks == 1  # cuda:N: every local rank on GPU N


def check_placement(device_spec: str, dist_backend: str, local_ranks: int, gpus: int) -> None:
    """Every rank of a node of ``local_ranks`` can be placed: the check a self-launching parent makes before it
    starts any rank (a rank repeats it for itself in ``place``). Raises ConfigError."""
    for local_rank in range(local_ranks):
        resolve_device(device_spec, local_rank, gpus)
    if local_ranks > 1 or dist_backend != "auto":
        resolve_dist_backend(dist_backend, device_spec, local_ranks, gpus)


def resolve_dtype(spec: str, device: torch.device, bf16_supported: bool) -> tuple[torch.dtype, bool, str]:
    """(dtype, TF32 allowed, how it was chosen) for ``model.dtype`` on ``device``.

    ``("auto", cpu, _)`` -> float32, no TF32 (the CPU kernels are exact fp32); ``("auto", cuda:0, True)`` ->
    bfloat16 with TF32 for the few float32 matmuls; ``("float32", cuda:0, True)`` -> float32 without TF32 (written
    out: IEEE fp32, exact); ``("bfloat16", cpu, _)`` -> bfloat16."""
    cuda = device.type == "cuda"
    if spec == "auto":
        if not cuda:
            return torch.float32, False, "auto: float32 on a CPU"
        if bf16_supported:
            return torch.bfloat16, True, "auto: bfloat16 on CUDA"
        return torch.float16, True, "auto: float16 on CUDA (no bfloat16 on this GPU)"
    if spec not in DTYPES:
        raise ConfigError(f"model.dtype must be auto, float32, bfloat16 or float16, got {spec!r}")
    return DTYPES[spec], cuda and spec != "float32", "as set"


# ---------------------------------------------------------------- this process's device


def gpu_count() -> int:
    """CUDA devices this process sees (0 on a CPU-only build or machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``: torchrun, or the Ray backend for its actors), else 0."""
    return _env_int("LOCAL_RANK", 0)


def local_world_size() -> int:
    """Ranks sharing this node: ``LOCAL_WORLD_SIZE`` (torchrun; the Ray backend sets it for its actors), else 1."""
    return max(1, _env_int("LOCAL_WORLD_SIZE", 1))


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, str(default)))
    except ValueError:
        return default


def place(device_spec: str, dtype_spec: str) -> Placement:
    """This rank's placement from ``model.device`` / ``model.dtype`` (ConfigError where it cannot be placed)."""
    device = resolve_device(device_spec, local_rank(), gpu_count())
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    dtype, tf32, why = resolve_dtype(dtype_spec, device, bf16)
    return Placement(device, dtype, tf32, why)


def bind(placement: Placement) -> None:
    """Make ``placement.device`` this process's current CUDA device (before any CUDA or distributed call: NCCL's
    communicator, object collectives and cuBLAS handles follow the current device) and set its float32 matmul
    precision (``set_fp32_precision``). Nothing on a CPU."""
    if placement.device.type != "cuda":
        return
    torch.cuda.set_device(placement.device)
    set_fp32_precision(placement.tf32)


_LEGACY_TF32_WARNING = "Please use the new API settings to control TF32"  # torch 2.9+'s one-time notice


def set_fp32_precision(tf32: bool) -> None:
    """Let float32 matmuls and cuDNN ops use TF32 (``tf32``), or keep them IEEE fp32, through torch's legacy flags
    and its per-backend ``fp32_precision`` flags together, so that every reader agrees.

    Why both: torch keeps two records of the choice. The legacy setters (``set_float32_matmul_precision``,
    ``cudnn.allow_tf32``) write both records; the newer per-backend setters (torch >= 2.9) write only their own,
    and a later read of the legacy record that disagrees with it raises. Inductor on torch 2.9-2.10 reads the legacy
    record while it compiles, so setting only ``torch.backends.cuda.matmul.fp32_precision`` made every compile fail
    and the compiled round fall back to eager. The legacy setters first (they exist on every admitted torch), then
    the per-backend flags where they exist (they override a ``torch.backends.fp32_precision`` a caller may have
    set, to which cuDNN's ops would otherwise fall back). torch 2.9+ notes once that the legacy setters will be
    deprecated; that notice is silenced here, since it is the reading of the legacy record that still matters.
    """
    precision = "tf32" if tf32 else "ieee"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_LEGACY_TF32_WARNING)
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32
    cudnn = torch.backends.cudnn
    for flags in (torch.backends.cuda.matmul, getattr(cudnn, "conv", None), getattr(cudnn, "rnn", None)):
        if flags is not None and hasattr(flags, "fp32_precision"):
            flags.fp32_precision = precision


def rows_are_cheap(device: torch.device) -> bool:
    """Whether a forward of many packed rows may cost about what one row costs on this device (a GPU: one row
    leaves most of its compute idle), so calibration must measure far more rows (``calibrate.measurement_plan``).
    On a CPU the cost rises within a few rows."""
    return device.type == "cuda"


def synchronizer(device: torch.device) -> Callable[[], None] | None:
    """What makes the host wait for ``device``'s queued work (None: a CPU, whose work is already done). Timing
    a CUDA forward without it measures kernel launches; syncing another GPU (the current one, when the argument is
    left out) measures nothing and opens a context there."""
    if device.type != "cuda":
        return None
    return lambda: torch.cuda.synchronize(device)


def pins_host_memory(device: torch.device) -> bool:
    """Whether host tensors bound for ``device`` should be pinned (page-locked): only a CUDA device copies from
    them asynchronously (a non-blocking copy from pageable memory is a synchronous one); a CPU has no copy."""
    return device.type == "cuda"


def peak_host_mib() -> float:
    """This process's peak resident memory so far, MiB (``getrusage``: kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


# ---------------------------------------------------------------- host threads


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS has one, else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 1


def resolve_threads(threads: int, cores: int | None = None, local_ranks: int | None = None) -> int:
    """``model.threads`` as a thread count: itself when set (> 0), else this rank's share of the node's cores.

    Worked example: 64 available cores, torchrun with 8 ranks per node (LOCAL_WORLD_SIZE=8) -> 8 threads per rank;
    2 cores and 3 ranks -> 1 (never 0); one plain process on 16 cores -> 16.
    """
    if threads > 0:
        return threads
    cores = available_cores() if cores is None else cores
    local_ranks = local_world_size() if local_ranks is None else local_ranks
    return max(1, cores // max(1, local_ranks))


def fp32_precision_readings() -> dict[str, object]:
    """Every reader of the TF32 choice that inductor, cuBLAS or cuDNN may consult, its value or "raises" (torch
    raises when a reading of the legacy record disagrees with a per-backend flag): what ``set_fp32_precision``
    must leave agreeing, read back by the GPU check and the tests."""
    backends = torch.backends
    readers = {
        "get_float32_matmul_precision": torch.get_float32_matmul_precision,
        "cuda.matmul.allow_tf32": lambda: backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": lambda: backends.cudnn.allow_tf32,
    }
    for name in ("cuda.matmul", "cudnn.conv", "cudnn.rnn"):
        holder = backends
        for part in name.split("."):
            holder = getattr(holder, part, None)
        if holder is not None and hasattr(holder, "fp32_precision"):
            readers[f"{name}.fp32_precision"] = lambda holder=holder: holder.fp32_precision
    out: dict[str, object] = {}
    for name, read in readers.items():
        try:
            out[name] = read()
        except RuntimeError:
            out[name] = "raises"
    return out

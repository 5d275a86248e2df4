"""Checks made before any worker starts, in one place: ``preflight`` (and ``check_model_fits``, which it shares with
the ranks' start-up).

``preflight(cfg, local_ranks)`` runs in every ``run`` once the output is locked and before anything is launched or
loaded: the plain process, the parent that starts the ``parallel.workers`` x ``parallel.groups`` ranks, each of
those ranks, a user's torchrun ranks. A setting that cannot run on this machine then fails with one ``error:`` line
and exit 2 in the process the user started, instead of in D x P ranks at once (which the parent could only report
as a failed peer, exit 3).
Every check here is one each rank makes the same way on the same machine, so nothing is refused here that a rank
would accept; what only the loaded model can tell (a ``.gguf`` model's context and vocabulary) is checked again
after loading by the same functions (``check_model_fits``, ``JobPool.load``).

In order:
- ``model.threads`` against the cores this process may run on (``check_threads``): more than them is refused, more
  than this machine's ranks' share of them a warning;
- placement (``device.check_placement``, where this process starts the ranks or is the only one): a GPU per rank
  where the config asks for one, NCCL only with one GPU per rank, CUDA where it is asked for;
- the model path (``loading.resolve_model_path``: a missing folder, an embedded model not fetched yet);
- the model's context (``max_position_embeddings`` in its config.json) against the rows of one round and against
  ``generation.max_new_tokens`` (``check_model_fits``);
- ``--pool-in``: the file's format, and with the model's tokenizer (loaded alone, before any weights) its
  tokenizer fingerprint and every token id against the model's vocabulary (``job_store.read_pool_file``);
- the local ranks about to start (``local_ranks``; None under a launcher, which started them already): the memory
  their model copies need at least, against what this machine has available; more ranks than cores is a warning.

With ``parallel.backend=ray`` nothing here applies: the workers run on the cluster's machines, which the actors
check for themselves. A new check of this machine (a device that must exist, say) belongs in ``preflight`` too, as
long as every rank would make it the same way.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from lp_runner.config import Config
from lp_runner.device import available_cores
from lp_runner.errors import ConfigError
from lp_runner.logs import log

# A rank's memory before its model's weights: Python with torch, transformers and a tokenizer loaded, the
# round's buffers of a small model. Measured: a run of a 6 MB model peaked at 458 MiB resident (``/usr/bin/time
# -f %M python -m lp_runner --prompt ... --set model.path=TINY``, a 2-core x86 CPU); the embedded model's 513 MiB
# of weights peaked at 1.44 GiB (the packed copies of its layers). A lower bound, so a refusal is certain.
RANK_BASE_BYTES = 400 << 20
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}


def preflight(cfg: Config, local_ranks: int | None) -> None:
    """Refuse (ConfigError / InputError / ModelError: one line, exit 2) what cannot run here; see the module doc.

    ``local_ranks``: the processes this machine is about to run (1 for a plain run, D x P for the parent that
    starts them); None where a launcher started this process (its peers may be loading already)."""
    if cfg.parallel.backend == "ray":
        return
    warning = check_threads(cfg.model.threads, local_ranks, available_cores())  # said once nothing is refused
    # torch and transformers load here: after the checks that need neither
    from lp_runner.decoding.layout import check_model_fits
    from lp_runner.device import check_placement, gpu_count
    from lp_runner.models.loading import resolve_model_path

    if local_ranks is not None:  # under a launcher each rank places itself (device.place) before it joins a group
        check_placement(cfg.model.device, cfg.parallel.dist_backend, local_ranks, gpu_count())
    path = resolve_model_path(cfg.model.path, cfg.model.cache_dir or None)
    limits = model_limits(path)  # {} for a .gguf file: checked after loading
    check_model_fits(cfg.lookahead, cfg.generation, limits.get("max_position_embeddings"))
    if cfg.run.pool_in:
        check_pool_file(cfg.run.pool_in, path, limits.get("vocab_size"))
    if local_ranks is not None:
        check_local_ranks(cfg, local_ranks, path)
    if warning is not None:
        log.warning("%s", warning)


def check_threads(threads: int, local_ranks: int | None, cores: int) -> str | None:
    """``model.threads`` against the ``cores`` this process may run on: ConfigError past them (threads past the
    cores take turns on them and every forward waits for the slowest: 1000 threads on 2 cores ran 0.54 tokens/s
    against 23.8, and calibration did not end); a warning (returned) where ``local_ranks`` ranks of this many
    threads each share fewer cores, as ``parallel.workers`` past the cores is. 0 (each rank's share) is always fine.

    ``check_threads(3, 1, 2)`` -> ConfigError; ``check_threads(2, 2, 2)`` -> a warning; ``check_threads(1, 2, 2)``
    -> None; ``local_ranks`` None (under a launcher, whose ranks the warning was for): the refusal only."""
    if threads == 0:
        return None
    if threads > cores:
        raise ConfigError(
            f"model.threads={threads} is more than the {cores} cores this process may run on: threads past the cores "
            f"take turns on them (much slower, the same output); use at most {cores}, or 0 for each rank's share"
        )
    if local_ranks is not None and threads * local_ranks > cores:
        return (
            f"model.threads={threads} x {local_ranks} ranks is {threads * local_ranks} threads on {cores} cores: they "
            "take turns (slower than model.threads=0, each rank's share; the output is the same)"
        )
    return None


def model_limits(path: Path) -> dict[str, int]:
    """``max_position_embeddings`` and ``vocab_size`` as a model folder's config.json states them (of its text
    model where it nests one), without importing transformers; {} for a ``.gguf`` file or an unreadable config
    (the loader's own checks say why). Only keys the file states: a class default is the loaded model's business."""
    try:
        data = json.loads((path / "config.json").read_text(encoding="utf-8")) if path.is_dir() else {}
    except (OSError, ValueError):
        return {}
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    out = {}
    for key in ("max_position_embeddings", "vocab_size"):
        value = text.get(key) if isinstance(text, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[key] = value
    return out


def check_pool_file(pool: str, model_path: Path, vocab_size: int | None) -> None:
    """``--pool-in`` before any weights load: its format always; its tokenizer and token ids where the model is a
    folder whose tokenizer loads alone (a ``.gguf`` model's tokenizer comes with its conversion: after loading)."""
    from lp_runner.decoding.job_store import read_pool_file, tokenizer_fingerprint

    if not model_path.is_dir():
        read_pool_file(pool, None)
        return
    from lp_runner.models.loading import load_tokenizer

    read_pool_file(pool, tokenizer_fingerprint(load_tokenizer(model_path)), vocab_size)


def weight_bytes(path: Path, per_value: int) -> int:
    """The bytes a model's weights take at ``per_value`` bytes per floating-point value, from its safetensors
    headers (no tensor is read); other formats: the files' own size."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    total = 0
    for file in files:
        header = _safetensors_header(file) if file.suffix == ".safetensors" else None
        if header is None:
            total += file.stat().st_size if file.is_file() else 0
            continue
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            count = 1
            for dim in info.get("shape", []):
                count *= int(dim)
            floating = str(info.get("dtype", "")).startswith(("F", "BF"))
            total += count * (per_value if floating else _SAFETENSORS_BYTES.get(info.get("dtype"), 4))
    return total


def _safetensors_header(file: Path) -> dict[str, Any] | None:
    """A safetensors file's JSON header (8-byte little-endian length, then the JSON), or None if unreadable."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                return None
            return json.loads(f.read(length))
    except (OSError, ValueError, struct.error):
        return None


def available_memory() -> int | None:
    """Bytes this process may still allocate: the kernel's MemAvailable, or less under a cgroup (v2) limit; None
    where neither can be read. Generous where unsure (a refusal must be certain): a cgroup's page cache counts as
    free, since the kernel reclaims it before it fails an allocation."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text().strip())
            stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
            found.append(max(0, int(limit) - used + int(stat.get("file", 0))))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_local_ranks(cfg: Config, ranks: int, path: Path) -> None:
    """``ranks`` processes on this machine, each with its own copy of the model: refused when even their lower
    bound of memory (RANK_BASE_BYTES + the weights, each) exceeds what is available; more ranks than cores is
    a warning (each gets a share of a core: slower, not wrong). A model on a GPU holds its weights there (loaded
    straight onto it): only the ranks' base is counted then."""
    import torch

    from lp_runner.device import gpu_count, resolve_device, resolve_dtype

    device = resolve_device(cfg.model.device, 0, gpu_count())
    on_cpu = device.type == "cpu"
    dtype = resolve_dtype(cfg.model.dtype, device, on_cpu or torch.cuda.is_bf16_supported())[0]
    weights = weight_bytes(path, dtype.itemsize)
    each = RANK_BASE_BYTES + (weights if on_cpu else 0)
    need, have = ranks * each, available_memory()
    par = cfg.parallel
    what = f"parallel.workers={par.workers} x parallel.groups={par.groups}" if ranks > 1 else "this run"
    if have is not None and need > have:
        raise ConfigError(
            f"{what} needs at least {_size(need)} of memory ({ranks} process{'es' if ranks > 1 else ''} of "
            f"{_size(RANK_BASE_BYTES)} + the model's {_size(weights if on_cpu else 0)} each); this machine has "
            f"{_size(have)} available" + ("; lower parallel.workers or parallel.groups" if ranks > 1 else "")
        )
    cores = available_cores()
    if ranks > cores:
        log.warning(
            "%s starts %d ranks on %d cores: each gets a share of a core (slower than fewer ranks; the output is "
            "the same)",
            what,
            ranks,
            cores,
        )


def _size(n: int) -> str:
    """3.2 GiB, 400 MiB."""
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"

"""Whether a job runs its rounds through a compiled forward (``model.compile: off | on | auto``), and why.

A compiled static-shape forward (``ModelAdapter.compile``) costs a compilation at start-up (minutes on a
2-core CPU for the embedded model, less from inductor's on-disk cache) and saves a device-dependent fraction of
every round. Whether it pays is a measured question, per device:

* ``on`` compiles, and records what it measured on this device (``CompileRecord``: the compile seconds and one
  round's forward eager and compiled, timed side by side right after compiling) under the cache dir, keyed like
  the calibration curve (device, threads, dtype, weights, torch);
* ``auto`` reads that record and compiles when the job's rounds, each saving ``eager_s - compiled_s``, save more
  than the compilation costs; rounds are estimated as the job's token budget (a round commits at least one
  token, so this is an upper bound: it favours compiling only for jobs that are long anyway). Without a record,
  ``auto`` runs eager and says how to get one, except on CUDA for a job of ``FIRST_CAPTURE_TOKENS`` or more:
  there compiling captures a CUDA graph per row bucket (``backends.rounds``), the saving a small model's
  launch-bound rounds are after, and the first long job makes the measurement (it records it as ``on`` does),
  so every later job decides from this device's own figures;
* ``off`` never compiles.

The decision and its reason go to every record and the summary. Under LP, rank 0 decides and every rank follows
(the start-up exchange), so the ranks of a group run one forward.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lp_runner.tuning.calibrate import calibration_key
from lp_runner.tuning.records import keyed_path, read_keyed, write_keyed

RECORD_ROWS = (2, 8)  # the rounds timed for the record: a short and a typical packed round
RECORD_KV = 256
RECORD_REPS = 5
# On CUDA without a record, ``auto`` captures (and so measures) for a job of at least this many tokens: a first
# capture is the measurement every later decision reads, paid once per device and weights, by a job long enough to
# use its graphs for thousands of rounds. A rule, not a measured figure; the record replaces it after one job.
FIRST_CAPTURE_TOKENS = 4096


@dataclass(frozen=True)
class CompileRecord:
    """What compiling cost and saved on one device: seconds to compile, one round's forward eager and compiled."""

    compile_s: float
    eager_s: float
    compiled_s: float


@dataclass(frozen=True)
class CompileChoice:
    mode: str  # the config's model.compile
    compiled: bool
    reason: str
    compile_s: float = 0.0  # this run's compilation (0 when eager)
    capture_s: dict[int, float] | None = None  # bucketed rounds (CUDA): each row bucket's compile and capture, s

    def describe(self) -> dict:
        return asdict(self)


def record_file(cache_root: Path, key: dict) -> Path:
    return keyed_path(cache_root, "compile", "record", key)


def record_key(device: torch.device, dtype: torch.dtype, weights_checksum: str, backend: dict | None = None) -> dict:
    """``backend``: the eager forward's backend's key fields (``ForwardBackend.key``; default torch's)."""
    return calibration_key(device, dtype, weights_checksum, backend=backend)


def load_record(path: Path, key: dict) -> CompileRecord | None:
    return read_keyed(path, key, lambda data: CompileRecord(**data["record"]))


def save_record(path: Path, key: dict, record: CompileRecord) -> None:
    write_keyed(path, key, record=asdict(record))


def decide(mode: str, record: CompileRecord | None, job_tokens: int, device_type: str = "cpu") -> tuple[bool, str]:
    """(compile?, why) for ``mode`` given this device's record, the job's token budget and the device's type
    (``torch.device.type``: on "cuda" compiling captures CUDA graphs) (pure).

    Examples: ("auto", None, 10_000, "cuda") -> captured, to measure; ("auto", None, 10_000, "cpu") -> eager;
    ("auto", CompileRecord(60, 0.05, 0.04), 7000) -> compiled (70 s saved > 60 s)."""
    if mode == "off":
        return False, "off"
    if mode == "on":
        return True, "on"
    if job_tokens <= 0:  # a Ray actor starts before it is handed prompts
        return False, "auto: eager (the job's length is not known to this worker; model.compile=on compiles)"
    if record is None:
        if device_type == "cuda" and job_tokens >= FIRST_CAPTURE_TOKENS:
            return True, (
                f"auto: captured (CUDA graphs; no measurement on this device yet: this job of {job_tokens} tokens "
                f">= {FIRST_CAPTURE_TOKENS} records what capturing costs and saves, later jobs decide from it)"
            )
        return False, "auto: eager (no measurement of the compiled forward on this device; model.compile=on makes one)"
    saving = job_tokens * (record.eager_s - record.compiled_s)
    pays = saving > record.compile_s
    verdict = "compiled" if pays else "eager"
    return pays, (
        f"auto: {verdict} (compiling took {record.compile_s:.0f} s here; at most {job_tokens} rounds x "
        f"{1e3 * (record.eager_s - record.compiled_s):.1f} ms saved = {saving:.0f} s)"
    )


def measure_record(adapter, compile_s: float, sync=None) -> CompileRecord:
    """One round's forward through ``adapter``'s eager round function and its compiled one (``ModelAdapter.run``
    with ``eager=True`` and without: one adapter, both warm), interleaved, medians of ``RECORD_REPS``, averaged
    over ``RECORD_ROWS``. Each on a region of the adapter's job arena: compiled rounds replay their graphs there."""
    from lp_runner.backends.adapter import causal
    from lp_runner.backends.staging import Rows

    need = RECORD_KV + max(RECORD_ROWS)
    means = {}
    with adapter.arena([need, need]) as arena:
        caches = {eager: arena.region(need) for eager in (True, False)}
        for eager, cache in caches.items():
            prefill = Rows([k % 97 for k in range(RECORD_KV)], range(RECORD_KV), causal(RECORD_KV), [RECORD_KV - 1])
            adapter.run([prefill], [cache], eager=eager)
        times: dict[bool, list[float]] = {True: [], False: []}
        for rows in RECORD_ROWS:
            per: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(RECORD_REPS + 1):  # the first of each is a warm-up
                for eager, cache in caches.items():
                    start = time.perf_counter()
                    adapter.run(
                        [Rows([0] * rows, range(RECORD_KV, RECORD_KV + rows), causal(rows), range(rows))],
                        [cache],
                        eager=eager,
                    )
                    if sync is not None:
                        sync()
                    per[eager].append(time.perf_counter() - start)
                    cache.crop(RECORD_KV)
            for k, v in per.items():
                times[k].append(sorted(v[1:])[len(v[1:]) // 2])
        means = {k: sum(v) / len(v) for k, v in times.items()}
    return CompileRecord(round(compile_s, 3), means[True], means[False])

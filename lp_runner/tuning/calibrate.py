"""Start-up calibration: this device's forward-cost curve, measured in seconds and cached.

Why at run time: the cost of a packed forward versus its row count is a property of the device, the dtype, the
thread count and the model, and two CPUs of the same machine kind can disagree completely (one measured 2-3 rows
at ~1.07x one row and 8 rows at 1.56x, another 2-3 rows at 1.6-1.9x and 8 rows at 1.35x). A setting tuned on
one and shipped as a constant is wrong on the other; the curve measured where the job runs is not.

The quick curve: the body cost (LM head on one row) at every row count of the device's plan and two K/V lengths,
plus the head on every row at the largest count (``costmodel.measure_curve(head_rows=...)``); repetitions
interleaved, medians, repeated until every point's spread is bounded (``CURVE_SPREAD``, at most ``CURVE_MAX_REPS``
sweeps and within the measurement's time budget), then made monotone (``CostCurve.monotone``): no row count is
priced below a smaller one's cost. Why both: two start-up calibrations of one model on one quiet CPU an hour apart
put 8 rows at 1.65x and at 1.05x one row's cost, and the later measured 3 rows cheaper than 1 (0.90x), so every 1-
and 2-row round was padded to 3 (``RowPlan``) on the strength of one noisy point. ``measurement_plan`` chooses the
grid by device (``device.rows_are_cheap``): on a CPU ``QUICK_ROWS`` to 48 rows (about 90 forwards; a round past
that costs more than it earns there, so it is extrapolated), on a GPU ``GPU_ROWS`` to 512 rows at ``GPU_KV`` (120
forwards: the flat part of a GPU's curve is where the Jacobi window and wide verification pay, and where it ends
only a measurement finds). Then ``measure_host`` times the host part of the engine's own rounds
(``costmodel.HostCost``), which every search prices, the start-up preset and ``lp_runner tune`` alike. The curve is
cached under the cache dir, keyed by everything that changes it (device model, threads, dtype, weights checksum,
torch version, the backend's key fields (its kernels and their build), and the grid through
``CALIBRATION_VERSION``), and reused; ``--recalibrate`` measures again. A curve measured on a busy machine (its
repetitions disagree: ``NOISY_SPREAD``) is used and cached, but the next run measures again and the quieter curve
stays: a moment's load does not price every later run's choices. A machine that stays busy would make every
start-up measure again, so a noisy curve is measured at most ``NOISY_TRIES`` times; after that the quietest one is
used until ``--recalibrate``.

A measurement says how far it got every ``PROGRESS_EVERY_S`` and stops at ``CALIBRATION_LIMIT_S`` (under LP, within
the other ranks' collective timeout): on a machine far busier than its cores, or with more threads than cores, it
could otherwise run for many minutes. The run then goes on without a curve (the config's setting as written, no
row padding: ``RoundPolicy.build``), and says so in one line; nothing is cached.

Under LP only rank 0 measures (the others wait, so the measurement has the machine to itself) and every rank
uses rank 0's curve: the replicated coordinators must make identical choices.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lp_runner.backends.staging import Rows
from lp_runner.backends.torch_backend import TORCH_KEY
from lp_runner.config import GenerationConfig, LookaheadConfig
from lp_runner.decoding.engine import LookaheadEngine
from lp_runner.device import rows_are_cheap, synchronizer
from lp_runner.tuning.costmodel import CostCurve, HostCost, curve_needs, measure_curve
from lp_runner.tuning.records import keyed_path, read_keyed, write_keyed

CALIBRATION_VERSION = 4  # bump when the measurement (or its grid) changes: older cache entries are then ignored
QUICK_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)  # rounds past 48 rows: extrapolated from 32-48
QUICK_KV = (64, 512)
QUICK_HEAD_ROWS = (48,)
QUICK_REPS = 3  # + one warm-up sweep (medians of 3: one noisy forward moves no point)
# Repeated (QUICK_REPS more sweeps at a time, interleaved) while some point's repetitions disagree by more than
# this (``costmodel.point_spreads``), up to CURVE_MAX_REPS sweeps: a passing load is outvoted, a lasting one
# leaves the curve noisy (NOISY_SPREAD) and measured again at the next start-up.
CURVE_SPREAD = 0.10
CURVE_MAX_REPS = 4 * QUICK_REPS
GPU_ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
GPU_KV = (512, 2048)
GPU_HEAD_ROWS = (512,)
# Host time (``measure_host``): two settings whose rounds differ in rows (a few without the window, about 25
# with a 4-4-4 window), a few rounds each on a fixed random prompt; the line through their medians.
HOST_SETTINGS = (
    LookaheadConfig(preset="off", lookahead_branch=False, verification_set_size=1),
    LookaheadConfig(preset="off", window_size=4, ngram_size=4, verification_set_size=4),
)
HOST_TOKENS = 24
HOST_PROMPT_TOKENS = 32
# A coarser grid where the quick one would not fit the time the other LP ranks wait (their start-up collective
# carries parallel.timeout_s): a large model on a CPU.
COARSE_ROWS = (1, 2, 4, 8, 16, 32, 48)  # includes QUICK_HEAD_ROWS
COARSE_KV = (512,)
COARSE_REPS = 1
# A curve whose repetitions disagree by more than this (``CostCurve.spread``) was measured on a busy machine: the
# run uses it and caches it, and the next run measures again, keeping the quieter curve (else a curve bent by a
# moment's load would price every later run's choices until --recalibrate). The embedded model's quick curve on
# a 2-core CPU: 0.08-0.22 on the quiet machine before the jitter allowance
# (costmodel.JITTER_S) came off, 0.61-0.95 with one busy process beside it.
NOISY_SPREAD = 0.4
NOISY_TRIES = 3  # measurements of a noisy curve before the quietest is kept (each start-up would measure again)
# A measurement's time limit. The embedded model's quick curve was seen to take 105-233 s on a 2-core CPU with
# other processes on its cores; well past that the machine is too busy for the curve to mean much.
CALIBRATION_LIMIT_S = 300.0
PROGRESS_EVERY_S = 15.0  # a line saying how far a measurement got, at most this often

Log = Callable[[str], None]


@dataclass(frozen=True)
class Calibration:
    curve: CostCurve
    key: dict  # what the curve was measured for
    source: str  # "measured" or "cache"
    seconds: float  # time spent measuring or loading it
    path: str  # the cache file

    @property
    def noisy(self) -> bool:
        """Measured on a busy machine (the next run measures again)."""
        return self.curve.spread > NOISY_SPREAD

    def summary(self) -> dict:
        return {
            "source": self.source,
            "seconds": round(self.seconds, 3),
            "device": self.key["device"],
            "spread": round(self.curve.spread, 3),
            "worst_spread": round(self.curve.worst_spread, 3),  # the noisiest point's, which bounds the sweeps
            "sweeps": self.curve.sweeps,
            "noisy": self.noisy,
            "file": self.path,  # the curve itself, with its measured host time (``lp_runner study --curve job``)
        }


def device_name(device: torch.device) -> str:
    """The device's model name: a GPU's name, else the CPU model as ``lscpu`` prints it."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def calibration_key(
    device: torch.device, dtype: torch.dtype, weights_checksum: str, compiled: bool = False, backend: dict | None = None
) -> dict:
    """Everything the curve depends on; a change of any field means a new measurement. ``backend``: the forward's
    backend's key fields (``ForwardBackend.key``: its kernels, and the build of any code it compiled; default:
    torch's kernels), as a forward on other kernels has another curve."""
    return {
        "compiled": compiled,  # a compiled forward has its own curve
        **(TORCH_KEY if backend is None else backend),  # and so does each backend's forward
        "version": CALIBRATION_VERSION,
        "device": device_name(device),
        "device_type": device.type,
        "threads": torch.get_num_threads() if device.type == "cpu" else 0,
        "dtype": str(dtype).replace("torch.", ""),
        "weights": weights_checksum,
        "torch": torch.__version__,
    }


def cache_file(cache_root: Path, key: dict) -> Path:
    return keyed_path(cache_root, "calibration", "curve", key)


def _load_entry(path: Path, key: dict) -> tuple[CostCurve, int] | None:
    """(the cached curve, how many measurements it is the quietest of) for ``key``, or None."""
    return read_keyed(path, key, lambda data: (CostCurve.from_dict(data["curve"]), int(data.get("tries", 1))))


def save(path: Path, key: dict, curve: CostCurve, seconds: float, tries: int = 1) -> None:
    """``tries``: the measurements ``curve`` is the quietest of (NOISY_TRIES bounds the re-measuring)."""
    write_keyed(path, key, curve=curve.to_dict(), measured_s=round(seconds, 3), tries=tries)


class CalibrationTimeout(Exception):
    """A measurement ran past its time limit (``Ticker``)."""


class Ticker:
    """Every timed forward of a measurement calls it: a progress line every PROGRESS_EVERY_S (through ``log``), and
    CalibrationTimeout once ``limit_s`` has passed since ``start``. ``unit``: what ``done`` counts, for the line;
    ``clock``: injectable for tests."""

    def __init__(
        self,
        limit_s: float,
        log: Log | None,
        clock: Callable[[], float] = time.perf_counter,
        start: float | None = None,
        unit: str = "forwards",
    ) -> None:
        self.clock = clock
        self.start = clock() if start is None else start
        self.limit_s = limit_s
        self.log = log
        self.unit = unit
        self.said = self.start

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if now - self.start > self.limit_s:
            raise CalibrationTimeout
        if self.log is not None and now - self.said >= PROGRESS_EVERY_S:
            self.said = now
            self.log(f"calibrating: {done} of {total} {self.unit} measured ({now - self.start:.0f} s)")


@dataclass(frozen=True)
class MeasurementPlan:
    """What the quick calibration measures: row counts, K/V lengths, where the head runs on every row, sweeps."""

    rows: tuple[int, ...]
    kv_lens: tuple[int, ...]
    head_rows: tuple[int, ...]
    reps: int

    @property
    def forwards(self) -> int:
        return (len(self.rows) + len(self.head_rows)) * len(self.kv_lens) * (self.reps + 1)


def measurement_plan(cheap_rows: bool, coarse: bool = False, max_positions: int | None = None) -> MeasurementPlan:
    """The grid for a device (``device.rows_are_cheap``): to 512 rows at K/V 512 and 2048 where rows are cheap (a
    GPU), else the CPU grid to 48 rows; ``coarse``: the CPU's fallback where the quick grid would overrun the
    time the other LP ranks wait. On a GPU, a model with fewer positions than K/V + rows gets its K/V lengths cut
    to fit (the longer one to what is left after the most rows, the shorter to a quarter of that). A pure
    function, so the plan is tested where no GPU exists."""
    if cheap_rows:
        kvs = GPU_KV
        if max_positions is not None and max_positions < max(GPU_KV) + max(GPU_ROWS):
            room = max(max_positions - max(GPU_ROWS), 4)
            kvs = tuple(sorted({max(room // 4, 1), room}))
        return MeasurementPlan(GPU_ROWS, kvs, GPU_HEAD_ROWS, QUICK_REPS)
    if coarse:
        return MeasurementPlan(COARSE_ROWS, COARSE_KV, QUICK_HEAD_ROWS, COARSE_REPS)
    return MeasurementPlan(QUICK_ROWS, QUICK_KV, QUICK_HEAD_ROWS, QUICK_REPS)


def measure_quick(
    adapter,
    budget_s: float | None = None,
    tick: Callable[[int, int], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> CostCurve:
    """The quick curve on the device's plan, repeated until its spread is bounded and made monotone (the module
    doc); with ``budget_s``, the coarse grid when one probe forward says the plan would take longer (about 2 x the
    probe's seconds per forward: most forwards have fewer rows than the probe's), and no more sweeps than fit in
    it. ``tick``, ``clock``: as ``costmodel.measure_curve`` takes them.

    Example (body ms at one K/V length, medians): 1 -> 100, 2 -> 105, 3 -> 90, 4 -> 108 is priced 100, 105, 105,
    108, so no 1- or 2-row round is padded to 3 rows (``RowPlan.from_curve``)."""
    sync = synchronizer(adapter.device)
    cheap = rows_are_cheap(adapter.device)
    plan = measurement_plan(cheap, max_positions=getattr(adapter, "max_positions", None))
    if budget_s is not None and not cheap and probe_seconds(adapter, sync, plan) * plan.forwards / 2 > budget_s:
        plan = measurement_plan(cheap, coarse=True)
    bound = {"max_spread": CURVE_SPREAD, "max_reps": CURVE_MAX_REPS, "budget_s": budget_s, "clock": clock}
    return measure_curve(
        adapter, plan.kv_lens, plan.rows, reps=plan.reps, sync=sync, head_rows=plan.head_rows, tick=tick, **bound
    ).monotone()


def measure_host(adapter, seed: int = 0, tick: Callable[[int, int], None] | None = None) -> HostCost:
    """Host seconds per round as the engine spends them (``RoundRecord.host_s``: a round's wall time less its
    forward and collective), from ``HOST_TOKENS`` greedy tokens of each of ``HOST_SETTINGS`` on a fixed random
    prompt, the prefill round left out; ``HostCost.through`` the two settings' medians. Shared by the start-up
    preset (through the cached curve) and ``lp_runner tune``, so both price host time alike. ``tick(tokens, all
    tokens)``: after each round."""
    gen = GenerationConfig(max_new_tokens=HOST_TOKENS)
    ids = torch.randint(
        0, adapter.vocab_size, (HOST_PROMPT_TOKENS,), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    groups = []
    total, done = HOST_TOKENS * len(HOST_SETTINGS), 0

    def on_commit(tokens) -> None:
        nonlocal done
        done += len(tokens)
        if tick is not None:
            tick(done, total)

    for la in HOST_SETTINGS:
        records = LookaheadEngine(adapter, la, gen, []).generate(ids, on_commit=on_commit).stats.records[1:]
        groups.append([(r.rows, r.host_s) for r in records])
    return HostCost.through(groups)


def probe_seconds(adapter, sync=None, plan: MeasurementPlan | None = None) -> float:
    """Seconds of one forward at the plan's most expensive point (most rows, longest K/V)."""
    plan = plan or measurement_plan(False)
    kv, q = max(plan.kv_lens), max(plan.rows)
    with adapter.arena([kv + q], scratch=True) as arena:
        cache = arena.region(kv + q)
        adapter.run([Rows([0] * kv, range(kv), torch.ones(kv, kv, dtype=torch.bool).tril(), [0])], [cache])
        (sync or (lambda: None))()
        start = time.perf_counter()
        adapter.run([Rows([0] * q, range(kv, kv + q), torch.ones(q, q, dtype=torch.bool).tril(), range(q))], [cache])
        (sync or (lambda: None))()
        return time.perf_counter() - start


def arena_needs(adapter, cache_root: Path, weights_checksum: str, recalibrate: bool = False) -> list[list[int]]:
    """The regions ``calibrate`` holds at once on ``adapter``'s job arena, one list of positions per measurement:
    none where a cached curve serves, else the curve's regions (one per K/V length, all alive:
    ``costmodel.measure_curve``; either grid) and each host-time generation's. A compiled adapter's warm-up sizes
    the arena for the most of them first (``ModelAdapter.compile``), so the measurements after it do not grow the
    arena under the graphs it recorded."""
    key = calibration_key(
        adapter.device, adapter.dtype, weights_checksum, getattr(adapter, "compiled", False), adapter.backend.key()
    )
    entry = None if recalibrate else _load_entry(cache_file(cache_root, key), key)
    if entry is not None and _serves(*entry):
        return []
    cheap = rows_are_cheap(adapter.device)
    plans = (measurement_plan(cheap, max_positions=getattr(adapter, "max_positions", None)),)
    plans += () if cheap else (measurement_plan(cheap, coarse=True),)
    curves = [curve_needs(p.kv_lens, p.rows) for p in plans]
    gen = GenerationConfig(max_new_tokens=HOST_TOKENS)
    hosts = [[LookaheadEngine(adapter, la, gen, []).capacity(HOST_PROMPT_TOKENS)] for la in HOST_SETTINGS]
    return curves + hosts


def _serves(cached: CostCurve, tries: int) -> bool:
    """A cached curve is used as it is: quiet, or the quietest of ``NOISY_TRIES`` measurements."""
    return cached.spread <= NOISY_SPREAD or tries >= NOISY_TRIES


def calibrate(
    adapter,
    cache_root: Path,
    weights_checksum: str,
    recalibrate: bool = False,
    log: Log | None = None,
    budget_s: float | None = None,
    limit_s: float = CALIBRATION_LIMIT_S,
) -> Calibration | None:
    """The curve for this adapter on this device: from the cache, or measured (and cached). ``budget_s``: the
    longest a measurement should take (LP: the other ranks wait for it within their collective timeout), which
    chooses the grid (default: half of ``limit_s``); ``limit_s``: where it is stopped, returning None (no curve:
    see the module doc)."""
    key = calibration_key(
        adapter.device, adapter.dtype, weights_checksum, getattr(adapter, "compiled", False), adapter.backend.key()
    )
    path = cache_file(cache_root, key)
    start = time.perf_counter()
    entry = None if recalibrate else _load_entry(path, key)
    cached, tries = entry if entry is not None else (None, 0)
    threads = f"{key['threads']} threads, " if key["threads"] else ""
    what = f"on {key['device']} ({threads}{key['dtype']})"
    if cached is not None and _serves(cached, tries):
        if cached.spread > NOISY_SPREAD and log is not None:
            log(
                f"the cached forward-cost curve {what} is noisy ({_spread_text(cached)}), the quietest of {tries} "
                "measurements: using it (--recalibrate measures again)"
            )
        return Calibration(cached, key, "cache", time.perf_counter() - start, str(path))
    if log is not None:
        if cached is None:
            log(f"calibrating the forward-cost curve {what}; cached for next runs")
        else:
            log(
                f"the cached forward-cost curve {what} is noisy ({_spread_text(cached)}): measuring it again "
                f"(measurement {tries + 1} of at most {NOISY_TRIES})"
            )
    tick = Ticker(limit_s, log, start=start)
    host_tick = Ticker(limit_s, log, start=start, unit="tokens of host time")
    # alone, the coarse grid where the probe says the quick one would take half the limit: a large model on a slow
    # CPU still gets a curve instead of running out of time on every start-up
    grid_budget = budget_s if budget_s is not None else limit_s / 2
    try:
        curve = dataclasses.replace(
            measure_quick(adapter, grid_budget, tick), host=measure_host(adapter, tick=host_tick)
        )
    except CalibrationTimeout:
        if log is not None:
            log(
                f"warning: calibrating took longer than {limit_s:.0f} s (a busy machine, or more threads than "
                "cores?): this run goes on without the forward-cost curve, its setting as written, rounds unpadded"
            )
        return None
    seconds = time.perf_counter() - start
    if cached is not None and cached.spread <= curve.spread:  # the cached one is the quieter: it stays
        _save_or_say(path, key, cached, seconds, tries + 1, log)
        return Calibration(cached, key, "cache", seconds, str(path))
    if curve.spread > NOISY_SPREAD and log is not None:
        log(
            f"warning: the forward-cost curve is noisy ({_spread_text(curve)}): is something else loading this "
            "machine? This run uses it; the next run measures again and keeps the quieter curve"
        )
    _save_or_say(path, key, curve, seconds, tries + 1, log)
    return Calibration(curve, key, "measured", seconds, str(path))


def _save_or_say(path: Path, key: dict, curve: CostCurve, seconds: float, tries: int, log: Log | None) -> None:
    try:
        save(path, key, curve, seconds, tries)
    except OSError as exc:  # a read-only cache costs a re-measurement next time, not the run
        if log is not None:
            log(f"warning: cannot cache the calibration at {path}: {exc.strerror or exc}")


def _spread_text(curve: CostCurve) -> str:
    quiet = f"a quiet machine's under {100 * NOISY_SPREAD:.0f}%"
    return f"repetitions {100 * curve.spread:.0f}% apart at the median point, {quiet}"


def shared_calibration(comm, measure: Callable[[], Calibration | None]) -> Calibration | None:
    """Rank 0's calibration on every rank (one start-up all_gather of its JSON; ranks > 0 never measure); None on
    every rank where rank 0 has none (its measurement ran out of time)."""
    mine = measure() if comm.rank == 0 else None
    if comm.world_size == 1:
        return mine
    if comm.rank == 0 and mine is None:
        comm.all_gather_strings(json.dumps({"none": True}))
        return None
    blob = json.dumps(
        {
            "curve": mine.curve.to_dict(),
            "key": mine.key,
            "source": mine.source,
            "seconds": mine.seconds,
            "path": mine.path,
        }
        if mine is not None
        else {}
    )
    first = json.loads(comm.all_gather_strings(blob)[0])
    if first.get("none"):
        return None
    return Calibration(
        CostCurve.from_dict(first["curve"]), first["key"], first["source"], first["seconds"], first["path"]
    )

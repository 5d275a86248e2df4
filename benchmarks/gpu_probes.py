"""What the rounds steps of ``benchmarks/gpu_check.sh`` check besides tokens and milliseconds: how many times the
round was compiled and how many CUDA-graph captures inductor skipped, a round's device time apart from its host
time, and the peak device memory of a measured call. Each works on a CPU too (the smoke run takes the same path);
what a CPU cannot tell is None there.

* ``compile_counts`` / ``compile_check``: torch's own process-wide counters, read before and after; a counter
  this torch does not keep is reported as ``"unknown"``, never as 0.
* ``RoundTimer``: a round's wall time (the device synchronised around it) and, on CUDA, its device time from CUDA
  events taken while a spin kernel keeps the device busy, so every launch of the round is queued before its
  first kernel starts and the events bracket the round's kernels alone. The host time per round is the
  difference: wall minus device, the part of the round the device spends waiting on the host (staging, launches
  or a graph's replay, Python). Example: an eager round of 9 ms wall whose kernels take 6 ms has a host time of
  3000 us; captured, the same kernels in 6.1 ms wall give 100 us.
* ``peak_memory``: ``torch.cuda.max_memory_allocated`` over one call, reset before it.
* ``capture_counts``: the CUDA graphs inductor's cudagraph tree has recorded on a device and how many it recorded
  again (a graph recorded twice replays stale addresses no more, but costs a capture mid-job); None off CUDA.
* ``device.fp32_precision_readings`` (read here): every reader of the TF32 choice (torch's legacy record and its
  per-backend flags), its value or ``"raises"``: the compile probe's evidence that ``device.bind`` left them in
  agreement.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lp_runner.device import synchronizer

UNKNOWN = "unknown"  # a counter this torch does not keep
SPIN_CALIBRATION_CYCLES = 20_000_000  # about 10 ms of a GPU's clock: long enough to time, short enough to ignore
MIN_SPIN_S = 0.002  # the shortest spin ahead of a timed round
MIB = 2**20


def _skips_counted() -> bool:
    """Whether this torch counts skipped CUDA-graph captures (``counters["inductor"]["cudagraph_skips"]``): the name
    appears in inductor's source. A counter nobody increments reads 0, which would pass for "no skip"."""
    for name in ("torch._inductor.cudagraph_utils", "torch._inductor.output_code", "torch._inductor.compile_fx"):
        try:
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.origin and '"cudagraph_skips"' in Path(spec.origin).read_text():
                return True
        except (ImportError, OSError):
            continue
    return False


def compile_counts() -> dict[str, int | None]:
    """Process-wide counts now: graphs dynamo compiled (``counters["stats"]["unique_graphs"]``) and CUDA-graph
    captures inductor skipped; None for a counter this torch does not have."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {"compilations": None, "cudagraph_skips": None}
    return {
        "compilations": int(counters["stats"]["unique_graphs"]),
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]) if _skips_counted() else None,
    }


def compile_check(before: dict[str, int | None], after: dict[str, int | None], device: torch.device) -> dict:
    """The compilations and skipped captures between two ``compile_counts``, and whether they are what one compiled
    round function should give: one compilation (every bucket, K/V width and arena shares it) and, on CUDA, no
    skipped capture. ``"unknown"`` where torch does not count; a zero compile count after a compiled round has run
    means the counter is not kept, so it is unknown too. Unknown counts do not fail the check.

    Example: ({"compilations": 3, ...}, {"compilations": 4, ...}) on CUDA with skips 0 -> {"compilations": 1,
    "cudagraph_skips": 0, "ok": True}."""
    got: dict = {}
    for key in ("compilations", "cudagraph_skips"):
        a, b = before.get(key), after.get(key)
        got[key] = UNKNOWN if a is None or b is None else b - a
    if got["compilations"] == 0:
        got["compilations"] = UNKNOWN
    one = got["compilations"] in (1, UNKNOWN)
    no_skip = device.type != "cuda" or got["cudagraph_skips"] in (0, UNKNOWN)
    return {**got, "ok": one and no_skip}


class RoundTimer:
    """Wall and device time of rounds on ``device`` (see the module doc); device times are None off CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sync = synchronizer(device)
        self.cuda = device.type == "cuda"
        self.cycles_per_s = self._spin_rate() if self.cuda else 0.0

    def _spin_rate(self) -> float:
        """Clock cycles per second of ``torch.cuda._sleep``'s spin, timed with CUDA events once."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # the spin kernel loaded before it is timed
        self.sync()
        start.record()
        torch.cuda._sleep(SPIN_CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
        return SPIN_CALIBRATION_CYCLES / (start.elapsed_time(end) / 1e3)

    def wall(self, run: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
        """Seconds of ``run()`` with the device synchronised before and after, and what it returned."""
        if self.sync:
            self.sync()
        start = time.perf_counter()
        out = run()
        if self.sync:
            self.sync()
        return time.perf_counter() - start, out

    def device_time(self, run: Callable[[], torch.Tensor], spin_s: float) -> tuple[float | None, bool, torch.Tensor]:
        """(device seconds of ``run()``'s kernels or None off CUDA, whether the host issued the whole round within
        the spin, what it returned). The spin (``spin_s``, at least ``MIN_SPIN_S``) is queued first, so the start
        event fires when it ends, after every launch of the round is queued; when the host takes longer than the
        spin (or syncs inside the round), the device time includes host gaps and the flag says so."""
        if not self.cuda:
            return None, True, run()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        spin_s = max(spin_s, MIN_SPIN_S)
        self.sync()
        torch.cuda._sleep(int(spin_s * self.cycles_per_s))
        start.record()
        t = time.perf_counter()
        out = run()
        issued = time.perf_counter() - t
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, issued < spin_s, out


def host_us(wall_s: list[float], device_s: list[float | None]) -> float | None:
    """Median wall minus median device time, in microseconds (None without device times)."""
    if not device_s or any(d is None for d in device_s):
        return None
    return round(1e6 * (statistics.median(wall_s) - statistics.median(device_s)), 1)


def peak_memory(run: Callable[[], object], device: torch.device) -> tuple[object, dict[str, float | None]]:
    """``run()``'s result and the device memory around it, in MiB: allocated before, the peak during it
    (``max_memory_allocated``, reset before), and the peak less what was allocated before. None off CUDA."""
    if device.type != "cuda":
        return run(), {"before_mib": None, "peak_mib": None, "added_mib": None}
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    mib = lambda b: round(b / MIB, 1)  # noqa: E731
    return out, {"before_mib": mib(before), "peak_mib": mib(peak), "added_mib": mib(peak - before)}


def capture_counts(device: torch.device) -> dict[str, int] | None:
    """{"graphs": CUDA graphs recorded, "rerecords": graphs recorded again} from inductor's cudagraph tree on
    ``device`` (read, never created); None off CUDA or where this torch keeps no tree. Read before and after a
    part of a step: graphs recorded after start-up are captures a job pays for mid-generation."""
    if device.type != "cuda":
        return None
    try:
        from torch._inductor import cudagraph_trees

        index = device.index if device.index is not None else torch.cuda.current_device()
        manager = cudagraph_trees.get_manager(index, create_if_none_exists=False)
    except (ImportError, AttributeError, RuntimeError):
        return None
    if manager is None:
        return {"graphs": 0, "rerecords": 0}

    def nodes(level) -> int:
        return sum(1 + sum(nodes(kids) for kids in node.children.values()) for node in level)

    graphs = sum(nodes(roots) for roots in manager.roots.values())
    rerecords = sum(sum(per_function.values()) for per_function in manager.num_rerecord.values())
    return {"graphs": graphs, "rerecords": rerecords}

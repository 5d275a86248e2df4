"""What a run shows and keeps: records to the output file, the progress bar, the end-of-run summary.

One ``Report`` per run, on the process that writes (the only process, torchrun's rank 0, or the Ray driver), so
every launcher produces the same file, bar and summary.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from lp_runner.config import Config
from lp_runner.decoding.metrics import combine
from lp_runner.jobs.output import OutputFile
from lp_runner.logs import STDERR, log


def format_summary(
    cfg: Config, summary: dict, load_s: float, workers: int, policy: dict | None = None, device: dict | None = None
) -> str:
    """``policy``: the last record's ``policy`` (the setting that ran, and why it was chosen); ``device``: its
    ``run.device`` (what ran it, in which dtype)."""
    la = cfg.lookahead
    head = (
        policy["setting"]
        if policy and "setting" in policy
        else (
            f"W={la.window_size} N={la.ngram_size} G={la.verification_set_size} pool_from_prompt={la.pool_from_prompt}"
        )
    )
    lines = [
        "-" * 64,
        f"lp_runner  {head}  workers={workers}",
        *device_lines(device),
        *policy_lines(policy),
        f"prompts {summary['generations']}  new tokens {summary['new_tokens']}  forwards {summary['forwards']}  "
        f"tokens/forward {summary['tokens_per_forward']:.2f}",
        f"tokens/s {summary['tokens_per_s']:.2f}  generation {summary['seconds']:.2f} s  model load {load_s:.2f} s",
        f"time split: forward {100 * summary['forward_share']:.1f}%  host {100 * summary['host_share']:.1f}%  "
        f"comm {100 * summary['comm_share']:.1f}% ({summary['comm_us_per_round']:.0f} us/round)  "
        f"mean packed rows {summary['mean_rows']:.1f}",
        *batch_lines(summary, policy),
        "-" * 64,
    ]
    return "\n".join(lines)


def device_lines(device: dict | None) -> list[str]:
    """What ran the job, e.g. ``device NVIDIA H200 (cuda): bfloat16 (auto: bfloat16 on CUDA), TF32 allowed; peak
    host memory after loading 1.9 GiB``; nothing for records without it."""
    if not device or "dtype" not in device:
        return []
    tf32 = ", TF32 allowed" if device.get("tf32") else ""
    ranks = device.get("load_peak_host_mib_ranks") or [device.get("load_peak_host_mib") or 0.0]
    of = f" (the most of {len(ranks)} ranks)" if len(ranks) > 1 else ""
    peak_txt = f"; peak host memory after loading {max(ranks) / 1024:.1f} GiB{of}" if max(ranks) else ""
    return [f"device {device['name']} ({device['type']}): {device['dtype']} ({device['dtype_choice']}){tf32}{peak_txt}"]


def batch_lines(summary: dict, policy: dict | None) -> list[str]:
    """With ``run.batch`` > 1, what the shared forwards held, e.g. ``batch 8: 120 forwards of 7.6 generations and
    21.3 rows, 12.40 tokens per forward (1.63 per generation)``; nothing one prompt at a time."""
    batch = (policy or {}).get("batch", 1)
    if batch <= 1 or summary.get("generations_per_forward", 1.0) <= 1.0:
        return []
    return [
        f"batch {batch}: {summary['batched_forwards']:.0f} forwards of {summary['generations_per_forward']:.1f} "
        f"generations and {summary['rows_per_forward']:.1f} rows, {summary['job_tokens_per_forward']:.2f} tokens "
        f"per forward ({summary['tokens_per_forward']:.2f} per generation)"
    ]


def policy_lines(policy: dict | None) -> list[str]:
    """How the setting was chosen (auto preset) and what the device's curve said, in two short lines."""
    lines = backend_lines(policy) + compile_lines(policy)
    if not policy or policy.get("preset") != "auto" or "choice" not in policy:
        return lines
    choice, cal = policy["choice"], policy.get("calibration", {})
    if policy.get("pinned"):  # written keys win over the search, whatever their value: say which they were
        lines.append(f"pinned by the config (kept as written by the auto preset): {', '.join(policy['pinned'])}")
    whose = f"; window acceptance: {choice['acceptance']}" if choice.get("acceptance") else ""
    if choice["samples"] == "none":  # nothing recorded for this model: nothing to predict from yet
        lines.append(f"preset auto: {choice['reason']}{whose}")
    else:
        lines.append(
            f"preset auto ({choice['samples']} outputs, {choice['evaluated']} settings priced"
            f"{', read from the cache' if choice.get('from_cache') else ''}): predicted "
            f"{choice['predicted_ms_per_token']:.1f} ms/token, "
            f"{choice['predicted_tokens_per_forward']:.2f} tokens/forward{whose}"
        )
    curve = choice.get("curve_body_ms", {})
    if curve:
        one = curve.get("1")
        pts = "  ".join(f"{q}:{ms / one:.2f}x" if one else f"{q}:{ms}ms" for q, ms in list(curve.items())[:8])
        pad = policy.get("padding", {}).get("rows_to", {})
        pad_txt = ", ".join(_ranges(pad)) or "none"
        batch = policy.get("batch", 1)
        per = f", a generation's share of forwards of {batch}" if batch > 1 else ""  # costmodel.batched_curve
        lines.append(
            f"curve ({cal.get('device', '?')}, {cal.get('source', '?')} {cal.get('seconds', 0):.1f} s"
            f"{_noise_text(cal)}{per}): rows {pts}"
            f"  padding {pad_txt}"
        )
    return lines


def _noise_text(cal: dict) -> str:
    """', noisy: 61% spread' for a curve measured on a busy machine (``calibrate.NOISY_SPREAD``)."""
    return f", noisy: {100 * cal['spread']:.0f}% spread" if cal.get("noisy") else ""


def backend_lines(policy: dict | None) -> list[str]:
    """The forward's backend (``model.backend``) in its own words (``ForwardBackend.summary``), e.g.
    ``forward: torch's linear layers, transformers' decoder layers; model.backend=auto: the model is on cuda:0``;
    nothing for a record without one."""
    summary = ((policy or {}).get("backend") or {}).get("summary")
    return [summary] if summary else []


def compile_lines(policy: dict | None) -> list[str]:
    """The job's forward (``model.compile``), e.g. ``forward compiled (model.compile=on; compiled in 95.2 s)`` or
    ``forward auto: eager (compiling took 100 s here; ...)``; nothing when off."""
    comp = (policy or {}).get("compile")
    if not comp or comp["mode"] == "off":
        return []
    took = f"; compiled in {comp['compile_s']:.1f} s" if comp["compiled"] else ""
    if comp["mode"] == "on" and comp["compiled"]:
        return [f"forward compiled (model.compile=on{took})"]
    return [f"forward {comp['reason']}{took}"]  # auto's reason, or why "on" fell back to eager


def _ranges(targets: dict[str, int]) -> list[str]:
    """{"2": 8, "3": 8, "4": 8, "9": 16} -> ["2-4->8", "9->16"]: padded row counts, consecutive runs merged."""
    runs: list[list[int]] = []  # [first, last, target]
    for q, t in sorted((int(q), t) for q, t in targets.items()):
        if runs and runs[-1][1] == q - 1 and runs[-1][2] == t:
            runs[-1][1] = q
        else:
            runs.append([q, q, t])
    return [f"{a}->{t}" if a == b else f"{a}-{b}->{t}" for a, b, t in runs]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: ``percentile([4, 1, 3, 2], 0.5)`` -> 2, ``percentile([4, 1, 3, 2], 0.9)`` -> 4."""
    ranked = sorted(values)
    if not ranked:
        return 0.0
    return ranked[max(0, min(len(ranked), math.ceil(q * len(ranked))) - 1)]


def job_line(records: Sequence[dict], wall_s: float, groups: int = 1) -> str:
    """The whole job: new tokens over its wall time, per-prompt latency (each record's ``seconds``) p50/p90, and
    each group's utilisation (its records' seconds over the wall time; parallel.groups > 1).

    Two groups, records (group 0, 2 s, 20 tokens), (1, 3 s, 30), (0, 1 s, 10), wall 4 s ->
    ``job 4.00 s  15.00 tokens/s  latency p50 2.00 s  p90 3.00 s  groups 2: busy 75% 75%``."""
    wall_s = max(wall_s, 1e-9)
    tokens = sum(r["new_tokens"] for r in records)
    latencies = [r["seconds"] for r in records]
    line = (
        f"job {wall_s:.2f} s  {tokens / wall_s:.2f} tokens/s  latency p50 {percentile(latencies, 0.5):.2f} s  "
        f"p90 {percentile(latencies, 0.9):.2f} s"
    )
    if groups > 1:
        busy = [sum(r["seconds"] for r in records if r.get("group") == g) / wall_s for g in range(groups)]
        line += f"  groups {groups}: busy " + " ".join(f"{100 * b:.0f}%" for b in busy)
    return line


class Report:
    """Records of this run go to ``output`` (if any) and the bar; ``finish`` prints the summary.

    ``total``: prompts in the job, ``already``: of those, how many the output held before (``--resume``).
    """

    def __init__(
        self, cfg: Config, output: OutputFile | None, total: int, already: int = 0, progress: bool = True
    ) -> None:
        self.cfg = cfg
        self.output = output
        self.records: list[dict] = []
        self.already = already
        self.started = time.perf_counter()  # the job's wall clock: tokens/s of the whole job, group utilisation
        self.bar: Any = None
        if progress and cfg.run.progress and total > 1 and log.isEnabledFor(logging.INFO):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=already, desc="prompts", unit="prompt", file=STDERR)

    def record(self, rec: dict) -> None:
        self.records.append(rec)
        if self.output is not None:
            try:
                self.output.write(rec)
            except BaseException:
                # the bar ends its line first: under D groups this runs on the collector thread, whose error line
                # would otherwise land on the bar's line and be drawn over by its next refresh
                self.close_bar()
                raise
        if self.bar is not None:
            self.bar.update(1)
            if "error" not in rec:
                self.bar.set_postfix(tok_per_fwd=f"{rec['tokens_per_forward']:.2f}", tok_s=f"{rec['tokens_per_s']:.1f}")

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def finish(self, load_s: float, workers: int, recoveries: Sequence[Sequence[dict]] = (), groups: int = 1) -> None:
        """The summary on stderr. ``recoveries`` (Ray): per lost group, the recovery events of the prompts it
        split (one line each loss)."""
        self.close_bar()
        if not self.cfg.run.summary:
            return
        generated = [r for r in self.records if "error" not in r]
        summary = combine(SimpleNamespace(**r["stats"]) for r in generated)
        policy = next((r["policy"] for r in reversed(generated) if "policy" in r), None)
        device = next((r["run"]["device"] for r in reversed(generated) if "run" in r), None)
        lines = format_summary(self.cfg, summary, load_s, workers, policy, device).split("\n")
        if generated:
            lines.insert(-1, job_line(generated, time.perf_counter() - self.started, groups))
        errors = len(self.records) - len(generated)
        if errors or self.already:
            lines.insert(
                -1,
                f"skipped: {self.already} already in the output (--resume), {errors} error records "
                f"(run.on_error={self.cfg.run.on_error})",
            )
        if recoveries:
            spent = sum(loss[0]["seconds"] or 0.0 for loss in recoveries)
            lines.insert(-1, f"recoveries {len(recoveries)} (lost workers, {spent:.2f} s to rebuild)")
            for loss in recoveries:
                lost, workers = loss[0]["lost"][:80], loss[0]["workers_after"]
                lines.insert(-1, f"  {lost} -> resumed {resumed_prompts(loss)} on {workers} workers")
        log.info("\n".join(lines))  # stderr: stdout carries only results (streamed text)


def resumed_prompts(loss: Sequence[dict]) -> str:
    """The prompts one lost group's recovery resumed, for the warning and the summary: "prompt 'b' at token 37",
    or with several in flight "prompts 'b' at token 37, 'c' at token 12"."""
    at = ", ".join(f"'{event['prompt']}' at token {event['resumed_at_token']}" for event in loss)
    return f"prompt{'s' if len(loss) > 1 else ''} {at}"

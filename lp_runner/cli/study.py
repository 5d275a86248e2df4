"""``python -m lp_runner study``: strong scaling, measured (the user's job at each P) or simulated (LP's lever).

    python -m lp_runner study --config configs/default.yaml --prompts p.jsonl --workers 1,2 --out DIR
    python -m lp_runner study --simulate --curve roofline:H200 --model-shape llama-8b --workers 1,2,4,8 --out DIR

Measured (``studies/measured.py``): the job runs through the real CLI at each P, the window being the auto
preset's choice at that P or ``--wng``, the P values interleaved over ``--repeat`` repetitions after a warm-up
prompt; an interrupted study resumes where it stopped. ``--curve`` beside it adds the simulation for the same P
values. Simulated (``studies/simulate.py``): at each P the window whose per-rank rows the curve makes cheapest
per token, on an acceptance table (``--acceptance``). ``--devices N`` (simulated) prices every split D x P = N.
Both write DIR/study.json, study.md and study.png. One convention everywhere: "speed vs P = 1" and "speed vs
plain decoding", > 1 faster.

Every option is checked before any P runs (bounds: ``MAX_WORKERS``, ``MAX_DEVICES``, ``MAX_KV_LEN``; numbers
finite), and ``--out`` follows ``outfiles.py``'s rule: a folder, not one of the run's inputs, writable (probed)
before any work; the report's files are written atomically.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from lp_runner.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, InputError, LPError
from lp_runner.limits import quote
from lp_runner.logs import OneLineParser, add_log_level, log, setup_logging

MAX_WORKERS = 1024  # parallel.workers' bound: no job runs more LP ranks
MAX_DEVICES = 1024  # --devices: every P dividing it gets a full window search
MAX_KV_LEN = 1 << 20  # --kv-len: past any model shape's context here (llama-8b: 128k positions)
DEFAULT_ACCEPTANCE = "embedded-calibration8"  # the embedded model's table (``tuning/acceptance.py``)


def build_parser() -> argparse.ArgumentParser:
    from lp_runner.studies.hardware import BANDWIDTH_FRACTION, FLOPS_FRACTION, GPUS, INTERCONNECTS, MODEL_SHAPES
    from lp_runner.studies.simulate import EXTEND_RULES

    p = OneLineParser(
        prog="python -m lp_runner study",
        description="Strong scaling: per-prompt latency at P = 1, 2, 4, ... LP workers, measured or simulated.",
    )
    p.add_argument("--out", required=True, help="folder for study.json, study.md, study.png (and P<p>.jsonl)")
    p.add_argument("--workers", help="comma-separated P values (default: 1,2 measured; 1,2,4,8 simulated)")
    p.add_argument("--simulate", action="store_true", help="only the simulation (needs --curve; runs no model)")
    p.add_argument("--config", help="measured: the job's YAML config")
    p.add_argument("--prompts", help="measured: the job's prompts (JSONL)")
    p.add_argument("--wng", help="measured: pin W,N,G at every P (default: the auto preset's choice at each P)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument(
        "--curve",
        help=f"the simulation's forward: roofline:NAME ({', '.join(GPUS)}), a curve file (a start-up "
        "calibration, tune --save-curve, or the GPU check's buckets.json), or, measured, job: the curve the "
        "job's P=1 run calibrated (with its measured host time)",
    )
    p.add_argument("--model-shape", default="embedded", choices=sorted(MODEL_SHAPES), help="for a roofline curve")
    p.add_argument(
        "--interconnect",
        default="nvlink",
        help=f"the all_gather's link: {', '.join(INTERCONNECTS)}, or measured:US (a measured 2-rank all_gather)",
    )
    p.add_argument(
        "--host-us",
        help="host time per round R[,PER_ROW] in microseconds (default: the curve file's measured host time; for a "
        "roofline, the engine's host time measured on a CPU host, labelled)",
    )
    p.add_argument("--host-label", help="where --host-us comes from, for the report (default: given)")
    p.add_argument(
        "--kv-len", help="cached positions before the first decode round (default: the recorded rounds' own)"
    )
    p.add_argument("--extend", default="hold", choices=EXTEND_RULES, help="tokens/forward beyond recorded windows")
    p.add_argument(
        "--slope",
        help="what-if: tokens per forward gained per doubling of a window's rows beyond the recorded windows (the "
        "Lookahead paper's log-linear law; implies --extend log)",
    )
    p.add_argument(
        "--acceptance",
        help=f"simulated: the acceptance table, a shipped name or a file (default: {DEFAULT_ACCEPTANCE}, the "
        "embedded model's)",
    )
    p.add_argument(
        "--record-acceptance",
        action="store_true",
        help="record the configured model's acceptance on --prompts at --windows into OUT (resumable): the table "
        "--acceptance OUT/table.json prices, and the auto preset's for this model",
    )
    p.add_argument("--windows", default="", help="--record-acceptance: W-N-G,W-N-G,... (default: a grid to 63-8-63)")
    p.add_argument(
        "--bandwidth-fraction",
        help=f"roofline: achievable share of the memory bandwidth (default {BANDWIDTH_FRACTION})",
    )
    p.add_argument(
        "--flops-fraction", help=f"roofline: achievable share of the dense bf16 FLOP/s (default {FLOPS_FRACTION})"
    )
    p.add_argument("--devices", help="simulated: price every split D x P of N devices (P dividing N)")
    p.add_argument("--repeat", default="3", help="measured: repetitions, P values interleaved (at least 3)")
    add_log_level(p)
    return p


def parse_int(text: str, what: str, low: int, high: int) -> int:
    """One integer in [low, high], its text bounded before it is converted (a 5,000-digit value is one line)."""
    text = text.strip()
    if not (text.lstrip("+-").isdigit() and len(text) <= 12):
        raise InputError(f"{what} expects an integer from {low} to {high}, got {quote(text)}")
    value = int(text)
    if not low <= value <= high:
        raise InputError(f"{what} must be from {low} to {high}, got {value}")
    return value


def parse_int_list(text: str, what: str, high: int = MAX_WORKERS) -> list[int]:
    """Comma-separated integers, each from 1 to ``high``."""
    if len(text) > 10_000:
        raise InputError(f"{what} is {len(text)} characters long: {quote(text)}")
    return [parse_int(x, what, 1, high) for x in text.split(",")]


def parse_number(text: str, what: str, low: float, high: float, low_open: bool = False) -> float:
    """A finite number in [low, high] (``low_open``: (low, high]): NaN, infinities and negated times are refused,
    since each would price every window at NaN or make time run backwards."""
    try:
        value = float(text) if len(text) <= 64 else float("nan")
    except ValueError:
        raise InputError(f"{what} expects a number, got {quote(text)}") from None
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        lower = f"> {low:g}" if low_open else f">= {low:g}"
        raise InputError(f"{what} must be a finite number {lower} and <= {high:g}, got {quote(text)}")
    return value


def parse_float_list(text: str, what: str) -> list[float]:
    parts = text.split(",")
    if not 1 <= len(parts) <= 2:
        raise InputError(f"{what} expects R[,PER_ROW] in microseconds, got {quote(text)}")
    return [parse_number(x, what, 0.0, 1e9) for x in parts]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        return _run(args)
    except KeyboardInterrupt:
        log.error("interrupted")
        return EXIT_INTERRUPTED
    except LPError as exc:
        from lp_runner.studies.measured import NotExact, RunFailed, StudyInterrupted

        log.error("%s", exc)
        if isinstance(exc, StudyInterrupted):
            return EXIT_INTERRUPTED
        from lp_runner.tuning.acceptance import NotGreedy

        return exc.code if isinstance(exc, (RunFailed, NotExact, NotGreedy)) else EXIT_USER_ERROR


@dataclass
class Options:
    """Every option checked and converted, before any P runs."""

    out: Path
    workers: list[int]
    devices: int | None
    kv_len: int | None
    repeat: int
    bandwidth_fraction: float
    flops_fraction: float
    slope: float | None
    link: object  # studies.hardware.Interconnect (imported late: torch)
    host_us: list[float] | None


def check_options(args: argparse.Namespace) -> Options:
    """Every option's bounds, in one place, before anything runs or is written (``outfiles``'s rule for --out)."""
    from lp_runner.studies.hardware import BANDWIDTH_FRACTION, FLOPS_FRACTION, INTERCONNECTS, measured_interconnect

    if args.simulate and args.curve is None:
        raise InputError("--simulate needs --curve (roofline:NAME or a curve file)")
    if not args.simulate and args.prompts is None:
        raise InputError("a measured study needs --prompts FILE.jsonl (or give --simulate --curve ...)")
    devices = None
    if args.devices is not None:
        if not args.simulate:
            raise InputError("--devices N prices splits in a simulated study: add --simulate")
        devices = parse_int(args.devices, "--devices", 1, MAX_DEVICES)
    kv_len = None if args.kv_len is None else parse_int(args.kv_len, "--kv-len", 0, MAX_KV_LEN)
    default = "1,2,4,8" if args.simulate else "1,2"
    workers = sorted(set(parse_int_list(args.workers or default, "--workers")))
    if devices:
        workers = sorted(set(workers) | {p for p in range(1, devices + 1) if devices % p == 0})
    link_name = args.interconnect
    if link_name.startswith("measured:"):
        us = parse_number(link_name.partition(":")[2], "--interconnect measured:US", 0.0, 1e9, low_open=True)
        link = measured_interconnect(us)
    elif link_name in INTERCONNECTS:
        link = INTERCONNECTS[link_name]
    else:
        raise InputError(f"--interconnect {quote(link_name)}: use {', '.join(INTERCONNECTS)} or measured:US")
    bw = BANDWIDTH_FRACTION if args.bandwidth_fraction is None else args.bandwidth_fraction
    fl = FLOPS_FRACTION if args.flops_fraction is None else args.flops_fraction
    slope = None if args.slope is None else parse_number(args.slope, "--slope", -10.0, 10.0)
    if args.host_label is not None and len(args.host_label) > 200:
        raise InputError(
            f"--host-label is {len(args.host_label)} characters long (at most 200): {quote(args.host_label)}"
        )
    out = Path(args.out)
    check_out(out, {"--prompts": args.prompts, "--config": args.config, "--curve": args.curve,
                    "--acceptance": args.acceptance})  # fmt: skip
    return Options(
        out,
        workers,
        devices,
        kv_len,
        parse_int(args.repeat, "--repeat", 3, 100),
        parse_number(str(bw), "--bandwidth-fraction", 0.0, 1.0, low_open=True),
        parse_number(str(fl), "--flops-fraction", 0.0, 1.0, low_open=True),
        slope,
        link,
        None if args.host_us is None else parse_float_list(args.host_us, "--host-us"),
    )


def _record(args) -> int:
    """``--record-acceptance``: every option checked before the model loads; the recording resumes from OUT."""
    from lp_runner.cli.acceptance import parse_windows, record_acceptance
    from lp_runner.config import load_config

    if args.simulate or args.curve is not None:
        raise InputError("--record-acceptance runs the model: drop --simulate and --curve (price it afterwards)")
    if args.prompts is None:
        raise InputError("--record-acceptance needs --prompts FILE.jsonl, the prompts to record on")
    windows = parse_windows(args.windows)
    out = Path(args.out)
    check_out(out, {"--prompts": args.prompts, "--config": args.config})
    cfg = load_config(args.config, list(args.overrides))
    data = record_acceptance(cfg, args.prompts, out, windows, log.info)
    for s in data["summary"]:
        w = "-".join(map(str, s["window"]))
        lo, hi = s["interval"]
        log.info("%s: %.2f tokens/forward [%.2f, %.2f], %.0f rows a round", w, s["tokens_per_forward"], lo, hi,
                 s["rows_per_round"])  # fmt: skip
    return 0


def check_out(out: Path, inputs: dict[str, str | None]) -> None:
    """``--out`` under ``outfiles.py``'s rule, before any work: a folder (a regular file, a FIFO or one of the
    run's inputs is refused), created if missing, and writable (a probe file made and removed: ``os.access``
    says yes to root on a read-only mount)."""
    import tempfile

    from lp_runner.outfiles import same_file

    for what, path in inputs.items():
        if path and Path(path).exists() and same_file(out, path):
            raise InputError(f"--out {out} is the same file as {what} {path}; give a folder for the report")
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file, not a folder; give a folder for study.json, study.md, study.png")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".study.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InputError(f"cannot write --out {out}: {exc.strerror or exc}") from None


def _run(args) -> int:
    if args.record_acceptance:
        return _record(args)
    opts = check_options(args)
    out, workers = opts.out, opts.workers
    table = None
    if args.curve is not None:
        from lp_runner.tuning.acceptance import load_table

        table = load_table(args.acceptance or DEFAULT_ACCEPTANCE)
    if args.curve == "job" and args.simulate:
        raise InputError("--curve job is the measured job's own curve: drop --simulate or name a curve")
    report: dict = {"date": date.today().isoformat(), "workers": workers}
    if not args.simulate:
        report["measured"] = measured(args, opts)
        report["machine"] = report["measured"].pop("machine")
    if args.curve == "job":
        args.curve = _job_curve(out, min(workers))
    if args.curve is not None:
        report["simulated"] = simulated(args, opts, table)
    from lp_runner.studies.report import write

    for path in write(report, out):
        log.info("wrote %s", path)
    sys.stdout.write(_summary(report))
    meas = report.get("measured")
    if meas and not meas["identical_outputs"]:
        from lp_runner.studies.measured import NotExact

        differ = [r["workers"] for r in meas["points"] if not r["identical_to_base"]]
        raise NotExact(
            f"outputs differ from P={meas['base_workers']}'s at P={','.join(map(str, differ))} (LP must be exact; "
            f"the prompts are in {out / 'study.md'})"
        )
    return 0


def measured(args, opts: Options) -> dict:
    from lp_runner.cli.preflight import preflight
    from lp_runner.config import load_config
    from lp_runner.jobs.prompts import read_prompts
    from lp_runner.studies.measured import pin_sets, run_study, summarize, threads_per_rank

    wng = tuple(parse_int_list(args.wng, "--wng", 1024)) if args.wng else None
    if wng is not None and len(wng) != 3:
        raise InputError(f"--wng expects W,N,G, got {quote(args.wng)}")
    sets = [x for o in args.overrides for x in ("--set", o)] + pin_sets(wng)
    plain = [s for s in sets if s != "--set"]
    cfg = load_config(args.config, plain)  # bad keys: one line here, not per P
    top = max(opts.workers)
    # the largest P checked here, before any P runs: memory, cores, the model's context
    preflight(load_config(args.config, [*plain, f"parallel.workers={top}"]), top * cfg.parallel.groups)
    ids = [s.id for s in read_prompts(args.prompts)]
    threads = threads_per_rank(cfg.model.threads, top)
    # the threads are the study's to set per run (the same a rank at every P): a given model.threads is used there
    run_sets = [x for o in args.overrides if not o.strip().startswith("model.threads=") for x in ("--set", o)]
    run_sets += pin_sets(wng)
    result = run_study(args.config, args.prompts, ids, opts.workers, opts.out, run_sets, opts.repeat, threads, log.info)
    result.update(summarize(opts.out, ids, result["runs"], result["load_averages"], result["cores"]))
    result["runs"] = [f"{r.key} rep {r.rep}" for r in result["runs"]]  # the order they ran in
    result.update(
        prompts=len(ids),
        prompts_file=args.prompts,
        config=args.config or "(defaults)",
        pinned_window=list(wng) if wng else None,
        device=cfg.model.device,
        machine=_machine(),
    )
    return result


def simulated(args, opts: Options, table) -> dict:
    from lp_runner.backends.buckets import BucketLadder
    from lp_runner.studies.hardware import ENGINE_HOST_COST, ENGINE_HOST_LABEL, curve_from_source
    from lp_runner.studies.simulate import Host, Inputs, acceptance_of, band, inputs_dict, simulate, slope_interval
    from lp_runner.tuning.costmodel import HostCost, RowPlan

    curve, label, on_gpu = curve_from_source(
        args.curve, args.model_shape, [opts.kv_len or 512], opts.bandwidth_fraction, opts.flops_fraction
    )
    if args.acceptance is None:
        log.info("acceptance: %s, the embedded model's table (default; --acceptance NAME|FILE)", DEFAULT_ACCEPTANCE)
    if opts.host_us is not None:
        parts = opts.host_us
        given = f"{args.host_label or 'given'} (--host-us {args.host_us})"  # checked: at most two numbers
        host = Host(HostCost(1e-6 * parts[0], 1e-6 * (parts[1] if len(parts) > 1 else 0.0)), given)
    elif curve.host is not None:
        host = Host(curve.host, "measured with the curve (the machine that measured it)")
    else:
        host = Host(ENGINE_HOST_COST, ENGINE_HOST_LABEL)
    accs = acceptance_of(table, opts.kv_len)
    row_plan = BucketLadder() if on_gpu else RowPlan.from_curve(curve)
    kv = (
        opts.kv_len
        if opts.kv_len is not None
        else _median([s.kv_len for a in accs[1:] for p in a.shapes for s in p[1:]])
    )
    inputs = Inputs(curve, host, opts.link, row_plan, kv)
    rule = "log" if opts.slope is not None else args.extend
    result = simulate(accs, opts.workers, inputs, rule, opts.slope)
    interval = slope_interval(accs)
    if interval is not None:
        result["slope_per_doubling"] = dict(zip(("point", "low", "high"), (round(x, 4) for x in interval), strict=True))
        result["band"] = band(accs, opts.workers, inputs, interval)
    result["inputs"] = inputs_dict(
        label, args.model_shape, table, host, opts.link, opts.kv_len, rule, opts.slope, on_gpu
    )
    result["windows"] = [
        {"window": a.window.to_dict(), "tokens_per_forward": round(a.tokens_per_forward, 3),
         "interval": [round(x, 3) for x in a.interval] if a.interval else None, "rows": round(a.rows, 1)}
        for a in accs
    ]  # fmt: skip
    if opts.devices:
        result["splits"] = splits(result, opts.devices)
    return result


def _median(xs: list[int]) -> int:
    s = sorted(xs)
    return s[len(s) // 2] if s else 512


def _job_curve(out: Path, workers: int) -> str:
    """The calibration file the job's P = ``workers`` run priced its rounds with (its records' policy)."""
    from lp_runner.studies.measured import Run, read_records, records_path

    for rec in read_records(records_path(out, Run(workers, 0, 0))).values():
        path = rec.get("policy", {}).get("calibration", {}).get("file")
        if path and Path(path).is_file():
            return path
    raise InputError(
        f"--curve job: the P={workers} run's records name no calibration file (lookahead.preset off with "
        "advanced.pad_rows false measures none, or the cache was cleared): give --curve FILE"
    )


def splits(result: dict, devices: int) -> dict:
    """Every split D x P of ``devices`` from the simulated per-P points (``tuning.split``), and why its winners
    win: latency from the window P affords, throughput from D prompts at once."""
    from lp_runner.studies.simulate import MARGIN
    from lp_runner.tuning.split import ASSUMPTION, split_table

    by_p = {p["workers"]: p for p in result["points"]}
    table = split_table(devices, lambda d, p: by_p[p]["ms_per_token"])
    by_workers = sorted(table, key=lambda sp: sp.workers)
    fast = wide = by_workers[0]
    for sp in by_workers[1:]:  # a larger P is named better only when MARGIN faster (or MARGIN more tokens/s)
        if sp.ms_per_token < fast.ms_per_token * (1 - MARGIN):
            fast = sp
        if sp.tokens_per_s > wide.tokens_per_s * (1 + MARGIN):
            wide = sp
    f, one = by_p[fast.workers], by_p[1]
    top = by_p[max(by_p)]
    if fast.workers > 1:
        why = (
            f"Lowest latency: {fast.label} ({f['ms_per_token']:.4f} ms/token): P={fast.workers} runs window "
            f"{_window(f['window'])} at {f['tokens_per_forward']:.2f} tokens/forward on {f['busiest_rank_rows']} "
            f"rows on the busiest rank, against {_window(one['window'])} at {one['tokens_per_forward']:.2f} on "
            f"{one['busiest_rank_rows']} rows at P=1."
        )
    else:
        why = (
            f"Lowest latency: {fast.label}: no P > 1 is {100 * MARGIN:g}% faster (P={top['workers']}: "
            f"{top['ms_per_token']:.4f} ms/token with window {_window(top['window'])}, {top['tokens_per_forward']:.2f} "
            "tokens/forward): a larger window "
            "per rank buys too few tokens per forward to pay the busier rank and the collective."
        )
    why += (
        f" Highest throughput: {wide.label} ({wide.tokens_per_s:.1f} tokens/s): D groups run D prompts at once with "
        "no collective, so they win throughput wherever P buys less than P times the speed."
    )
    return {
        "devices": devices,
        "assumption": ASSUMPTION,
        "table": [{**sp.to_dict(), "window": by_p[sp.workers]["window"]} for sp in table],
        "lowest_latency": fast.to_dict(),
        "highest_throughput": wide.to_dict(),
        "why": why,
    }


def _window(d: dict) -> str:
    return "plain decoding" if d["W"] == 0 else f"{d['W']}-{d['N']}-{d['G']}"


def _machine() -> str:
    """The CPU's model name (``lscpu``'s), and the GPU's where the job ran on one."""
    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    if torch.cuda.is_available():
        name += f", {torch.cuda.get_device_name(0)}"
    return name


def _summary(report: dict) -> str:
    """What the terminal shows: per P the figures the report's tables hold, one convention (> 1 faster)."""
    from lp_runner.studies.report import rows_label

    lines = []
    meas = report.get("measured")
    if meas:
        for p in meas["points"]:
            lines.append(
                f"measured {p['label']}: {p['ms_per_token']:.3f} ms/token (spread {100 * p['spread']:.0f}%), speed vs "
                f"P=1 {_x(p['speed_vs_p1'])}, {p['tokens_per_forward']:.2f} tokens/forward, "
                f"{rows_label(p['busiest_rank_rows'])} rows a round on the busiest rank, window {p['window']}"
            )
        lines.append(f"outputs identical at every P: {meas['identical_outputs']}")
        lines += [f"warning: {w}" for w in meas.get("warnings", [])]
    sim = report.get("simulated")
    if sim:
        lines.append(f"simulated on {sim['inputs']['curve']}")
        lines.append(f"acceptance: {sim['inputs']['acceptance']}; host: {sim['inputs']['host']}")
        knee = sim["knee_rows"]
        for p in sim["points"]:
            lo, hi = p["tokens_per_forward_interval"] or (p["tokens_per_forward"],) * 2
            lines.append(
                f"simulated P={p['workers']}: window {_window(p['window'])}, busiest rank {p['busiest_rank_rows']:.0f} "
                f"rows (knee {knee}), {p['tokens_per_forward']:.2f} tokens/forward [{lo:.2f}, {hi:.2f}], forward "
                f"{p['forward_ms']:.3f} + collective {p['collective_ms']:.3f} + host {p['host_ms']:.3f} ms a round, "
                f"{p['ms_per_token']:.4f} ms/token, speed vs P=1 {_x(p['speed_vs_p1'])}, vs plain decoding "
                f"{_x(p['speed_vs_plain'])}"
            )
        b = sim.get("band")
        if b:
            r, sl = b["speed_vs_p1"], b["slope_per_doubling"]
            lines.append(
                f"band: P={b['workers']} speed vs P=1 {min(r['low'], r['high']):.2f}x to "
                f"{max(r['low'], r['high']):.2f}x "
                f"({r['point']:.2f}x at the fitted slope {sl['point']:+.3f}) over the recorded slope's 95% interval "
                f"{sl['low']:+.3f} to {sl['high']:+.3f} tokens/forward per doubling of rows"
            )
        if sim.get("splits"):
            lines.append(sim["splits"]["why"])
    return "\n".join(lines) + "\n"


def _x(value: float | None) -> str:
    return "n/a (P=1 not in --workers)" if value is None else f"{value:.2f}x"

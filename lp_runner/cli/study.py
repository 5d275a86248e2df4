"""``python -m lp_runner study``: strong scaling, measured (the user's job at each P) or simulated (LP's lever).

    python -m lp_runner study --config configs/default.yaml --prompts p.jsonl --workers 1,2 --out DIR
    python -m lp_runner study --simulate --curve roofline:H200 --model-shape llama-8b --workers 1,2,4,8 --out DIR

Measured (``studies/measured.py``): the job runs through the real CLI at each P, the window being the auto
preset's choice at that P or ``--wng``; an interrupted study resumes where it stopped. ``--curve`` beside it adds
the simulation for the same P values. Simulated (``studies/simulate.py``): at each P the window whose per-rank
rows the curve makes cheapest per token. ``--devices N`` (simulated) prices every split D x P = N. Both write
DIR/study.json, study.md and study.png.
"""

from __future__ import annotations

import argparse
import sys
from datetime import date
from pathlib import Path

from lp_runner.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, InputError, LPError
from lp_runner.logs import OneLineParser, add_log_level, log, setup_logging


def build_parser() -> argparse.ArgumentParser:
    from lp_runner.studies.hardware import GPUS, INTERCONNECTS, MODEL_SHAPES
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
        help="host time per round R[,PER_ROW] in microseconds (default: the curve file's measured host time; "
        "none for a roofline, which makes the simulation a lower bound)",
    )
    p.add_argument("--host-label", help="where --host-us comes from, for the report (default: given)")
    p.add_argument("--kv-len", type=int, default=512, help="cached positions the simulated rounds see")
    p.add_argument("--extend", default="hold", choices=EXTEND_RULES, help="tokens/forward beyond recorded windows")
    p.add_argument("--devices", type=int, help="simulated: price every split D x P of N devices (P dividing N)")
    add_log_level(p)
    return p


def parse_int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise InputError(f"{what} expects comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise InputError(f"{what} values must be >= 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        return _run(args)
    except KeyboardInterrupt:
        log.error("interrupted")
        return EXIT_INTERRUPTED
    except LPError as exc:
        from lp_runner.studies.measured import RunFailed, StudyInterrupted

        log.error("%s", exc)
        if isinstance(exc, StudyInterrupted):
            return EXIT_INTERRUPTED
        return exc.code if isinstance(exc, RunFailed) else EXIT_USER_ERROR


def _run(args) -> int:
    out = Path(args.out)
    if args.simulate and args.curve is None:
        raise InputError("--simulate needs --curve (roofline:NAME or a curve file)")
    if not args.simulate and args.prompts is None:
        raise InputError("a measured study needs --prompts FILE.jsonl (or give --simulate --curve ...)")
    if args.devices is not None and (args.devices < 1 or not args.simulate):
        raise InputError("--devices N (N >= 1) prices splits in a simulated study: add --simulate")
    if args.kv_len < 0:
        raise InputError(f"--kv-len must be >= 0, got {args.kv_len}")
    default = "1,2,4,8" if args.simulate else "1,2"
    workers = sorted(set(parse_int_list(args.workers or default, "--workers")))
    if args.devices:
        workers = sorted(set(workers) | {p for p in range(1, args.devices + 1) if args.devices % p == 0})
    report: dict = {"date": date.today().isoformat(), "workers": workers}
    if not args.simulate:
        report["measured"] = measured(args, workers, out)
        report["machine"] = report["measured"].pop("machine")
    if args.curve == "job":
        if args.simulate:
            raise InputError("--curve job is the measured job's own curve: drop --simulate or name a curve")
        args.curve = _job_curve(out, min(workers))
    if args.curve is not None:
        report["simulated"] = simulated(args, workers)
    from lp_runner.studies.report import write

    for path in write(report, out):
        log.info("wrote %s", path)
    sys.stdout.write(_summary(report))
    return 0


def measured(args, workers: list[int], out: Path) -> dict:
    from lp_runner.config import load_config
    from lp_runner.jobs.prompts import read_prompts
    from lp_runner.studies.measured import pin_sets, run_study, summarize

    wng = tuple(parse_int_list(args.wng, "--wng")) if args.wng else None
    if wng is not None and len(wng) != 3:
        raise InputError(f"--wng expects W,N,G, got {args.wng!r}")
    sets = [x for o in args.overrides for x in ("--set", o)] + pin_sets(wng)
    cfg = load_config(args.config, [s for s in sets if s != "--set"])  # bad keys: one line here, not per P
    ids = [s.id for s in read_prompts(args.prompts)]
    run_study(args.config, args.prompts, ids, workers, out, sets, log.info)
    result = summarize(out, ids, workers)
    result.update(
        prompts=len(ids),
        prompts_file=args.prompts,
        config=args.config or "(defaults)",
        pinned_window=list(wng) if wng else None,
        device=cfg.model.device,
        machine=_machine(),
    )
    return result


def simulated(args, workers: list[int]) -> dict:
    from lp_runner.studies.hardware import INTERCONNECTS, curve_from_source, measured_interconnect
    from lp_runner.studies.simulate import Host, acceptance, inputs_dict, simulate
    from lp_runner.tuning.costmodel import HostCost
    from lp_runner.tuning.preset import shipped_prior

    curve, label = curve_from_source(args.curve, args.model_shape, [args.kv_len])
    link_name = args.interconnect
    if link_name.startswith("measured:"):
        try:
            link = measured_interconnect(float(link_name.partition(":")[2]))
        except ValueError:
            raise InputError(f"--interconnect measured:US expects microseconds, got {link_name!r}") from None
    elif link_name in INTERCONNECTS:
        link = INTERCONNECTS[link_name]
    else:
        raise InputError(f"--interconnect {link_name!r}: use {', '.join(INTERCONNECTS)} or measured:US")
    if args.host_us is not None:
        parts = parse_float_list(args.host_us, "--host-us")
        given = f"{args.host_label or 'given'} (--host-us {args.host_us})"
        host = Host(HostCost(1e-6 * parts[0], 1e-6 * (parts[1] if len(parts) > 1 else 0.0)), given)
    elif curve.host is not None:
        host = Host(curve.host, "measured with the curve (the machine that measured it)")
    else:
        host = Host(HostCost(), "left out (none measured for this curve): the figures are a lower bound")
    table = acceptance(shipped_prior().recorded)
    result = simulate(table, workers, curve, host, link, args.kv_len, args.extend)
    result["inputs"] = inputs_dict(label, args.model_shape, host, link, args.kv_len, args.extend)
    if args.devices:
        result["splits"] = splits(result, args.devices)
    return result


def _job_curve(out: Path, workers: int) -> str:
    """The calibration file the job's P = ``workers`` run priced its rounds with (its records' policy)."""
    from lp_runner.studies.measured import read_records, records_path

    for rec in read_records(records_path(out, workers)).values():
        path = rec.get("policy", {}).get("calibration", {}).get("file")
        if path and Path(path).is_file():
            return path
    raise InputError(
        f"--curve job: the P={workers} run's records name no calibration file (lookahead.preset off with "
        "advanced.pad_rows false measures none, or the cache was cleared): give --curve FILE"
    )


def parse_float_list(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise InputError(f"{what} expects R[,PER_ROW] in microseconds, got {text!r}") from None
    if not 1 <= len(values) <= 2 or min(values) < 0:
        raise InputError(f"{what} expects one or two non-negative numbers, got {text!r}")
    return values


def splits(result: dict, devices: int) -> dict:
    """Every split D x P of ``devices`` from the simulated per-P points (``tuning.split``), and why its winners
    win: latency from the window P affords, throughput from D prompts at once."""
    from lp_runner.tuning.split import ASSUMPTION, highest_throughput, lowest_latency, split_table

    by_p = {p["workers"]: p for p in result["points"]}
    table = split_table(devices, lambda d, p: by_p[p]["ms_per_token"])
    fast, wide = lowest_latency(table), highest_throughput(table)
    f, one = by_p[fast.workers], by_p[1]
    top = by_p[max(by_p)]
    if fast.workers > 1:
        why = (
            f"Lowest latency: {fast.label} ({f['ms_per_token']:.4f} ms/token): P={fast.workers} runs window "
            f"{_window(f['window'])} at {f['tokens_per_forward']:.2f} tokens/forward on {f['rows_per_rank']} rows per "
            f"rank, against {_window(one['window'])} at {one['tokens_per_forward']:.2f} on {one['rows_per_rank']} "
            "rows at P=1."
        )
    else:
        why = (
            f"Lowest latency: {fast.label}: no P > 1 is faster (P={top['workers']}: {top['ms_per_token']:.4f} ms/token "
            f"with window {_window(top['window'])}, {top['tokens_per_forward']:.2f} tokens/forward): a larger window "
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
    lines = []
    for kind in ("measured", "simulated"):
        part = report.get(kind)
        if not part:
            continue
        for p in part["points"]:
            lines.append(
                f"{kind} P={p['workers']}: {p['ms_per_token']:.4f} ms/token ({p['speedup_vs_p1']:.2f}x P=1's speed), "
                f"{p['tokens_per_forward']:.2f} tokens/forward, {p['rows_per_rank']} rows/rank"
            )
        if kind == "measured":
            lines.append(f"outputs identical at every P: {part['identical_outputs']}")
        if kind == "simulated" and part.get("splits"):
            lines.append(part["splits"]["why"])
    return "\n".join(lines) + "\n"

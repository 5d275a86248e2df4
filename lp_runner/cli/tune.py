"""``python -m lp_runner tune``: pick the lookahead settings (and P) that minimise time per token on this device.

The thorough mode of the one search (``tuning/search.py``; the start-up auto preset is its quick mode):
1. measure this device's forward-cost curve (``costmodel.measure_curve``) over the row counts the search can
   produce, and the host time per round (``calibrate.measure_host``, as start-up calibration does);
2. run each considered setting greedily on the calibration prompts and record every round's shape (greedy output,
   and so the shapes, depend only on the setting, not on timing noise);
3. predict seconds per token = (forward cost of each round from the curve at its rows and K/V length + the
   measured host time + communication at P > 1) / tokens (``search.price``);
4. coordinate search over every knob of ``search.SPACE``, once per P: improve one knob at a time from the base
   config until a full pass changes nothing (the searches share the calibration runs).

The winner is written as a complete YAML config (the base config with the chosen keys) with the predicted
figures in its header. ``--devices N`` searches at every P dividing N and prices every split D x P = N
(``split.split_table``): it names the split with the lowest per-token latency (the written config, D = N / P)
and the one with the highest job throughput. ``benchmarks/compare.py --tuned`` checks a tuned config against
the default on held-back prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
from collections.abc import Sequence
from datetime import date
from pathlib import Path

import yaml

from lp_runner.config import Config, LookaheadConfig, load_config
from lp_runner.decoding.layout import max_round_rows
from lp_runner.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, InputError, LPError, first_line
from lp_runner.logs import OneLineParser, add_log_level, log, setup_logging
from lp_runner.outfiles import check_not_an_input, check_writable, is_stream, write_file
from lp_runner.tuning.costmodel import CostCurve
from lp_runner.tuning.search import MIN_GAIN, SPACE, Scored, TuneResult, describe, tune
from lp_runner.tuning.split import ASSUMPTION, Split, highest_throughput, lowest_latency, split_table, splits_of

MAX_WORKERS = 1024  # parallel.workers' own bound
MAX_DEVICES = 1 << 16  # --devices: P runs over its divisors (a loop up to N)
# Numeric options -> (lowest, highest) allowed. --reps: each curve point's repetitions (one at least, for its
# median); --passes: coordinate-search passes; --max-new-tokens as generation.max_new_tokens; --min-gain a
# fraction of the time per token; --allgather-us at most 10 s a round.
RANGES = {
    "--max-new-tokens": (1, 1_000_000),
    "--reps": (1, 1000),
    "--passes": (1, 100),
    "--min-gain": (0.0, 0.99),
    "--allgather-us": (0.0, 1e7),
}


def tuned_config(base: Config, result: TuneResult, devices: int | None = None) -> Config:
    """The base config with the winning setting and P; with ``devices`` also D = devices / P, so the written
    config is the lowest-latency split of all the devices (the same P, every device used)."""
    cfg = dataclasses.replace(base, lookahead=result.best.lookahead)
    groups = base.parallel.groups if devices is None else devices // result.best.workers
    cfg.parallel = dataclasses.replace(base.parallel, workers=result.best.workers, groups=groups)
    return cfg


def device_splits(result: TuneResult, devices: int) -> list[Split]:
    """Every split D x P of ``devices``, each priced at the best setting the search found at its P
    (``split.split_table``: latency is that setting's ms/token, throughput D x its tokens/s)."""
    return split_table(devices, lambda d, p: result.per_workers[p].ms_per_token)


def split_lines(result: TuneResult, table: Sequence[Split]) -> list[str]:
    """What ``tune --devices`` says: one line per split, then the two winners, one line each."""
    lines = [f"splits of {table[0].devices} devices (predicted; each device runs its own forward at the curve):"]
    for sp in table:
        la = describe(result.per_workers[sp.workers].lookahead)
        lines.append(f"  {sp.label:11s} {sp.ms_per_token:8.2f} ms/token  {sp.tokens_per_s:9.2f} tokens/s  {la}")
    fast, wide = lowest_latency(table), highest_throughput(table)
    lines.append(f"lowest latency: {fast.label}  {fast.ms_per_token:.2f} ms/token (the written config)")
    lines.append(
        f"highest throughput: {wide.label}  {wide.tokens_per_s:.2f} tokens/s "
        f"(--set parallel.groups={wide.groups} --set parallel.workers={wide.workers} with the P={wide.workers} setting)"
    )
    lines.append("why: " + split_why(result, fast))
    return lines


def split_why(result: TuneResult, fast: Split) -> str:
    """Why the lowest-latency split wins, in the figures LP trades: the tokens per forward the setting at its P
    buys, against the rows on its busiest rank, compared with P = 1 (each P's winner; the collective and host
    time are in its ms/token)."""
    one, best = result.per_workers[min(result.per_workers)], result.per_workers[fast.workers]
    if fast.workers == one.workers:
        return (
            f"no P > 1 is faster: at P = {one.workers} the setting buys {one.tokens_per_forward:.2f} tokens/forward "
            f"on {one.mean_rows:.1f} rows, and a larger window's share per rank does not buy enough more tokens to "
            "pay the busier rank and the all_gather"
        )
    return (
        f"P = {best.workers} runs {best.tokens_per_forward:.2f} tokens/forward on {best.mean_rows:.1f} rows on its "
        f"busiest rank ({describe(best.lookahead)}), against {one.tokens_per_forward:.2f} on {one.mean_rows:.1f} "
        f"rows at P = {one.workers}: more tokens per forward for each rank's share of the window"
    )


def write_config(cfg: Config, result: TuneResult, path: Path, header: Sequence[str]) -> None:
    """A complete config (every key, so it does not depend on later changes of defaults) with the why on top.
    The setting is written with ``preset: off``: a tuned setting is a preset of its own, to be run as written.
    Written as every output is (``outfiles.write_file``): an interruption or a full disk leaves the old file."""
    d = cfg.to_user_dict()
    d["lookahead"]["preset"] = "off"
    lines = [f"# {h}" for h in header]
    lines.append(
        f"# predicted: {result.best.ms_per_token:.2f} ms/token at P={result.best.workers} "
        f"(tokens/forward {result.best.tokens_per_forward:.2f}, rows {result.best.mean_rows:.1f}); "
        f"base config: {result.base.ms_per_token:.2f} ms/token"
    )
    write_file(path, ("\n".join(lines) + "\n" + yaml.safe_dump(d, sort_keys=False)).encode("utf-8"))


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m lp_runner tune",
        description="Pick lookahead settings that minimise predicted time per token on this device.",
    )
    p.add_argument("--config", help="base YAML config (its model, device and threads are used)")
    p.add_argument("--prompts", required=True, help="calibration prompts (JSONL); keep them apart from test prompts")
    p.add_argument("--output", required=True, help="where to write the tuned YAML config")
    p.add_argument("--overwrite", action="store_true", help="--output exists: replace it (once the tune is done)")
    p.add_argument("--report", help="also write every evaluated setting to this JSON file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per calibration prompt")
    p.add_argument("--workers", help="comma-separated P values to consider, e.g. 1,2,4 (default 1)")
    p.add_argument(
        "--devices",
        help="N devices: consider every split D x P = N (P dividing N) and name the split with the lowest latency "
        "and the one with the highest job throughput",
    )
    p.add_argument("--allgather-us", type=float, default=350.0, help="measured 2-rank all_gather cost per round")
    add_log_level(p)
    p.add_argument("--curve", help="a saved cost curve (JSON from --save-curve); measured when omitted")
    p.add_argument("--save-curve", help="write the measured cost curve here")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions per curve point")
    p.add_argument("--passes", type=int, default=2, help="coordinate-search passes over all knobs (at most)")
    p.add_argument(
        "--min-gain",
        type=float,
        default=MIN_GAIN,
        help=f"smallest relative predicted gain that moves (default {100 * MIN_GAIN:.0f}%%, as the auto preset)",
    )
    return p


def curve_rows(space: dict[str, Sequence], base: LookaheadConfig) -> list[int]:
    """Row counts the search can produce, up to the largest setting's round (the curve interpolates between)."""
    w, n = max(space.get("window_size", (base.window_size,))), max(space.get("ngram_size", (base.ngram_size,)))
    g = max(space.get("verification_set_size", (base.verification_set_size,)))
    c = max(space.get("context_tokens", (base.context_tokens,)))
    big = dataclasses.replace(base, window_size=w, ngram_size=n, verification_set_size=g, context_tokens=c)
    top = max_round_rows(big)
    grid = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    return [q for q in grid if q < top] + [top]


def parse_workers(text: str) -> list[int]:
    try:
        workers = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise InputError(f"--workers expects comma-separated integers, got {text[:40]!r}") from None
    if not workers or workers[0] < 1 or workers[-1] > MAX_WORKERS:
        raise InputError(f"--workers values must be from 1 to {MAX_WORKERS} (parallel.workers), got {text[:40]!r}")
    return workers


def parse_devices(text: str | None, workers: str | None) -> int | None:
    """``--devices N``: one integer >= 1, or None when not given; P then runs over the divisors of N, so
    ``--workers`` with it is refused rather than silently ignored."""
    if text is None:
        return None
    if workers is not None:
        raise InputError("give --devices (every split D x P = N) or --workers (P values), not both")
    try:
        devices = int(text)
    except ValueError:
        devices = 0
    if devices < 1:
        raise InputError(f"--devices expects one integer >= 1 (the number of devices), got {text[:40]!r}")
    if devices > MAX_DEVICES:
        raise InputError(f"--devices is at most {MAX_DEVICES}, got {devices}")
    return devices


def check_numbers(args: argparse.Namespace) -> None:
    """Every numeric option in its range (``RANGES``), one ``error:`` line before anything is loaded or measured:
    ``--reps 0`` would leave a curve point without a measurement, ``--min-gain nan`` a search that never moves."""
    for name, (low, high) in RANGES.items():
        value = getattr(args, name.lstrip("-").replace("-", "_"))
        if not (math.isfinite(value) and low <= value <= high):
            raise InputError(f"{name} must be from {low:g} to {high:g}, got {value!r}")


def check_files(args: argparse.Namespace) -> None:
    """The files tune writes, before it loads or measures anything (``lp_runner.outfiles``): none is one of its
    inputs or another of its outputs, each folder takes a file, and an existing ``--output`` needs
    ``--overwrite`` (as ``run`` asks for its records)."""
    inputs = {"--prompts": args.prompts, "--config": args.config, "--curve": args.curve}
    written = {"--output": args.output, "--save-curve": args.save_curve, "--report": args.report}
    given = [(option, path) for option, path in written.items() if path]
    for i, (option, path) in enumerate(given):
        check_not_an_input(path, option, {**inputs, **dict(given[:i])})
        check_writable(path, option)
    out = Path(args.output)
    if not args.overwrite and out.exists() and not is_stream(out):
        raise InputError(f"--output {out} already exists; give --overwrite to replace it or choose another file")


def read_curve(path: str) -> CostCurve:
    """``--curve``: a cost curve saved by ``--save-curve``, read before the model loads."""
    try:
        return CostCurve.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"cannot read cost curve {path}: {first_line(exc)}") from None


def main(argv: list[str] | None = None) -> int:
    """``tune``: 0, 2 for an ``LPError`` (one line), 130 interrupted (Ctrl-C or SIGTERM: one line; the output is
    written only at the end, atomically, so the old file stays)."""
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run(args)
    except LPError as exc:
        log.error("%s", exc)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        log.error("interrupted; --output was not written")
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run(args) -> int:
    from lp_runner.jobs.prompts import read_prompts

    # everything the user gave, checked before anything is loaded or measured
    cfg = load_config(args.config, args.overrides)
    devices = parse_devices(args.devices, args.workers)
    workers = [p for _, p in splits_of(devices)] if devices else parse_workers(args.workers or "1")
    check_numbers(args)
    specs = read_prompts(args.prompts)
    check_files(args)
    saved = read_curve(args.curve) if args.curve else None

    import torch

    from lp_runner.backends.adapter import ModelAdapter
    from lp_runner.device import synchronizer
    from lp_runner.jobs.worker import eos_token_ids, start_worker
    from lp_runner.tuning.calibrate import measure_host
    from lp_runner.tuning.costmodel import measure_curve

    solo = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, workers=1, groups=1))
    # the tuner measures its own, finer curve: the worker needs no start-up calibration or auto preset
    solo.lookahead = dataclasses.replace(cfg.lookahead, preset="off", pad_rows=False)
    cfg.lookahead = dataclasses.replace(cfg.lookahead, preset="off")  # the base setting runs as written
    solo.generation = dataclasses.replace(cfg.generation, max_new_tokens=args.max_new_tokens)  # what it measures
    worker = start_worker(solo, specs)  # the prompts tokenized and checked as a job's
    adapter: ModelAdapter = worker.adapter
    job = worker.prompts
    prompts = [list(ids) for ids, problem in zip(job.ids, job.problems, strict=True) if problem is None]
    gen = dataclasses.replace(cfg.generation, max_new_tokens=args.max_new_tokens)
    say = log.info  # progress lines, to stderr (--log-level)

    if saved is not None:
        curve = saved
    else:
        rows = curve_rows(SPACE, cfg.lookahead)
        kv = sorted({min(len(p) for p in prompts), max(len(p) for p in prompts) + args.max_new_tokens})
        say(f"measuring the forward-cost curve: rows {rows}, K/V lengths {kv}")
        sync = synchronizer(adapter.device)
        curve = measure_curve(adapter, kv, rows, reps=args.reps, sync=sync)
    if curve.host is None:  # a saved curve from before host time was measured with it
        curve = dataclasses.replace(curve, host=measure_host(adapter))
    say(f"host time per round: {1e6 * curve.host.round_s:.0f} us + {1e6 * curve.host.row_s:.1f} us per row")
    if args.save_curve and not args.curve:
        write_file(args.save_curve, json.dumps(curve.to_dict(), indent=2).encode("utf-8"))
    say(f"calibrating on {len(prompts)} prompts x {args.max_new_tokens} tokens")
    result = tune(
        adapter,
        prompts,
        cfg.lookahead,
        gen,
        eos_token_ids(adapter.model.generation_config, worker.tokenizer),
        curve,
        workers,
        1e-6 * args.allgather_us,
        log=say,
        max_passes=args.passes,
        min_gain=args.min_gain,
    )
    table = device_splits(result, devices) if devices else []
    chosen = tuned_config(cfg, result, devices)
    threads = torch.get_num_threads()
    header = [
        f"written by `python -m lp_runner tune` on {date.today().isoformat()}: "
        f"{len(prompts)} calibration prompts from {args.prompts}, {args.max_new_tokens} tokens each,",
        f"device {adapter.device}, {threads} threads, base config {args.config or '(defaults)'}",
    ]
    if table:
        wide = highest_throughput(table)
        header.append(
            f"{devices} devices: this is the lowest-latency split; highest throughput: {wide.label} "
            f"({wide.tokens_per_s:.2f} tokens/s predicted) with {describe(result.per_workers[wide.workers].lookahead)}"
        )
        cores = len(os.sched_getaffinity(0))
        if adapter.device.type == "cpu" and devices * threads > cores:
            log.warning(
                "--devices %d on this CPU: %d processes x %d threads exceed its %d cores, so the splits would share "
                "cores the curve priced as their own; measure the curve with --set model.threads=%d",
                devices,
                devices,
                threads,
                cores,
                max(cores // devices, 1),
            )
    write_config(chosen, result, Path(args.output), header)
    if args.report:
        report = {
            "date": date.today().isoformat(),
            "curve": curve.to_dict(),  # with the measured host time, priced as the auto preset prices it
            "threads": threads,
            "workers": workers,
            "allgather_2_rank_us": args.allgather_us,
            "best": _scored_dict(result.best),
            "base": _scored_dict(result.base),
            "per_workers": [_scored_dict(s) for s in result.per_workers.values()],
            "evaluated": [_scored_dict(s) for s in result.evaluated],
        }
        if table:
            report["devices"] = devices
            report["split_assumption"] = ASSUMPTION
            report["splits"] = [
                {**sp.to_dict(), "lookahead": dataclasses.asdict(result.per_workers[sp.workers].lookahead)}
                for sp in table
            ]
            report["lowest_latency"] = lowest_latency(table).to_dict()
            report["highest_throughput"] = highest_throughput(table).to_dict()
        write_file(args.report, json.dumps(report, indent=2).encode("utf-8"))
    say(f"base:  {describe(result.base.lookahead)}  {result.base.ms_per_token:.2f} ms/token (predicted)")
    say(f"tuned: {describe(result.best.lookahead)}  P={result.best.workers}  {result.best.ms_per_token:.2f} ms/token")
    for line in split_lines(result, table) if table else []:
        say(line)
    say(f"wrote {args.output}")
    return 0


def _scored_dict(s: Scored) -> dict:
    return {
        "lookahead": dataclasses.asdict(s.lookahead),
        "workers": s.workers,
        "ms_per_token": round(s.ms_per_token, 3),
        "tokens_per_forward": round(s.tokens_per_forward, 3),
        "mean_rows": round(s.mean_rows, 2),
    }

"""``python -m lp_runner`` and ``torchrun -m lp_runner``: one entry point; WORLD_SIZE decides the rank count.

Without torchrun, ``parallel.workers=P > 1`` re-launches this same command under ``torch.distributed.run`` on
this machine, so a single-machine LP run needs no launcher knowledge.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from lp_runner.config import Config, load_config
from lp_runner.errors import InputError, LPError
from lp_runner.metrics import combine
from lp_runner.prompts import PromptSpec, read_prompts

EXIT_USER_ERROR = 2
EXIT_PEER_FAILURE = 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lp_runner",
        description="Exact Lookahead Decoding with Lookahead Parallelism (same tokens as greedy generate).",
    )
    p.add_argument("--config", help="YAML config (sections: model, lookahead, generation, parallel, run)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="a single plain-text prompt (streamed to the terminal)")
    src.add_argument("--prompts", help="JSONL file: one {id, prompt | messages} object per line")
    p.add_argument("--output", help="write one JSON record per prompt to this JSONL file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config key (repeatable), e.g. --set lookahead.window_size=15",
    )
    return p


def rank_prefix() -> str:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f"[rank {os.environ.get('RANK', '0')}] " if world > 1 else ""


def relaunch_with_torchrun(cfg: Config, argv: list[str]) -> int:
    """parallel.workers > 1 without a launcher: run the same command as P local torchrun workers."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={cfg.parallel.workers}",
        "-m",
        "lp_runner",
        *argv,
    ]
    rc = subprocess.call(cmd)
    if rc != 0:
        print(f"error: LP workers failed (torchrun exited with {rc}); see the worker messages above", file=sys.stderr)
    return rc


def format_summary(cfg: Config, summary: dict, load_s: float, workers: int) -> str:
    la = cfg.lookahead
    lines = [
        "-" * 64,
        f"lp_runner  W={la.window_size} N={la.ngram_size} G={la.verification_set_size} "
        f"pool_from_prompt={la.pool_from_prompt}  workers={workers}",
        f"prompts {summary['generations']}  new tokens {summary['new_tokens']}  forwards {summary['forwards']}  "
        f"tokens/forward {summary['tokens_per_forward']:.2f}",
        f"tokens/s {summary['tokens_per_s']:.2f}  generation {summary['seconds']:.2f} s  model load {load_s:.2f} s",
        f"time split: forward {100 * summary['forward_share']:.1f}%  host {100 * summary['host_share']:.1f}%  "
        f"comm {100 * summary['comm_share']:.1f}% ({summary['comm_us_per_round']:.0f} us/round)  "
        f"mean packed rows {summary['mean_rows']:.1f}",
        "-" * 64,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["tune"]:
        from lp_runner.tune import main as tune_main

        return tune_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.prompt is not None:
            specs = [PromptSpec(id="prompt", prompt=args.prompt)]
        elif args.prompts is not None:
            specs = read_prompts(args.prompts)
        else:
            raise InputError("give --prompt TEXT or --prompts FILE.jsonl")
        if cfg.parallel.backend == "ray":
            from lp_runner.ray_backend import run_on_ray  # imported lazily: ray is optional

            return run_on_ray(cfg, specs, args.output, single=args.prompt is not None)
        if cfg.parallel.workers > 1 and "WORLD_SIZE" not in os.environ:
            return relaunch_with_torchrun(cfg, argv)
        return run_local(cfg, specs, args.output, single=args.prompt is not None)
    except LPError as exc:
        from lp_runner.errors import DistributedError

        print(f"error: {rank_prefix()}{exc}", file=sys.stderr, flush=True)
        return EXIT_PEER_FAILURE if isinstance(exc, DistributedError) else EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"error: {rank_prefix()}interrupted", file=sys.stderr)
        return 130


def _on_sigterm(signum: int, frame: object) -> None:
    """torchrun stops the surviving workers with SIGTERM when one fails: say so instead of dying silently."""
    print(
        f"error: {rank_prefix()}stopped by the launcher (SIGTERM): another worker failed or the job was cancelled",
        file=sys.stderr,
        flush=True,
    )
    os._exit(128 + signum)


def run_local(cfg: Config, specs: list[PromptSpec], output: str | None, single: bool) -> int:
    """This process is one rank (or the only one): run all prompts, rank 0 writes and reports."""
    from lp_runner.runner import run_prompts, start_worker  # heavy imports after argument checks

    if "WORLD_SIZE" in os.environ:
        signal.signal(signal.SIGTERM, _on_sigterm)

    out_file = None
    if output is not None and int(os.environ.get("RANK", "0")) == 0:
        try:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
            out_file = open(output, "w", encoding="utf-8")  # noqa: SIM115 - closed in finally
        except OSError as exc:
            raise InputError(f"cannot write output file {output}: {exc.strerror or exc}") from None
    try:
        worker = start_worker(cfg)
        stream = None
        if single and cfg.run.stream and worker.is_main:
            stream = lambda text: print(text, end="", flush=True)  # noqa: E731
        bar = None
        if not single and cfg.run.progress and worker.is_main and len(specs) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(specs), desc="prompts", unit="prompt", file=sys.stderr)
        stats = []

        def on_record(rec: dict) -> None:
            stats.append(rec)
            if out_file is not None:
                out_file.write(json.dumps(rec) + "\n")
                out_file.flush()  # nothing is lost if a later prompt fails
            if bar is not None:
                bar.update(1)
                bar.set_postfix(tok_per_fwd=f"{rec['tokens_per_forward']:.2f}", tok_s=f"{rec['tokens_per_s']:.1f}")

        run_prompts(worker, specs, on_record=on_record, stream=stream)
        if bar is not None:
            bar.close()
        if stream is not None:
            print(flush=True)
        if worker.is_main and cfg.run.summary:
            summary = combine(_StatsView(r["stats"]) for r in stats)
            print(format_summary(cfg, summary, worker.load_s, worker.comm.world_size), file=sys.stderr)
        return 0
    finally:
        if out_file is not None:
            out_file.close()
        _shutdown_group()


class _StatsView:
    """Adapts a record's ``stats`` dict to the attribute access ``combine`` expects."""

    def __init__(self, d: dict) -> None:
        self.__dict__.update(d)


def _shutdown_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

"""``python -m lp_runner`` and ``torchrun -m lp_runner``: one entry point; WORLD_SIZE decides the rank count.

Commands: ``run`` (the default: ``python -m lp_runner --config c.yaml ...`` means ``python -m lp_runner run
--config c.yaml ...``), ``tune`` (``cli.tune``), ``study`` (``cli.study``: strong scaling) and ``fetch``
(``models.fetch``); ``--version`` prints
the package version and ``--log-level`` (before or after the command) sets what goes to stderr (``lp_runner.logs``).

Without torchrun, ``parallel.workers=P`` x ``parallel.groups=D`` > 1 starts this same command as D x P ranks on
this machine (``lp_runner.cli.launch``), so a single-machine run needs no launcher knowledge. Whatever can be checked
before that is checked first, in this process (``lp_runner.cli.preflight``): a setting that cannot run is one line and
exit 2 here, not a failure of every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import TYPE_CHECKING

from lp_runner import __version__
from lp_runner.config import Config, load_config
from lp_runner.decoding.job_store import check_pool_out
from lp_runner.errors import (
    EXIT_INTERRUPTED,
    EXIT_PEER_FAILURE,
    EXIT_USER_ERROR,
    DistributedError,
    InputError,
    LPError,
)
from lp_runner.jobs.output import LOCK_HOLDER_ENV, OutputFile
from lp_runner.jobs.prompts import PromptSpec, prompt_problem, read_prompts
from lp_runner.limits import check_path_text
from lp_runner.logs import OneLineParser, StderrClosed, add_log_level, log, setup_logging, tell_launcher
from lp_runner.outfiles import EXIT_BROKEN_PIPE, StdoutClosed, check_not_an_input, check_writable, write_stdout

if TYPE_CHECKING:
    from collections.abc import Collection

    from lp_runner.cli.launch import RankExit
    from lp_runner.decoding.job_store import JobPool
    from lp_runner.parallel.comm import Communicator

COMMANDS = ("run", "tune", "study", "fetch")


def build_parser() -> argparse.ArgumentParser:
    """The ``run`` command's arguments (also the top level: no command means ``run``)."""
    p = OneLineParser(
        prog="python -m lp_runner [run]",
        description="Exact Lookahead Decoding with Lookahead Parallelism (same tokens as greedy generate).",
        epilog="other commands: 'python -m lp_runner tune -h' (choose a setting for this device and model), "
        "'python -m lp_runner study -h' (strong scaling over P, measured or simulated), "
        "'python -m lp_runner fetch -h' (download the embedded model into the cache)",
    )
    p.add_argument("--version", action="version", version=f"lp_runner {__version__}")
    p.add_argument("--config", help="YAML config (sections: model, lookahead, generation, parallel, run)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="a single plain-text prompt (streamed to the terminal)")
    src.add_argument("--prompts", help="JSONL file: one {id, prompt | messages} object per line")
    p.add_argument("--output", help="write one JSON record per prompt to this JSONL file")
    again = p.add_mutually_exclusive_group()
    again.add_argument(
        "--resume", action="store_true", help="--output exists: keep its records, run only the prompts it lacks"
    )
    again.add_argument(
        "--overwrite", action="store_true", help="--output exists: replace it (once the first new record is ready)"
    )
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="measure this device's forward-cost curve again instead of reusing the cached one (advanced.recalibrate)",
    )
    p.add_argument("--pool-in", metavar="FILE", help="start the job store from FILE (advanced.pool_in; pool_scope=job)")
    p.add_argument("--pool-out", metavar="FILE", help="save the job store to FILE at the end (advanced.pool_out)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config key (repeatable), e.g. --set lookahead.window_size=15",
    )
    add_log_level(p)
    return p


def split_command(argv: list[str]) -> tuple[str, list[str]]:
    """``[--log-level L] [COMMAND] ARGS`` -> (command, the command's arguments); no command is ``run``.

    ``["--log-level", "DEBUG", "tune", "--prompts", "p"]`` -> ("tune", ["--log-level", "DEBUG", "--prompts", "p"]);
    ``["--config", "c.yaml"]`` -> ("run", ["--config", "c.yaml"])."""
    i = 0
    while i < len(argv) and (argv[i] == "--log-level" or argv[i].startswith("--log-level=")):
        i += 2 if argv[i] == "--log-level" else 1
    if i < len(argv) and argv[i] in COMMANDS:
        return argv[i], argv[:i] + argv[i + 1 :]
    return "run", argv


def main(argv: list[str] | None = None) -> int:
    try:
        return _command(argv)
    except StderrClosed:  # from a line on the way out (an error's own line): ends as any closed stderr does
        return EXIT_BROKEN_PIPE


def _command(argv: list[str] | None) -> int:
    command, args = split_command(list(sys.argv[1:] if argv is None else argv))
    if command == "tune":
        from lp_runner.cli.tune import main as tune_main

        return tune_main(args)
    if command == "study":
        from lp_runner.cli.study import main as study_main

        return study_main(args)
    if command == "fetch":
        from lp_runner.models.fetch import main as fetch_main

        return fetch_main(args, prog="python -m lp_runner fetch")
    return _run(args)


def _run(argv: list[str]) -> int:
    """The ``run`` command; ``argv``: its arguments (no command word)."""
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    launched = "WORLD_SIZE" in os.environ
    # A rank leaves at once on torchrun's SIGTERM; a top-level run ends on a scheduler's SIGTERM as on Ctrl-C.
    previous = signal.signal(signal.SIGTERM, _on_sigterm if launched else _interrupt)
    output = None
    try:
        flags = ["advanced.recalibrate=true"] if args.recalibrate else []
        flags += [f"advanced.{k}={v}" for k, v in (("pool_in", args.pool_in), ("pool_out", args.pool_out)) if v]
        cfg = load_config(args.config, args.overrides + flags)
        if args.prompt is not None:
            specs = [PromptSpec(id="prompt", prompt=args.prompt, where="--prompt")]
        elif args.prompts is not None:
            check_path_text("--prompts", args.prompts)
            specs = read_prompts(args.prompts)
        else:
            raise InputError("give --prompt TEXT or --prompts FILE.jsonl")
        if (args.resume or args.overwrite) and args.output is None:
            raise InputError(f"{'--resume' if args.resume else '--overwrite'} needs --output FILE")
        if cfg.run.on_error == "stop":  # the whole input, before any weights are loaded
            for spec in specs:
                if (problem := prompt_problem(spec)) is not None:
                    raise InputError(f"{spec.describe()}: {problem}")
        single = args.prompt is not None
        check_outputs(cfg, args)
        if args.output is not None and int(os.environ.get("RANK", "0")) == 0:
            mode = "resume" if args.resume else "overwrite" if args.overwrite else "new"
            output = OutputFile.open(args.output, mode, cfg)  # checked and locked before anything is loaded
        from lp_runner.cli.preflight import preflight  # after the lock: a second run on the file fails at once

        preflight(cfg, None if launched else cfg.parallel.workers * cfg.parallel.groups)
        if cfg.parallel.backend == "ray":
            from lp_runner.jobs.ray import run_on_ray  # imported lazily: ray is optional

            code = run_on_ray(cfg, specs, output, single=single)
        elif cfg.parallel.workers * cfg.parallel.groups > 1 and not launched:
            code = run_self_launched(cfg, argv, output)
        else:
            code = run_local(cfg, specs, output, single=single)
        if output is not None:
            output.close(complete=code == 0)
            output = None
        return code
    except (StdoutClosed, StderrClosed):  # | head: nothing to say, as cat says nothing; the records written stay
        return EXIT_BROKEN_PIPE
    except LPError as exc:
        log.error("%s", exc)
        tell_launcher(f"error: {exc}")
        return EXIT_PEER_FAILURE if isinstance(exc, DistributedError) else EXIT_USER_ERROR
    except KeyboardInterrupt:
        log.error("interrupted")
        return EXIT_INTERRUPTED
    finally:
        if output is not None:
            output.close()
        signal.signal(signal.SIGTERM, previous)


def pool_files(cfg: Config) -> dict[str, str]:
    """The job store's files a run reads or writes, by the option that names them (also ``advanced.pool_in`` /
    ``pool_out`` in a config)."""
    return {"--pool-in": cfg.run.pool_in, "--pool-out": cfg.run.pool_out}


def check_outputs(cfg: Config, args: argparse.Namespace) -> None:
    """The files this run writes, before anything loads (``lp_runner.outfiles``): none may be one of its inputs
    or the other output; ``--pool-out``'s folder must take a file, and a file it would replace must be a pool
    (``--output`` is checked as it is opened). The
    pool may be read from and saved to one file (it is read at the start, replaced at the end). Under Ray the
    pool is saved by an actor, maybe on another machine: its folder is not checked here."""
    inputs = {"--prompts": args.prompts, "--config": args.config}
    if args.output is not None:
        check_path_text("--output", args.output)  # ENAMETOOLONG in one line, not from inside os.stat
        check_not_an_input(args.output, "--output", {**inputs, **pool_files(cfg)})
    if cfg.run.pool_out:
        check_not_an_input(cfg.run.pool_out, "--pool-out", inputs)
        if cfg.parallel.backend != "ray" and int(os.environ.get("RANK", "0")) == 0:
            check_writable(cfg.run.pool_out, "--pool-out")
            check_pool_out(cfg.run.pool_out)  # replaces a pool, never a file of another kind


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _on_sigterm(signum: int, frame: object) -> None:
    """A launcher stops the surviving ranks with SIGTERM when one fails: say so instead of dying silently.

    A rank may sit in a collective that only returns at its timeout, so it leaves at once (records already
    written are flushed; the kernel drops the output lock)."""
    log.error("stopped by the launcher (SIGTERM): another worker failed or the job was cancelled")
    os._exit(128 + signum)


# ---------------------------------------------------------------- parallel.workers=P: the ranks started for you


def run_self_launched(cfg: Config, argv: list[str], output: OutputFile | None) -> int:
    """parallel.workers x parallel.groups > 1 without a launcher: the same command as D x P local ranks
    (``launch.launch_ranks``); ``argv``: the ``run`` command's arguments, which each rank parses again.

    This process holds the output's lock for the ranks (rank 0 writes). Its exit code is the ranks' own: the first
    of 2 (input), 1 (a bug), 130 (interrupted) among them, else 3 (a failed peer: a rank killed, or stopped after
    another failed). The ranks print their own ``error:`` lines; this process adds one line naming the rank that
    ended first."""
    from lp_runner.cli.launch import launch_ranks, rank_command

    env = {LOCK_HOLDER_ENV: str(os.getpid())} if output is not None else {}
    result = launch_ranks(cfg.parallel.workers * cfg.parallel.groups, rank_command(argv), env)
    if result.interrupted is not None:
        log.error("interrupted")
        return EXIT_INTERRUPTED
    first = result.first_failure
    if first is None:
        return 0
    if first.returncode == EXIT_BROKEN_PIPE:  # rank 0's stdout was closed (| head): it ended quietly, so do we
        return EXIT_BROKEN_PIPE
    codes = {e.returncode for e in result.exits}
    code = next((c for c in (EXIT_USER_ERROR, 1, EXIT_INTERRUPTED) if c in codes), EXIT_PEER_FAILURE)
    log.error("LP workers failed (exit code %d): %s", code, failure_story(first, result.stopped, result.said))
    return code


# Exit codes whose rank always wrote a message without leaving its error file: 1, an uncaught exception (Python
# prints its traceback); 128 + SIGTERM, ``_on_sigterm`` (its line says why, and it leaves at once).
_CODES_WITH_A_MESSAGE = frozenset({1, 128 + signal.SIGTERM})


def failure_story(first: RankExit, stopped: list[int], said: Collection[int] = ()) -> str:
    """Which rank ended the job, honestly: the first to end, unless it ended because a peer stopped answering
    (exit 3) and a rank was found stopped (SIGSTOP, a debugger) at that moment: then the stopped rank is why.

    ``said``: the ranks that reported an ``error:`` line (``LaunchResult.said``). The line sends the reader to
    the first rank's message above only when there is one: that rank reported it, or its exit code is one that
    always comes with a message (``_CODES_WITH_A_MESSAGE``); otherwise it says the rank wrote none.

    ``failure_story(RankExit(1, -9), [])`` -> "worker rank 1 was killed by SIGKILL first";
    ``failure_story(RankExit(1, 3), [0], [1])`` -> "worker rank 0 was stopped (SIGSTOP or a debugger) and stopped
    answering; worker rank 1 gave up waiting for it (see its message above)"; the same with ``said=[]`` ends
    "...gave up waiting for it (it wrote no error line)"."""
    wrote = first.rank in said or first.returncode in _CODES_WITH_A_MESSAGE
    if first.returncode == EXIT_PEER_FAILURE and stopped:
        ranks = " and ".join(str(r) for r in stopped)
        one = len(stopped) == 1
        where = "see its message above" if wrote else "it wrote no error line"
        return (
            f"worker rank {ranks} {'was' if one else 'were'} stopped (SIGSTOP or a debugger) and stopped answering; "
            f"worker rank {first.rank} gave up waiting for {'it' if one else 'them'} ({where})"
        )
    said_line = ""
    if first.returncode > 0:
        said_line = "; see its message above" if wrote else " without an error line"
    return f"worker rank {first.rank} {first.describe()} first{said_line}"


# ---------------------------------------------------------------- this process runs the prompts


def run_local(cfg: Config, specs: list[PromptSpec], output: OutputFile | None, single: bool) -> int:
    """This process is one rank (or the only one): run the prompts the output lacks; rank 0 writes and reports.

    With ``parallel.groups`` > 1 the groups share the prompts through the job's queue (``queue.run_queued``)."""
    from lp_runner.collector import worker_start_up
    from lp_runner.jobs.queue import run_queued
    from lp_runner.jobs.report import Report
    from lp_runner.jobs.worker import model_checksum, run_prompts, start_worker  # heavy imports after argument checks

    worker, finished = None, False
    try:
        with worker_start_up():  # this process's one worker: its start-up's objects out of later collections
            worker = start_worker(cfg, specs)
        done = output.done if output is not None else set()
        if output is not None and done:
            output.check_weights(model_checksum(worker.adapter.model))
        everyone = worker.control or worker.comm  # the whole job (D > 1: its gloo control group)
        if everyone.world_size > 1:  # every rank runs the prompts rank 0's output lacks
            done = set(json.loads(everyone.all_gather_strings(json.dumps(sorted(done)))[0]))
        todo = worker.prompts.without(done)  # tokenized and checked once, at start-up
        rebuild_store(worker.store, worker.is_main, specs, output, everyone)
        stream = None
        if single and cfg.run.stream and worker.is_main:
            stream = write_stdout
        skipped = len(specs) - len(todo.specs)
        report = Report(cfg, output, len(specs), skipped, progress=worker.is_main and not single)
        try:
            if worker.layout is not None:
                run_queued(worker, todo, on_record=report.record, stream=stream)
            else:
                run_prompts(worker, todo, on_record=report.record, stream=stream)
        finally:
            report.close_bar()
        if stream is not None:
            write_stdout("\n")
        if worker.is_main:
            report.finish(worker.load_s, worker.comm.world_size, groups=cfg.parallel.groups)
        finished = True
        return 0
    finally:
        _shutdown_group(clean=finished)


def rebuild_store(
    store: JobPool | None, writes: bool, specs: list[PromptSpec], output: OutputFile | None, everyone: Communicator
) -> None:
    """``--resume`` under ``pool_scope: job``: the job store starts from the outputs already written, in the
    job's prompt order, as if the job had not been interrupted (the store then holds what an uninterrupted
    run's would have held before the remaining prompts, whatever order the records were written in). Rank 0's
    records (``writes``: this is rank 0), shared once over ``everyone``, so every replica of a group's store is the
    same. Error records add nothing."""
    if store is None:
        return
    seen = output.finished_outputs([s.id for s in specs]) if output is not None and writes else []
    if everyone.world_size > 1:
        seen = json.loads(everyone.all_gather_strings(json.dumps(seen))[0])
    for prompt_ids, output_ids in seen:
        store.add(prompt_ids, output_ids)


def _shutdown_group(clean: bool = True) -> None:
    """Leave the process group. After a failure under NCCL the communicators are aborted instead: a collective a
    lost peer never joined may still be queued on the GPU, and destroying the group would wait for it (or NCCL's
    watchdog would end the process with a stack dump after the one-line error)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch >= 2.6; private, so looked up
    if not clean and dist.get_backend() == "nccl" and abort is not None:
        abort()
        return
    dist.destroy_process_group()

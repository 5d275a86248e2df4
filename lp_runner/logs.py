"""Diagnostics through ``logging``, to stderr, at the level of ``--log-level``; results stay on stdout.

stdout carries only results (the streamed text of ``--prompt``, the folder ``fetch`` prints, ``--version``);
records go to ``--output``. Everything else (progress lines, the summary, warnings, errors) goes to the
``lp_runner`` logger, which writes to stderr once ``setup_logging`` ran (every command calls it; a library user
of ``lp_runner.generate`` sees warnings only, through Python's last-resort handler). Lines keep the CLI's form::

    INFO     calibrating this device's forward cost...          (the message alone)
    WARNING  warning: [rank 1] lost worker ...; resuming ...    (rank prefix only with more than one rank)
    ERROR    error: [rank 1] peer rank 0 stopped answering

``--log-level WARNING`` keeps warnings and errors only; ``DEBUG`` adds debug lines. There is no level above
ERROR: a failing run always says why. INFO lines come from the writing process only (rank 0 or the driver), so
they go without the rank prefix.

A stderr whose reader went away (``2> >(head -1)``) ends the run as a closed stdout does (``StderrClosed``: exit
141, silent, the records written kept); the progress bar writes through ``STDERR`` for the same reason.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import threading
import time
from typing import NoReturn

from lp_runner.errors import LPError

LOGGER = "lp_runner"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LEVEL = "INFO"
LEVEL_ENV = "LP_RUNNER_LOG_LEVEL"  # the driver's level, for Ray actors (set in their environment at start)
_LABELS = {logging.DEBUG: "debug: ", logging.WARNING: "warning: ", logging.ERROR: "error: "}

log = logging.getLogger(LOGGER)


def rank_prefix() -> str:
    """``"[rank 1] "`` under a launcher with more than one rank, else ``""``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f"[rank {os.environ.get('RANK', '0')}] " if world > 1 else ""


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        if record.levelno == logging.INFO:
            return record.getMessage()
        label = _LABELS.get(min(record.levelno, logging.ERROR), "")  # CRITICAL reads as an error too
        return f"{label}{rank_prefix()}{record.getMessage()}"


class StderrClosed(LPError):
    """stderr's reader went away: the run ends without a word, as ``outfiles.StdoutClosed`` (exit 141)."""


def write_stderr(text: str) -> None:
    """``text`` on whatever ``sys.stderr`` is at the time (pytest and Ray replace it), flushed at once. A closed
    pipe is ``StderrClosed``, with stderr pointed at ``/dev/null`` first: nothing after it (the interpreter's
    last flush, a line on the way out) fails again."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except BrokenPipeError:
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stderr.fileno())
            os.close(devnull)
        raise StderrClosed("stderr was closed by its reader") from None


class _Stderr:
    """A file for a writer that takes one (the progress bar): ``write_stderr`` behind ``write`` and ``flush``."""

    def write(self, text: str) -> int:
        write_stderr(text)
        return len(text)

    def flush(self) -> None:
        pass  # every write is flushed

    def __getattr__(self, name: str) -> object:  # fileno, isatty, encoding: the bar sizes itself to the terminal
        return getattr(sys.stderr, name)


STDERR = _Stderr()  # stateless: one is enough


class _StderrHandler(logging.Handler):
    """Writes through ``write_stderr``. A closed stderr ends the run from the main thread's line; another thread's
    line (a heartbeat, a collector) is dropped and the run goes on, stderr then on ``/dev/null``: an exception
    there would end that thread, not the run."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_stderr(self.format(record) + "\n")
        except StderrClosed:
            if threading.current_thread() is threading.main_thread():
                raise
        except Exception:
            self.handleError(record)


def setup_logging(level: str = DEFAULT_LEVEL) -> None:
    """Route the ``lp_runner`` logger to stderr at ``level`` (one of LEVELS); calling it again replaces it."""
    for handler in [h for h in log.handlers if isinstance(h, _StderrHandler)]:
        log.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(_Formatter())
    log.addHandler(handler)
    log.setLevel(level.upper())
    log.propagate = False  # a host application's root handlers do not print the lines twice


ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # where a launcher reads a rank's error line (torchrun's name)


def tell_launcher(line: str) -> None:
    """This rank's ``error:`` line, also in the error file its launcher reads (``ERROR_FILE_ENV``), for the
    launcher's own report; the line itself is on stderr already. Without the variable nothing is written.

    Two launchers read it. torchrun ends every job with a failed rank the same way, whatever the rank's exit
    code: its own ``ChildFailedError`` traceback and exit 1 (``torch.distributed.launcher.api.launch_agent``
    raises it for any non-zero exit; nothing the ranks do changes that, short of exiting 0, which would call a
    failed job a success). With this file its report's "Root Cause" names the rank's line ("traceback : error:
    prompt 'a' ...") and its exit code (2: input, 3: a failed peer) instead of a link to the elastic docs. The
    ranks ``parallel.workers`` starts without a launcher (``cli.launch``) each get a file too: the parent's
    summary line sends the reader to a rank's message above only when that rank wrote one."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    # the format torch's own error handler writes (``ErrorHandler.record_exception``), the line as the "traceback"
    record = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as f:
        json.dump(record, f)


def add_log_level(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` on a command's parser (every command takes it)."""
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LEVELS,
        default=DEFAULT_LEVEL,
        help="what goes to stderr: DEBUG, INFO (default: progress lines and the summary too), WARNING or ERROR; "
        "results (streamed text, printed paths) always go to stdout",
    )


def level_name() -> str:
    """The level the logger runs at now (what the driver hands its Ray actors)."""
    return logging.getLevelName(log.getEffectiveLevel())


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors read as every other error of the CLI: one ``error:`` line and exit 2,
    instead of argparse's usage block (seven lines for two conflicting flags, the error itself last)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see '{self.prog} --help')\n")

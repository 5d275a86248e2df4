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
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

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


class _StderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at the time (pytest and Ray replace it), flushed at once."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
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

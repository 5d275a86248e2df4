"""Local ranks started by this process: ``parallel.workers`` x ``parallel.groups`` > 1 without a launcher.

Why not torchrun (which did this before): its agent prints lines of its own around the ranks' (a banner on
OMP_NUM_THREADS, "Sending process ... closing signal SIGTERM", and, whenever a rank fails, a ChildFailedError
traceback of some 40 lines), and reports every failure as exit 1. Filtering its stderr would depend on the format
of its log lines in each torch version; routing its error reporting to files (``--redirects``, ``--tee``,
``--log-dir``, TORCHELASTIC_ERROR_FILE) moves the ranks' lines off the terminal as well, while the agent still
prints its own traceback. On one machine, without elastic restarts, nothing the agent does is needed beyond what
this module does itself, so the ranks' lines reach the terminal untouched and their exit codes come back as they
are:

- rendezvous: a TCP store hosted here on a free port (port 0: the kernel picks one; nothing can take it between
  the choice and the bind), the ranks its clients (``TORCHELASTIC_USE_AGENT_STORE``, as under torchrun's agent);
  the D-groups work queue lives in it too (``parallel/groups.py``);
- each rank: this command as ``python -m lp_runner run ARGV`` with the environment torchrun gives its workers
  (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, OMP_NUM_THREADS=1 unless
  set), in a session of its own (a terminal's Ctrl-C reaches this process, which forwards it), with SIGTERM as its
  parent-death signal (this process killed, even by SIGKILL: the ranks stop), stdout and stderr inherited;
- each rank's error line: stderr stays the terminal's, so this process cannot see what a rank printed; a rank
  that fails with an ``error:`` line also writes it to a file of this process's own (TORCHELASTIC_ERROR_FILE, the
  name torchrun's agent gives the ranks; ``logs.tell_launcher``), which is how ``LaunchResult.said`` knows
  which ranks spoke (the summary line sends the reader to a rank's message above only then);
- the end: when a rank fails, the others get PEER_GRACE_S to end on their own (a bad prompt fails every rank
  alike, each saying so), then SIGTERM, then SIGKILL after STOP_GRACE_S; Ctrl-C / SIGTERM to this process is
  forwarded to every rank, with the same STOP_GRACE_S. This process is a child subreaper, so anything a rank
  started (compile workers) and left behind comes back to it and is stopped before it returns.

Worked example (P = 2, rank 1 killed by SIGKILL mid-run): rank 0's collective fails at once (gloo sees the closed
connection) and it exits 3 with its own ``error:`` line; ``launch_ranks`` returns exits [rank 1: -9, rank 0: 3]
and the caller (``__main__``) prints one summary line and returns 3.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from lp_runner.errors import DistributedError
from lp_runner.logs import ERROR_FILE_ENV

PEER_GRACE_S = 3.0  # after a rank fails, how long the others get to end on their own before SIGTERM
STOP_GRACE_S = 15.0  # after SIGTERM (or a forwarded Ctrl-C), how long the ranks get before SIGKILL
STORE_TIMEOUT_S = 60.0  # the hosted store's own operations
POLL_S = 0.1
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class RankExit:
    rank: int
    returncode: int  # the exit status, or -N for a rank ended by signal N

    def describe(self) -> str:
        """``"exited with code 2"``, ``"was killed by SIGKILL"``."""
        if self.returncode >= 0:
            return f"exited with code {self.returncode}"
        try:
            name = signal.Signals(-self.returncode).name
        except ValueError:
            name = f"signal {-self.returncode}"
        return f"was killed by {name}"


@dataclass
class LaunchResult:
    exits: list[RankExit] = field(default_factory=list)  # in the order the ranks ended
    interrupted: int | None = None  # the signal this process got and forwarded (SIGINT, SIGTERM), if any
    # ranks found stopped (SIGSTOP, a debugger) when the first failure came: a peer that gave up waiting on them
    # ended first, but they are why
    stopped: list[int] = field(default_factory=list)
    said: dict[int, str] = field(default_factory=dict)  # rank -> the error line it reported (logs.tell_launcher)

    @property
    def first_failure(self) -> RankExit | None:
        return next((e for e in self.exits if e.returncode != 0), None)


def rank_command(argv: list[str]) -> list[str]:
    """``python -m lp_runner run ARGV``: the command word written out, so each rank parses exactly the ``run``
    arguments this process got (``--log-level`` included)."""
    return [sys.executable, "-m", "lp_runner", "run", *argv]


def rank_env(rank: int, world: int, port: int, run_id: str) -> dict[str, str]:
    """What torchrun gives a worker on a one-node job (the code cannot tell the two launchers apart)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the store is this process's: every rank connects as a client
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # each rank sets its own threads at start
    }


def launch_ranks(world: int, command: list[str], env: Mapping[str, str] | None = None) -> LaunchResult:
    """Run ``command`` as ranks 0..world-1 on this machine and wait for all of them (see the module doc).

    ``env``: added to this process's environment for every rank. Leaves no process behind."""
    from torch.distributed import TCPStore  # imports torch: only once ranks are to be started

    try:
        store = TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=STORE_TIMEOUT_S)
        )
    except Exception as exc:  # no loopback, no free port
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DistributedError(f"cannot host the ranks' rendezvous on 127.0.0.1 ({reason[:200]})") from None
    base = {**os.environ, **(env or {})}
    run_id = uuid.uuid4().hex[:8]
    result = LaunchResult()
    signals: list[int] = []

    def forward(signum: int, frame: object) -> None:
        signals.append(signum)
        _signal_all(_descendants(), signum)

    _become_subreaper()
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    procs: dict[int, subprocess.Popen] = {}
    with tempfile.TemporaryDirectory(prefix="lp_runner-ranks-") as said_dir:
        error_files = {rank: Path(said_dir, f"rank-{rank}.json") for rank in range(world)}
        try:
            for rank in range(world):
                if signals:
                    break
                procs[rank] = subprocess.Popen(
                    command,
                    env={
                        **base,
                        **rank_env(rank, world, store.port, run_id),
                        ERROR_FILE_ENV: str(error_files[rank]),
                    },
                    start_new_session=True,
                    preexec_fn=_stop_with_parent,
                )
            if signals:  # arrived while the ranks were being started
                _signal_all(_descendants(), signals[0])
            _wait(procs, signals, result)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            _stop_leftovers()
            del store  # the rendezvous closes with the job
        result.said = {rank: line for rank, path in error_files.items() if (line := _error_line(path)) is not None}
    result.interrupted = signals[0] if signals else None
    return result


def _error_line(path: Path) -> str | None:
    """The ``error:`` line a rank left in its error file (``logs.tell_launcher``); None when it wrote none (or
    a file that cannot be read: the line is on the terminal either way, and the summary claims nothing)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return str(record["message"]["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _wait(procs: dict[int, subprocess.Popen], signals: list[int], result: LaunchResult) -> None:
    """Until every rank has ended; the first failure or a forwarded signal starts the bounded stop."""
    live = dict(procs)
    terminate_at = kill_at = None
    while live:
        now = time.monotonic()
        for rank, proc in list(live.items()):
            code = proc.poll()
            if code is None:
                continue
            result.exits.append(RankExit(rank, code))
            del live[rank]
            if code != 0 and terminate_at is None:
                terminate_at = now + PEER_GRACE_S
                result.stopped = [r for r, p in live.items() if _is_stopped(p.pid)]
        if signals and kill_at is None:
            kill_at = now + STOP_GRACE_S  # the signal itself was forwarded by the handler
        if live and terminate_at is not None and now >= terminate_at:
            terminate_at = float("inf")
            _signal_all(_descendants(), signal.SIGTERM)  # the ranks' handler says why and leaves at once
            kill_at = now + STOP_GRACE_S if kill_at is None else kill_at
        if live and kill_at is not None and now >= kill_at:
            _signal_all(_descendants(), signal.SIGKILL)
        if live:
            time.sleep(POLL_S)  # short sleeps: the signal handler runs between them


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T: SIGSTOP, SIGTSTP; t: a debugger holds it), from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] in ("T", "t")


def _stop_with_parent() -> None:
    """In a rank, before it runs: SIGTERM when this process dies, even by SIGKILL."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _become_subreaper() -> None:
    """Orphaned descendants (what a dead rank started) are re-parented to this process, not to init."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _descendants() -> list[int]:
    """Pids of every process below this one (from /proc; Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def _stop_leftovers() -> None:
    """Processes the ranks left behind: SIGTERM, a bounded wait, SIGKILL; then reap them all."""
    left = _descendants()
    if left:
        _signal_all(left, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while _descendants() and time.monotonic() < deadline:
            _reap()
            time.sleep(POLL_S)
        _signal_all(_descendants(), signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while _descendants() and time.monotonic() < deadline:
            _reap()
            time.sleep(0.05)
    _reap()


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass

"""The output JSONL file: one writer per file, nothing lost on a re-run, ``--resume`` after an interruption.

Every launcher writes through ``OutputFile`` (a plain process, torchrun's rank 0, the Ray driver; under
``parallel.workers=P`` the parent holds the lock and its rank 0 writes), so the rules are the same everywhere:

- An existing, non-empty output is refused unless the run says ``resume`` or ``overwrite``.
- A lock (``OUT.lock``, ``flock``) is held for the run's life; a second run on the same file fails at once and
  names the holder's pid. The kernel drops the lock when its holder dies, even by ``kill -9``.
- A new file (``new`` or ``overwrite``) is written as the sibling ``OUT.new`` and renamed over ``OUT`` when its
  first record is complete: a run that fails before that leaves the old file as it was.
- ``OUT`` follows the rule of every file a run writes (``lp_runner.outfiles``): refused when it is one of the
  run's inputs, its folder checked writable before anything loads, a symlink's target written (the link kept).
  An existing ``OUT`` that is not a regular file (``/dev/null``, a FIFO, ``/proc/self/fd/1``) is written in place,
  without lock or rename (it cannot be resumed): renaming over it would replace the node.
- ``resume`` keeps every complete record, drops a torn last line (a kill in the middle of a write) and appends
  the prompts whose id has no record yet. Records carry ``config_digest`` and ``weights_checksum``; a resume with
  other settings or other weights is refused, naming what differs. Their ``run`` field (the whole config,
  versions, device: ``worker.run_info``) says how to re-run them and is not compared.

Worked example (``--resume`` after ``kill -9`` during the third record)::

    OUT before   {"id": "a", ...}\\n{"id": "b", ...}\\n{"id": "c", "prompt_i      <- torn: no newline
    scan         done = {a, b}; good_bytes = end of b's line
    run          c and d are generated; the first write truncates OUT to good_bytes, then appends c, d
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lp_runner.backends import record_settings
from lp_runner.config import Config, user_key
from lp_runner.errors import InputError
from lp_runner.outfiles import OutputError, check_writable, is_stream, write_all

MODES = ("new", "resume", "overwrite")
LOCK_SUFFIX = ".lock"
NEW_SUFFIX = ".new"
# Set by the self-launching parent for its torchrun ranks: the pid that holds the output's lock on their behalf.
LOCK_HOLDER_ENV = "LP_RUNNER_OUTPUT_LOCK_HOLDER"
# Settings that do not change a single generated token: left out of the digest, so a resume may change them.
# How the model is run, not which tokens it gives: threads (the forward's backend leaves or names itself:
# ``backends.record_settings``).
_NOT_IN_DIGEST = {"model": ("threads", "cache_dir", "allow_pickle")}
_DIGEST_SECTIONS = ("model", "lookahead", "generation")


def output_settings(cfg: Config) -> dict[str, dict[str, Any]]:
    """The settings that decide the generated tokens (model, lookahead, generation), as records carry them."""
    data = cfg.to_dict()
    settings = {
        section: {k: v for k, v in data[section].items() if k not in _NOT_IN_DIGEST.get(section, ())}
        for section in _DIGEST_SECTIONS
    }
    settings["model"] = record_settings(settings["model"])
    return settings


def output_digest(cfg: Config) -> str:
    """``config_digest`` of a record: a short hash of ``output_settings``."""
    blob = json.dumps(output_settings(cfg), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def settings_diff(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> list[str]:
    """``["lookahead.window_size: 7 in the file, 5 now", "advanced.max_verify_rows: 0 in the file, 2 now", ...]``
    (each key as the user writes it); empty when nothing differs."""
    out = []
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section, {}), new.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key, "(unset)") != b.get(key, "(unset)"):
                where = user_key(f"{section}.{key}")
                out.append(f"{where}: {a.get(key, '(unset)')!r} in the file, {b.get(key, '(unset)')!r} now")
    return out


@dataclass
class Scan:
    """What an existing output file holds."""

    records: dict[str, dict] = field(default_factory=dict)  # id -> complete record (error records included)
    lines: dict[str, int] = field(default_factory=dict)  # id -> line of its record
    good_bytes: int = 0  # length of the file up to its last complete line
    torn: bool = False  # bytes after the last complete line (a record cut by a kill)
    size: int = 0  # the file's length when scanned


def scan(path: Path) -> Scan:
    """Complete records by id; a last line without its newline is torn (dropped on resume), any other bad line
    is an error: the file is not an lp_runner output, or was edited."""
    out = Scan()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return out
    except OSError as exc:
        raise InputError(f"cannot read output file {path}: {exc.strerror or exc}") from None
    out.size = len(data)
    end = data.rfind(b"\n") + 1
    out.good_bytes, out.torn = end, end < len(data)
    for number, raw in enumerate(data[:end].split(b"\n")[:-1], start=1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            rec = None
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
            raise InputError(f"{path}:{number}: not an lp_runner record; refusing to resume or overwrite it")
        out.records[rec["id"]] = rec
        out.lines[rec["id"]] = number
    return out


class OutputLock:
    """``flock`` on ``OUT.lock`` holding the holder's pid; released (and the file removed) by ``release``."""

    def __init__(self, output: Path) -> None:
        self.path = output.with_name(output.name + LOCK_SUFFIX)
        self.fd: int | None = None

    def acquire(self, output: Path) -> None:
        inherited = os.environ.get(LOCK_HOLDER_ENV)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                if inherited is not None and holder == inherited:
                    return  # our launcher holds it for this run (parallel.workers=P started torchrun)
                raise InputError(
                    f"output file {output} is being written by another lp_runner run (pid {holder}); wait for it "
                    "to end or choose another --output"
                ) from None
            # A holder that finished removed the lock file after we opened it: lock the new one instead.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while still locked: a waiting opener sees the inode change and retries
        os.close(self.fd)
        self.fd = None


class OutputFile:
    """The run's JSONL sink. ``open`` checks and locks before any weights are loaded; ``write`` appends records."""

    def __init__(self, path: Path, mode: str, cfg: Config, existing: Scan, lock: OutputLock | None) -> None:
        self.path = path
        self.stream = lock is None  # not a regular file: written in place, never locked, renamed or truncated
        self.mode = mode
        self.digest = output_digest(cfg)
        self.settings = output_settings(cfg)
        self.existing = existing
        self.lock = lock
        self.sibling = path.with_name(path.name + NEW_SUFFIX)
        self.fd: int | None = None  # the file being written (OUT, or OUT.new until its first record is complete)
        self.good_bytes = 0  # its length up to its last complete record
        self.on_sibling = False  # writing OUT.new, which has not replaced OUT yet
        self.written = 0

    @classmethod
    def open(cls, path: str | Path, mode: str, cfg: Config) -> OutputFile:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        out = Path(path)
        check_writable(out, "output file")
        if is_stream(out):
            if mode == "resume":
                raise InputError(f"--resume needs a regular output file; {out} is a device, FIFO or socket")
            return cls(out, mode, cfg, Scan(), None)
        out = Path(os.path.realpath(out)) if out.is_symlink() else out  # the link's target is the file
        lock = OutputLock(out)
        try:
            lock.acquire(out)
        except OSError as exc:  # a full disk has no room for the holder's pid
            raise OutputError(f"cannot write output file {out}: its lock {lock.path}: {exc.strerror or exc}") from None
        try:
            if mode == "new" and out.exists() and out.stat().st_size > 0:
                raise InputError(
                    f"output file {out} already exists; give --resume to continue it or --overwrite to replace it"
                )
            sink = cls(out, mode, cfg, scan(out) if mode == "resume" else Scan(), lock)
            sink.check_config()
            with contextlib.suppress(FileNotFoundError):
                sink.sibling.unlink()  # left by a run killed before its first record
        except BaseException:
            lock.release()
            raise
        return sink

    @property
    def done(self) -> set[str]:
        """Ids with a complete record already in the file (resume only)."""
        return set(self.existing.records)

    def finished_outputs(self, ids: Sequence[str]) -> list[tuple[list[int], list[int]]]:
        """(prompt ids, output ids) of the records already in the file, in the order of ``ids`` (the job's
        prompt order); error records have none. What ``--resume`` rebuilds a job store from."""
        records = self.existing.records
        return [(records[i]["prompt_ids"], records[i]["output_ids"]) for i in ids if "output_ids" in records.get(i, {})]

    def _records(self) -> Iterator[tuple[int, dict]]:
        for rid, rec in self.existing.records.items():
            yield self.existing.lines[rid], rec

    def check_config(self) -> None:
        for line, rec in self._records():
            if rec.get("config_digest") == self.digest:
                continue
            if "config_digest" not in rec:
                raise InputError(
                    f"--resume: {self.path}:{line} carries no config_digest (an older lp_runner wrote it), so it "
                    "cannot be checked against this run's settings; use --overwrite or another --output"
                )
            diff = settings_diff(rec.get("config") or {}, self.settings) or ["config_digest differs"]
            raise InputError(
                f"--resume: {self.path} was written with other settings ({'; '.join(diff[:4])}); resume with the "
                "same config, or use --overwrite"
            )

    def check_weights(self, checksum: str) -> None:
        """After the model is loaded: the records must come from the same weights."""
        for line, rec in self._records():
            theirs = rec.get("weights_checksum")
            if theirs != checksum:
                raise InputError(
                    f"--resume: {self.path}:{line} was generated from other model weights (checksum "
                    f"{str(theirs)[:12]} in the file, {checksum[:12]} now, model.path={self.settings['model']['path']}"
                    "); resume with the same model, or use --overwrite"
                )

    def write(self, rec: dict) -> None:
        """Append one record; it is in the kernel's hands when this returns (a later failure cannot lose it).

        An OSError (ENOSPC, EIO, EDQUOT) is an OutputError naming the file, what it holds and how to go on; the
        torn tail of the failed write is cut off where the file system allows it (``--resume`` drops it too)."""
        data = (json.dumps(rec) + "\n").encode("utf-8")
        try:
            if self.fd is None:
                self._begin(data)
            else:
                write_all(self.fd, data)
        except OSError as exc:
            raise self._failed(exc) from None
        self.good_bytes += len(data)
        self.written += 1

    def _begin(self, first: bytes) -> None:
        if self.stream:
            self.fd = os.open(self.path, os.O_WRONLY)
            write_all(self.fd, first)
            return
        if self.mode == "resume" and self.path.exists():
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            os.ftruncate(self.fd, self.existing.good_bytes)  # drop a torn last line
            self.good_bytes = self.existing.good_bytes
            write_all(self.fd, first)
            return
        self.fd = os.open(self.sibling, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.on_sibling = True
        write_all(self.fd, first)
        os.fsync(self.fd)  # on disk before it replaces the old file: a crash leaves one or the other, whole
        os.replace(self.sibling, self.path)  # the old file goes only now, with a complete record in its place
        self.on_sibling = False

    def _failed(self, exc: OSError) -> OutputError:
        """After a failed write: the file cut back to its last complete record (or ``OUT.new`` removed, the old
        ``OUT`` untouched), and the one line that says so."""
        reason = exc.strerror or str(exc)
        if self.on_sibling:  # OUT.new never replaced OUT
            self._close_fd()
            with contextlib.suppress(OSError):
                self.sibling.unlink()
            kept = "the existing file is unchanged" if self.path.exists() else "nothing was written"
            return OutputError(f"cannot write {self.sibling} ({reason}); {kept}")
        held = len(self.existing.records) + self.written  # complete records in the file
        if self.stream:
            self._close_fd()
            return OutputError(f"cannot write {self.path} ({reason}); {held} records written to it")
        torn = ""
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, self.good_bytes)
            except OSError as cut:
                torn = f"; its last line is torn ({cut.strerror or cut}), --resume drops it"
        return OutputError(f"cannot write {self.path} ({reason}); {held} records written{torn}, resume with --resume")

    def _close_fd(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self, complete: bool = False) -> None:
        """``complete``: the run ended normally (a resume with nothing new still drops a torn last line)."""
        try:
            if self.fd is not None:
                self._close_fd()
            elif complete and self.mode == "resume" and self.existing.torn:
                with open(self.path, "r+b") as f:
                    if os.fstat(f.fileno()).st_size == self.existing.size:  # not appended to by our ranks
                        f.truncate(self.existing.good_bytes)
            if not self.stream:
                with contextlib.suppress(FileNotFoundError):
                    self.sibling.unlink()
        finally:
            if self.lock is not None:
                self.lock.release()

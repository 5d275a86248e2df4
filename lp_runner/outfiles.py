"""One rule for every file a run writes: ``--output`` (``jobs/output.py``), ``--pool-out``
(``decoding/job_store.py``), ``tune --output``, ``--save-curve`` and ``--report`` (``cli/tune.py``); and the
streamed text on stdout (``write_stdout``).

- **Not an input.** An output that is one of the run's own inputs (the prompts, the config, a curve it reads) is
  refused: the same path, or the same file through a hard link or a symlink (``same_file``). Writing it would
  destroy what the run reads, and the user learns it only when the input is gone.
- **Checked before any work** (``check_writable``): not a folder, its folder creatable and writable (probed by
  creating a file there: ``os.access`` says yes to root on a read-only mount). A missing folder is created then;
  a refusal is one ``error:`` line before the model loads, not a traceback after the whole job.
- **Written atomically** where it is a regular file or does not exist yet (``write_file``): a temporary file in
  the same folder, ``fsync``, ``os.replace`` over the target (a symlink's target: the link stays a link). A full
  disk or an interruption leaves the old file or none, never a torn or empty one.
- **Never replaces a file of another kind.** A run's records (``--output``) replace an existing file only with
  ``--overwrite`` and only when it holds records; ``tune --output`` only with ``--overwrite``; ``--pool-out`` a
  previous pool or an empty file (``job_store.check_pool_out``: saving a pool over a records file lost them without
  a word). Each is checked before any work, with the other checks here.
- **Never replaced when it is not a regular file.** An existing device, FIFO or symlink to a descriptor
  (``/dev/null``, ``/proc/self/fd/1``) is opened and written in place (``is_stream``): renaming a regular file
  over it would replace a machine's device node, or leave a FIFO's reader waiting for nothing.

Worked example (``--pool-out pool.json`` on a disk with room for half the file)::

    check_writable   pool.json's folder exists and takes a probe file           (before the model loads)
    write_file       .pool.json.<random>.tmp gets half the bytes, then ENOSPC -> removed
                     OutputError: "cannot write pool.json (No space left on device); the existing file is
                     unchanged"                                                 (pool.json as it was)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from lp_runner.errors import InputError, LPError

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away (cat, grep)


class OutputError(LPError):
    """An output cannot be written (disk full, I/O error, quota): what is on disk, and how to go on."""


class StdoutClosed(LPError):
    """stdout's reader went away (``| head -c 5``): the run ends without a word, exit ``EXIT_BROKEN_PIPE``, as
    ``cat`` and ``grep`` do; whatever ``--output`` holds stays as written, for ``--resume``."""


def is_stream(path: str | Path) -> bool:
    """``path`` exists (symlinks followed) and is not a regular file: a device, a FIFO, a socket, a terminal."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def same_file(a: str | Path, b: str | Path) -> bool:
    """The same file: equal once symlinks are resolved, or the same device and inode (a hard link, a bind mount).

    Inodes are compared for regular files only: two names of one terminal (``/dev/stdin``, ``/dev/stdout``) are
    one inode but not one file's contents."""
    if Path(a).resolve() == Path(b).resolve():
        return True
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return stat.S_ISREG(sa.st_mode) and (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def check_not_an_input(output: str | Path, option: str, inputs: Mapping[str, str | Path | None]) -> None:
    """Refuse ``output`` (named by ``option``, e.g. ``"--output"``) when it is one of ``inputs`` (option -> path;
    None: not given) or another of the run's outputs."""
    for what, path in inputs.items():
        if path and same_file(output, path):
            raise InputError(f"{option} {output} is the same file as {what} {path}; write it to another file")


def check_writable(path: str | Path, option: str) -> None:
    """One ``error:`` line, before any work, for an output that could not be written at the end: a folder, a
    path under a file, a folder that cannot be created or written. Creates missing parent folders. An existing
    stream (``is_stream``) is only checked for write permission: opening a FIFO here would wait for a reader."""
    out = Path(path)
    if out.is_dir():
        raise InputError(f"{option} {out} is a folder; give a file name (e.g. {out / 'out'})")
    if is_stream(out):
        if not os.access(out, os.W_OK):
            raise InputError(f"cannot write {option} {out}: permission denied")
        return
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(f"cannot write {option} {out}: {parent} is a file, not a folder")
            break
    folder = _target(out).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{out.name[:64]}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InputError(f"cannot write {option} {out}: folder {folder}: {exc.strerror or exc}") from None


def write_file(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` under the module's rule: in place for a stream, else atomically (the old file or
    none after a failure). A failure is an ``OutputError`` naming the file and what is left of it."""
    out = Path(path)
    if is_stream(out):
        try:
            fd = os.open(out, os.O_WRONLY)
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            raise OutputError(f"cannot write {out} ({exc.strerror or exc})") from None
        return
    target = _target(out)
    existed = target.exists()
    tmp = None
    try:
        tmp = target.with_name(f".{target.name[:64]}.{secrets.token_hex(6)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to open()'s files
        try:
            write_all(fd, data)
            os.fsync(fd)
            if existed:  # the replaced file's permissions stay
                os.fchmod(fd, stat.S_IMODE(os.stat(target).st_mode))
        finally:
            os.close(fd)
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        kept = "the existing file is unchanged" if existed else "nothing was written"
        raise OutputError(f"cannot write {out} ({exc.strerror or exc}); {kept}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a write may take fewer; an OSError propagates)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _target(out: Path) -> Path:
    """The file a regular write replaces: a symlink's target (the link is kept), else the path itself."""
    return Path(os.path.realpath(out)) if out.is_symlink() else out


def write_stdout(text: str) -> None:
    """The streamed text on stdout, flushed at once. A closed pipe is ``StdoutClosed`` (the caller ends quietly);
    any other failure (``> /dev/full``: ENOSPC) an ``OutputError`` (one line). Either way stdout is pointed at
    ``/dev/null`` first: the interpreter flushes it again at exit and would print "Exception ignored ..."."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        _drop_stdout()
        raise StdoutClosed("stdout was closed by its reader") from None
    except OSError as exc:
        _drop_stdout()
        raise OutputError(f"cannot write the text to stdout ({exc.strerror or exc})") from None


def _drop_stdout() -> None:
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)

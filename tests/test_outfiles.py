"""``lp_runner.outfiles``: the one rule for every file a run writes, on real files, links, FIFOs and limits.

The CLI's cases (each option, each command) are in ``tests/cli/test_outputs.py``; these pin the functions.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from dist_helpers import env_with_repo

from lp_runner.errors import InputError, LPError
from lp_runner.outfiles import OutputError, check_not_an_input, check_writable, is_stream, same_file, write_file


def test_same_file_by_path_hard_link_and_symlink(tmp_path: Path) -> None:
    a = tmp_path / "a.txt"
    a.write_text("x")
    (tmp_path / "hard").hardlink_to(a)
    (tmp_path / "soft").symlink_to(a)
    (tmp_path / "other").write_text("x")  # same bytes, another file
    assert same_file(a, tmp_path / "." / "a.txt")
    assert same_file(a, tmp_path / "hard") and same_file(tmp_path / "soft", a)
    assert not same_file(a, tmp_path / "other")
    assert same_file(tmp_path / "new.txt", tmp_path / "sub" / ".." / "new.txt")  # neither exists: by path
    with pytest.raises(InputError, match=r"--save-curve .*hard is the same file as --prompts .*a\.txt"):
        check_not_an_input(tmp_path / "hard", "--save-curve", {"--config": None, "--prompts": a})
    check_not_an_input(tmp_path / "other", "--save-curve", {"--prompts": a})  # not an input: no error


def test_check_writable_refuses_a_folder_a_path_under_a_file_and_creates_a_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="is a folder"):
        check_writable(tmp_path, "--output")
    (tmp_path / "f").write_text("x")
    with pytest.raises(InputError, match=r"f is a file, not a folder"):
        check_writable(tmp_path / "f" / "o.json", "--output")
    check_writable(tmp_path / "new" / "deeper" / "o.json", "--output")
    assert (tmp_path / "new" / "deeper").is_dir() and list((tmp_path / "new" / "deeper").iterdir()) == []


def test_write_file_replaces_atomically_keeps_the_mode_and_follows_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "t.yaml"
    write_file(target, b"one\n")
    umask = os.umask(0)
    os.umask(umask)
    assert target.read_bytes() == b"one\n" and stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    target.chmod(0o600)
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    write_file(link, b"two\n")
    assert link.is_symlink() and target.read_bytes() == b"two\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.yaml", "t.yaml"]  # no temporary file left


def test_write_file_to_a_fifo_streams_in_place(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert is_stream(fifo) and not is_stream(tmp_path) and not is_stream(tmp_path / "missing")
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    write_file(fifo, b"streamed\n")
    reader.join(10)
    assert got == [b"streamed\n"] and stat.S_ISFIFO(fifo.lstat().st_mode)


_WRITE_UNDER_A_LIMIT = """
import resource, signal, sys
from lp_runner.outfiles import OutputError, write_file
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))
try:
    write_file(sys.argv[1], b"x" * 1000)
except OutputError as exc:
    print(exc)
"""


@pytest.mark.parametrize("existed", [True, False])
def test_a_failed_write_leaves_the_old_file_or_none(tmp_path: Path, existed: bool) -> None:
    """A file-size limit (RLIMIT_FSIZE) makes the write fail midway, as a full disk does: the old file stays as
    it was (or none is made) and no temporary file is left."""
    out = tmp_path / "o.json"
    if existed:
        out.write_bytes(b"old\n")
    proc = subprocess.run(
        [sys.executable, "-c", _WRITE_UNDER_A_LIMIT, str(out)], env=env_with_repo(), capture_output=True, text=True
    )
    kept = "the existing file is unchanged" if existed else "nothing was written"
    assert proc.stdout == f"cannot write {out} (File too large); {kept}\n", proc.stderr
    assert (out.read_bytes() == b"old\n") if existed else not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["o.json"] if existed else [])
    assert issubclass(OutputError, LPError)  # one line at the CLI, exit 2


def test_stdout_closed_is_quiet_at_exit() -> None:
    """write_stdout to a pipe whose reader is gone: StdoutClosed, and no "Exception ignored ... BrokenPipeError"
    from the interpreter's own flush at exit."""
    code = "from lp_runner.outfiles import StdoutClosed, write_stdout\ntry:\n    write_stdout('x' * 10)\n"
    code += "except StdoutClosed:\n    raise SystemExit(7)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env_with_repo(), stdout=subprocess.PIPE, stderr=-1)
    proc.stdout.close()
    assert proc.wait(30) == 7
    assert proc.stderr.read() == b""

"""Every file a run writes, and its output streams, through the real CLI (``python -m lp_runner`` in subprocesses).

One rule for ``--output``, ``--pool-out``, ``tune --output`` and ``--save-curve`` (``lp_runner.outfiles``): refused
when it is one of the run's inputs, checked writable before any work, written atomically where it is a regular
file, written in place (never replaced) where it is a device or a FIFO. ``tune`` follows the job's rules
(``--overwrite``, range checks before measuring, Ctrl-C / SIGTERM as exit 130), and the streamed text on stdout
ends without a traceback when its reader goes away or its disk is full. Every failing run: stderr without a
traceback, its inputs byte-identical afterwards. Device nodes and FIFOs are made in the test's own folder; the
full and read-only disks are small tmpfs mounts there (skipped where this process may not mount).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dist_helpers import env_with_repo, job_args, lp_runner_cmd, read_jsonl, write_prompts

from lp_runner.errors import InputError

PROMPTS = [{"id": "a", "prompt": "def add(a, b):"}, {"id": "b", "prompt": "The list goes on and"}]
TINY = ("--set", "model.threads=1", "--set", "advanced.progress=false")


def run(*args: str, timeout: float = 300, **popen) -> subprocess.CompletedProcess:
    return subprocess.run(
        lp_runner_cmd(*args), env=env_with_repo(), capture_output=True, text=True, timeout=timeout, **popen
    )


def assert_one_line(proc: subprocess.CompletedProcess, fragment: str, code: int = 2) -> None:
    """Exit ``code``, stderr one ``error:`` line holding ``fragment``, no traceback."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert fragment in lines[0], lines[0]


def snapshot(*paths: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in paths}


def assert_unchanged(before: dict[Path, bytes]) -> None:
    for path, data in before.items():
        assert path.read_bytes() == data, f"{path} changed"


@pytest.fixture
def inputs(tmp_path: Path) -> tuple[Path, Path]:
    """(prompts, config) of a cheap run."""
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    config = tmp_path / "c.yaml"
    config.write_text("generation:\n  max_new_tokens: 4\n")
    return prompts, config


def mount_tmpfs(path: Path, options: str) -> None:
    path.mkdir(exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}")


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A read-only folder even for root: a read-only tmpfs (chmod alone does not stop root)."""
    folder = tmp_path / "ro"
    mount_tmpfs(folder, "size=64k,ro")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs; the test fills it (``fill``) after putting its old files there."""
    folder = tmp_path / "disk"
    mount_tmpfs(folder, "size=64k")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path) -> None:
    """Every free block of ``folder``'s file system taken by one filler file."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 1024):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


def char_device(path: Path, major: int, minor: int) -> Path:
    """A character device node in the test's own folder (1, 3: like /dev/null; 1, 7: like /dev/full)."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    except PermissionError:
        pytest.skip("cannot make a device node here (needs root or CAP_MKNOD)")
    return path


# ---------------------------------------------------------------------------------------------------------
# refused before any work: fast (nothing is loaded)


def test_pool_out_that_is_an_input_is_refused(tmp_path: Path, inputs) -> None:
    """--pool-out naming the prompts or the config (a path, a hard link, a symlink) is refused before the job: the
    pool's JSON would replace them at the end."""
    prompts, config = inputs
    (tmp_path / "hard.jsonl").hardlink_to(prompts)
    (tmp_path / "soft.yaml").symlink_to(config)
    before = snapshot(prompts, config)
    base = ["--prompts", str(prompts), "--config", str(config), "--set", "lookahead.pool_scope=job"]
    cases = [(prompts, "--prompts"), (tmp_path / "hard.jsonl", "--prompts"), (tmp_path / "soft.yaml", "--config")]
    for pool, what in cases:
        assert_one_line(run(*base, "--pool-out", str(pool)), f"--pool-out {pool} is the same file as {what}")
    assert_unchanged(before)


def test_pool_out_over_a_file_that_is_not_a_pool_is_refused_before_the_job(tmp_path: Path, inputs) -> None:
    """--pool-out naming an earlier run's records file replaced it with the pool's JSON at the end, without a word
    (--output refuses to replace what is not its records): refused before the job, the file as it was."""
    prompts, config = inputs
    records = tmp_path / "earlier.jsonl"
    records.write_text(json.dumps({"id": "a", "text": "kept"}) + "\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    before = snapshot(records, notes)
    base = ["--prompts", str(prompts), "--config", str(config), "--set", "lookahead.pool_scope=job"]
    for other in (records, notes):
        assert_one_line(
            run(*base, "--pool-out", str(other)),
            f"--pool-out {other} exists and is not an lp_runner pool file; saving the pool would replace it",
        )
    assert_unchanged(before)


def test_check_pool_out_takes_a_pool_an_empty_file_or_none(tmp_path: Path) -> None:
    """What --pool-out may replace: a pool as ``save`` writes it (or spaced, as by hand), an empty file, nothing."""
    from lp_runner.decoding.job_store import JobPool, check_pool_out

    saved = tmp_path / "saved.json"
    JobPool(100).save(saved, "fingerprint")
    spaced = tmp_path / "spaced.json"
    spaced.write_text('{\n  "format": "lp_runner.job_pool", "version": 1}')
    empty = tmp_path / "empty.json"
    empty.write_text("")
    for path in (saved, spaced, empty, tmp_path / "none.json"):
        check_pool_out(path)
    (tmp_path / "other.json").write_text('{"format": "something.else"}')
    with pytest.raises(InputError, match="is not an lp_runner pool file"):
        check_pool_out(tmp_path / "other.json")


def test_pool_out_in_a_read_only_folder_is_refused_before_the_job(tmp_path: Path, inputs, read_only_dir) -> None:
    prompts, config = inputs
    base = ["--prompts", str(prompts), "--config", str(config), "--set", "lookahead.pool_scope=job"]
    pool = read_only_dir / "pool.json"
    assert_one_line(run(*base, "--pool-out", str(pool)), f"cannot write --pool-out {pool}: folder {read_only_dir}")
    under = prompts / "pool.json"
    assert_one_line(run(*base, "--pool-out", str(under)), f"{prompts} is a file, not a folder")
    assert not (tmp_path / "o.jsonl").exists()


def test_resume_of_a_device_output_is_refused(tmp_path: Path, inputs) -> None:
    prompts, _ = inputs
    node = char_device(tmp_path / "null", 1, 3)
    assert_one_line(run("--prompts", str(prompts), "--output", str(node), "--resume"), "--resume needs a regular")
    assert stat.S_ISCHR(node.lstat().st_mode)


def test_conflicting_and_unknown_flags_are_one_line() -> None:
    """argparse's usage block (seven lines, the error last) becomes one error: line, exit 2."""
    assert_one_line(run("--prompt", "hi", "--resume", "--overwrite"), "not allowed with argument")
    assert_one_line(run("--prompt", "hi", "--bogus"), "unrecognized arguments: --bogus")
    assert_one_line(run("tune", "--output", "x.yaml"), "the following arguments are required: --prompts")


def test_tune_refuses_its_inputs_and_an_existing_output(tmp_path: Path, inputs) -> None:
    """tune's --output / --save-curve naming an input is refused, an existing --output needs --overwrite, before
    the model loads."""
    prompts, config = inputs
    tuned = tmp_path / "tuned.yaml"
    tuned.write_text("old: config\n")
    before = snapshot(prompts, config, tuned)
    base = ["tune", "--prompts", str(prompts), "--config", str(config)]
    same = "is the same file as"
    assert_one_line(run(*base, "--output", str(prompts)), f"--output {prompts} {same} --prompts {prompts}")
    assert_one_line(run(*base, "--output", str(config), "--overwrite"), f"--output {config} {same} --config")
    assert_one_line(run(*base, "--output", str(tuned)), f"--output {tuned} already exists; give --overwrite")
    curve = ["--save-curve", str(config)]
    assert_one_line(run(*base, "--output", str(tmp_path / "t2.yaml"), *curve), f"--save-curve {config} {same}")
    assert_unchanged(before)
    assert not (tmp_path / "t2.yaml").exists()


def test_tune_output_in_a_read_only_folder_is_refused_at_once(inputs, read_only_dir) -> None:
    prompts, _ = inputs
    out = read_only_dir / "tuned.yaml"
    started = time.monotonic()
    assert_one_line(run("tune", "--prompts", str(prompts), "--output", str(out)), f"cannot write --output {out}")
    assert time.monotonic() - started < 60  # before the model loads and the curve is measured


def test_tune_numbers_are_range_checked_before_measuring(tmp_path: Path, inputs) -> None:
    """--reps -1 was an IndexError traceback after the whole curve was measured."""
    from lp_runner.cli.tune import RANGES, build_parser, check_numbers
    from lp_runner.errors import InputError

    prompts, _ = inputs
    out = tmp_path / "t.yaml"
    assert_one_line(run("tune", "--prompts", str(prompts), "--output", str(out), "--reps", "-1"), "--reps must be")
    assert not out.exists()
    base = ["--prompts", "p", "--output", "o"]
    for option, (low, high) in RANGES.items():  # each bound, just outside and on it
        for bad in (low - 1, high * 2 + 1, *([float("nan")] if isinstance(low, float) else [])):
            with pytest.raises(InputError, match=f"{option} must be from"):
                check_numbers(build_parser().parse_args([*base, option, str(bad)]))
        for good in (low, high):
            check_numbers(build_parser().parse_args([*base, option, str(good)]))


# ---------------------------------------------------------------------------------------------------------
# runs of the tiny model (slow: a model loads)


def job(tiny_dir: Path, prompts: Path, out: Path | str, *extra: str) -> list[str]:
    return job_args(tiny_dir, prompts, Path(out), *extra, max_new_tokens=8)


@pytest.mark.slow
def test_device_and_fifo_outputs_are_written_in_place(tiny_dir, tmp_path: Path, inputs) -> None:
    """An output that is a character device, a FIFO with a reader or a symlink to a descriptor is streamed to,
    never replaced by a regular file (``OUT.new`` renamed over it)."""
    prompts, _ = inputs
    node = char_device(tmp_path / "null", 1, 3)
    proc = run(*job(tiny_dir, prompts, node))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert stat.S_ISCHR(node.lstat().st_mode) and sorted(p.name for p in tmp_path.iterdir()) == [
        "c.yaml",
        "null",
        "p.jsonl",
    ]

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    proc = run(*job(tiny_dir, prompts, fifo))
    reader.join(30)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert [json.loads(line)["id"] for line in got[0].splitlines()] == ["a", "b"]

    link = tmp_path / "stdout.jsonl"
    link.symlink_to("/proc/self/fd/1")
    proc = run(*job(tiny_dir, prompts, link))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert link.is_symlink() and os.readlink(link) == "/proc/self/fd/1"
    assert [json.loads(line)["id"] for line in proc.stdout.splitlines()] == ["a", "b"]


@pytest.mark.slow
def test_pool_out_on_a_full_disk_leaves_the_old_pool(tiny_dir, inputs, full_disk) -> None:
    prompts, _ = inputs
    pool = full_disk / "pool.json"
    pool.write_text('{"format": "lp_runner.job_pool", "old": "pool"}')  # a previous pool: --pool-out replaces it
    fill(full_disk)
    before = snapshot(prompts, pool)
    out = full_disk.parent / "o.jsonl"
    proc = run(*job(tiny_dir, prompts, out, "--set", "lookahead.pool_scope=job", "--pool-out", str(pool)))
    assert_one_line(proc, f"cannot write {pool} (No space left on device); the existing file is unchanged")
    assert_unchanged(before)
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler", "pool.json"]


@pytest.mark.slow
def test_stream_to_a_closed_pipe_ends_quietly_and_the_records_resume(tiny_dir, tmp_path: Path) -> None:
    """--prompt's text to a pipe whose reader is gone (``| head -c 5``): exit 141 as cat's, nothing on stderr (no
    BrokenPipeError, not even Python's "Exception ignored" at shutdown); the records file as it was; --resume
    then completes it."""
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:1])
    out = tmp_path / "o.jsonl"
    assert run(*job(tiny_dir, prompts, out)).returncode == 0
    old = snapshot(out)
    single = [a if a != str(prompts) else "def add(a, b):" for a in job(tiny_dir, prompts, out, "--resume")]
    single[0] = "--prompt"  # the same settings as the records in OUT: a resume of it
    proc = subprocess.Popen(lp_runner_cmd(*single), env=env_with_repo(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first token: every write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(300) == 141, err[-3000:]
    assert err == "", err[-3000:]
    assert_unchanged(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl", "p.jsonl"]
    resumed = run(*single)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["id"] for r in read_jsonl(out)] == ["a", "prompt"]


@pytest.mark.slow
def test_a_closed_stderr_ends_the_run_as_a_closed_stdout_does(tiny_dir, tmp_path: Path) -> None:
    """stderr's reader gone (``2> >(head -c 1)``): the progress bar's first write raised BrokenPipeError and the run
    ended with exit 1 (its traceback lost on the closed pipe). Now exit 141 with nothing on stdout, as a closed
    stdout ends it, and --resume then runs the job. A single prompt streams its text, then ends the same way at
    its first line on stderr."""
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "o.jsonl"
    with_bar = job(tiny_dir, prompts, out, "--set", "advanced.progress=true")
    single = [
        "--prompt",
        "def add(a, b):",
        "--set",
        f"model.path={tiny_dir}",
        *TINY,
        "--set",
        "generation.max_new_tokens=8",
    ]
    for args in (with_bar, single):
        proc = subprocess.Popen(
            lp_runner_cmd(*args), env=env_with_repo(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        proc.stderr.close()  # the reader is gone before the first line
        text = proc.stdout.read().decode()
        assert proc.wait(300) == 141, text[-3000:]
        assert (text == "") if args is with_bar else text.strip(), text[-3000:]
    assert not out.exists() or [r["id"] for r in read_jsonl(out)] == []
    resumed = run(*job(tiny_dir, prompts, out, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(r["id"] for r in read_jsonl(out)) == ["a", "b"]


def test_a_closed_stderr_is_quiet_at_exit() -> None:
    """A log line to a stderr whose reader is gone: StderrClosed from the main thread, and nothing after it (the
    interpreter's own flush at exit, a line on the way out) fails again."""
    code = "from lp_runner.logs import StderrClosed, log, setup_logging\nsetup_logging()\ntry:\n    log.info('x')\n"
    code += "except StderrClosed:\n    log.error('after')\n    print('closed', flush=True)\n    raise SystemExit(7)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env_with_repo(), stdout=subprocess.PIPE, stderr=-1)
    proc.stderr.close()
    assert proc.stdout.read() == b"closed\n"
    assert proc.wait(30) == 7


@pytest.mark.slow
def test_stream_to_a_full_device_is_one_line(tiny_dir, tmp_path: Path) -> None:
    """--prompt's text to a device that is always full (``> /dev/full``, here a node of the test's own): one line,
    exit 2, no --output written."""
    full = char_device(tmp_path / "full", 1, 7)
    out = tmp_path / "o.jsonl"
    args = ["--prompt", "def add(a, b):", "--output", str(out), "--set", f"model.path={tiny_dir}", *TINY]
    with open(full, "w") as stdout:
        proc = subprocess.run(
            lp_runner_cmd(*args), env=env_with_repo(), stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300
        )
    assert_one_line(proc, "cannot write the text to stdout (No space left on device)")
    assert not out.exists() and not (tmp_path / "o.jsonl.new").exists()


@pytest.mark.slow
def test_groups_full_disk_message_stands_on_its_own_line(tiny_dir, tmp_path: Path, full_disk) -> None:
    """Under parallel.groups=2 the writer's error came from the record collector's thread onto the progress bar's
    line (drawn over by the bar's next refresh): the bar now ends its line first."""
    prompts = write_prompts(tmp_path / "many.jsonl", [{"id": f"p{i}", "prompt": f"Item {i}: and"} for i in range(40)])
    out = full_disk / "o.jsonl"
    args = [*job(tiny_dir, prompts, out, "--set", "parallel.groups=2", "--set", "advanced.progress=true")]
    proc = run(*args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert any(ln.startswith(f"error: [rank 0] cannot write {out} (No space left on device)") for ln in lines), lines
    assert lines[-1].endswith("first; see its message above"), lines[-1]


def tune_args(tiny_dir: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return ["tune", "--prompts", str(prompts), "--output", str(out), "--set", f"model.path={tiny_dir}", *TINY[:2],
            "--max-new-tokens", "4", "--passes", "1", *extra]  # fmt: skip


@pytest.mark.slow
def test_tune_on_a_full_disk_leaves_the_old_output(tiny_dir, inputs, full_disk) -> None:
    """The tuned config was written with write_text: a full disk left a 0-byte file after the whole tune."""
    prompts, _ = inputs
    out = full_disk / "tuned.yaml"
    out.write_text("old: config\n")
    fill(full_disk)
    before = snapshot(prompts, out)
    proc = run(*tune_args(tiny_dir, prompts, out, "--reps", "1", "--overwrite", "--log-level", "WARNING"))
    assert_one_line(proc, f"cannot write {out} (No space left on device); the existing file is unchanged")
    assert_unchanged(before)
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler", "tuned.yaml"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_tune_interrupted_is_one_line_and_exit_130(tiny_dir, tmp_path: Path, inputs, sig) -> None:
    """Ctrl-C was a 39-line KeyboardInterrupt traceback, SIGTERM a death by the signal (143); the old output
    stays."""
    prompts, _ = inputs
    out = tmp_path / "tuned.yaml"
    out.write_text("old: config\n")
    before = snapshot(prompts, out)
    args = tune_args(tiny_dir, prompts, out, "--reps", "1000", "--overwrite")  # measuring lasts past the signal
    proc = subprocess.Popen(lp_runner_cmd(*args), env=env_with_repo(), stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # the first progress line: the curve is being measured
        seen.append(line)
        if line.startswith("measuring the forward-cost curve"):
            break
    proc.send_signal(sig)
    rest = proc.stderr.read()
    assert proc.wait(60) == 130, "".join(seen) + rest
    assert "Traceback" not in rest
    assert rest.strip().splitlines() == ["error: interrupted; --output was not written"], rest
    assert_unchanged(before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "p.jsonl", "tuned.yaml"]


@pytest.mark.slow
def test_tune_writes_a_new_output_and_replaces_with_overwrite(tiny_dir, tmp_path: Path, inputs) -> None:
    """The happy path under the rule: a new file, then --overwrite through a symlink replaces the target and
    keeps the link."""
    prompts, _ = inputs
    target = tmp_path / "tuned.yaml"
    target.write_text("old: config\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    proc = run(
        *tune_args(tiny_dir, prompts, link, "--reps", "1", "--overwrite", "--save-curve", str(tmp_path / "c.json"))
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert link.is_symlink() and "written by `python -m lp_runner tune`" in target.read_text()
    assert json.loads((tmp_path / "c.json").read_text())
    assert read_jsonl(prompts) == PROMPTS

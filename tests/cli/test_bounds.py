"""Every input has a bound that fails in one line: values of absurd size, YAML aliases, over-long paths, repeated
keys, run for real (``python -m lp_runner`` in a subprocess).

Each case ends with exit 2 and one short ``error:`` line, no traceback, before any model is loaded (so these are
fast). The bounds themselves are listed in docs/design.md 9.6.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_helpers import REPO

from lp_runner.config import load_config
from lp_runner.errors import ConfigError
from lp_runner.limits import MAX_YAML_NODES, QUOTE_CHARS, check_path_text, quote

MAX_LINE = 400  # an error line that quotes a value shows at most QUOTE_CHARS of it


# Runs the CLI as ``python -m lp_runner`` does and writes its peak resident memory (VmHWM: this program's own,
# whereas a child's ru_maxrss also counts the test process it was forked from) to the file $PEAK_FILE.
_WITH_PEAK = """
import atexit, os, runpy, sys
def peak():
    with open("/proc/self/status") as status, open(os.environ["PEAK_FILE"], "w") as out:
        out.write(next(line for line in status if line.startswith("VmHWM:")).split()[1])
atexit.register(peak)
sys.argv[0] = "lp_runner"
runpy.run_module("lp_runner", run_name="__main__", alter_sys=True)
"""


def run_cli(*args: str, peak_file: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m lp_runner ARGS``; with ``peak_file``, its peak resident memory (KiB) is written there."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    command = ["-m", "lp_runner"] if peak_file is None else ["-c", _WITH_PEAK]
    if peak_file is not None:
        env["PEAK_FILE"] = str(peak_file)
    return subprocess.run(
        [sys.executable, *command, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )


def assert_one_line(proc: subprocess.CompletedProcess, fragment: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[:2000])
    assert "Traceback" not in proc.stderr, proc.stderr[:2000]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr[:2000]
    assert lines[0].startswith("error: ") and fragment in lines[0], lines[0][:2000]
    assert len(lines[0]) < MAX_LINE, lines[0][:2000]
    return lines[0]


def _bomb(levels: int) -> str:
    """A billion-laughs config: each level a list of nine aliases of the one before (9**levels values)."""
    names = [f"l{i}" for i in range(levels)]
    rows = ["model:", f"  path: [&{names[0]} [lol, lol, lol, lol, lol, lol, lol, lol, lol],"]
    rows += [f"    &{names[i]} [{', '.join(['*' + names[i - 1]] * 9)}]," for i in range(1, levels)]
    return "\n".join([*rows, f"    *{names[-1]}]"]) + "\n"


def test_an_alias_bomb_is_refused_before_it_is_expanded_or_echoed(tmp_path: Path) -> None:
    """9**6 values from a ~400-byte file: refused by its expanded size while composing, so the error line and the
    process stay small (the config would otherwise be echoed whole in 'model.path must be a string, got ...')."""
    config = tmp_path / "bomb.yaml"
    config.write_text(_bomb(6))
    assert config.stat().st_size < 500 and MAX_YAML_NODES < 9**6
    proc = run_cli("--prompt", "hi", "--config", str(config), peak_file=tmp_path / "peak")
    assert_one_line(proc, "values once its aliases are expanded")
    assert len(proc.stderr) < 1024
    assert config.read_text() == _bomb(6)  # the input as it was
    peak_kib = int((tmp_path / "peak").read_text())
    assert 0 < peak_kib < 200 * 1024, peak_kib  # the interpreter and PyYAML: the expansion was never built


def test_an_alias_bomb_in_a_set_value_and_a_recursive_alias(tmp_path: Path) -> None:
    bomb = "[&a [x,x,x,x,x,x,x,x,x,x], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], "
    bomb += "&d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c], [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]]"
    assert_one_line(run_cli("--prompt", "hi", "--set", f"model.path={bomb}"), "--set model.path: more than")
    config = tmp_path / "loop.yaml"
    config.write_text("model:\n  path: &a [1, *a]\n")
    assert_one_line(run_cli("--prompt", "hi", "--config", str(config)), "loop.yaml:2: a recursive alias")
    # a few aliases are fine: a config may share a value
    shared = tmp_path / "shared.yaml"
    shared.write_text("generation:\n  max_new_tokens: &n 12\nlookahead:\n  window_size: *n\n")
    cfg = load_config(shared)
    assert cfg.generation.max_new_tokens == cfg.lookahead.window_size == 12


@pytest.mark.parametrize(
    ("where", "digits", "fragment"),
    [
        ("set", 5000, "--set generation.max_new_tokens: a value of 5000 characters, more than any setting holds"),
        ("set", 200, "--set generation.max_new_tokens: an integer of 200 digits, more than any setting takes"),
        ("yaml", 5000, "big.yaml:2: an integer of 5000 digits, more than any setting takes (100)"),
    ],
)
def test_an_integer_of_thousands_of_digits(tmp_path: Path, where: str, digits: int, fragment: str) -> None:
    """Python refuses to parse past 4300 digits, inside PyYAML's constructor: a traceback before this bound."""
    number = "9" * digits
    if where == "set":
        proc = run_cli("--prompt", "hi", "--set", f"generation.max_new_tokens={number}")
    else:
        (tmp_path / "big.yaml").write_text(f"generation:\n  max_new_tokens: {number}\n")
        proc = run_cli("--prompt", "hi", "--config", str(tmp_path / "big.yaml"))
    assert_one_line(proc, fragment)


FIX = ("--config", "configs/fixed-cpu.yaml", "--set", "generation.max_new_tokens=16")


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("0x" + "f" * 4000, "--set generation.seed: an integer of 4817 digits (written in base 16), more than any"),
        ("0x" + "f" * 109, "--set generation.seed: an integer of 132 digits (written in base 16), more than any"),
        ("0b" + "1" * 400, "--set generation.seed: an integer of 121 digits (written in base 2)"),
        ("0" + "7" * 200, "--set generation.seed: an integer of 181 digits (written in base 8)"),
        ("1" + "_0" * 150, "--set generation.seed: an integer of 151 digits, more than any setting takes (100)"),
        ("'" + "9" * 150 + "'", "generation.seed must be an integer of at most 100 digits, got <an integer of 150"),
    ],
    ids=["hex-4000", "hex-109", "binary", "octal", "underscores", "quoted"],
)
def test_an_integer_is_bounded_by_its_size_in_every_notation(value: str, fragment: str) -> None:
    """The bound counted decimal characters: ``0x`` and 4,000 ``f`` passed it, the job ran and streamed, and the
    record's JSON then failed on the 4,817-digit seed with a traceback; 109 hex digits (a 132-digit seed) ran with
    exit 0. The seed has no range of its own, so only the size bound refuses these."""
    assert_one_line(run_cli(*FIX, "--prompt", "hi", "--set", f"generation.seed={value}"), fragment)


def test_the_largest_integer_in_any_notation_is_read() -> None:
    """The bound's edge: 100 digits pass however written (the count for another base is at most one over)."""
    assert load_config(None, ["generation.seed=" + "9" * 100]).generation.seed == 10**100 - 1
    assert load_config(None, ["generation.seed=0x" + "f" * 82]).generation.seed == 16**82 - 1  # 99 digits
    with pytest.raises(ConfigError, match="at most 100 digits"):
        load_config(None, ["generation.seed='" + "9" * 101 + "'"])


@pytest.mark.parametrize("where", ["yaml", "set"])
def test_yaml_nested_ten_thousand_deep_is_one_line(tmp_path: Path, where: str) -> None:
    """``dtype: [[[...]]]`` 10,000 deep ended in a RecursionError traceback of 190 KB (PyYAML's composer recurses per
    level); the node and size bounds do not bound depth."""
    if where == "yaml":
        config = tmp_path / "deep.yaml"
        config.write_text("model:\n  dtype: " + "[" * 10_000 + "]" * 10_000 + "\n")
        proc = run_cli("--prompt", "hi", "--config", str(config))
        fragment = "deep.yaml:2: collections nested more than 64 deep, far more than a config holds"
    else:
        proc = run_cli("--prompt", "hi", "--set", "model.dtype=" + "[" * 2000)  # unclosed: still composed first
        fragment = "--set model.dtype: collections nested more than 64 deep"
    assert_one_line(proc, fragment)
    assert len(proc.stderr) < 1024


def test_a_config_nested_as_deep_as_the_bound_is_read(tmp_path: Path) -> None:
    """Depth 64 is read (and then refused for its type, not its depth); block style nests the same way."""
    with pytest.raises(ConfigError, match="model.dtype must be a string"):
        load_config(None, ["model.dtype=" + "[" * 64 + "]" * 64])
    config = tmp_path / "block.yaml"
    config.write_text("model:\n  dtype:\n" + "".join(" " * (2 * i + 4) + "-\n" for i in range(70)))
    with pytest.raises(ConfigError, match="block.yaml:.*nested more than 64 deep"):
        load_config(config)


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        (["generation.temperature=-1"], "generation.temperature must be >= 0 (read only when sampling, where it must"),
        (["generation.temperature=-0.5", "generation.do_sample=true"], "generation.temperature must be >= 0"),
        (["generation.temperature=0", "generation.do_sample=true"], "generation.temperature must be > 0 when sampling"),
        (["generation.top_p=0"], "generation.top_p must be in (0, 1], got 0.0"),
        (["generation.top_k=-1"], "generation.top_k must be >= 0, got -1"),
    ],
    ids=["negative-greedy", "negative-sampling", "zero-sampling", "top-p", "top-k"],
)
def test_sampling_values_out_of_range_are_refused_under_greedy_too(settings: list[str], fragment: str) -> None:
    """temperature=-1 ran under greedy (where it is not read), while top_p and top_k out of range were refused."""
    args = [arg for setting in settings for arg in ("--set", setting)]
    assert_one_line(run_cli(*FIX, "--prompt", "hi", *args), fragment)


def test_temperature_zero_under_greedy_runs_as_written() -> None:
    """0 is how many users say greedy: not a mistake."""
    assert load_config(None, ["generation.temperature=0"]).generation.temperature == 0.0


def test_a_quoted_integer_string_is_echoed_by_its_size() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"generation.max_new_tokens='{'9' * 4000}'"])
    assert str(info.value).endswith("got <an integer of 4000 digits>"), str(info.value)[:500]


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("a" * 300, "model.path has a file or folder name of 300 bytes, longer than the system takes (255)"),
        ("a" * 100_000, "--set model.path: a value of 100000 characters, more than any setting holds (4096)"),
        ("é/" * 1400, "model.path is a path of 4200 bytes, longer than the system takes (4095)"),
        ("", "model.path is empty: give a model folder"),
        ("  ", "model.path is empty: give a model folder"),
    ],
    ids=["300-name", "100-KB", "4200-path", "empty", "blank"],
)
def test_model_path_too_long_or_empty(value: str, fragment: str) -> None:
    """A name past 255 bytes failed in os.stat with 'File name too long' (a traceback); an empty model.path ran
    the embedded model without a word."""
    assert_one_line(run_cli("--prompt", "hi", "--set", f"model.path={value}"), fragment)


def test_over_long_input_paths_and_keys(tmp_path: Path) -> None:
    long_name = str(tmp_path / ("c" * 300))
    assert_one_line(run_cli("--prompt", "hi", "--config", long_name), "--config has a file or folder name of 300")
    assert_one_line(run_cli("--prompts", long_name), "--prompts has a file or folder name of 300 bytes")
    assert_one_line(run_cli("--prompt", "hi", "--output", long_name), "--output has a file or folder name of 300 bytes")
    assert_one_line(run_cli("--prompt", "hi", "--pool-out", long_name), "pool_out has a file or folder name")
    line = assert_one_line(run_cli("--prompt", "hi", "--set", "k" * 100_000 + "=1"), "unknown config key 'kkk")
    assert "(100000 characters)" in line
    too_big = tmp_path / "huge.yaml"
    too_big.write_text("# padding\n" * 200_000)
    assert_one_line(run_cli("--prompt", "hi", "--config", str(too_big)), "more than a config holds (1048576)")


def test_a_key_set_twice_on_the_command_line_is_refused() -> None:
    """As a key given twice in a YAML file is: the first value would be dropped without a word."""
    proc = run_cli("--prompt", "hi", "--set", "lookahead.window_size=16", "--set", "lookahead.window_size=32")
    assert_one_line(proc, "lookahead.window_size is given twice on the command line (16, then 32); give each key")


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("abc", "'abc'"),
        ("a" * 300, "'" + "a" * QUOTE_CHARS + "...' (300 characters)"),
        (10**5000, "<an integer of 5001 digits>"),
        (12345, "12345"),
        ([[1, 2]] * 100, "[[1, 2], [1, 2], [1, 2], [1, 2], ...]"),
        ({"k": "v" * 100}, "{'k': '" + "v" * QUOTE_CHARS + "...' (100 characters)}"),
        (float("nan"), "nan"),
        ("it's" * 100, '"' + ("it's" * 15) + '..." (400 characters)'),  # repr's own quotes, both ends
    ],
    ids=["short", "long-string", "huge-int", "int", "nested-list", "dict", "nan", "quotes"],
)
def test_quote_shows_a_short_prefix(value: object, shown: str) -> None:
    assert quote(value) == shown


def test_check_path_text_takes_what_the_system_takes() -> None:
    check_path_text("x", "/" + "/".join(["n" * 255] * 15))  # 255-byte names, 3855 bytes in all
    with pytest.raises(ConfigError, match="of 256 bytes"):
        check_path_text("x", "n" * 256)
    with pytest.raises(ConfigError, match="of 258 bytes"):
        check_path_text("x", "é" * 129)  # bytes, not characters


def test_more_threads_than_cores_is_refused_before_loading() -> None:
    """model.threads=1000 on 2 cores ran at 0.54 tokens/s against 23.8, and its calibration did not end."""
    cores = len(os.sched_getaffinity(0))
    proc = run_cli("--prompt", "hi", "--set", f"model.threads={cores + 1}")
    assert_one_line(proc, f"model.threads={cores + 1} is more than the {cores} cores this process may run on")


@pytest.mark.parametrize(
    ("threads", "ranks", "cores", "outcome"),
    [
        (0, 4, 2, None),  # each rank's share: always fine
        (2, 1, 2, None),
        (1, 2, 2, None),
        (3, 1, 2, "error"),
        (3, None, 2, "error"),  # under a launcher too
        (2, 2, 2, "model.threads=2 x 2 ranks is 4 threads on 2 cores: they take turns"),
        (2, None, 2, None),  # a launcher's rank: the warning belongs to whoever started the ranks
    ],
)
def test_check_threads(threads: int, ranks: int | None, cores: int, outcome: str | None) -> None:
    from lp_runner.cli.preflight import check_threads

    if outcome == "error":
        with pytest.raises(ConfigError, match=f"model.threads={threads} is more than the {cores} cores"):
            check_threads(threads, ranks, cores)
        return
    warning = check_threads(threads, ranks, cores)
    assert warning == outcome if outcome is None else warning.startswith(outcome)


def test_an_error_line_goes_to_the_launchers_error_file(tmp_path: Path) -> None:
    """torchrun gives each rank TORCHELASTIC_ERROR_FILE; the rank's line goes there, in torch's own format."""
    error_file = tmp_path / "error.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHELASTIC_ERROR_FILE": str(error_file)}
    proc = subprocess.run(
        [sys.executable, "-m", "lp_runner", "--prompt", "hi", "--set", "lookahead.ngram_size=2"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )  # fmt: skip
    line = assert_one_line(proc, "lookahead.ngram_size (N) must be >= 3")
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == message["extraInfo"]["py_callstack"] == line


@pytest.mark.slow
def test_a_bad_prompt_under_torchrun_is_named_in_its_report(tmp_path: Path) -> None:
    """Every rank finds the empty prompt and exits 2 with its line. torchrun itself ends any job with a failed rank
    in its ChildFailedError traceback and exit 1, whatever the ranks' codes (launcher/api.py raises it for any
    non-zero exit): its report's Root Cause then shows the rank's line and exit code 2, not a link to the docs."""
    from dist_helpers import env_with_repo, torchrun_cmd

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": ""}) + "\n")
    command = torchrun_cmd(2, "--prompts", str(prompts), "--set", "model.threads=1")
    proc = subprocess.run(command, capture_output=True, text=True, env=env_with_repo(), timeout=300)
    assert proc.returncode == 1, proc.stderr  # torchrun's own code for any failed rank
    ranks = re.findall(r"^error: \[rank (\d)\] prompt 'a' \(\S*p\.jsonl:1\): empty prompt", proc.stderr, re.M)
    assert ranks and set(ranks) <= {"0", "1"}, proc.stderr
    root = proc.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert re.search(r"exitcode\s*: 2 ", root), root
    assert re.search(r"traceback : error: prompt 'a' \(\S*p\.jsonl:1\): empty prompt: at least one token", root), root


@pytest.mark.slow
def test_a_half_precision_run_says_what_its_output_is_exact_to(tiny_dir: Path) -> None:
    """model.dtype=bfloat16 on a CPU printed only "bfloat16 (as set)" in the summary, although its outputs can differ
    from float32 greedy at near-ties (4 of 6 prompts did on the embedded model): the run says so once, at start-up."""
    args = ["--prompt", "def f(x):", "--set", f"model.path={tiny_dir}", "--set", "model.threads=1"]
    args += [
        "--set",
        "generation.max_new_tokens=4",
        "--set",
        "lookahead.preset=off",
        "--set",
        "advanced.pad_rows=false",
    ]
    half = run_cli(*args, "--set", "model.dtype=bfloat16")
    assert half.returncode == 0, half.stderr
    caveats = [ln for ln in half.stderr.splitlines() if "may differ from float32 greedy" in ln]
    assert caveats == [
        "model.dtype bfloat16 (as set): outputs may differ from float32 greedy decoding where the top two tokens "
        "nearly tie in bfloat16 (docs/design.md 3.3); float32 on a CPU is token-identical"
    ], half.stderr
    full = run_cli(*args)
    assert full.returncode == 0 and "may differ" not in full.stderr, full.stderr


def test_a_long_prompt_id_is_quoted_by_its_start(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "x" * 100_000, "prompt": ""}) + "\n")
    line = assert_one_line(run_cli("--prompts", str(prompts)), "(100000 characters) (")
    assert line.endswith("p.jsonl:1): empty prompt: at least one token is needed"), line


@pytest.mark.slow
def test_a_prompt_far_too_long_is_refused_before_it_is_tokenized(embedded, tmp_path: Path) -> None:
    """A 50 MB line was tokenized whole before the context check refused it (7.6 GB peak, 40 s). By its characters
    it cannot fit (the embedded model's longest token is 81 characters, its context 8192), so it is refused before
    the tokenizer sees it, under either ``run.on_error``: the line names the prompt and its characters, and the
    process grows no more than a run of a short prompt does (tokenizing this 10 MB line alone added 1.3 GB)."""
    prompts, short = tmp_path / "p.jsonl", tmp_path / "short.jsonl"
    first = json.dumps({"id": "a", "prompt": "hi"}) + "\n"
    prompts.write_text(first + json.dumps({"id": "b", "prompt": "word " * 2_000_000}) + "\n")
    short.write_text(first)
    why = "prompt of 10000000 characters, at least 30865 tokens (no token of this tokenizer spans more than 81), "
    why += "which with max_new_tokens=16 exceeds the model's context of 8192 positions"
    peaks = {}
    for on_error, file in (("stop", prompts), ("skip", prompts), ("baseline", short)):
        out = tmp_path / f"{on_error}.jsonl"
        args = [*FIX, "--set", "model.threads=1", "--set", f"run.on_error={'skip' if on_error == 'skip' else 'stop'}"]
        proc = run_cli(*args, "--prompts", str(file), "--output", str(out), peak_file=tmp_path / "peak")
        peaks[on_error] = int((tmp_path / "peak").read_text())
        if on_error == "stop":
            assert_one_line(proc, f"error: prompt 'b' ({prompts}:2): {why}")
            continue
        assert proc.returncode == 0, proc.stderr[-2000:]
        records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
        assert records["a"]["new_tokens"] > 0, records
        if on_error == "skip":
            assert records["b"]["error"] == f"prompt 'b' ({prompts}:2): {why}", records["b"]
    # the prompts file itself is read whole (10 MB as bytes, text and JSON): far less than its tokens
    assert max(peaks["stop"], peaks["skip"]) < peaks["baseline"] + 200 * 1024, peaks


def test_the_character_bound_refuses_only_what_cannot_fit() -> None:
    """On the embedded tokenizer (longest entry 81 characters): a prompt at the bound is left to the tokenizer, one
    character past it is refused; a chat counts its messages' characters."""
    from transformers import AutoTokenizer

    from lp_runner.jobs.prompts import PromptSpec, too_long_to_tokenize
    from lp_runner.models.loading import fetch_embedded_model

    tokenizer = AutoTokenizer.from_pretrained(fetch_embedded_model())
    room = 100 - 10  # a context of 100 positions, 10 new tokens
    at_bound = room * 81 * 4
    assert too_long_to_tokenize(PromptSpec("a", prompt="x" * at_bound), tokenizer, 10, 100) is None
    past = too_long_to_tokenize(PromptSpec("a", prompt="x" * (at_bound + 1)), tokenizer, 10, 100)
    assert past == (
        f"prompt of {at_bound + 1} characters, at least 91 tokens (no token of this tokenizer spans more than 81), "
        "which with max_new_tokens=10 exceeds the model's context of 100 positions"
    )
    chat = tuple({"role": "user", "content": "x" * (at_bound // 2 + 1)} for _ in range(2))
    assert too_long_to_tokenize(PromptSpec("a", messages=chat), tokenizer, 10, 100) is not None
    assert len(tokenizer("x" * at_bound)["input_ids"]) > room  # the text the bound lets through is still refused

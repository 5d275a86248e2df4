"""Configuration loading and the command line, run for real (``python -m lp_runner`` in a subprocess).

User errors must end the process with exit code 2 and a single ``error: ...`` line on stderr, never a traceback.
The end-to-end CLI runs (marked slow) use the embedded model and check every output field, the tokens against HF
greedy, the summary and the streamed text.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_helpers import REPO
from helpers import hf_greedy

import lp_runner
from lp_runner.config import Config, load_config, parse_override
from lp_runner.errors import ConfigError

REPO_ROOT = REPO

# ---------------------------------------------------------------------------------------------------------
# load_config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["lookahead.ngram_size=2"], "lookahead.ngram_size (N) must be >= 3, got 2"),
        (["lookahead.window_size=0"], "lookahead.window_size (W) must be >= 1, got 0"),
        (["lookahead.verification_set_size=-1"], "lookahead.verification_set_size (G) must be >= 0, got -1"),
        (
            ["lookahead.windw_size=3"],
            "unknown config key 'lookahead.windw_size' (did you mean 'lookahead.window_size'?)",
        ),
        (["lookahead.window_size=abc"], "lookahead.window_size must be an integer, got 'abc'"),
        (["lookahead.window_size=1.5"], "lookahead.window_size must be an integer, got 1.5"),
        (["lookahead.window_size=true"], "lookahead.window_size must be an integer, got True"),
        (["advanced.pool_from_prompt=maybe"], "advanced.pool_from_prompt must be true or false, got 'maybe'"),
        (["generation.temperature=warm"], "generation.temperature must be a number, got 'warm'"),
        (["model.path=[1, 2]"], "model.path must be a string, got [1, 2]"),
        (["nosection.key=1"], "unknown config key 'nosection.key'"),
        (["lookahead=3"], "unknown config key 'lookahead'"),
        (["lookahead.window_size"], "--set expects section.key=value, got 'lookahead.window_size'"),
        (["generation.max_new_tokens=0"], "generation.max_new_tokens must be >= 1, got 0"),
        (
            ["advanced.context_min_ngram=4"],
            "advanced.context_min_ngram must be between 1 and context_max_ngram=3, got 4",
        ),
        (
            ["advanced.long_match_ngram=4"],
            "advanced.long_match_ngram must be between 0 (off) and context_max_ngram=3, got 4",
        ),
        (["advanced.long_match_rows=-1"], "advanced.long_match_rows must be >= 0 (0: no cap), got -1"),
        (["generation.top_p=0"], "generation.top_p must be in (0, 1], got 0.0"),
        (["model.dtype=float64"], "model.dtype must be one of auto, float32, bfloat16, float16, got 'float64'"),
        (["model.device=tpu"], "model.device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
        (["model.device=cuda:x"], "model.device must be auto, cpu, cuda or cuda:N, got 'cuda:x'"),
        (["run.on_error=ignore"], "run.on_error must be one of stop, skip, got 'ignore'"),
        # upper bounds: what no run can use (docs/design.md 9.6)
        (["lookahead.window_size=100000"], "lookahead.window_size (W) must be <= 1024 (a round's rows grow with it"),
        (["lookahead.ngram_size=65"], "lookahead.ngram_size (N) must be <= 64 (a round's rows grow with it"),
        (["lookahead.verification_set_size=5000"], "lookahead.verification_set_size (G) must be <= 1024"),
        (["advanced.max_verify_rows=5000"], "advanced.max_verify_rows must be <= 4096, got 5000"),
        (["advanced.pool_max_tokens=1000000000"], "advanced.pool_max_tokens must be <= 100000000 (about 82 bytes"),
        (["generation.max_new_tokens=2000000"], "generation.max_new_tokens must be <= 1000000 (and less than the"),
        (["parallel.workers=2000"], "parallel.workers must be <= 1024 (and what this machine holds"),
        (["parallel.timeout_s=1e30"], "parallel.timeout_s must be <= 604800 (a week: a longer wait is a hang), got"),
        (["parallel.timeout_s=.nan"], "parallel.timeout_s must be a finite number, got nan"),
        (["generation.temperature=.inf"], "generation.temperature must be a finite number, got inf"),
        (["advanced.gpus_per_worker=100"], "advanced.gpus_per_worker must be -1 (auto) or 0 to 64, got 100.0"),
        (["model.threads=5000"], "model.threads must be <= 1024, got 5000"),
    ],
)
def test_override_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "positions", "message"),
    [
        # W=1024 N=5: 1 + 1023 + 1024 x 3 + 7 x 10 rows, whatever the model
        (["lookahead.window_size=1024"], None, "computes up to 4166 rows (the live token, W-1 + W x (N-2) window"),
        (["lookahead.window_size=1024", "advanced.lookahead_branch=false"], 200, None),  # no window: 71 rows
        ([], 64, "computes up to 98 rows (the live token, W-1 + W x (N-2) window rows, G x the longest proposal), "
         "more than the model's context of 64 positions"),
        (["generation.max_new_tokens=16"], 98, None),  # the round fits exactly
        (["generation.max_new_tokens=4096"], 4096, "generation.max_new_tokens=4096 leaves no room for a prompt in "
         "the model's context of 4096 positions (at most 4095)"),
        (["generation.max_new_tokens=4095"], 4096, None),
    ],
)  # fmt: skip
def test_setting_against_the_models_context(overrides, positions, message) -> None:
    """The rows a round of the setting computes, against MAX_ROUND_ROWS and the model's context; max_new_tokens
    against the context (a prompt needs a position). Made before launching (config.json) and after loading."""
    from lp_runner.decoding.layout import check_model_fits

    cfg = load_config(None, overrides)
    if message is None:
        check_model_fits(cfg.lookahead, cfg.generation, positions)
        return
    with pytest.raises(ConfigError) as info:
        check_model_fits(cfg.lookahead, cfg.generation, positions)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_override_types() -> None:
    cfg = load_config(
        None,
        [
            "lookahead.window_size=15",
            "advanced.pool_from_prompt=false",
            "generation.temperature=0.7",
            "generation.top_p=1",  # an int literal for a float field
            "model.path=/some/folder",
            "advanced.cache_dir=",  # empty value: the empty string
            "advanced.stream=off",  # YAML 1.1 style booleans are accepted
            "lookahead.ngram_size= 4",  # whitespace around the value
        ],
    )
    assert cfg.lookahead.window_size == 15 and type(cfg.lookahead.window_size) is int
    assert cfg.lookahead.pool_from_prompt is False
    assert cfg.generation.temperature == 0.7
    assert cfg.generation.top_p == 1.0 and type(cfg.generation.top_p) is float
    assert cfg.model.path == "/some/folder"
    assert cfg.model.cache_dir == ""
    assert cfg.run.stream is False
    assert cfg.lookahead.ngram_size == 4
    assert parse_override("model.path=123") == ("model.path", 123)
    assert load_config(None, ["model.path=123"]).model.path == "123"  # numbers become strings for str fields
    # an on | off | auto choice survives YAML 1.1 reading a bare on / off as a boolean, in --set and in files
    assert load_config(None, ["model.compile=on"]).model.compile == "on"
    assert load_config(None, ["model.compile=off"]).model.compile == "off"
    assert load_config(None, []).model.compile == "auto"
    with pytest.raises(ConfigError, match="model.compile"):
        load_config(None, ["model.compile=fast"])


def test_defaults_and_later_override_wins(tmp_path: Path) -> None:
    assert load_config().lookahead.window_size == Config().lookahead.window_size == 7
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("lookahead:\n  window_size: 9\n  ngram_size: 4\n")
    cfg = load_config(cfg_file, ["lookahead.window_size=12"])
    assert (cfg.lookahead.window_size, cfg.lookahead.ngram_size) == (12, 4)  # file, then the override
    with pytest.raises(ConfigError, match="lookahead.window_size is given twice on the command line"):
        load_config(cfg_file, ["lookahead.window_size=11", "lookahead.window_size=12"])  # as a YAML key given twice


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lookahed:\n  window_size: 3\n", "unknown config key 'lookahed'"),
        ("lookahead:\n  ngram_size: 2\n", "lookahead.ngram_size (N) must be >= 3, got 2"),
        ("lookahead:\n  widow_size: 3\n", "unknown config key 'lookahead.widow_size' (did you mean"),
        ("lookahead: 3\n", "config section 'lookahead' must be a mapping"),
        ("- 1\n- 2\n", "must hold a mapping of sections"),
        ("lookahead: {window_size: [\n", "is not valid YAML"),
        # a key given twice: PyYAML alone keeps the last one silently
        ("model:\n  path: a\nrun:\n  stream: true\nmodel:\n  threads: 1\n", ":5: duplicate key 'model' (first given"),
        ("lookahead:\n  window_size: 3\n  window_size: 4\n", ":3: duplicate key 'window_size' (first given at line 2"),
        ("lookahead: {window_size: 3, window_size: 4}\n", ":1: duplicate key 'window_size' (first given at line 1)"),
    ],
)
def test_config_file_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(missing)


def test_empty_config_file_means_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == Config()


# ---------------------------------------------------------------------------------------------------------
# The command line


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lp_runner", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=REPO_ROOT,
    )


def assert_user_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr  # one line, nothing else on stderr
    assert lines[0].startswith("error: "), lines[0]
    assert fragment in lines[0], lines[0]
    assert proc.stdout == ""


@pytest.fixture
def prompts_file(tmp_path: Path):
    def write(*lines: str) -> Path:
        path = tmp_path / "prompts.jsonl"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    return write


def test_cli_rejects_n2() -> None:
    assert_user_error(run_cli("--prompt", "hi", "--set", "lookahead.ngram_size=2"), "ngram_size (N) must be >= 3")


def test_cli_unknown_key() -> None:
    assert_user_error(
        run_cli("--prompt", "hi", "--set", "lookahead.window=3"),
        "unknown config key 'lookahead.window' (did you mean 'lookahead.window_size'?)",
    )


def test_cli_missing_config_file(tmp_path: Path) -> None:
    assert_user_error(run_cli("--prompt", "hi", "--config", str(tmp_path / "x.yaml")), "config file not found")


def test_cli_config_path_is_a_folder_or_not_utf8(tmp_path: Path) -> None:
    assert_user_error(run_cli("--prompt", "hi", "--config", str(tmp_path)), f"config path {tmp_path} is a folder")
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"model:\n  path: caf\xe9\n")
    assert_user_error(run_cli("--prompt", "hi", "--config", str(bad)), f"config file {bad} is not UTF-8 text")


@pytest.mark.parametrize(
    "first_line",
    [
        "Dear diary, Bob says the vault's password is: hunter2",
        '{"architectures": ["LlamaForCausalLM"], "hidden_size": 576}',  # a model's config.json
        "SECRET_KEY: abc123",
    ],
    ids=["notes", "hf-config", "env"],
)
def test_cli_config_that_is_another_kind_of_file_is_not_echoed(tmp_path: Path, first_line: str) -> None:
    """A config path that is a symlink to another kind of file echoed that file's first line back ("unknown config
    key 'Dear diary, ...'"): it is named as a file that is not a config, by its path and its link's target."""
    other = tmp_path / "other.txt"
    other.write_text(first_line + "\n")
    link = tmp_path / "run.yaml"
    link.symlink_to(other)
    proc = run_cli("--prompt", "hi", "--config", str(link))
    assert_user_error(proc, f"config file {link} (a link to {other}) is not an lp_runner config: it has none of")
    assert first_line.split(":")[0] not in proc.stderr, proc.stderr
    (tmp_path / "typo.yaml").write_text("generaton:\n  seed: 1\n")  # a config's misspelled section is still named
    proc = run_cli("--prompt", "hi", "--config", str(tmp_path / "typo.yaml"))
    assert_user_error(proc, "unknown config key 'generaton' (did you mean 'generation")


def test_cli_device_is_checked_before_loading() -> None:
    proc = run_cli("--prompt", "hi", "--set", "model.device=tpu")
    assert_user_error(proc, "model.device must be auto, cpu, cuda or cuda:N, got 'tpu'")


def test_cli_output_path_errors(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    proc = run_cli("--prompt", "hi", "--output", str(afile / "sub" / "o.jsonl"))
    assert_user_error(proc, f"cannot write output file {afile / 'sub' / 'o.jsonl'}: {afile} is a file, not a folder")
    assert_user_error(run_cli("--prompt", "hi", "--output", str(tmp_path)), f"output file {tmp_path} is a folder")
    assert_user_error(run_cli("--prompt", "hi", "--resume"), "--resume needs --output FILE")
    assert afile.read_text() == "x"


def test_cli_output_that_is_an_input_is_refused(tmp_path: Path) -> None:
    """--output naming the prompts file, the config file or a pool file (even through another path to it) is
    refused before anything is written: with --overwrite the records would replace the prompts."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    config = tmp_path / "c.yaml"
    config.write_text("generation:\n  max_new_tokens: 4\n")
    (tmp_path / "link.jsonl").hardlink_to(prompts)
    base = ["--prompts", str(prompts), "--config", str(config), "--overwrite"]
    same = "same file as"
    assert_user_error(run_cli(*base, "--output", str(prompts)), f"--output {prompts} is the {same} --prompts {prompts}")
    assert_user_error(run_cli(*base, "--output", str(tmp_path / "link.jsonl")), f"{same} --prompts {prompts}")
    assert_user_error(run_cli(*base, "--output", str(tmp_path / "." / "c.yaml")), f"{same} --config {config}")
    pool = tmp_path / "pool.json"
    assert_user_error(run_cli(*base, "--output", str(pool), "--pool-out", str(pool)), f"{same} --pool-out {pool}")
    assert_user_error(run_cli(*base, "--output", str(pool), "--pool-in", str(pool)), f"{same} --pool-in {pool}")
    assert prompts.read_text() == '{"id": "a", "prompt": "hi"}\n'
    assert config.read_text() == "generation:\n  max_new_tokens: 4\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "link.jsonl", "p.jsonl"]


def test_cli_needs_a_prompt() -> None:
    assert_user_error(run_cli(), "give --prompt TEXT or --prompts FILE.jsonl")


def test_cli_unreadable_prompts_file(tmp_path: Path) -> None:
    assert_user_error(run_cli("--prompts", str(tmp_path / "missing.jsonl")), "cannot read prompts file")
    assert_user_error(run_cli("--prompts", str(tmp_path)), "cannot read prompts file")  # a directory


def test_cli_invalid_jsonl_line(prompts_file) -> None:
    path = prompts_file('{"id": "a", "prompt": "x"}', '{"id": "b", "prompt": ')
    assert_user_error(run_cli("--prompts", str(path)), f"{path}:2: invalid JSON")


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ('{"prompt": "x"}', "missing 'id'"),
        ('{"id": 1, "prompt": "x", "messages": []}', "needs exactly one of 'prompt' or 'messages'"),
        ('{"id": 1, "messages": [{"role": "user"}]}', "'messages' must be a list of"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_cli_invalid_prompt_objects(prompts_file, line: str, fragment: str) -> None:
    assert_user_error(run_cli("--prompts", str(prompts_file(line))), fragment)


def test_cli_duplicate_ids(prompts_file) -> None:
    path = prompts_file('{"id": "a", "prompt": "x"}', '{"id": "b", "prompt": "x"}', '{"id": "a", "prompt": "y"}')
    assert_user_error(run_cli("--prompts", str(path)), f"{path}:3: duplicate id 'a' (first on line 1)")


def test_cli_non_utf8_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "caf\xe9"}\n')
    assert_user_error(run_cli("--prompts", str(path)), f"{path}:2: not UTF-8 text")


def test_cli_empty_prompt_is_named_before_loading(prompts_file) -> None:
    path = prompts_file('{"id": "a", "prompt": "x"}', '{"id": "e", "messages": []}')
    proc = run_cli("--prompts", str(path), "--set", "model.path=/nonexistent")  # the prompt is checked first
    assert_user_error(proc, f"prompt 'e' ({path}:2): empty prompt")


def test_cli_missing_model() -> None:
    assert_user_error(run_cli("--prompt", "hi", "--set", "model.path=/nonexistent"), "model path not found")


def test_cli_hub_like_id_is_refused() -> None:
    proc = run_cli("--prompt", "hi", "--set", "model.path=HuggingFaceTB/SmolLM2-135M-Instruct")
    assert_user_error(proc, "lp_runner never downloads")


# ---------------------------------------------------------------------------------------------------------
# End-to-end on the embedded model


@pytest.mark.slow
def test_cli_prompt_beyond_context(embedded) -> None:
    # the embedded model has 8192 positions; checked as soon as the tokenizer is loaded: before the start-up
    # calibration (forced here with --recalibrate), whose progress line would come before the error
    proc = run_cli("--prompt", "def f(x):", "--set", "generation.max_new_tokens=8190", "--recalibrate")
    assert_user_error(proc, "exceeds the model's context of 8192 positions")


RECORD_FIELDS = {
    "id",
    "prompt_ids",
    "output_ids",
    "text",
    "new_tokens",
    "forwards",
    "seconds",
    "model",
    "window_size",
    "ngram_size",
    "verification_set_size",
    "pool_from_prompt",
}


@pytest.mark.slow
def test_cli_prompts_file_end_to_end(embedded, prompts_file, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = prompts_file(
        json.dumps({"id": "code", "prompt": "def fibonacci(n):\n    "}),
        json.dumps({"id": "chat", "messages": [{"role": "user", "content": "List three primary colors."}]}),
    )
    out = tmp_path / "out" / "records.jsonl"  # the parent folder does not exist yet
    proc = run_cli(
        "--prompts",
        str(path),
        "--output",
        str(out),
        "--set",
        "generation.max_new_tokens=32",
        "--set",
        "lookahead.window_size=5",
        "--set",
        "lookahead.ngram_size=4",
        "--set",
        "lookahead.verification_set_size=5",
        "--set",
        "model.threads=1",  # one intra-op thread: far faster than two on a machine whose cores are busy
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert re.search(r"lp_runner  .*N=4 G=5 .* workers=1\n", proc.stderr)  # the summary (the setting that ran)
    assert "tokens/forward" in proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # written as they finish; one at a time they start in the queue order, the longest prompt first (the chat
    # template's tokens make "chat" the longer one)
    assert [r["id"] for r in records] == ["chat", "code"]
    assert len(records[0]["prompt_ids"]) > len(records[1]["prompt_ids"])

    # the records name a model folder that from_pretrained loads as it is
    model = AutoModelForCausalLM.from_pretrained(records[0]["model"], dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    _, tokenizer = embedded
    for rec in records:
        assert rec.keys() >= RECORD_FIELDS, RECORD_FIELDS - rec.keys()
        assert (rec["window_size"], rec["ngram_size"], rec["verification_set_size"]) == (5, 4, 5)
        assert rec["pool_from_prompt"] is True
        assert rec["new_tokens"] == len(rec["output_ids"]) > 0
        assert 1 <= rec["forwards"] <= rec["new_tokens"]
        assert rec["seconds"] > 0
        assert rec["text"] == tokenizer.decode(rec["output_ids"], skip_special_tokens=True)
        assert rec["output_ids"] == hf_greedy(model, rec["prompt_ids"], 32, eos_ids), rec["id"]
    # the chat prompt went through the chat template (it starts with the template's first special token)
    chat_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "List three primary colors."}], add_generation_prompt=True, tokenize=True
    )
    if hasattr(chat_ids, "input_ids"):
        chat_ids = chat_ids["input_ids"]
    assert records[0]["prompt_ids"] == list(chat_ids)
    assert records[1]["prompt_ids"] == tokenizer("def fibonacci(n):\n    ")["input_ids"]


@pytest.mark.slow
def test_cli_single_prompt_streams_the_text(embedded, tmp_path: Path) -> None:
    out = tmp_path / "one.jsonl"
    proc = run_cli(
        "--prompt",
        "def add(a, b):",
        "--output",
        str(out),
        "--set",
        "generation.max_new_tokens=24",
        "--set",
        "model.threads=1",
    )
    assert proc.returncode == 0, proc.stderr
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["id"] == "prompt"
    _, tokenizer = embedded
    text = tokenizer.decode(rec["output_ids"], skip_special_tokens=True)
    assert rec["text"] == text
    assert proc.stdout == text + "\n"  # streamed chunk by chunk, then one newline
    assert len(text) > 0


# ---------------------------------------------------------------------------------------------------------
# Records carry what re-running them takes


def _record_and_config(embedded, tmp_path: Path) -> tuple[dict, Config]:
    """One record made as the runner makes it (embedded model, 4 tokens), written and read back through the
    output file; the config came from a YAML file plus --set, so defaults, file keys and overrides all show."""
    import transformers

    from lp_runner.backends.adapter import ModelAdapter
    from lp_runner.jobs.output import OutputFile
    from lp_runner.jobs.prompts import PromptSpec
    from lp_runner.jobs.worker import Worker, run_prompts
    from lp_runner.parallel.comm import SoloCommunicator

    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("lookahead:\n  window_size: 5\ngeneration:\n  max_new_tokens: 4\n")
    cfg = load_config(yaml_file, ["lookahead.preset=off", "model.threads=1"])
    model, tokenizer = embedded
    worker = Worker(cfg, SoloCommunicator(), ModelAdapter(model), tokenizer, Path("embedded"), torch.device("cpu"), 0.0)
    out = OutputFile.open(tmp_path / "o.jsonl", "new", cfg)
    try:
        prompts = worker.prepare([PromptSpec(id="a", prompt="def f(x):", where="test")])
        (made,) = run_prompts(worker, prompts, on_record=out.write)
    finally:
        out.close(complete=True)
    (rec,) = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert rec == json.loads(json.dumps(made)) and rec["new_tokens"] == 4  # it ran (4 tokens), written as made
    assert rec["run"]["versions"] == {
        "lp_runner": lp_runner.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }
    return rec, cfg


def test_record_carries_the_whole_config_versions_and_device(embedded, tmp_path: Path) -> None:
    from lp_runner.config import config_from_dict
    from lp_runner.models.loading import weights_checksum
    from lp_runner.tuning.calibrate import device_name

    rec, cfg = _record_and_config(embedded, tmp_path)
    run = rec["run"]
    assert set(run) == {"config", "versions", "device"}
    # every section, not only the token-deciding ones in rec["config"]
    assert set(run["config"]) == {"model", "lookahead", "generation", "parallel", "run", "explicit"}
    assert config_from_dict(run["config"]) == cfg  # rebuilt exactly, explicit keys included
    assert run["config"]["explicit"] == [
        "generation.max_new_tokens",
        "lookahead.preset",
        "lookahead.window_size",
        "model.threads",
    ]
    # a YAML of the explicit keys gives the same Config through --config (the others are this version's defaults)
    again = tmp_path / "again.yaml"
    sections: dict[str, dict] = {}
    for key in run["config"]["explicit"]:
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = run["config"][section][name]
    again.write_text(json.dumps(sections))  # JSON is YAML
    assert load_config(again) == cfg
    assert run["device"] == {
        "type": "cpu",
        "name": device_name(torch.device("cpu")),
        "threads": torch.get_num_threads(),
    }
    assert run["device"]["name"]  # a CPU model name, not empty
    assert rec["weights_checksum"] == weights_checksum(embedded[0])


def test_resume_checks_settings_not_the_run_field(embedded, tmp_path: Path) -> None:
    """The ``run`` field describes a run; ``--resume`` still compares only what decides the tokens: a resume on
    other threads or workers keeps the file, one with another window is refused."""
    from lp_runner.config import config_from_dict
    from lp_runner.errors import InputError
    from lp_runner.jobs.output import OutputFile

    rec, _ = _record_and_config(embedded, tmp_path)
    path = tmp_path / "o.jsonl"
    other_run = config_from_dict(rec["run"]["config"])
    other_run.model.threads, other_run.parallel.workers = 2, 2
    sink = OutputFile.open(path, "resume", other_run)
    try:
        assert sink.done == {"a"}
    finally:
        sink.close(complete=True)
    other_window = config_from_dict(rec["run"]["config"])
    other_window.lookahead.window_size = 7
    with pytest.raises(InputError, match="lookahead.window_size: 5 in the file, 7 now"):
        OutputFile.open(path, "resume", other_window)


# ---------------------------------------------------------------------------------------------------------
# Commands, --version, --log-level


def test_cli_version() -> None:
    for args in (["--version"], ["run", "--version"]):
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == f"lp_runner {lp_runner.__version__}\n"  # a result: stdout, nothing on stderr
        assert proc.stderr == ""
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", lp_runner.__version__)  # pyproject's version, as installed


@pytest.mark.parametrize(
    ("argv", "command", "rest"),
    [
        (["--config", "c.yaml"], "run", ["--config", "c.yaml"]),  # no command: run, as before commands existed
        (["run", "--config", "c.yaml"], "run", ["--config", "c.yaml"]),
        (["tune", "--prompts", "p"], "tune", ["--prompts", "p"]),
        (["fetch", "--force"], "fetch", ["--force"]),
        (["--log-level", "DEBUG", "tune", "-h"], "tune", ["--log-level", "DEBUG", "-h"]),  # global option first
        (["--log-level=ERROR", "fetch"], "fetch", ["--log-level=ERROR"]),
        (["--prompt", "run"], "run", ["--prompt", "run"]),  # a prompt that is a command word stays a prompt
        ([], "run", []),
    ],
)
def test_split_command(argv: list[str], command: str, rest: list[str]) -> None:
    from lp_runner.cli.main import split_command

    assert split_command(argv) == (command, rest)


def test_self_launch_passes_the_run_arguments_through() -> None:
    """parallel.workers=P starts each rank with the same arguments, the command word written out; each rank
    parses them back to the same run arguments (--log-level included)."""
    from lp_runner.cli.launch import rank_command
    from lp_runner.cli.main import build_parser, split_command

    argv = ["--log-level", "WARNING", "--prompt", "hi", "--set", "parallel.workers=2"]
    cmd = rank_command(argv)
    assert cmd[1:] == ["-m", "lp_runner", "run", *argv]
    command, rest = split_command(cmd[cmd.index("lp_runner") + 1 :])  # what each rank's main sees
    assert (command, rest) == ("run", argv)
    args = build_parser().parse_args(rest)
    assert (args.log_level, args.prompt, args.overrides) == ("WARNING", "hi", ["parallel.workers=2"])


def test_cli_commands_dispatch() -> None:
    fetch = run_cli("fetch", "--help")
    assert fetch.returncode == 0 and fetch.stdout.startswith("usage: python -m lp_runner fetch "), fetch.stdout
    tune = run_cli("--log-level", "DEBUG", "tune", "--help")
    assert tune.returncode == 0 and tune.stdout.startswith("usage: python -m lp_runner tune "), tune.stdout
    explicit, implicit = run_cli("run", "--help"), run_cli("--help")
    assert explicit.returncode == implicit.returncode == 0
    assert explicit.stdout == implicit.stdout and "--log-level" in explicit.stdout and "fetch" in explicit.stdout
    # the same user error through run, explicit or not
    assert_user_error(run_cli("run", "--prompt", "hi", "--set", "lookahead.ngram_size=2"), "ngram_size (N) must be")
    assert_user_error(run_cli("--prompt", "hi", "--set", "lookahead.ngram_size=2"), "ngram_size (N) must be")
    # errors are never silenced: ERROR is the highest level there is
    quiet = run_cli("--log-level", "ERROR", "--prompt", "hi", "--set", "lookahead.ngram_size=2")
    assert_user_error(quiet, "ngram_size (N) must be")
    bad = run_cli("--log-level", "LOUD", "--prompt", "hi")
    assert bad.returncode == 2 and "argument --log-level: invalid choice: 'LOUD'" in bad.stderr


def test_fetch_command_prints_the_path_and_logs_to_stderr(embedded) -> None:
    """The model is cached (the embedded fixture fetched it): stdout is the folder alone; the progress line goes
    to stderr at INFO and is gone at WARNING."""
    from lp_runner.models.loading import embedded_model_dir

    folder = str(embedded_model_dir())
    info = run_cli("fetch")
    assert info.returncode == 0, info.stderr
    assert info.stdout == folder + "\n"
    assert info.stderr == f"embedded model ready at {folder}\n"
    quiet = run_cli("fetch", "--log-level", "WARNING")
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, folder + "\n", "")


def test_log_lines_keep_the_cli_form(capsys, monkeypatch) -> None:
    from lp_runner.logs import log, setup_logging

    try:
        setup_logging("WARNING")
        log.info("hidden")
        log.warning("low on memory")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "1")
        log.error("peer lost")
        setup_logging("debug")  # again: replaces the handler, no line printed twice
        log.info("a progress line")  # INFO comes from the writing rank only: no prefix
        log.debug("detail")
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.splitlines() == [
            "warning: low on memory",
            "error: [rank 1] peer lost",
            "a progress line",
            "debug: [rank 1] detail",
        ]
    finally:
        setup_logging()


@pytest.mark.slow
def test_cli_log_level_keeps_stdout_for_the_text(embedded) -> None:
    """stdout carries the streamed text and nothing else at every level; --log-level WARNING empties stderr of
    the summary (INFO) on a run that has nothing to warn about."""
    args = ["--prompt", "def add(a, b):", "--set", "generation.max_new_tokens=6", "--set", "model.threads=1"]
    args += ["--set", "lookahead.preset=off"]  # no start-up calibration: a quick run
    loud, quiet = run_cli("run", *args), run_cli(*args, "--log-level", "WARNING")
    assert loud.returncode == quiet.returncode == 0, (loud.stderr, quiet.stderr)
    model, tokenizer = embedded
    eos = model.generation_config.eos_token_id
    ids = tokenizer("def add(a, b):")["input_ids"]
    new = hf_greedy(model, ids, 6, [eos] if isinstance(eos, int) else list(eos or []))
    text = tokenizer.decode(new, skip_special_tokens=True)
    assert loud.stdout == quiet.stdout == text + "\n"
    assert "tokens/forward" in loud.stderr  # the summary, at INFO
    assert quiet.stderr == ""


# ---------------------------------------------------------------- user knobs and the advanced section


def test_the_config_has_few_user_knobs_and_every_other_field_is_advanced() -> None:
    """Every field is written exactly one way: ``section.name`` for the user knobs (at most 25), ``advanced.name``
    for the internals the preset and the tuner turn and for experiments."""
    import dataclasses

    from lp_runner.config import _SECTION_TYPES, ADVANCED_KEYS, USER_KEYS

    users = [f"{s}.{n}" for s, names in USER_KEYS.items() for n in names]
    assert len(users) <= 25, users
    fields = {f"{s}.{f.name}" for s, cls in _SECTION_TYPES.items() for f in dataclasses.fields(cls)}
    assert set(users) | set(ADVANCED_KEYS.values()) == fields
    assert not set(users) & set(ADVANCED_KEYS.values())
    for name in ("max_verify_rows", "long_match_rows", "context_tokens", "candidate_policy", "huge_pages", "pad_rows"):
        assert name in ADVANCED_KEYS  # tuner-born and experimental knobs are not user knobs


@pytest.mark.parametrize(
    "override, message",
    [
        ("lookahead.max_verify_rows=3", "'lookahead.max_verify_rows' is an advanced setting: write it as "
         "'advanced.max_verify_rows'"),
        ("run.progress=false", "'run.progress' is an advanced setting: write it as 'advanced.progress'"),
        ("advanced.window_size=5", "unknown config key 'advanced.window_size' (did you mean"),
        ("advanced.bogus=1", "unknown config key 'advanced.bogus'"),
    ],
)  # fmt: skip
def test_a_key_in_the_wrong_place_is_one_line_naming_where_it_goes(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value).startswith(message), str(info.value)


def test_an_advanced_key_pins_the_preset_by_presence_even_at_its_default() -> None:
    cfg = load_config(None, ["advanced.max_verify_rows=0", "lookahead.window_size=7"])  # both their defaults
    assert set(cfg.pinned_lookahead()) == {"max_verify_rows", "window_size"}
    assert cfg.explicit == ("advanced.max_verify_rows", "lookahead.window_size")  # as the user wrote them


def test_a_config_written_as_a_user_writes_it_reads_back_equal(tmp_path: Path) -> None:
    """``to_user_dict`` (what ``lp_runner tune`` writes): user sections and one ``advanced:`` section."""
    import yaml

    cfg = load_config(None, ["advanced.max_verify_rows=3", "lookahead.window_size=5", "advanced.progress=false"])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.to_user_dict()))
    again = load_config(path)
    assert {k: v for k, v in again.to_dict().items() if k != "explicit"} == {
        k: v for k, v in cfg.to_dict().items() if k != "explicit"
    }
    assert "advanced.max_verify_rows" in again.explicit and "lookahead.max_verify_rows" not in again.explicit


def test_the_summary_names_the_keys_the_config_pinned() -> None:
    from lp_runner.jobs.report import policy_lines

    policy = {
        "preset": "auto",
        "pinned": ["advanced.max_verify_rows", "lookahead.window_size"],
        "choice": {"samples": "shipped", "evaluated": 3, "predicted_ms_per_token": 10.0,
                   "predicted_tokens_per_forward": 1.5},
    }  # fmt: skip
    assert (
        "pinned by the config (kept as written by the auto preset): advanced.max_verify_rows, lookahead.window_size"
        in policy_lines(policy)
    )

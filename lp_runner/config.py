"""Run configuration: dataclasses, YAML loading, ``--set section.key=value`` overrides and validation.

Every user-facing knob lives here, so that a YAML file, a command-line override and a Ray job all go through
the same type checks and produce the same one-line error messages (``ConfigError``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import json
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lp_runner.errors import ConfigError
from lp_runner.limits import (
    MAX_CONFIG_BYTES,
    MAX_VALUE_CHARS,
    BoundedLoader,
    check_int,
    check_path_text,
    check_setting_text,
    load_yaml,
    quote,
)


@dataclass
class ModelConfig:
    path: str = "embedded"  # "embedded" (SmolLM2-135M-Instruct), a local HF folder, a .gguf file, or org/name[@rev]
    # from the local Hugging Face cache (never downloaded)
    # auto | float32 | bfloat16 | float16; auto: bfloat16 on a CUDA device that has it (float16 on one that does
    # not), float32 on a CPU. On CUDA, float32 matmuls may use TF32 unless float32 is written out (lp_runner.device)
    dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N (under torchrun, cuda means cuda:LOCAL_RANK)
    threads: int = 0  # torch intra-op threads per worker; 0 = the process's cores / ranks on this node
    allow_pickle: bool = False  # load pickle-format checkpoints (unsafe: arbitrary code on load)
    compile: str = "auto"  # off | on | auto: rounds through torch.compile (auto: when this device's record says
    # the job is long enough to pay for the compilation; see lp_runner/tuning/compile_choice.py)
    # the kernels the forward runs on, chosen once at load (lp_runner.backends.BACKENDS names and explains each
    # value); auto: lp_runner's CPU kernels on a CPU where they work, transformers' layers elsewhere
    backend: str = "auto"
    # the CPU plug-in's options (advanced.*; lp_runner/backends/cpu says what each does and costs):
    huge_pages: bool = False  # its packed weights in transparent huge pages: faster forwards, a slower start-up
    native_layers: bool = True  # its Llama-family decoder layers in one call (false: transformers' layer code)
    cache_dir: str = ""  # where the embedded model lives; "" = $LP_RUNNER_CACHE or ~/.cache/lp_runner
    # the acceptance table the auto preset prices (``tuning.acceptance``: a file ``study --record-acceptance`` wrote,
    # or a shipped name); "" = the one recorded for this model (the cache's, else the package's), else none
    acceptance: str = ""


def _inert(when: typing.Callable[[LookaheadConfig], bool]) -> dict:
    """Field metadata: the setting is inert (changes no round) when ``when(la)`` holds. The tuner's memo
    (``inert_knobs``) reads it, so a new knob declares its own inertness here and nowhere else."""
    return {"inert_when": when}


def _no_window(la: LookaheadConfig) -> bool:
    return not la.lookahead_branch


def _nothing_verified(la: LookaheadConfig) -> bool:
    return la.verification_set_size == 0  # G = 0: no candidate is proposed, so no proposal knob matters


def _no_context(la: LookaheadConfig) -> bool:
    return _nothing_verified(la) or not la.context_lookup


def _cap_never_lifted(la: LookaheadConfig) -> bool:
    no_change = la.max_verify_rows == 0 and la.long_match_rows == 0  # lifting "no cap" to "no cap"
    return la.long_match_ngram == 0 or _no_context(la) or no_change


@dataclass
class LookaheadConfig:
    """The round shape. The algorithm is W, N, G and the window switch; the rest is the proposal policy (which
    sources fill the budget G, and how long their proposals are) and the row-cap policy (how many verification
    rows a round may spend). Every knob that can be inert says when (``inert_knobs``)."""

    # the algorithm
    window_size: int = field(default=7, metadata=_inert(_no_window))  # W: Jacobi window columns
    # N: n-gram length; each trajectory holds N-1 levels, pool suffixes N-1 (inert with neither window nor G)
    ngram_size: int = field(default=5, metadata=_inert(lambda la: _no_window(la) and _nothing_verified(la)))
    verification_set_size: int = 7  # G: pool suffixes kept per key and verified per round
    # proposal policy: the n-gram pool
    pool_from_prompt: bool = field(default=True, metadata=_inert(_nothing_verified))  # seed it with the prompt
    # repair the pool with the committed text's n-grams (verified continuations)
    pool_from_output: bool = field(default=True, metadata=_inert(_nothing_verified))
    lookahead_branch: bool = True  # false: no Jacobi window rows (pure pool / context lookup, like prompt lookup)
    # proposal policy: context lookup (continuations of earlier occurrences of the committed suffix)
    context_lookup: bool = field(default=True, metadata=_inert(_nothing_verified))
    context_max_ngram: int = field(default=3, metadata=_inert(_no_context))  # longest suffix matched
    # shortest match that proposes (1-token matches are cheap to find, rarely right)
    context_min_ngram: int = field(default=1, metadata=_inert(_no_context))
    context_tokens: int = field(default=10, metadata=_inert(_no_context))  # tokens proposed per match (at most)
    # row-cap policy: verification rows per round, all candidates together (0: no cap)
    max_verify_rows: int = field(default=0, metadata=_inert(_nothing_verified))
    # a context match at least this long lifts the cap to long_match_rows (0: never)
    long_match_ngram: int = field(default=0, metadata=_inert(_cap_never_lifted))
    # the cap after a long context match (0: no cap); long copies earn long proposals
    long_match_rows: int = field(default=0, metadata=_inert(_cap_never_lifted))
    # grow / shrink proposals with their acceptance (1..context_tokens), per match length
    context_adaptive: bool = field(default=True, metadata=_inert(_no_context))
    # context_first | pool_first: who fills the budget G first
    candidate_policy: str = field(default="context_first", metadata=_inert(_nothing_verified))
    # auto: the knobs above that the config does not set are chosen at start-up from this device's measured
    # forward-cost curve (``lp_runner.tuning.preset``); off: every knob as written
    preset: str = "auto"
    pad_rows: bool = True  # run each round at the cheapest measured row count >= its own (exact; needs the curve)
    # prompt: pool and context index start empty for every prompt; job: also a store of the job's earlier outputs
    # (``decoding.job_store``) proposes, shared by the prompts of a run (and saved / loaded by --pool-out / --pool-in).
    # job by measurement (benchmarks/results/global_pool.md): more tokens per forward on chat and on code
    pool_scope: str = "job"
    pool_max_tokens: int = 1_000_000  # the job store's bound; the oldest generations are evicted first


def inert_knobs(la: LookaheadConfig) -> set[str]:
    """The lookahead knobs that change no round of ``la`` (their values may differ without any effect).

    Example: with lookahead_branch false, window_size is inert; with G = 0 every proposal and row-cap knob is.
    """
    return {f.name for f in dataclasses.fields(la) if "inert_when" in f.metadata and f.metadata["inert_when"](la)}


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables top-p
    seed: int = 0
    stop_on_eos: bool = True


@dataclass
class ParallelConfig:
    backend: str = "torch"  # torch (torchrun, or one local process) | ray
    workers: int = 1  # P; under torchrun it must equal WORLD_SIZE (with groups > 1: WORLD_SIZE = groups x workers)
    groups: int = 1  # D: independent LP groups of P workers each, fed prompts from one work queue (torchrun, Ray)
    dist_backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    timeout_s: float = 120.0  # every collective fails after this long instead of hanging
    share_cores: bool = True  # CPU, groups > 1: a group with no more work gives its threads to the busy ones
    # Ray backend (parallel.backend=ray): one actor per worker, placed through one placement group.
    ray_address: str = ""  # "" = $RAY_ADDRESS if set, else a local Ray instance started (and stopped) for the run
    cpus_per_worker: float = 1.0  # CPUs reserved per actor
    gpus_per_worker: float = -1.0  # GPUs per actor; -1 = auto (1 when the cluster has GPUs, else 0)
    resources_per_worker: str = ""  # extra custom Ray resources per actor: "name=amount,name=amount"
    placement_timeout_s: float = 60.0  # wait at most this long for the cluster to free the workers' resources
    max_restarts: int = 2  # lost-worker recoveries allowed per run before the run fails


@dataclass
class RunConfig:
    stream: bool = True  # stream text for a single prompt
    progress: bool = True  # progress bar over a prompts file
    summary: bool = True  # one-screen summary at the end
    recalibrate: bool = False  # measure the forward-cost curve again even if one is cached (``--recalibrate``)
    on_error: str = "stop"  # stop | skip: a bad prompt ends the run, or becomes an error record {id, error}
    pool_in: str = ""  # start the job store (lookahead.pool_scope=job) from this file (``--pool-in``)
    pool_out: str = ""  # save the job store here at the end of the run (``--pool-out``)
    # generations in flight per group, all in one forward per round, a new prompt joining as one finishes
    # (lp_runner/decoding/scheduler.py); 1: one prompt at a time. Outputs are the same at any value. 1 by measurement
    # (benchmarks/batching.py, 40 prompts on a 2-core CPU): 4 gave 2.0x the job tokens/s at 2.0x the median
    # latency per prompt, 8 2.6x at 3.1x; which side of that trade a job wants is the user's to say
    batch: int = 1


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    # "section.key" of every key the YAML file or a --set gave: the auto preset chooses only the others
    explicit: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Every field by the section that keeps it, and ``explicit`` (records; ``config_from_dict`` rebuilds it)."""
        return dataclasses.asdict(self)

    def to_user_dict(self) -> dict[str, dict[str, Any]]:
        """Every setting as a user writes it in a YAML file: the user keys by section, the rest under
        ``advanced`` (``load_config`` reads it back to an equal Config)."""
        data = self.to_dict()
        out = {section: {name: data[section][name] for name in names} for section, names in USER_KEYS.items()}
        out[ADVANCED] = {name: data[key.split(".")[0]][name] for name, key in ADVANCED_KEYS.items()}
        return out

    def pinned_lookahead(self) -> tuple[str, ...]:
        """Lookahead knobs the user set, by presence (the auto preset keeps them as given, whatever their value):
        ``lookahead.window_size`` and ``advanced.max_verify_rows`` pin ``window_size`` and ``max_verify_rows``."""
        fields = (internal_key(k) for k in self.explicit)
        return tuple(k.split(".", 1)[1] for k in fields if k.startswith("lookahead."))

    def digest(self) -> str:
        """A short stable hash, used to check that every distributed rank runs the same config."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


_SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig,
    "lookahead": LookaheadConfig,
    "generation": GenerationConfig,
    "parallel": ParallelConfig,
    "run": RunConfig,
}
# What a user configures, section by section. Every other field is an internal of the run's plan (the knobs the
# auto preset and the tuner turn: row caps, context-lookup lengths, the proposal order, padding) or an experiment
# (the CPU plug-in's options, core sharing) or a per-invocation flag (--pool-in): each is
# written ``advanced.<name>`` (one ``advanced:`` section in a YAML file), is kept in its own section, is recorded
# like any setting, and pins the auto preset like any lookahead key the user writes.
USER_KEYS: dict[str, tuple[str, ...]] = {
    "model": ("path", "dtype", "device", "threads", "compile", "backend"),
    "lookahead": ("window_size", "ngram_size", "verification_set_size", "preset", "pool_scope"),
    "generation": ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed"),
    "parallel": ("backend", "workers", "groups", "dist_backend", "timeout_s", "ray_address"),
    "run": ("on_error", "batch"),
}
ADVANCED = "advanced"
# advanced name -> "section.field" where it is kept (every name is unique across the sections)
ADVANCED_KEYS: dict[str, str] = {
    f.name: f"{section}.{f.name}"
    for section, cls in _SECTION_TYPES.items()
    for f in dataclasses.fields(cls)
    if f.name not in USER_KEYS[section]
}


assert len(ADVANCED_KEYS) == sum(
    len(dataclasses.fields(cls)) - len(USER_KEYS[section]) for section, cls in _SECTION_TYPES.items()
), "an advanced name is a field of two sections"


def user_key(internal: str) -> str:
    """How a user writes the "section.field" ``internal`` (for messages): ``lookahead.max_verify_rows`` ->
    ``advanced.max_verify_rows``; a user key is itself."""
    section, _, name = internal.partition(".")
    return f"{ADVANCED}.{name}" if ADVANCED_KEYS.get(name) == internal else internal


def internal_key(key: str) -> str:
    """The "section.field" a written key is kept under: ``advanced.max_verify_rows`` -> ``lookahead.max_verify_rows``;
    a user key is itself."""
    section, _, name = key.partition(".")
    return ADVANCED_KEYS.get(name, key) if section == ADVANCED else key


_CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.compile": ("off", "on", "auto"),
    "model.backend": ("auto", "torch", "native", "native-bf16"),
    "lookahead.preset": ("auto", "off"),
    "lookahead.candidate_policy": ("context_first", "pool_first"),
    "lookahead.pool_scope": ("prompt", "job"),
    "parallel.backend": ("torch", "ray"),
    "parallel.dist_backend": ("auto", "gloo", "nccl"),
    "run.on_error": ("stop", "skip"),
}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")  # model.device


def _known_keys() -> list[str]:
    users = [f"{section}.{name}" for section, names in USER_KEYS.items() for name in names]
    return users + [f"{ADVANCED}.{name}" for name in ADVANCED_KEYS]


_RENAMED = {"model.prepack": "model.backend"}  # keys that were renamed: the error names the new key and its values


def _unknown(key: str) -> ConfigError:
    section, _, name = key.partition(".")
    if section in _SECTION_TYPES and ADVANCED_KEYS.get(name) == key:
        return ConfigError(f"'{key}' is an advanced setting: write it as '{ADVANCED}.{name}'")
    if len(key) > 100:  # no key is this long: name it by its start
        return ConfigError(f"unknown config key {quote(key)}")
    if key in _RENAMED:
        new = _RENAMED[key]
        return ConfigError(f"'{key}' is now '{new}' (one of {', '.join(_CHOICES[new])})")
    close = difflib.get_close_matches(key, _known_keys(), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def _field_type(section_cls: type, name: str) -> type:
    hints = typing.get_type_hints(section_cls)
    return hints[name]


def _coerce(internal: str, value: Any, target: type) -> Any:
    """Convert a YAML or command-line value to the field's type, refusing lossy or ambiguous conversions.
    ``internal``: the "section.field" being set, named in errors as the user writes it."""
    key = user_key(internal)
    if target is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "0", "off"):
            return False
        raise ConfigError(f"{key} must be true or false, got {quote(value)}")
    if target is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be an integer, got {quote(value)}")
        number = None
        if isinstance(value, int):
            number = value
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):  # Python refuses past 4300 digits: one line below
                number = int(value)
        if number is None:
            raise ConfigError(f"{key} must be an integer, got {quote(value)}")
        check_int(key, number)  # every integer, however it came (YAML in any base, a string, the API)
        return number
    if target is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {quote(value)}")
        number = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):
                number = float(value)
        if number is None:
            raise ConfigError(f"{key} must be a number, got {quote(value)}")
        if not math.isfinite(number):  # nan passes every comparison a bound makes; inf overflows a timeout
            raise ConfigError(f"{key} must be a finite number, got {quote(value)}")
        return number
    if target is str:
        if isinstance(value, bool) and {"on", "off"} <= set(_CHOICES.get(internal, ())):
            return "on" if value else "off"  # YAML 1.1 reads a bare on / off as a boolean
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key} must be a string, got {quote(value)}")
    raise AssertionError(f"unsupported config field type {target} for {key}")


def set_key(cfg: Config, key: str, value: Any) -> None:
    """Set a key as a user writes it (``<section>.<name>`` of ``USER_KEYS``, or ``advanced.<name>``) on ``cfg``, with
    type checking (mutates ``cfg``)."""
    parts = key.split(".")
    if len(parts) != 2:
        raise _unknown(key)
    section, name = parts
    if not (name in USER_KEYS.get(section, ()) or (section == ADVANCED and name in ADVANCED_KEYS)):
        raise _unknown(key)
    set_field(cfg, internal_key(key), value)


def set_field(cfg: Config, key: str, value: Any) -> None:
    """Set ``section.field`` of any field, user-facing or internal, with type checking (mutates ``cfg``): the
    rebuild of a recorded config (``config_from_dict``) and the Python API, which take every field."""
    parts = key.split(".")
    if len(parts) != 2 or parts[0] not in _SECTION_TYPES:
        raise _unknown(key)
    section, name = parts
    section_cls = _SECTION_TYPES[section]
    if name not in {f.name for f in dataclasses.fields(section_cls)}:
        raise _unknown(key)
    if key == "lookahead.preset" and value is False:  # YAML 1.1 reads a bare ``off`` as false
        value = "off"
    coerced = _coerce(key, value, _field_type(section_cls, name))
    setattr(getattr(cfg, section), name, coerced)


def parse_override(text: str) -> tuple[str, Any]:
    """``"lookahead.window_size=15"`` -> ("lookahead.window_size", 15); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set expects section.key=value, got {quote(text)}")
    key, raw = text.split("=", 1)
    key = key.strip()
    if len(key) > 100:  # no key is this long
        raise _unknown(key)
    if len(raw) > MAX_VALUE_CHARS:  # before YAML reads it
        raise ConfigError(
            f"--set {key}: a value of {len(raw)} characters, more than any setting holds ({MAX_VALUE_CHARS})"
        )
    try:
        value = load_yaml(raw, f"--set {key}") if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if value is None:
        value = raw
    return key, value


class _UniqueKeyLoader(BoundedLoader):
    """``limits.BoundedLoader`` (sizes bounded before anything is built) that also refuses a mapping key given
    twice (PyYAML keeps the last one silently, so a second ``model:`` section would replace the first without a
    word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise ConfigError(
                    f"{self.where}:{line}: duplicate key {quote(key)} (first given at line {seen[key]}); "
                    "give each key once"
                )
            seen[key] = line
        return super().construct_mapping(node, deep)


def _read_yaml(p: Path) -> Any:
    """The YAML document in ``p``; invalid YAML or a duplicate key is a one-line ConfigError naming the line."""
    size = p.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {p} is {size} bytes, more than a config holds ({MAX_CONFIG_BYTES})")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {p} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    try:
        return load_yaml(text, f"config file {p}", _UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {p} is not valid YAML: {str(exc).splitlines()[0][:200]}") from None


def _like_a_section(key: Any) -> bool:
    """A section's name, or one misspelled (``lookahed``, ``modle``: the error names it with the fix; ``more`` is
    not close enough to ``model``)."""
    names = [*_SECTION_TYPES, ADVANCED]
    return isinstance(key, str) and len(key) <= 100 and bool(difflib.get_close_matches(key, names, 1, 0.75))


def _not_a_config(p: Path) -> ConfigError:
    """A file without one section, or a name like one: another kind of file (a model's config.json, notes, a link
    gone astray). Its keys are not echoed (a typo in a real config is, with a suggestion): its first line may be
    anything, a secret included."""
    link = f" (a link to {p.resolve()})" if p.is_symlink() else ""
    sections = ", ".join([*_SECTION_TYPES, ADVANCED])
    return ConfigError(f"config file {p}{link} is not an lp_runner config: it has none of the sections {sections}")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file, then the ``--set`` overrides; validated before return."""
    cfg = Config()
    explicit: set[str] = set()
    if path is not None:
        check_path_text("--config", str(path))
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config path {p} is a folder, not a YAML file")
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        data = _read_yaml(p) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections")
        if data and not any(_like_a_section(k) for k in data):
            raise _not_a_config(p)
        for section, values in data.items():
            if section not in _SECTION_TYPES and section != ADVANCED:
                raise _unknown(str(section))
            if values is None:
                continue
            if not isinstance(values, dict):
                raise ConfigError(f"config section '{section}' must be a mapping")
            for name, value in values.items():
                set_key(cfg, f"{section}.{name}", value)
                explicit.add(f"{section}.{name}")
    given: dict[str, Any] = {}
    for text in overrides or []:
        key, value = parse_override(text)
        if key in given:  # as a key given twice in a YAML file: the first would be dropped without a word
            raise ConfigError(
                f"{key} is given twice on the command line ({quote(given[key])}, then {quote(value)}); "
                "give each key once"
            )
        given[key] = value
        set_key(cfg, key, value)
        explicit.add(key)
    cfg.explicit = tuple(sorted(explicit))
    validate(cfg)
    return cfg


class Bound(typing.NamedTuple):
    """A setting's range. Below it the error reads ``{key}{label} must be {op} {value}{meaning}, got {x}{why}``;
    above ``most`` (inclusive; None: no upper bound) ``{key}{label} must be <= {most}{most_why}, got {x}``."""

    op: str  # ">=" or ">"
    value: float
    label: str = ""  # e.g. " (W)"
    meaning: str = ""  # e.g. " (0: no cap)"
    why: str = ""
    most: float | None = None  # the largest value that can run, or that any run could use
    most_why: str = ""


# The most rows one round may compute, whatever the model: a round's masks grow with the square of its rows (at
# 4096 rows the additive float mask alone is 4096 x (past + 4096) x 4 bytes, 128 MiB at a past of 4096 tokens) and
# its layout is rebuilt in Python every round; a setting past it is a mistake, not a speed-up. A model's context
# bounds a round further (``decoding.layout.check_model_fits``).
MAX_ROUND_ROWS = 4096
_ROWS = f" (a round's rows grow with it, and a round computes at most {MAX_ROUND_ROWS})"
_WEEK_S = 7 * 24 * 3600.0  # a wait longer than this is a hang, not a timeout

# Every setting's bounds, in one table; checks that relate two keys or constrain a value further are written out in
# ``check_lookahead`` and ``validate``. What each bound means for the round and the machine: docs/design.md 9.6.
_BOUNDS: dict[str, Bound] = {
    "lookahead.ngram_size": Bound(
        ">=", 3, " (N)", why=": N-1 trajectory levels need at least one level above the base stripe",
        most=64, most_why=_ROWS,
    ),
    "lookahead.window_size": Bound(">=", 1, " (W)", most=1024, most_why=_ROWS),
    "lookahead.verification_set_size": Bound(">=", 0, " (G)", most=1024, most_why=_ROWS),
    "lookahead.context_max_ngram": Bound(">=", 1, most=64, most_why=" (the context index keeps a key per length)"),
    "lookahead.max_verify_rows": Bound(">=", 0, meaning=" (0: no cap)", most=MAX_ROUND_ROWS),
    "lookahead.context_tokens": Bound(">=", 1, most=1024, most_why=_ROWS),
    "lookahead.long_match_rows": Bound(">=", 0, meaning=" (0: no cap)", most=MAX_ROUND_ROWS),
    # ~82 bytes a stored token (measured at a million: docs/design.md 2.1): the bound is about 8 GB
    "lookahead.pool_max_tokens": Bound(">=", 0, most=100_000_000, most_why=" (about 82 bytes a stored token)"),
    "generation.max_new_tokens": Bound(
        ">=", 1, most=1_000_000, most_why=" (and less than the model's context, checked once it is known)"
    ),
    "generation.top_k": Bound(">=", 0),  # above the vocabulary it keeps every token, as HF's warper does
    "parallel.workers": Bound(">=", 1, most=1024, most_why=" (and what this machine holds, checked at start)"),
    "parallel.groups": Bound(">=", 1, most=1024, most_why=" (and what this machine holds, checked at start)"),
    "parallel.timeout_s": Bound(">", 0, most=_WEEK_S, most_why=" (a week: a longer wait is a hang)"),
    "parallel.cpus_per_worker": Bound(">=", 0, most=1024),
    "parallel.placement_timeout_s": Bound(">", 0, most=_WEEK_S, most_why=" (a week: a longer wait is a hang)"),
    "parallel.max_restarts": Bound(">=", 0, most=1000),
    "model.threads": Bound(">=", 0, most=1024),
    "run.batch": Bound(">=", 1, meaning=" (1: one prompt at a time)", most=1024),
}  # fmt: skip


def _check_bounds(section: str, values: object) -> None:
    """Every ``_BOUNDS`` entry of ``section`` on ``values`` (that section's dataclass), in table order."""
    for key, b in _BOUNDS.items():
        if key.startswith(section + "."):
            x = getattr(values, key.split(".", 1)[1])
            if x < b.value if b.op == ">=" else x <= b.value:
                raise ConfigError(
                    f"{user_key(key)}{b.label} must be {b.op} {b.value:g}{b.meaning}, got {quote(x)}{b.why}"
                )
            if b.most is not None and x > b.most:
                raise ConfigError(f"{user_key(key)}{b.label} must be <= {_number(b.most)}{b.most_why}, got {quote(x)}")


def _number(v: float) -> str:
    """1000000.0 -> "1000000", 0.5 -> "0.5" (a bound as the user would type it)."""
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def check_lookahead(la: LookaheadConfig) -> None:
    """W/N/G checks, shared by config validation and the engine (which may be built without a Config)."""
    _check_bounds("lookahead", la)
    if not 1 <= la.context_min_ngram <= la.context_max_ngram:
        raise ConfigError(
            f"advanced.context_min_ngram must be between 1 and context_max_ngram={la.context_max_ngram}, "
            f"got {la.context_min_ngram}"
        )
    if not 0 <= la.long_match_ngram <= la.context_max_ngram:
        raise ConfigError(
            f"advanced.long_match_ngram must be between 0 (off) and context_max_ngram={la.context_max_ngram}, "
            f"got {la.long_match_ngram}"
        )


def validate(cfg: Config) -> None:
    """Reject settings that cannot run, before anything is allocated."""
    gen, par = cfg.generation, cfg.parallel
    check_lookahead(cfg.lookahead)
    for section in ("generation", "parallel", "model", "run"):
        _check_bounds(section, getattr(cfg, section))
    if gen.temperature < 0:  # under greedy too: a setting that cannot sample is a mistake, not inert
        raise ConfigError(
            f"generation.temperature must be >= 0 (read only when sampling, where it must be > 0), "
            f"got {gen.temperature}"
        )
    if gen.temperature == 0 and gen.do_sample:
        raise ConfigError(f"generation.temperature must be > 0 when sampling, got {gen.temperature}")
    if not 0.0 < gen.top_p <= 1.0:
        raise ConfigError(f"generation.top_p must be in (0, 1], got {gen.top_p}")
    if (par.gpus_per_worker < 0 and par.gpus_per_worker != -1) or par.gpus_per_worker > 64:
        raise ConfigError(f"advanced.gpus_per_worker must be -1 (auto) or 0 to 64, got {par.gpus_per_worker}")
    if (cfg.run.pool_in or cfg.run.pool_out) and cfg.lookahead.pool_scope != "job":
        raise ConfigError("--pool-in / --pool-out (advanced.pool_in, advanced.pool_out) need lookahead.pool_scope=job")
    check_texts(cfg)
    if not _DEVICE.fullmatch(cfg.model.device):
        raise ConfigError(f"model.device must be auto, cpu, cuda or cuda:N, got {quote(cfg.model.device)}")
    for key, choices in _CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in choices:
            raise ConfigError(f"{user_key(key)} must be one of {', '.join(choices)}, got {quote(value)}")


# String settings that name a file or folder the run opens: checked against the system's path limits up front
_PATHS = ("model.path", "model.cache_dir", "model.acceptance", "run.pool_in", "run.pool_out")


def check_texts(cfg: Config) -> None:
    """Every string setting within ``limits.MAX_VALUE_CHARS``; every path setting within the system's path limits
    (one line here rather than ``File name too long`` from deep inside a loader); ``model.path`` not empty."""
    for section, cls in _SECTION_TYPES.items():
        for f in dataclasses.fields(cls):
            value = getattr(getattr(cfg, section), f.name)
            if isinstance(value, str):
                check_setting_text(user_key(f"{section}.{f.name}"), value)
    for key in _PATHS:
        section, name = key.split(".")
        check_path_text(user_key(key), getattr(getattr(cfg, section), name))
    if not cfg.model.path.strip():
        raise ConfigError(
            "model.path is empty: give a model folder, a .gguf file, org/name from the local Hugging Face cache, "
            "or embedded (the built-in model)"
        )


def config_from_dict(data: dict[str, dict[str, Any]]) -> Config:
    """Rebuild a Config from ``Config.to_dict()`` output (used to ship configs to Ray actors)."""
    cfg = Config()
    for section, values in data.items():
        if section == "explicit":
            cfg.explicit = tuple(values)
            continue
        for name, value in values.items():
            set_field(cfg, f"{section}.{name}", value)
    validate(cfg)
    return cfg

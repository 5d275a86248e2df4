"""Run configuration: dataclasses, YAML loading, ``--set section.key=value`` overrides and validation.

Every user-facing knob lives here, so that a YAML file, a command-line override and a Ray job all go through
the same type checks and produce the same one-line error messages (``ConfigError``).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lp_runner.errors import ConfigError


@dataclass
class ModelConfig:
    path: str = "embedded"  # "embedded" (SmolLM2-135M-Instruct), a local HF folder, a .gguf file, or org/name[@rev]
    # from the local Hugging Face cache (never downloaded)
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N (under torchrun, cuda means cuda:LOCAL_RANK)
    threads: int = 0  # torch intra-op threads per worker; 0 = the process's cores / ranks on this node
    allow_pickle: bool = False  # load pickle-format checkpoints (unsafe: arbitrary code on load)
    compile: str = "auto"  # off | on | auto: rounds through torch.compile (auto: when this device's record says
    # the job is long enough to pay for the compilation; see lp_runner/compile_choice.py)
    prepack: str = "auto"  # off | on | auto | native | onednn | native-bf16: linear layers' weights packed once
    # for a CPU kernel (auto: the faster of lp_runner's native product and oneDNN's where they work, measured; see
    # prepack.py). native-bf16: the native product on the linear weights rounded to bfloat16 (half the bytes per
    # forward; float32 arithmetic: exact for the model with those rounded weights, not for the original)
    huge_pages: bool = False  # the native products' packed weights in transparent huge pages: each forward faster
    # (1-row: 1.04-1.19x measured), but start-up slower where fresh huge pages are dear to fault in (a VM: +3 s for
    # the embedded model); for long jobs (lp_runner/arena.py)
    native_layers: bool = True  # on native products, Llama-family decoder layers run natively, all in one call, in
    # eager rounds and prefills (lp_runner/native_layers.py); false: transformers' layer code on the same products
    cache_dir: str = ""  # where the embedded model lives; "" = $LP_RUNNER_CACHE or ~/.cache/lp_runner


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
    # forward-cost curve (``lp_runner.preset``); off: every knob as written
    preset: str = "auto"
    pad_rows: bool = True  # run each round at the cheapest measured row count >= its own (exact; needs the curve)
    # prompt: pool and context index start empty for every prompt; job: also a store of the job's earlier outputs
    # (``lp_runner.job_pool``) proposes, shared by the prompts of a run (and saved / loaded by --pool-out / --pool-in).
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
    # (lp_runner/scheduler.py); 1: one prompt at a time. Outputs are the same at any value. 1 by measurement
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
        return dataclasses.asdict(self)

    def pinned_lookahead(self) -> tuple[str, ...]:
        """Lookahead knobs the user set (the auto preset keeps them as given)."""
        return tuple(k.split(".", 1)[1] for k in self.explicit if k.startswith("lookahead."))

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
_CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.compile": ("off", "on", "auto"),
    "model.prepack": ("off", "on", "auto", "native", "onednn", "native-bf16"),
    "lookahead.preset": ("auto", "off"),
    "lookahead.candidate_policy": ("context_first", "pool_first"),
    "lookahead.pool_scope": ("prompt", "job"),
    "parallel.backend": ("torch", "ray"),
    "parallel.dist_backend": ("auto", "gloo", "nccl"),
    "run.on_error": ("stop", "skip"),
}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")  # model.device


def _known_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _SECTION_TYPES.items() for f in dataclasses.fields(cls)]


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, _known_keys(), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def _field_type(section_cls: type, name: str) -> type:
    hints = typing.get_type_hints(section_cls)
    return hints[name]


def _coerce(key: str, value: Any, target: type) -> Any:
    """Convert a YAML or command-line value to the field's type, refusing lossy or ambiguous conversions."""
    if target is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "0", "off"):
            return False
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if target is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if target is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if target is str:
        if isinstance(value, bool) and {"on", "off"} <= set(_CHOICES.get(key, ())):
            return "on" if value else "off"  # YAML 1.1 reads a bare on / off as a boolean
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key} must be a string, got {value!r}")
    raise AssertionError(f"unsupported config field type {target} for {key}")


def set_key(cfg: Config, key: str, value: Any) -> None:
    """Set ``section.name`` on ``cfg`` with type checking (mutates ``cfg``)."""
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
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if value is None:
        value = raw
    return key.strip(), value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file, then the ``--set`` overrides; validated before return."""
    cfg = Config()
    explicit: set[str] = set()
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config path {p} is a folder, not a YAML file")
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {p} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {str(exc).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections")
        for section, values in data.items():
            if section not in _SECTION_TYPES:
                raise _unknown(str(section))
            if values is None:
                continue
            if not isinstance(values, dict):
                raise ConfigError(f"config section '{section}' must be a mapping")
            for name, value in values.items():
                set_key(cfg, f"{section}.{name}", value)
                explicit.add(f"{section}.{name}")
    for text in overrides or []:
        key, value = parse_override(text)
        set_key(cfg, key, value)
        explicit.add(key)
    cfg.explicit = tuple(sorted(explicit))
    validate(cfg)
    return cfg


class Bound(typing.NamedTuple):
    """A plain lower bound; the error reads ``{key}{label} must be {op} {value}{meaning}, got {x}{why}``."""

    op: str  # ">=" or ">"
    value: float
    label: str = ""  # e.g. " (W)"
    meaning: str = ""  # e.g. " (0: no cap)"
    why: str = ""


# Every plain lower bound, in one table; checks that relate two keys or constrain a value further are written out
# in ``check_lookahead`` and ``validate``.
_BOUNDS: dict[str, Bound] = {
    "lookahead.ngram_size": Bound(
        ">=", 3, " (N)", why=": N-1 trajectory levels need at least one level above the base stripe"
    ),
    "lookahead.window_size": Bound(">=", 1, " (W)"),
    "lookahead.verification_set_size": Bound(">=", 0, " (G)"),
    "lookahead.context_max_ngram": Bound(">=", 1),
    "lookahead.max_verify_rows": Bound(">=", 0, meaning=" (0: no cap)"),
    "lookahead.context_tokens": Bound(">=", 1),
    "lookahead.long_match_rows": Bound(">=", 0, meaning=" (0: no cap)"),
    "lookahead.pool_max_tokens": Bound(">=", 0),
    "generation.max_new_tokens": Bound(">=", 1),
    "generation.top_k": Bound(">=", 0),
    "parallel.workers": Bound(">=", 1),
    "parallel.groups": Bound(">=", 1),
    "parallel.timeout_s": Bound(">", 0),
    "parallel.cpus_per_worker": Bound(">=", 0),
    "parallel.placement_timeout_s": Bound(">", 0),
    "parallel.max_restarts": Bound(">=", 0),
    "model.threads": Bound(">=", 0),
    "run.batch": Bound(">=", 1, meaning=" (1: one prompt at a time)"),
}


def _check_bounds(section: str, values: object) -> None:
    """Every ``_BOUNDS`` entry of ``section`` on ``values`` (that section's dataclass), in table order."""
    for key, b in _BOUNDS.items():
        if key.startswith(section + "."):
            x = getattr(values, key.split(".", 1)[1])
            if x < b.value if b.op == ">=" else x <= b.value:
                raise ConfigError(f"{key}{b.label} must be {b.op} {b.value:g}{b.meaning}, got {x}{b.why}")


def check_lookahead(la: LookaheadConfig) -> None:
    """W/N/G checks, shared by config validation and the engine (which may be built without a Config)."""
    _check_bounds("lookahead", la)
    if not 1 <= la.context_min_ngram <= la.context_max_ngram:
        raise ConfigError(
            f"lookahead.context_min_ngram must be between 1 and context_max_ngram={la.context_max_ngram}, "
            f"got {la.context_min_ngram}"
        )
    if not 0 <= la.long_match_ngram <= la.context_max_ngram:
        raise ConfigError(
            f"lookahead.long_match_ngram must be between 0 (off) and context_max_ngram={la.context_max_ngram}, "
            f"got {la.long_match_ngram}"
        )


def validate(cfg: Config) -> None:
    """Reject settings that cannot run, before anything is allocated."""
    gen, par = cfg.generation, cfg.parallel
    check_lookahead(cfg.lookahead)
    for section in ("generation", "parallel", "model", "run"):
        _check_bounds(section, getattr(cfg, section))
    if gen.temperature <= 0 and gen.do_sample:
        raise ConfigError(f"generation.temperature must be > 0 when sampling, got {gen.temperature}")
    if not 0.0 < gen.top_p <= 1.0:
        raise ConfigError(f"generation.top_p must be in (0, 1], got {gen.top_p}")
    if par.gpus_per_worker < 0 and par.gpus_per_worker != -1:
        raise ConfigError(f"parallel.gpus_per_worker must be >= 0 or -1 (auto), got {par.gpus_per_worker}")
    if (cfg.run.pool_in or cfg.run.pool_out) and cfg.lookahead.pool_scope != "job":
        raise ConfigError("--pool-in / --pool-out (run.pool_in, run.pool_out) need lookahead.pool_scope=job")
    if not _DEVICE.fullmatch(cfg.model.device):
        raise ConfigError(f"model.device must be auto, cpu, cuda or cuda:N, got {cfg.model.device!r}")
    for key, choices in _CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(choices)}, got {value!r}")


def config_from_dict(data: dict[str, dict[str, Any]]) -> Config:
    """Rebuild a Config from ``Config.to_dict()`` output (used to ship configs to Ray actors)."""
    cfg = Config()
    for section, values in data.items():
        if section == "explicit":
            cfg.explicit = tuple(values)
            continue
        for name, value in values.items():
            set_key(cfg, f"{section}.{name}", value)
    validate(cfg)
    return cfg

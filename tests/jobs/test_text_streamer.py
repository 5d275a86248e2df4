"""The CLI's text streamer: what it prints is the whole output's decode, though each round decodes a window.

Oracle: ``tokenizer.decode`` of the whole output (what the record's ``text`` holds), and the streamer as it was
(the whole output decoded every round, its new characters printed). The tokenizer is the embedded model's
(SmolLM2: byte-level BPE, where one character's bytes may span tokens); the texts mix one- to four-byte
characters, and random token runs cut characters anywhere.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from lp_runner.jobs.worker import TextStreamer
from lp_runner.models.loading import fetch_embedded_model, load_tokenizer

TEXTS = (
    "naïve café, Ærøskøbing — 東京の天気は晴れ 🚀😀👩‍👩‍👧 ü€𝄞",
    "def f(x):\n    return x  # ∑ᵢ xᵢ² ≤ ∞, ℝ → ℂ\n\n\n日本語のテキスト🙂🙂🙂",
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(fetch_embedded_model())


class _Counting:
    """The tokenizer, counting how many tokens each ``decode`` call read."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids: Sequence[int], **kwargs) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def _whole_decode_streamer(tokenizer, shown: Sequence[int] = ()) -> tuple[list[str], callable]:
    """The streamer as it was: the whole output decoded every round, its new complete characters printed."""
    ids, out = list(shown), []
    printed = [len(tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")) if shown else 0]

    def put(tokens: Sequence[int]) -> None:
        ids.extend(tokens)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            out.append(text[printed[0] :])
            printed[0] = len(text)

    return out, put


def _rounds(ids: Sequence[int], seed: int) -> list[list[int]]:
    """``ids`` cut into rounds of 1 to 5 tokens, as lookahead commits them."""
    rng, out, i = random.Random(seed), [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        out.append(list(ids[i : i + n]))
        i += n
    return out


def _outputs(tokenizer) -> list[list[int]]:
    texts = [tokenizer(t).input_ids for t in TEXTS]
    rng = random.Random(0)
    noise = [[rng.randrange(len(tokenizer)) for _ in range(300)] for _ in range(3)]  # bytes cut anywhere, specials
    return texts + [texts[0] * 8] + noise


@pytest.mark.parametrize("seed", range(4))
def test_streamed_text_is_the_whole_decode(tokenizer, seed: int) -> None:
    multibyte = 0
    for ids in _outputs(tokenizer):
        written: list[str] = []
        counting = _Counting(tokenizer)
        streamer = TextStreamer(counting, written.append)
        old, old_put = _whole_decode_streamer(tokenizer)
        rounds = _rounds(ids, seed)
        for tokens in rounds:
            streamer(tokens)
            old_put(tokens)
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        assert written == old  # the same characters printed at the same rounds as the whole decode printed them
        if not whole.endswith("\ufffd"):
            assert "".join(written) == whole
        else:  # an output that ends inside a character: everything before it
            assert whole.startswith("".join(written)) and "".join(written) == whole[: len("".join(written))]
        multibyte += sum(1 for tokens in rounds if "\ufffd" in tokenizer.decode(tokens))  # a character was cut
        if len(ids) > 100:  # incremental: no round decodes more than its window, however long the output
            assert max(counting.lengths) < 60, max(counting.lengths)
    assert multibyte > 0  # guard: rounds did cut multi-byte characters


def test_a_resumed_stream_prints_what_follows(tokenizer) -> None:
    ids = tokenizer(TEXTS[0]).input_ids
    for cut in range(1, len(ids)):
        shown, rest = ids[:cut], ids[cut:]
        written: list[str] = []
        streamer = TextStreamer(tokenizer, written.append, shown=shown)
        for tokens in _rounds(rest, cut):
            streamer(tokens)
        before = tokenizer.decode(shown, skip_special_tokens=True).rstrip("\ufffd")
        assert before + "".join(written) == TEXTS[0], cut

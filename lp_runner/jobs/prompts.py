"""Prompt specs: reading the prompts JSONL and turning a spec into token ids.

JSONL: one object per line with ``id`` and either ``prompt`` (plain text, tokenized with the tokenizer's
defaults) or ``messages`` (a chat; the chat template is applied with the generation prompt).

Errors that make the file unreadable (not UTF-8, not JSON, no id, a duplicate id) always end the run: they name
the file and line. Errors of one prompt (empty, too long for the model) name its id and line, and follow
``run.on_error``: ``stop`` ends the run before anything is generated, ``skip`` turns them into error records.

A prompt far too long for the model is refused by its characters before it is tokenized (``too_long_to_tokenize``):
a tokenizer holds every token of a 50 MB line at once, gigabytes, only for the context check to refuse it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lp_runner.errors import InputError
from lp_runner.limits import quote


@dataclass(frozen=True)
class PromptSpec:
    id: str
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    where: str = ""  # "FILE:LINE" of a prompts file, "--prompt" for the command line's

    def describe(self) -> str:
        """How errors name this prompt: ``prompt 'b' (p.jsonl:3)``."""
        return f"prompt {quote(self.id)} ({self.where})" if self.where else f"prompt {quote(self.id)}"

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id}
        if self.messages is not None:
            d["messages"] = [dict(m) for m in self.messages]
        else:
            d["prompt"] = self.prompt
        return d


def spec_from_obj(obj: Any, where: str) -> PromptSpec:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object with 'id' and 'prompt' or 'messages'")
    if "id" not in obj:
        raise InputError(f"{where}: missing 'id'")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise InputError(f"{where}: needs exactly one of 'prompt' or 'messages'")
    if has_prompt:
        if not isinstance(obj["prompt"], str):
            raise InputError(f"{where}: 'prompt' must be a string")
        return PromptSpec(id=str(obj["id"]), prompt=obj["prompt"], where=where)
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
    ):
        raise InputError(f"{where}: 'messages' must be a list of {{'role': str, 'content': str}}")
    return PromptSpec(id=str(obj["id"]), messages=tuple(dict(m) for m in msgs), where=where)


def prompt_problem(spec: PromptSpec) -> str | None:
    """What makes this prompt unusable before any tokenizer is loaded (None: nothing found)."""
    if spec.prompt == "" or spec.messages == ():
        return "empty prompt: at least one token is needed"
    return None


def queue_order(lengths: Sequence[int]) -> list[int]:
    """Indices of the prompts, longest first (ties in file order): long prompts start early, so the job does
    not end waiting on one. ``queue_order([10, 40, 25, 40])`` -> [1, 3, 2, 0]."""
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


# Characters a tokenizer's normalizer may fold into one of a token's (NFKC composes a Hangul syllable from three
# jamo): the character bound allows for it, so it refuses only prompts that cannot fit whatever the normalizer does.
NORMALIZER_SLACK = 4


def prompt_chars(spec: PromptSpec) -> int:
    """The characters of a prompt's text (a chat: its messages' contents; the template only adds tokens)."""
    if spec.messages is not None:
        return sum(len(m["content"]) for m in spec.messages)
    return len(spec.prompt or "")


def too_long_to_tokenize(spec: PromptSpec, tokenizer: Any, max_new_tokens: int, context: int) -> str | None:
    """What is wrong with a prompt whose text alone is too long for ``context`` positions less ``max_new_tokens``,
    known from its characters without tokenizing it (None: it may fit; tokenizing it says).

    No token covers more characters than its longest vocabulary entry (byte-level and SentencePiece vocabularies
    spell a character of the text with at least one of theirs), so a prompt of C characters is at least
    C / (longest x NORMALIZER_SLACK) tokens. Example: the embedded model's longest token is 81 characters (a newline
    and 80 spaces), its context 8192: with max_new_tokens=16 a prompt past 8176 x 81 x 4 = 2,649,024 characters is
    refused here, a shorter one is tokenized and checked by its tokens."""
    room = context - max_new_tokens
    chars = prompt_chars(spec)
    if chars <= max(room, 0) * NORMALIZER_SLACK:  # no token is shorter than one character: nothing to learn here
        return None
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    least = math.ceil(chars / (longest * NORMALIZER_SLACK))
    if least <= room:
        return None
    return (
        f"prompt of {chars} characters, at least {least} tokens (no token of this tokenizer spans more than "
        f"{longest}), which with max_new_tokens={max_new_tokens} exceeds the model's context of {context} positions"
    )


def read_prompts(path: str | Path) -> list[PromptSpec]:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read prompts file {p}: {exc.strerror or exc}") from None
    specs: list[PromptSpec] = []
    first_line: dict[str, int] = {}
    for i, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"{p}:{i}: not UTF-8 text (byte {exc.start} of the line: {exc.reason})") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{p}:{i}: invalid JSON ({exc.msg})") from None
        spec = spec_from_obj(obj, f"{p}:{i}")
        if spec.id in first_line:
            raise InputError(f"{p}:{i}: duplicate id {quote(spec.id)} (first on line {first_line[spec.id]})")
        first_line[spec.id] = i
        specs.append(spec)
    if not specs:
        raise InputError(f"prompts file {p} holds no prompts")
    return specs


def encode(tokenizer: Any, spec: PromptSpec) -> list[int]:
    """Token ids exactly as a user of ``generate`` would build them."""
    if spec.messages is not None:
        ids = tokenizer.apply_chat_template(
            [dict(m) for m in spec.messages], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if hasattr(ids, "input_ids"):  # some tokenizers return a BatchEncoding even with return_dict=False
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(spec.prompt)["input_ids"])


@dataclass(frozen=True)
class JobPrompts:
    """A job's prompts as its loop runs them: each spec's token ids and what is wrong with it (None: nothing),
    made once per process before the first generation (``prepare_prompts``) and handed to the loop.

    ``order()`` is the one queue order every launcher runs: the usable prompts, longest first (ties in file
    order), so long prompts start early and the job does not end waiting on one. Example: prompts of 10, 40, 25
    and 40 tokens, the third one empty -> order [1, 3, 0]."""

    specs: tuple[PromptSpec, ...]
    ids: tuple[tuple[int, ...], ...]  # () for a prompt that cannot run
    problems: tuple[str | None, ...]

    def order(self) -> list[int]:
        good = [i for i, problem in enumerate(self.problems) if problem is None]
        return [good[k] for k in queue_order([len(self.ids[i]) for i in good])]

    def without(self, done: set[str]) -> JobPrompts:
        """The prompts whose ids are not in ``done`` (``--resume``: what the output lacks), in file order."""
        keep = [i for i, spec in enumerate(self.specs) if spec.id not in done]
        return JobPrompts(
            tuple(self.specs[i] for i in keep), tuple(self.ids[i] for i in keep), tuple(self.problems[i] for i in keep)
        )


def prepare_prompts(
    specs: Sequence[PromptSpec], tokenizer: Any, max_new_tokens: int, max_positions: int | None, on_error: str
) -> JobPrompts:
    """Tokenize and check every prompt once, before anything is generated: the one place a job's prompts become
    token ids. A prompt is unusable when it is empty, cannot be tokenized (messages for a tokenizer without a
    chat template) or does not fit the model's context (``max_positions``, None: unbounded) with
    ``max_new_tokens``; under ``run.on_error=stop`` the first such prompt raises an InputError naming its id and
    line, under ``skip`` its problem is kept for its error record."""
    ids: list[tuple[int, ...]] = []
    problems: list[str | None] = []
    for spec in specs:
        tokens, problem = _checked_ids(spec, tokenizer, max_new_tokens, max_positions)
        if problem is not None and on_error == "stop":
            raise InputError(f"{spec.describe()}: {problem}")
        ids.append(tokens)
        problems.append(problem)
    return JobPrompts(tuple(specs), tuple(ids), tuple(problems))


def _checked_ids(
    spec: PromptSpec, tokenizer: Any, max_new_tokens: int, max_positions: int | None
) -> tuple[tuple[int, ...], str | None]:
    """(token ids, None) for a usable prompt, ((), what is wrong) otherwise."""
    problem = prompt_problem(spec)
    if problem is None and max_positions is not None:  # before the tokenizer holds every token of a 50 MB line
        problem = too_long_to_tokenize(spec, tokenizer, max_new_tokens, max_positions)
    if problem is not None:
        return (), problem
    try:
        ids = tuple(encode(tokenizer, spec))
    except ValueError as exc:  # e.g. messages for a tokenizer without a chat template
        return (), f"cannot tokenize: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    if not ids:
        return (), "empty prompt: at least one token is needed"
    if max_positions is not None and len(ids) + max_new_tokens > max_positions:
        return (), (
            f"prompt of {len(ids)} tokens plus max_new_tokens={max_new_tokens} exceeds the model's context of "
            f"{max_positions} positions"
        )
    return ids, None

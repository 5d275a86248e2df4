"""Prompt specs: reading the prompts JSONL and turning a spec into token ids.

JSONL: one object per line with ``id`` and either ``prompt`` (plain text, tokenized with the tokenizer's
defaults) or ``messages`` (a chat; the chat template is applied with the generation prompt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lp_runner.errors import InputError


@dataclass(frozen=True)
class PromptSpec:
    id: str
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None

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
        return PromptSpec(id=str(obj["id"]), prompt=obj["prompt"])
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
    ):
        raise InputError(f"{where}: 'messages' must be a list of {{'role': str, 'content': str}}")
    return PromptSpec(id=str(obj["id"]), messages=tuple(dict(m) for m in msgs))


def read_prompts(path: str | Path) -> list[PromptSpec]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read prompts file {p}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise InputError(f"prompts file {p} is not UTF-8 text") from None
    specs = []
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{p}:{i}: invalid JSON ({exc.msg})") from None
        specs.append(spec_from_obj(obj, f"{p}:{i}"))
    if not specs:
        raise InputError(f"prompts file {p} holds no prompts")
    ids = [s.id for s in specs]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise InputError(f"prompts file {p}: duplicate id {dup!r}")
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

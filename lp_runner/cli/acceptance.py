"""``lp_runner study --record-acceptance``: record the configured model's acceptance at LP's windows.

The model loads as a job's does (placement, dtype, threads, backend), its fingerprint taken before the backend
repacks the weights; each prompt and window is one record in ``OUT/records.jsonl`` (``tuning.acceptance.record``:
resumable, every window checked against the prompt's greedy output). At the end the table goes to
``OUT/table.json`` and to the cache under the model's fingerprint, where the auto preset finds it for this model
(``acceptance.table_text_for``), and ``study --simulate --acceptance OUT/table.json`` prices it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lp_runner.config import Config, GenerationConfig, LookaheadConfig
from lp_runner.errors import InputError
from lp_runner.tuning.acceptance import (
    DEFAULT_WINDOWS,
    PromptToRecord,
    cached_table_path,
    read_records,
    record,
    table,
)

MAX_WINDOWS = 64  # a grid past this is a typo's, not a study's (each window is a pass over every prompt)
MAX_WINDOW_SIDE = 255  # W and G; N at most 32: a round's rows stay within a forward's bound


def parse_windows(text: str) -> list[tuple[int, int, int]]:
    """``"7-5-7,15-5-15"`` -> [(7, 5, 7), (15, 5, 15)]; empty: the default grid. One line for anything else."""
    if not text:
        return list(DEFAULT_WINDOWS)
    out = []
    for part in text.split(","):
        bits = part.strip().split("-")
        if len(bits) != 3 or not all(b.isdigit() and len(b) <= 3 for b in bits):
            raise InputError(f"--windows expects W-N-G[,W-N-G...] with small whole numbers, got {part.strip()!r}")
        w, n, g = map(int, bits)
        if not (1 <= w <= MAX_WINDOW_SIDE and 3 <= n <= 32 and 1 <= g <= MAX_WINDOW_SIDE):
            raise InputError(f"--windows {part.strip()}: W and G from 1 to {MAX_WINDOW_SIDE}, N from 3 to 32")
        out.append((w, n, g))
    if len(out) > MAX_WINDOWS:
        raise InputError(f"--windows names {len(out)} windows; at most {MAX_WINDOWS}")
    return out


@dataclass
class Recorder:
    """The configured model loaded as a job's is, ready to record: ``run(lookahead, ids)`` generates once and
    returns (output ids, the generation's ``RoundRecord``s)."""

    run: Callable[[LookaheadConfig, Sequence[int]], tuple[list[int], list]]
    tokenizer: Any
    max_positions: int | None
    weights: str  # the model's ``acceptance.fingerprint``, taken before the backend repacks the weights
    dtype: torch.dtype
    cache_root: Path
    threads: int  # torch's intra-op threads the recording runs on (its wall times depend on them, counts do not)


def load_recorder(cfg: Config) -> Recorder:
    """Load ``cfg``'s model (placement, dtype, threads, backend as a job does) for ``acceptance.record``."""
    from lp_runner.backends import select_backend
    from lp_runner.backends.adapter import ModelAdapter
    from lp_runner.decoding.engine import LookaheadEngine
    from lp_runner.device import bind, place, resolve_threads
    from lp_runner.jobs.worker import eos_token_ids
    from lp_runner.models.loading import default_cache_dir, load_model_and_tokenizer, resolve_model_path
    from lp_runner.tuning.acceptance import fingerprint

    placement = place(cfg.model.device, cfg.model.dtype)
    bind(placement)
    torch.set_num_threads(resolve_threads(cfg.model.threads))
    path = resolve_model_path(cfg.model.path, cfg.model.cache_dir or None)
    model, tokenizer, _ = load_model_and_tokenizer(path, dtype=placement.dtype, device=placement.device)
    weights = fingerprint(model)
    cache_root = Path(cfg.model.cache_dir).expanduser() if cfg.model.cache_dir else default_cache_dir()
    backend = select_backend(cfg.model.backend, model, placement.device, config=cfg.model, cache_root=cache_root)
    adapter = ModelAdapter(model, backend=backend)
    gen = GenerationConfig(max_new_tokens=cfg.generation.max_new_tokens)
    eos = eos_token_ids(model.generation_config, tokenizer)  # as a job's engine gets them

    def run(la: LookaheadConfig, ids: Sequence[int]) -> tuple[list[int], list]:
        res = LookaheadEngine(adapter, la, gen, eos).generate(list(ids))
        return list(res.output_ids), list(res.stats.records)

    threads = torch.get_num_threads()
    return Recorder(run, tokenizer, adapter.max_positions, weights, placement.dtype, cache_root, threads)


def record_acceptance(
    cfg: Config, prompts_path: str, out: Path, windows: Sequence[tuple[int, int, int]], log: Callable[[str], None]
) -> dict:
    """Record, write the table (``OUT/table.json`` and the cache's copy for this model) and return it."""
    from lp_runner.jobs.prompts import prepare_prompts, read_prompts

    specs = read_prompts(prompts_path)
    if not specs:
        raise InputError(f"{prompts_path}: no prompts to record on")
    rec = load_recorder(cfg)
    checked = prepare_prompts(specs, rec.tokenizer, cfg.generation.max_new_tokens, rec.max_positions, "stop")
    prompts = [
        PromptToRecord(s.id, "chat" if s.messages is not None else "completion", ids)
        for s, ids in zip(checked.specs, checked.ids, strict=True)
    ]
    records_file = out / "records.jsonl"
    record(rec.run, prompts, windows, records_file, log, rec.threads)
    name = f"{cfg.model.path} ({rec.dtype}), greedy".replace("torch.", "")
    max_new = cfg.generation.max_new_tokens
    data = table(read_records(records_file), name, Path(prompts_path).name, max_new, rec.weights, True)
    text = json.dumps(data, separators=(",", ":")) + "\n"
    for target in (out / "table.json", cached_table_path(rec.cache_root, rec.weights)):
        _write_atomic(target, text)
        log(f"wrote {target}")
    return data


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)

"""A job's round policy: which lookahead setting each generation uses and which row count each round runs at.

Built once per worker after the model is loaded (``RoundPolicy.build``): the device's forward-cost curve
(``calibrate``; rank 0's on every rank), the padding plan derived from it (``costmodel.RowPlan``) and, with
``lookahead.preset: auto``, the setting chosen from the curve (``preset.AutoPreset``), re-chosen between prompts
from the job's own outputs. With ``preset: off`` and ``pad_rows: false`` nothing is measured and the config's
setting runs as written. Every input of a choice is shared by all ranks, so every rank holds the same policy.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lp_runner.config import Config, LookaheadConfig, internal_key
from lp_runner.tuning.acceptance import Prior, fingerprint, table_from_text, table_text_for
from lp_runner.tuning.calibrate import (
    CALIBRATION_LIMIT_S,
    Calibration,
    arena_needs,
    calibrate,
    shared_calibration,
)
from lp_runner.tuning.costmodel import RowPlan, as_one_rank, batched_curve, shapes_from_records
from lp_runner.tuning.preset import NOT_ROUND_SHAPE, AutoPreset
from lp_runner.tuning.search import describe


@dataclass
class RoundPolicy:
    lookahead: LookaheadConfig  # the setting for the next generation
    row_plan: RowPlan | None  # None: every round at its own row count
    calibration: Calibration | None
    auto: AutoPreset | None
    compile: dict | None = None  # the job's forward: eager or compiled and why (``compile_choice.CompileChoice``)
    backend: dict | None = None  # the kernels it runs on and why (``ForwardBackend.describe``)
    pinned: tuple[str, ...] = ()  # the keys the config wrote that the auto preset keeps, as they were written
    batch: int = 1  # generations sharing each forward (``run.batch``, where the model can batch)

    @classmethod
    def fixed(cls, lookahead: LookaheadConfig) -> RoundPolicy:
        """The config's setting as written, no padding (what a caller without a curve gets)."""
        return cls(lookahead, None, None, None)

    @classmethod
    def build(
        cls,
        cfg: Config,
        adapter,
        comm,
        cache_root: Path,
        weights_checksum: Callable[[], str],
        log: Callable[[str], None] | None = None,
        batch: int = 1,
        model_fingerprint: str | None = None,
    ) -> RoundPolicy:
        """``batch``: generations that share each forward (``run.batch``); the auto preset then prices a round of
        one generation as its share of a forward of all of them (``costmodel.batched_curve``).
        ``model_fingerprint``: ``acceptance.fingerprint`` of the checkpoint, taken before a backend repacked its
        weights (None: taken from the adapter's model, which must not be repacked); it picks the model's own
        acceptance table."""
        la = cfg.lookahead
        if la.preset != "auto" and not la.pad_rows:
            return dataclasses.replace(cls.fixed(la), batch=batch)
        # the group waits in a collective; with groups > 1 the other groups wait for the --resume done set
        waited = comm.world_size > 1 or cfg.parallel.groups > 1
        budget = 0.5 * cfg.parallel.timeout_s if waited else None
        # stopped before the waiting ranks' timeout: the job goes on without a curve instead of failing
        limit = min(CALIBRATION_LIMIT_S, 0.8 * cfg.parallel.timeout_s) if waited else CALIBRATION_LIMIT_S
        cal = shared_calibration(
            comm, lambda: calibrate(adapter, cache_root, weights_checksum(), cfg.run.recalibrate, log, budget, limit)
        )
        if cal is None:  # the measurement ran out of time (calibrate said so): the setting as written
            return dataclasses.replace(cls.fixed(la), batch=batch)
        row_plan = RowPlan.from_curve(cal.curve) if la.pad_rows else None
        # rounds of several generations are not padded (scheduler.RoundLoop): the search prices them unpadded
        plan_for_search = (row_plan if batch == 1 else None) or RowPlan.identity()
        auto, pinned = None, ()
        if la.preset == "auto":
            curve = batched_curve(cal.curve, batch)
            mine = model_fingerprint or fingerprint(adapter.model)
            prior, whose = shared_prior(comm, lambda: table_text_for(cfg.model.acceptance, mine, cache_root))
            auto = AutoPreset(
                la, cfg.pinned_lookahead(), curve, plan_for_search, comm.world_size, cache_root, batch, prior, whose
            )
            shape = {f"lookahead.{name}" for name in auto.pinned} - {f"lookahead.{n}" for n in NOT_ROUND_SHAPE}
            pinned = tuple(k for k in cfg.explicit if internal_key(k) in shape)
        return cls(auto.lookahead if auto else la, row_plan, cal, auto, pinned=pinned, batch=batch)

    @staticmethod
    def arena_needs(cfg: Config, adapter, cache_root: Path, weights_checksum: Callable[[], str]) -> list[list[int]]:
        """The regions ``build``'s measurements hold at once on ``adapter``'s job arena, one list per measurement
        (a calibration it measures: ``calibrate.arena_needs``; none when it measures nothing), for the warm-up to
        size the arena before it records."""
        la = cfg.lookahead
        if la.preset != "auto" and not la.pad_rows:
            return []
        return arena_needs(adapter, cache_root, weights_checksum(), cfg.run.recalibrate)

    def observe(
        self,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        records: Sequence = (),
        ran: LookaheadConfig | None = None,
        remaining: int | None = None,
    ) -> bool:
        """After a generation: True when the next one uses another setting (the auto preset adapted).
        ``records``: its rounds (``GenerationStats.records``) and ``ran`` the setting they ran (default: the
        current one); a window setting's rounds are the job's own window statistics (``AutoPreset.observe``).
        ``remaining``: the generations still to start (None: unknown), the same on every rank."""
        if self.auto is None:
            return False
        ran = ran or self.lookahead
        own = ran == self.lookahead and ran.lookahead_branch and records
        # as P = 1 ran them: every rank holds the same shapes, so every rank makes the same choice
        shapes = as_one_rank(shapes_from_records(records, ran.window_size), len(prompt_ids)) if own else None
        if not self.auto.observe(prompt_ids, output_ids, shapes, remaining):
            return False
        self.lookahead = self.auto.lookahead
        return True

    def describe(self) -> dict:
        """What the records and the summary say about the setting and why it was chosen."""
        out: dict = {"preset": "auto" if self.auto else "off", "setting": describe(self.lookahead), "batch": self.batch}
        out["lookahead"] = dataclasses.asdict(self.lookahead)
        if self.auto is not None:
            out["choice"] = self.auto.choice.to_dict()
            out["choice"]["from_cache"] = self.auto.from_cache and self.auto.choice is self.auto.history[0]
        if self.auto is not None:
            out["pinned"] = list(self.pinned)
        if self.calibration is not None:
            out["calibration"] = self.calibration.summary()
        if self.compile is not None:
            out["compile"] = self.compile
        if self.backend is not None:
            out["backend"] = self.backend
        if self.row_plan is not None:
            k = -1  # the longest measured K/V length: what most rounds of a long generation see
            padded = {q: t for q, t in enumerate(self.row_plan.targets[k], start=1) if t != q}
            out["padding"] = {"kv_len": self.row_plan.kv_lens[k], "rows_to": {str(q): t for q, t in padded.items()}}
        return out


def shared_prior(comm, find: Callable[[], tuple[str | None, str]]) -> tuple[Prior | None, str]:
    """Rank 0's acceptance table on every rank (one start-up all_gather of its text), so every rank prices the
    same one even where their caches differ; ``find`` runs on rank 0 only."""
    text, whose = find() if comm.rank == 0 else (None, "")
    if comm.world_size > 1:
        text, whose = json.loads(comm.all_gather_strings(json.dumps([text, whose]))[0])
    return (None if text is None else table_from_text(text, whose).prior), whose

"""``lookahead.preset: auto``: choose the round shape from this device's measured forward-cost curve.

The tuner's model (``costmodel.predict``: recorded round shapes priced by a measured curve), made fast enough
to run at start-up. Its expensive part, running every considered setting on the model to learn its round
shapes, is replaced where it can be by a simulation that needs no model at all:

* Greedy output does not depend on the setting (every setting is exact), and without the Jacobi window a
  round's plan depends only on the committed tokens (pool and context index are fed the committed text, the
  adaptive context lengths the verdicts). So given a prompt and the model's output, ``simulate`` replays the
  real ``Coordinator`` round by round, verifies each candidate against the known output (the longest common
  prefix is what the model would accept), and yields exactly the round shapes the engine would produce
  (``tests/test_preset.py`` checks this against real runs). One setting over a few thousand tokens takes
  milliseconds, so a coordinate search over dozens of settings fits in a second or two.
* Jacobi-window rounds depend on the model's own trajectory guesses: they cannot be simulated, so the package
  ships the round shapes of a few window settings recorded once with the embedded model on the calibration
  prompts (``lp_runner/tuning/data/acceptance.json``, made by ``benchmarks/record_acceptance.py``), priced by the
  same live curve.

The samples start as the shipped calibration outputs (SmolLM2-135M-Instruct on prompts kept apart from every
benchmark prompt) and are replaced by this job's own outputs as they are generated (``AutoPreset.observe``):
the search is re-run on what this model actually writes for this job. Every choice is a pure function of the
curve and the committed tokens, so every LP rank makes the same one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

from lp_runner.collector import collector_paused
from lp_runner.config import LookaheadConfig, check_lookahead
from lp_runner.decoding.coordinator import Coordinator
from lp_runner.decoding.job_store import JobPool, StoreView, store_views
from lp_runner.errors import ConfigError
from lp_runner.tuning.costmodel import CostCurve, RoundShape, RowPlan, predict
from lp_runner.tuning.records import keyed_path, read_keyed, write_keyed
from lp_runner.tuning.search import coordinate_search, describe

# Knobs the start-up search moves (window off), in search order, with the values tried. The row cap is the
# knob that meets the curve: with padding, a cap of (cheap row count - 1) makes long proposals free.
AUTO_SPACE: dict[str, tuple] = {
    "verification_set_size": (0, 1, 2, 3, 4),  # 0: plain decoding, where no proposal pays for its rows
    "max_verify_rows": (0, 1, 2, 3, 4, 5, 7, 9, 11, 15, 23, 31),
    "long_match_ngram": (0, 2, 3),
    "long_match_rows": (0, 4, 7, 11, 15),
    "context_tokens": (4, 6, 10, 16),
}
# The same knobs for generations that share their forwards (``run.batch`` > 1, priced on ``costmodel.batched_curve``),
# the row cap first: there a speculative row costs a share of a forward of B x rows, and from the defaults (G=7,
# no cap) a search that tries G first finds plain decoding (G=0) better than long uncapped candidates, after which
# every proposal knob is inert and a short cap is never tried. On the 2-thread curve of this project's EPYC the
# row cap first chose G=7 rows<=2 at batch 4 and rows<=1 at batch 8 (predicted 3.1x and 5.0x one prompt at a
# time's tokens/s, against G=0's 2.5x and 4.4x); at batch 1 the two orders choose settings 0.1% apart.
BATCH_AUTO_SPACE: dict[str, tuple] = {
    k: AUTO_SPACE[k]
    for k in ("max_verify_rows", "verification_set_size", "long_match_ngram", "long_match_rows", "context_tokens")
}
# set in a config, they still leave every round-shape knob free (the job store's scope and bound are the job's,
# whichever setting runs)
NOT_ROUND_SHAPE = {"preset", "pad_rows", "pool_scope", "pool_max_tokens"}
AUTO_MIN_GAIN = 0.01  # a knob moves only on a predicted gain above 1% (predictions carry noise of the curve)
HOST_SHARE = 0.02  # host time per round as a share of a one-row forward (measured: ~2% in every configuration)
ADAPT_AFTER_TOKENS = (256, 1024, 4096)  # re-choose from this job's outputs once this many tokens were written
MAX_SAMPLE_TOKENS = 4096  # the search reads at most this many recent output tokens (bounds its time)


@dataclass(frozen=True)
class Sample:
    """One generation: what was asked and what the model answered (greedy or sampled)."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]


def simulate(la: LookaheadConfig, sample: Sample, store: JobPool | StoreView | None = None) -> list[RoundShape]:
    """The round shapes the engine produces at P = 1 for ``la`` (window off) on ``sample``, without the model.

    ``store``: the job store the engine would read under ``pool_scope: job`` (None: none, whatever the scope);
    a ``JobPool`` gets the sample at the end, as the engine does, so simulating a job's samples in order with one
    store reproduces the job; a ``StoreView`` (``job_pool.store_views``: the store before this sample) is only read.

    Verification against the known output: a candidate's hits are its longest common prefix with the output
    that follows the live key (past the output's end nothing is known, which only matters in the last round,
    whose emitted count the budget cuts anyway); the winner is the first candidate with the most hits, as in
    ``verify.greedy_verify``; the round emits hits + 1 tokens.

    Example: prompt (5, 6), output (7, 8, 9) and one candidate (7, 8, 1) planned in the prefill round: hits 2,
    emitted 3 -> one round, RoundShape(kv_len=0, ordinary=2, candidates=(3,), winner=0, emitted=3).
    """
    if la.lookahead_branch:
        raise ValueError("rounds with the Jacobi window depend on the model's guesses and cannot be simulated")
    out = sample.output_ids
    coord = Coordinator(la, 1, sample.prompt_ids, store=store)
    history = list(sample.prompt_ids)
    shapes: list[RoundShape] = []
    past_len, ordinary, done = 0, len(history), 0
    while done < len(out):
        plan = coord.plan(history, None)
        best, best_hits = -1, 0
        for c, cand in enumerate(plan.candidates):
            hits = _common_prefix(cand, out, done)
            if hits > best_hits or best < 0:
                best, best_hits = c, hits
        emitted = min(best_hits + 1, len(out) - done)
        shapes.append(
            RoundShape(past_len, ordinary, la.window_size, -1, tuple(map(len, plan.candidates)), best, emitted)
        )
        history.extend(out[done : done + emitted])
        done += emitted
        if done >= len(out):
            break
        past_len, ordinary = past_len + ordinary + best_hits, 1
        coord.feedback(plan, best, best_hits)
        coord.observe((), history, emitted)
    if isinstance(store, JobPool):
        store.add(sample.prompt_ids, out)
    return shapes


def _common_prefix(candidate: Sequence[int], out: Sequence[int], start: int) -> int:
    n = 0
    for tok in candidate:
        if start + n >= len(out) or out[start + n] != tok:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Recorded:
    """A window setting's round shapes, recorded once with a real model (``lp_runner/tuning/data/acceptance.json``)."""

    name: str
    lookahead: LookaheadConfig
    shapes: tuple[tuple[RoundShape, ...], ...]  # per calibration prompt


@dataclass(frozen=True)
class Prior:
    """What ships with the package: calibration samples and recorded window settings."""

    model: str
    samples: tuple[Sample, ...]
    recorded: tuple[Recorded, ...]


@lru_cache(maxsize=1)
def shipped_prior() -> Prior:
    """The calibration data in the package (see the module docstring); read once per process."""
    text = resources.files("lp_runner.tuning").joinpath("data/acceptance.json").read_text(encoding="utf-8")
    return prior_from_dict(json.loads(text))


def prior_from_dict(d: dict) -> Prior:
    samples = tuple(Sample(tuple(s["prompt_ids"]), tuple(s["output_ids"])) for s in d["samples"])
    recorded = tuple(
        Recorded(
            r["name"],
            LookaheadConfig(**r["lookahead"]),
            tuple(tuple(RoundShape(*row[:4], tuple(row[4]), *row[5:]) for row in prompt) for prompt in r["shapes"]),
        )
        for r in d.get("recorded", [])
    )
    return Prior(d["model"], samples, recorded)


@dataclass
class Choice:
    """The setting a search chose, with the why (for the summary and every record)."""

    lookahead: LookaheadConfig
    predicted_ms_per_token: float
    tokens_per_forward: float
    samples: str  # "shipped" (the package's calibration outputs) or "observed" (this job's own outputs)
    evaluated: int  # distinct settings priced
    reason: str
    curve_ms: dict[int, float] = field(default_factory=dict)  # the curve points behind it: rows -> body ms

    def to_dict(self) -> dict:
        la = self.lookahead
        return {
            "setting": describe(la),
            "predicted_ms_per_token": round(self.predicted_ms_per_token, 3),
            "predicted_tokens_per_forward": round(self.tokens_per_forward, 3),
            "samples": self.samples,
            "evaluated": self.evaluated,
            "reason": self.reason,
            "curve_body_ms": {str(k): round(v, 2) for k, v in self.curve_ms.items()},
        }


def _price(
    shapes: Sequence[Sequence[RoundShape]], curve: CostCurve, row_plan: RowPlan, host_s: float, world_size: int = 1
) -> tuple[float, float]:
    """(predicted ms per token, tokens per forward) of recorded or simulated rounds, prefill rounds excluded,
    replayed at ``world_size`` ranks (communication left out: one small all_gather per round for every setting)."""
    seconds = tokens = rounds = 0
    for prompt in shapes:
        p = predict(prompt, curve, world_size, 0.0, host_s, row_plan=row_plan)
        seconds, tokens, rounds = seconds + p.seconds, tokens + p.tokens, rounds + p.rounds
    ms = 1e3 * seconds / tokens if tokens else float("inf")
    return ms, (tokens / rounds if rounds else 0.0)


@collector_paused()
def search(
    base: LookaheadConfig,
    pinned: Sequence[str],
    curve: CostCurve,
    row_plan: RowPlan,
    samples: Sequence[Sample],
    recorded: Sequence[Recorded] = (),
    sample_source: str = "shipped",
    space: dict[str, tuple] | None = None,
    world_size: int = 1,
) -> Choice:
    """The setting with the lowest predicted time per token on ``samples`` under ``curve``.

    Window-off settings: a coordinate search over ``AUTO_SPACE`` (knobs in ``pinned`` keep ``base``'s value),
    priced by simulation. Window settings: each ``recorded`` one whose values agree with every pinned knob,
    priced from its recorded shapes. The lowest prediction wins; with nothing admissible (the pins rule out every
    candidate) ``base`` is returned as it is.
    """
    space = AUTO_SPACE if space is None else space
    pinned = set(pinned) - NOT_ROUND_SHAPE
    host_s = HOST_SHARE * curve.seconds(1, kv_len=curve.kv_lens[0])
    priced: dict[tuple, tuple[float, float]] = {}
    views: dict[int, list[StoreView] | None] = {}  # per store bound: one store for every setting, read in views

    def evaluate(la: LookaheadConfig) -> tuple[float, int] | None:
        key = dataclasses.astuple(la)
        if key not in priced:
            # under pool_scope: job the engine's store proposes too: the samples in order, each seeing the
            # store of the samples before it
            stores: list[JobPool | StoreView | None] = [None] * len(samples)
            if la.pool_scope == "job":
                if la.pool_max_tokens not in views:
                    views[la.pool_max_tokens] = store_views(
                        [(s.prompt_ids, s.output_ids) for s in samples], la.pool_max_tokens
                    )
                # where the samples fill the store it evicts: this setting's own store, grown sample by sample
                stores = views[la.pool_max_tokens] or [JobPool(la.pool_max_tokens)] * len(samples)
            shapes = [simulate(la, s, store) for s, store in zip(samples, stores, strict=True)]
            priced[key] = _price(shapes, curve, row_plan, host_s, world_size)
        return priced[key][0], 1

    options: list[tuple[float, float, LookaheadConfig, str]] = []
    if not base.lookahead_branch or "lookahead_branch" not in pinned:
        start = dataclasses.replace(base, lookahead_branch=False, preset="off")
        free = {k: v for k, v in space.items() if k not in pinned}
        best, _ = coordinate_search(start, evaluate, free, max_passes=3, min_gain=AUTO_MIN_GAIN)
        evaluate(best)
        ms, tpf = priced[dataclasses.astuple(best)]
        options.append((ms, tpf, best, "simulated"))
    for rec in recorded:
        if any(getattr(rec.lookahead, k) != getattr(base, k) for k in pinned):
            continue
        ms, tpf = _price(rec.shapes, curve, row_plan, host_s, world_size)
        adopted = dataclasses.replace(  # padding and the job store: the config's
            rec.lookahead,
            preset="off",
            pad_rows=base.pad_rows,
            pool_scope=base.pool_scope,
            pool_max_tokens=base.pool_max_tokens,
        )
        options.append((ms, tpf, adopted, f"recorded {rec.name}"))
    curve_ms = {p.rows: 1e3 * p.body_s for p in curve.points if p.kv_len == curve.kv_lens[-1]}
    if not options:
        return Choice(base, float("inf"), 0.0, sample_source, 0, "every candidate contradicts a pinned knob", curve_ms)
    ms, tpf, la, how = min(options, key=lambda o: o[0])
    check_lookahead(la)
    runner_up = sorted(options, key=lambda o: o[0])[1:2]
    why = f"lowest predicted ms/token ({how})"
    if runner_up:
        why += f"; next: {describe(runner_up[0][2])} at {runner_up[0][0]:.1f} ms/token ({runner_up[0][3]})"
    return Choice(la, ms, tpf, sample_source, len(priced) + len(recorded), why, curve_ms)


@lru_cache(maxsize=1)
def code_digest() -> str | None:
    """A digest of lp_runner's sources and data files: the start-up search is a function of its inputs and of
    this code (the simulation replays the coordinator, the pricing the cost model, the samples ship in data/).
    None when the package is not a folder of files (a zipped install): its choice is then never cached."""
    root = Path(str(resources.files("lp_runner")))
    files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json", ".c") and p.is_file())
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:20]


def startup_key(
    base: LookaheadConfig,
    pinned: Sequence[str],
    curve: CostCurve,
    row_plan: RowPlan,
    world_size: int,
    space: dict[str, tuple] | None = None,
) -> dict:
    """Everything the start-up search (shipped samples) depends on."""
    return {
        "space": list(AUTO_SPACE if space is None else space),  # the search's order (BATCH_AUTO_SPACE's differs)
        "base": dataclasses.asdict(base),
        "pinned": sorted(pinned),
        "curve": curve.to_dict(),
        "row_plan": dataclasses.asdict(row_plan),
        "world_size": world_size,
        "code": code_digest(),
    }


def choice_to_fields(choice: Choice) -> dict:
    return {**dataclasses.asdict(choice), "curve_ms": {str(k): v for k, v in choice.curve_ms.items()}}


def choice_from_fields(d: dict) -> Choice:
    fields = {**d, "lookahead": LookaheadConfig(**d["lookahead"])}
    fields["curve_ms"] = {int(k): v for k, v in d["curve_ms"].items()}
    return Choice(**fields)


class AutoPreset:
    """The auto preset of one job: a first choice from the shipped samples, then choices from the job's own.

    ``observe`` after every generation; ``lookahead`` is the setting for the next one. Re-chosen when the job's
    output tokens first reach each of ``ADAPT_AFTER_TOKENS``, from the most recent ``MAX_SAMPLE_TOKENS``; a job
    whose choice holds the Jacobi window keeps it (window rounds cannot be simulated from outputs).

    ``cache_root``: where the start-up choice is kept for the next job with the same inputs (``startup_key``).
    It is a pure function of them, and the search took 4.7 s of every start on a 2-core EPYC (Zen 3): 53
    settings simulated over the shipped samples. ``from_cache`` says whether this one was read back.
    """

    def __init__(
        self,
        base: LookaheadConfig,
        pinned: Sequence[str],
        curve: CostCurve,
        row_plan: RowPlan,
        world_size: int = 1,
        cache_root: Path | None = None,
        batch: int = 1,
    ) -> None:
        """``batch`` > 1: ``curve`` is a batch's (``costmodel.batched_curve``) and the search moves the row cap
        first (``BATCH_AUTO_SPACE``)."""
        if base.preset != "auto":
            raise ConfigError(f"AutoPreset needs lookahead.preset=auto, got {base.preset!r}")
        self.base, self.pinned, self.curve, self.row_plan = base, tuple(pinned), curve, row_plan
        self.world_size = world_size
        self.space = BATCH_AUTO_SPACE if batch > 1 else AUTO_SPACE
        self.choice, self.from_cache = self._startup_choice(cache_root)
        self.history: list[Choice] = [self.choice]
        self._observed: list[Sample] = []
        self._tokens = 0

    @property
    def lookahead(self) -> LookaheadConfig:
        return self.choice.lookahead

    def observe(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> bool:
        """Add a finished generation; returns True when the setting for the next one changed."""
        if not output_ids:
            return False
        before = self._tokens
        self._observed.append(Sample(tuple(prompt_ids), tuple(output_ids)))
        self._tokens += len(output_ids)
        crossed = any(before < t <= self._tokens for t in ADAPT_AFTER_TOKENS)
        if not crossed or self.lookahead.lookahead_branch:
            return False
        recent, count = [], 0
        for s in reversed(self._observed):
            if count >= MAX_SAMPLE_TOKENS:
                break
            recent.append(s)
            count += len(s.output_ids)
        choice = self._search(recent[::-1], (), "observed")
        changed = choice.lookahead != self.choice.lookahead
        self.choice = choice
        self.history.append(choice)
        return changed

    def _startup_choice(self, cache_root: Path | None) -> tuple[Choice, bool]:
        """The search over the shipped samples, or its result from the cache (a read-only cache costs the search
        again next time, not the run)."""
        path = key = None
        if cache_root is not None and code_digest() is not None:
            key = startup_key(self.base, self.pinned, self.curve, self.row_plan, self.world_size, self.space)
            path = keyed_path(cache_root, "preset", "startup", key)
            cached = read_keyed(path, key, lambda data: choice_from_fields(data["choice"]))
            if cached is not None:
                return cached, True
        prior = shipped_prior()
        choice = self._search(prior.samples, prior.recorded, "shipped")
        if path is not None:
            with contextlib.suppress(OSError):
                write_keyed(path, key, choice=choice_to_fields(choice))
        return choice, False

    def _search(self, samples: Sequence[Sample], recorded: Sequence[Recorded], source: str) -> Choice:
        return search(
            self.base,
            self.pinned,
            self.curve,
            self.row_plan,
            samples,
            recorded,
            source,
            space=self.space,
            world_size=self.world_size,
        )

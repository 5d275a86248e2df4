"""``lookahead.preset: auto``: choose the round shape from this device's measured forward-cost curve.

The quick mode of the one search (``tuning/search.py``: the same knob space, pricing, host-time model and gain
rule as ``lp_runner tune``), fast enough to run at start-up. Its expensive part, running every considered
setting on the model to learn its round shapes, is replaced where it can be by a simulation that needs no model:

* Greedy output does not depend on the setting (every setting is exact), and without the Jacobi window a
  round's plan depends only on the committed tokens (pool and context index are fed the committed text, the
  adaptive context lengths the verdicts). So given a prompt and the model's output, ``simulate`` replays the
  real ``Coordinator`` round by round, verifies each candidate against the known output (the longest common
  prefix is what the model would accept), and yields exactly the round shapes the engine would produce
  (``tests/tuning/test_preset.py`` checks this against real runs). One setting over a few thousand tokens takes
  milliseconds, so a coordinate search over dozens of settings fits in a second or two.
* Jacobi-window rounds depend on the model's own trajectory guesses: they cannot be simulated. Where their
  payoff comes from, and why: the job's own window rounds. The start-up choice prices the window settings the
  package ships recorded (``lp_runner/tuning/data/acceptance/``, made by ``benchmarks/record_acceptance.py``
  with the embedded model: W-N-G up to 31-7-31); they only decide whether the job *tries* the window. A job that
  runs a window records every round it runs (``observe(shapes=...)``), and each re-choice prices that window
  setting from this job's own rounds, on this model and these prompts, against the window-off settings
  simulated on the same job's outputs: a model whose window does not pay drops it after its first few hundred
  tokens. This costs no forward the job does not run anyway; recording windows per model at first use would
  cost every new model minutes of forwards before its first token on a CPU, where the window cannot pay, and it
  needs prompts in the model's own tokenizer. What it cannot do: try the window for a model whose window pays
  where the shipped recording says it does not (on a curve where rows are nearly free every recorded window
  pays; on a CPU none does).

The samples start as the shipped calibration outputs (SmolLM2-135M-Instruct on prompts kept apart from every
benchmark prompt) and are replaced by this job's own outputs as they are generated (``AutoPreset.observe``):
the search is re-run on what this model actually writes for this job. Every choice is a pure function of the
curve (with its measured host time, rank 0's on every rank) and the committed tokens, so every LP rank makes the
same one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

from lp_runner.collector import collector_paused
from lp_runner.config import LookaheadConfig, check_lookahead
from lp_runner.decoding.coordinator import Coordinator
from lp_runner.decoding.job_store import JobPool, StoreView, store_views
from lp_runner.decoding.layout import max_round_rows
from lp_runner.errors import ConfigError
from lp_runner.tuning.acceptance import Prior, Recorded, Sample, prior_digest
from lp_runner.tuning.costmodel import CostCurve, RoundShape, RowPlan
from lp_runner.tuning.records import keyed_path, read_keyed, write_keyed
from lp_runner.tuning.search import MIN_GAIN, QUICK_KNOBS, Scored, coordinate_search, describe, price, space_of

AUTO_SPACE: dict[str, tuple] = space_of(QUICK_KNOBS)  # the start-up search's share of the one knob space
# The same knobs for generations that share their forwards (``run.batch`` > 1, priced on ``costmodel.batched_curve``),
# the row cap first: there a speculative row costs a share of a forward of B x rows, and from the defaults (G=7,
# no cap) a search that tries G first finds plain decoding (G=0) better than long uncapped candidates, after which
# every proposal knob is inert and a short cap is never tried.
BATCH_AUTO_SPACE: dict[str, tuple] = space_of(
    ("max_verify_rows", "verification_set_size", "long_match_ngram", "long_match_rows", "context_tokens")
)
# set in a config, they still leave every round-shape knob free (the job store's scope and bound are the job's,
# whichever setting runs)
NOT_ROUND_SHAPE = {"preset", "pad_rows", "pool_scope", "pool_max_tokens"}
ADAPT_AFTER_TOKENS = (256, 1024, 4096)  # re-choose from this job's outputs once this many tokens were written
# a window running is re-judged from its own rounds once they cover this many output tokens: on fewer, one
# prompt's kind decides (of the shipped samples the first two, code that repeats its prompt, favour the window
# off on a flat curve, the other six the window)
WINDOW_EVIDENCE_TOKENS = 1024
# a model with no acceptance table tries its window only where a round of it costs at most this many one-row
# forwards (``probe_setting``)
PROBE_COST = 1.5
MAX_SAMPLE_TOKENS = 4096  # the search reads at most this many recent output tokens (bounds its time)


def simulate(la: LookaheadConfig, sample: Sample, store: JobPool | StoreView | None = None) -> list[RoundShape]:
    """The round shapes the engine produces at P = 1 for ``la`` (window off) on ``sample``, without the model.

    ``store``: the job store the engine would read under ``pool_scope: job`` (None: none, whatever the scope);
    a ``JobPool`` gets the sample at the end, as the engine does, so simulating a job's samples in order with one
    store reproduces the job; a ``StoreView`` (``job_store.store_views``: the store before this sample) is only read.

    Verification against the known output: a candidate's hits are its longest common prefix with the output
    that follows the live key (past the output's end nothing is known, which only matters in the last round,
    whose emitted count the budget cuts anyway); the winner is the first candidate with the most hits, as in
    ``greedy.greedy_verify``; the round emits hits + 1 tokens.

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
    acceptance: str = ""  # whose window acceptance was priced (``acceptance.table_text_for``'s label)

    def to_dict(self) -> dict:
        la = self.lookahead
        return {
            "setting": describe(la),
            "predicted_ms_per_token": round(self.predicted_ms_per_token, 3),
            "predicted_tokens_per_forward": round(self.tokens_per_forward, 3),
            "samples": self.samples,
            "evaluated": self.evaluated,
            "reason": self.reason,
            "acceptance": self.acceptance,
            "curve_body_ms": {str(k): round(v, 2) for k, v in self.curve_ms.items()},
        }


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

    ``search.coordinate_search`` over ``space`` (knobs in ``pinned`` keep ``base``'s value) from ``base`` with
    the window off, each setting priced by simulation; then each ``recorded`` window setting that agrees with
    every pinned knob, priced from its recorded shapes, replaces the winner under the same gain rule
    (``search.MIN_GAIN``). Priced by ``search.price`` at P = ``world_size`` with the curve's measured host time:
    each round at its busiest rank's share of the columns and candidates (``costmodel.rank_rows``, the engine's
    own sharding), so at P > 1 a window too large for one device wins where its share per rank sits under the
    curve's knee and buys more tokens per forward (LP's lever; ``tests/tuning/test_preset.py``). Communication
    left out (one small all_gather per round for every setting). With nothing admissible (the pins
    rule out every candidate) ``base`` is returned as it is.
    """
    space = AUTO_SPACE if space is None else space
    pinned = set(pinned) - NOT_ROUND_SHAPE
    priced: dict[tuple, tuple[Scored, str]] = {}
    views: dict[int, list[StoreView] | None] = {}  # per store bound: one store for every setting, read in views
    windows: dict[tuple, Recorded] = {}
    for rec in recorded:
        if any(getattr(rec.lookahead, k) != getattr(base, k) for k in pinned):
            continue
        adopted = dataclasses.replace(  # padding and the job store: the config's
            rec.lookahead,
            preset="off",
            pad_rows=base.pad_rows,
            pool_scope=base.pool_scope,
            pool_max_tokens=base.pool_max_tokens,
        )
        windows[dataclasses.astuple(adopted)] = dataclasses.replace(rec, lookahead=adopted)

    def shapes_of(la: LookaheadConfig) -> tuple[Sequence[Sequence[RoundShape]], str]:
        if la.lookahead_branch:
            rec = windows[dataclasses.astuple(la)]
            return rec.shapes, f"recorded {rec.name}"
        # under pool_scope: job the engine's store proposes too: the samples in order, each seeing the store of
        # the samples before it
        stores: list[JobPool | StoreView | None] = [None] * len(samples)
        if la.pool_scope == "job":
            if la.pool_max_tokens not in views:
                views[la.pool_max_tokens] = store_views(
                    [(s.prompt_ids, s.output_ids) for s in samples], la.pool_max_tokens
                )
            # where the samples fill the store it evicts: this setting's own store, grown sample by sample
            stores = views[la.pool_max_tokens] or [JobPool(la.pool_max_tokens)] * len(samples)
        return [simulate(la, s, store) for s, store in zip(samples, stores, strict=True)], "simulated"

    def evaluate(la: LookaheadConfig) -> tuple[float, int] | None:
        key = dataclasses.astuple(la)
        if key not in priced:
            if la.lookahead_branch and key not in windows:
                return None  # a window setting nobody recorded cannot be priced here
            shapes, how = shapes_of(la)
            priced[key] = (price(la, shapes, curve, world_size, 0.0, None, row_plan), how)
        return priced[key][0].ms_per_token, 1

    extra, off = [rec.lookahead for rec in windows.values()], None
    if not base.lookahead_branch or "lookahead_branch" not in pinned:
        start = dataclasses.replace(base, lookahead_branch=False, preset="off")
        free = {k: v for k, v in space.items() if k not in pinned}
        off, _ = coordinate_search(start, evaluate, free, max_passes=3, min_gain=MIN_GAIN)
        best, _ = coordinate_search(off, evaluate, {}, min_gain=MIN_GAIN, extra=extra)  # the window: same rule
    else:  # the window pinned on: only recorded window settings are admissible
        best = min(extra, key=lambda la: evaluate(la)[0], default=None)
    curve_ms = {p.rows: 1e3 * p.body_s for p in curve.points if p.kv_len == curve.kv_lens[-1]}
    if best is None:
        return Choice(base, float("inf"), 0.0, sample_source, 0, "every candidate contradicts a pinned knob", curve_ms)
    evaluate(best)
    check_lookahead(best)
    chosen, how = priced[dataclasses.astuple(best)]
    # the runner-up among the window-off search's winner and the window settings
    options = [priced[dataclasses.astuple(off)]] if off is not None else []
    options += [priced[k] for k in windows if k in priced]
    others = sorted((v for v in options if v[0].lookahead != best), key=lambda v: v[0].ms_per_token)
    why = f"lowest predicted ms/token ({how})"
    if others:
        nxt, nxt_how = others[0]
        why += f"; next: {describe(nxt.lookahead)} at {nxt.ms_per_token:.1f} ms/token ({nxt_how})"
    return Choice(best, chosen.ms_per_token, chosen.tokens_per_forward, sample_source, len(priced), why, curve_ms)


def probe_setting(base: LookaheadConfig, pinned: Sequence[str], curve: CostCurve) -> tuple[LookaheadConfig, str]:
    """The first setting of a model nothing was recorded for, and why: the config's, with its window only where a
    round of it costs at most ``PROBE_COST`` one-row forwards on this device's curve (a GPU under its knee), unless
    the config pins the window. A window earns tokens per forward that only its own rounds can tell; past that cost
    it would have to more than double what the window-off proposals already commit to pay, which no model's window
    was seen to do here, so the job starts without it and its outputs price the window-off knobs from the first
    re-choice on. Example: W=7 N=5 G=7 is 57 rows: run on a curve flat to 128 rows, left off on one where 57 rows
    cost 4 one-row forwards."""
    la = dataclasses.replace(base, preset="off")
    if not la.lookahead_branch:
        return la, "no acceptance recorded for this model: the setting as configured (window off)"
    rows = max_round_rows(la)
    cost = curve.ratio(rows, kv_len=curve.kv_lens[0])
    if cost <= PROBE_COST or "lookahead_branch" in pinned or "window_size" in pinned:
        return la, f"no acceptance recorded for this model: its window tried as configured ({rows} rows, {cost:.2f}x)"
    la = dataclasses.replace(la, lookahead_branch=False)
    check_lookahead(la)
    return la, f"no acceptance recorded for this model: window off (a round of it costs {cost:.2f}x one row here)"


def payback(observed: int, remaining: int | None) -> bool:
    """Whether a re-choice after ``observed`` generations can pay for itself: at least as many generations are
    still to start (``remaining``; None: unknown, assumed to). Its cost grows with the outputs it reads, its gain
    with the generations it serves; with re-choices at geometrically spaced token counts (``ADAPT_AFTER_TOKENS``)
    this keeps every search inside the first half of a job. Example: a job of 40 prompts re-chooses after 256
    output tokens (2 observed, 38 to start) and 1,024 (8, 32), but not after 4,096 (34, 6)."""
    return remaining is None or remaining >= observed


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
    output tokens first reach each of ``ADAPT_AFTER_TOKENS`` while enough of the job is left to repay the search
    (``payback``), from the most recent ``MAX_SAMPLE_TOKENS``; a job
    whose choice holds the Jacobi window prices it from its own window rounds, once they cover
    ``WINDOW_EVIDENCE_TOKENS``, and keeps it only where they beat the window-off settings simulated on the same
    outputs (window rounds cannot be simulated).

    ``cache_root``: where the start-up choice is kept for the next job with the same inputs (``startup_key``).
    It is a pure function of them, and the search took seconds of every start on a 2-core CPU (some 50
    settings simulated over the shipped samples). ``from_cache`` says whether this one was read back.
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
        prior: Prior | None = None,
        acceptance: str = "the embedded model's (shipped)",
    ) -> None:
        """``batch`` > 1: ``curve`` is a batch's (``costmodel.batched_curve``) and the search moves the row cap
        first (``BATCH_AUTO_SPACE``). ``prior``: the samples and window acceptance recorded for the model that
        runs (``acceptance.table_text_for``), ``acceptance`` whose it is; None: nothing recorded for this model,
        so the first choice is the config's setting as written (the window on at its W-N-G unless the config
        turned it off) and the job's own rounds decide from the first re-choice on."""
        if base.preset != "auto":
            raise ConfigError(f"AutoPreset needs lookahead.preset=auto, got {base.preset!r}")
        self.base, self.pinned, self.curve, self.row_plan = base, tuple(pinned), curve, row_plan
        self.world_size = world_size
        self.space = BATCH_AUTO_SPACE if batch > 1 else AUTO_SPACE
        self.prior, self.acceptance = prior, acceptance
        self.choice, self.from_cache = self._startup_choice(cache_root)
        self.history: list[Choice] = [self.choice]
        self._observed: list[Sample] = []
        self._window_rounds: list[tuple[RoundShape, ...]] = []  # this job's rounds of the window setting running
        self._window_tokens = 0  # the output tokens they made
        self._tokens = 0

    @property
    def lookahead(self) -> LookaheadConfig:
        return self.choice.lookahead

    def observe(
        self,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        shapes: Sequence[RoundShape] | None = None,
        remaining: int | None = None,
    ) -> bool:
        """Add a finished generation; returns True when the setting for the next one changed. ``shapes``: the
        rounds it ran (``costmodel.shapes_from_records``); those of a window setting are this job's own window
        statistics, which price that setting at the next re-choice (see the module docstring).

        ``remaining``: the generations still to start after this one (None: unknown, e.g. ``api.generate``'s
        calls). A re-choice runs on the job's critical path (the next prompt, and every generation in flight
        beside it, waits for its seconds of simulation), and it pays back only over the generations that start
        after it; so it is skipped when fewer of them are left than it learned from (``payback``)."""
        if not output_ids:
            return False
        if self.lookahead.lookahead_branch and shapes:
            self._window_rounds.append(tuple(shapes))
            self._window_tokens += len(output_ids)
        before = self._tokens
        self._observed.append(Sample(tuple(prompt_ids), tuple(output_ids)))
        self._tokens += len(output_ids)
        if not any(before < t <= self._tokens for t in ADAPT_AFTER_TOKENS):
            return False
        if not payback(len(self._observed), remaining):
            return False
        if self.lookahead.lookahead_branch and self._window_tokens < WINDOW_EVIDENCE_TOKENS:
            return False  # too few of its own rounds (or none observed) to judge the window: it stays
        recent, count = [], 0
        for s in reversed(self._observed):
            if count >= MAX_SAMPLE_TOKENS:
                break
            recent.append(s)
            count += len(s.output_ids)
        own: tuple[Recorded, ...] = ()
        if self.lookahead.lookahead_branch:  # the window setting that ran, priced from its own rounds
            own = (Recorded("this job's rounds", self.lookahead, tuple(self._window_rounds[-len(recent) :])),)
        choice = self._search(recent[::-1], own, "observed")
        changed = choice.lookahead != self.choice.lookahead
        self.choice = choice
        self.history.append(choice)
        if changed:
            self._window_rounds, self._window_tokens = [], 0
        return changed

    def _startup_choice(self, cache_root: Path | None) -> tuple[Choice, bool]:
        """The search over the shipped samples, or its result from the cache (a read-only cache costs the search
        again next time, not the run)."""
        if self.prior is None:
            la, why = probe_setting(self.base, self.pinned, self.curve)
            why += (
                "; re-chosen from this job's own outputs and window rounds (lp_runner study --record-acceptance "
                "records a table for this model)"
            )
            return Choice(la, 0.0, 0.0, "none", 0, why, {}, self.acceptance), False
        path = key = None
        if cache_root is not None and code_digest() is not None:
            key = startup_key(self.base, self.pinned, self.curve, self.row_plan, self.world_size, self.space)
            key["acceptance"] = prior_digest(self.prior)
            path = keyed_path(cache_root, "preset", "startup", key)
            cached = read_keyed(path, key, lambda data: choice_from_fields(data["choice"]))
            if cached is not None:
                return cached, True
        choice = self._search(self.prior.samples, self.prior.recorded, "shipped")
        if path is not None:
            with contextlib.suppress(OSError):
                write_keyed(path, key, choice=choice_to_fields(choice))
        return choice, False

    def _search(self, samples: Sequence[Sample], recorded: Sequence[Recorded], source: str) -> Choice:
        choice = search(
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
        if source == "observed":  # only this job's own rounds price a window once the job has outputs
            whose = "this job's window rounds" if recorded else "none: the window-off settings on this job's outputs"
        else:
            whose = self.acceptance
        return dataclasses.replace(choice, acceptance=whose)

"""One worker's job: join the group (if any), load the replica, check peers, run prompts, report records.

The same function runs as the only process (P = 1), as a torchrun rank, and inside a Ray actor, so every path
produces the same records. Only rank 0 streams, writes and reports.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lp_runner.backends import check_backend, select_backend
from lp_runner.backends.adapter import ModelAdapter
from lp_runner.config import Config
from lp_runner.decoding.engine import GenerationResult, LookaheadEngine
from lp_runner.decoding.job_store import JobPool, tokenizer_fingerprint
from lp_runner.decoding.layout import check_model_fits
from lp_runner.decoding.scheduler import Job, batch_for
from lp_runner.device import (
    Placement,
    bind,
    gpu_count,
    local_world_size,
    peak_host_mib,
    place,
    resolve_dist_backend,
    resolve_threads,
    synchronizer,
)
from lp_runner.errors import ConfigError, DistributedError, InputError, first_line
from lp_runner.jobs.output import output_digest, output_settings
from lp_runner.jobs.prompts import PromptSpec, encode, prompt_problem
from lp_runner.logs import log
from lp_runner.models.loading import default_cache_dir, load_model_and_tokenizer, resolve_model_path, weights_checksum
from lp_runner.parallel.comm import (
    Communicator,
    SoloCommunicator,
    TorchCommunicator,
    init_process_group,
    strings_group,
)
from lp_runner.parallel.groups import GroupLayout, Heartbeat, form_groups, group_layout
from lp_runner.tuning.calibrate import device_name
from lp_runner.tuning.compile_choice import (
    RECORD_KV,
    CompileChoice,
    decide,
    load_record,
    measure_record,
    record_file,
    record_key,
    save_record,
)
from lp_runner.tuning.policy import RoundPolicy


@dataclass
class Worker:
    cfg: Config
    comm: Communicator
    adapter: ModelAdapter
    tokenizer: Any
    model_path: Path
    device: torch.device
    load_s: float
    policy: RoundPolicy | None = None  # setting and row padding per round; None: the config's setting as written
    group: int = 0  # this rank's LP group (parallel.groups = D > 1; comm is then the group's communicator)
    layout: GroupLayout | None = None  # None: one group, the whole world
    control: Communicator | None = None  # D > 1: the whole world, on gloo (start-up messages only)
    heartbeat: Heartbeat | None = None  # D > 1, on each group's leader: tells world rank 0 the group is alive
    store: JobPool | None = None  # lookahead.pool_scope=job: the job's store (advanced.pool_in's contents at start)
    placement: Placement | None = None  # device, dtype and TF32 as resolved (device.place)
    load_peak_mib: float = 0.0  # this process's peak host memory right after loading the weights
    load_peaks_mib: list[float] | None = None  # every rank's load_peak_mib (check_peers), in rank order
    encoded: dict[str, list[int]] = field(default_factory=dict)  # a prompt's token ids by its spec: tokenized once

    @property
    def is_main(self) -> bool:
        """The writing rank: rank 0 of the world (with D groups, the leader of group 0)."""
        return self.comm.rank == 0 and self.group == 0


def _rank0_timings(comm: Communicator, ms: dict[str, float]) -> dict[str, float]:
    """What rank 0 of this LP group measured when choosing the backend's kernels: its ranks choose alike."""
    return json.loads(comm.all_gather_strings(json.dumps(ms))[0])


def distributed_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun / Ray environment; (0, 1, 0) when alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


def start_worker(cfg: Config, prompts: Sequence[PromptSpec] = (), prompt_count: int = 0) -> Worker:
    """Join the process group, load the model, and check that all ranks agree.

    ``prompts``: with ``run.on_error=stop``, checked (tokenized, against the model's context) as soon as the
    tokenizer is loaded, so a bad prompt file fails before the start-up calibration is measured.
    ``prompt_count``: the job's number of prompts where ``prompts`` are not given here (a Ray actor: the driver
    holds them); the batch never exceeds the job's prompts (``scheduler.batch_for``).

    Under a launcher (torchrun or the Ray backend: MASTER_ADDR is set) the process group is formed even with one
    rank, so ``torchrun --nproc-per-node=1`` runs the same collective path as P > 1 (NCCL on a GPU); a plain
    ``python -m lp_runner`` uses the no-op communicator.

    With ``parallel.groups = D > 1`` the world (D x P ranks, WORLD_SIZE checked) splits into D LP groups of
    contiguous ranks (``parallel.groups``); ``comm`` is this rank's group (the no-op one when P = 1), ``control``
    the whole world on gloo (peer check, ``--resume`` done set), and each group's leader starts its heartbeat.
    """
    rank, world, _ = distributed_env()
    launched = "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    par = cfg.parallel
    layout = group_layout(world, rank, par.workers, par.groups) if par.groups > 1 else None  # checks D x P
    if layout is None and world > 1 and par.workers not in (1, world):
        raise ConfigError(f"parallel.workers={par.workers} but the launcher started {world} workers")
    placement = place(cfg.model.device, cfg.model.dtype)  # before anything touches a GPU
    if rank == 0 and (caveat := placement.precision_caveat()) is not None:
        log.info("%s", caveat)
    check_backend(cfg.model.backend, placement.device)  # before the weights are loaded
    bind(placement)
    torch.set_num_threads(resolve_threads(cfg.model.threads))  # LOCAL_WORLD_SIZE counts all D x P local ranks
    comm, control, heartbeat = join_groups(cfg, placement, layout, launched or world > 1)
    start = time.perf_counter()
    path = resolve_model_path(cfg.model.path, cfg.model.cache_dir or None)
    model, tokenizer, folder = load_model_and_tokenizer(
        path, dtype=placement.dtype, device=placement.device, allow_pickle=cfg.model.allow_pickle
    )
    load_peak_mib = peak_host_mib()  # the weights went straight to the device: what loading cost the host
    _CHECKSUMS[model] = weights_checksum(model)  # of the checkpoint's weights, before a backend repacks them
    cache_root = default_cache_dir() if not cfg.model.cache_dir else Path(cfg.model.cache_dir).expanduser()
    backend = select_backend(  # once, at load: nothing after this knows which kernels run
        cfg.model.backend,
        model,
        placement.device,
        config=cfg.model,
        cache_root=cache_root,
        agree=lambda ms: _rank0_timings(comm, ms),
    )
    load_s = time.perf_counter() - start
    adapter = ModelAdapter(model, backend=backend)
    check_model_fits(cfg.lookahead, cfg.generation, adapter.max_positions)  # the loaded model's own context
    worker = Worker(cfg, comm, adapter, tokenizer, folder, placement.device, load_s)
    worker.placement, worker.load_peak_mib = placement, load_peak_mib
    worker.layout, worker.control, worker.heartbeat = layout, control, heartbeat
    worker.group = layout.group if layout is not None else 0
    worker.store = job_store(cfg, tokenizer, adapter.vocab_size)  # --pool-in checked before the first forward
    if (control or comm).world_size > 1:
        check_peers(worker, control or comm)  # every rank of the job, not only of its group
    arena_tokens = 0
    if prompts:
        checker = LookaheadEngine(worker.adapter, cfg.lookahead, cfg.generation, eos_token_ids(worker), comm)
        prompt_ids, _ = check_prompts(worker, checker, prompts)  # on_error=stop: the first bad prompt raises here
        arena_tokens = checker.capacity(max(map(len, prompt_ids), default=0))  # the job's longest generation
    job_tokens = len(prompts) * cfg.generation.max_new_tokens
    batch, why_not = batch_for(cfg.run.batch, worker.adapter, len(prompts) or prompt_count)
    if why_not and worker.is_main:
        log.warning(why_not)
    compile_choice = choose_forward(
        worker, job_tokens, cache_root, say=_log if worker.is_main else None, arena_tokens=arena_tokens, batch=batch
    )
    worker.policy = RoundPolicy.build(
        cfg,
        worker.adapter,
        comm,
        cache_root=cache_root,
        weights_checksum=lambda: model_checksum(worker),
        log=_log if worker.is_main else None,
        batch=batch,
    )
    worker.policy.compile = compile_choice.describe()
    worker.policy.backend = worker.adapter.backend.describe()  # the compiled adapter's where it compiled
    return worker


def join_groups(
    cfg: Config, placement: Placement, layout: GroupLayout | None, launched: bool
) -> tuple[Communicator, Communicator | None, Heartbeat | None]:
    """(this rank's LP group, the whole job on gloo when D > 1, the group leader's heartbeat) for a rank whose
    device is bound (``device.bind``): the process group is formed on that device, the round exchange runs on
    the resolved backend (NCCL: the rank's GPU) and every start-up string goes over gloo.

    Alone (no launcher) this is the no-op communicator; under a launcher the group is formed even with one rank,
    so ``torchrun --nproc-per-node=1`` runs the same collective path as P > 1."""
    par = cfg.parallel
    if layout is None and not launched:
        return SoloCommunicator(), None, None
    backend = resolve_dist_backend(par.dist_backend, cfg.model.device, local_world_size(), gpu_count())
    init_process_group(backend, par.timeout_s, placement.device)
    device = placement.collective_device(backend)
    if layout is None:
        return TorchCommunicator(device, None, strings_group(par.timeout_s), par.timeout_s), None, None
    groups = form_groups(layout, par.timeout_s)
    comm: Communicator = SoloCommunicator()  # a group of one rank has nothing to exchange, as a plain process
    if layout.workers > 1:
        comm = TorchCommunicator(device, groups.group, groups.group_strings, par.timeout_s)
    control = TorchCommunicator(torch.device("cpu"), groups.control, None, par.timeout_s)
    heartbeat = None
    if comm.rank == 0:
        heartbeat = Heartbeat(layout.group, par.timeout_s)
        heartbeat.start()
    return comm, control, heartbeat


def job_store(cfg: Config, tokenizer: Any, vocab_size: int | None = None) -> JobPool | None:
    """The job's store under ``pool_scope: job`` (None otherwise), started from ``advanced.pool_in`` when given
    (a pool file of another tokenizer, version, a truncated one or one with a token id outside ``vocab_size``,
    the model's: a one-line InputError)."""
    if cfg.lookahead.pool_scope != "job":
        return None
    store = JobPool(cfg.lookahead.pool_max_tokens)
    if cfg.run.pool_in:
        store.load(cfg.run.pool_in, tokenizer_fingerprint(tokenizer), vocab_size)
    return store


def save_store(worker: Worker) -> None:
    """``advanced.pool_out``: the writing rank saves the job's store after the job's last prompt."""
    if worker.cfg.run.pool_out and worker.store is not None and worker.is_main:
        worker.store.save(worker.cfg.run.pool_out, tokenizer_fingerprint(worker.tokenizer))


def _log(message: str) -> None:
    log.info(message)


def check_peers(worker: Worker, comm: Communicator | None = None) -> None:
    """Every rank must run the same config on the same weights, or outputs would silently fork.

    ``comm``: the ranks to compare (default: the worker's LP group); ranks in errors are its ranks. The same
    message carries each rank's peak host memory at load, which the writing rank keeps for the records."""
    mine = f"{worker.cfg.digest()}|{model_checksum(worker)}|{worker.load_peak_mib:.1f}"
    everyone = (comm or worker.comm).all_gather_strings(mine)
    worker.load_peaks_mib = [float(s.split("|")[2]) for s in everyone]
    cfgs = {s.split("|")[0] for s in everyone}
    if len(cfgs) > 1:
        bad = [r for r, s in enumerate(everyone) if s.split("|")[0] != everyone[0].split("|")[0]]
        raise DistributedError(f"config mismatch between ranks: ranks {bad} differ from rank 0")
    if len({s.split("|")[1] for s in everyone}) > 1:
        bad = [r for r, s in enumerate(everyone) if s.split("|")[1] != everyone[0].split("|")[1]]
        raise DistributedError(f"model weights differ between ranks: ranks {bad} differ from rank 0")


def eos_token_ids(worker: Worker) -> list[int]:
    ids = worker.adapter.model.generation_config.eos_token_id
    if ids is None:
        ids = worker.tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


_CHECKSUMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_checksum(worker: Worker) -> str:
    """``weights_checksum`` of the worker's model, computed once per model (one pass over the weights)."""
    model = worker.adapter.model
    if model not in _CHECKSUMS:
        _CHECKSUMS[model] = weights_checksum(model)
    return _CHECKSUMS[model]


def make_error_record(worker: Worker, spec: PromptSpec, error: str) -> dict:
    """``run.on_error=skip``: what the output keeps of a prompt that could not run (resume skips it too)."""
    return {
        "id": spec.id,
        "error": error,
        "config_digest": output_digest(worker.cfg),
        "weights_checksum": model_checksum(worker),
        "config": output_settings(worker.cfg),
        "run": run_info(worker),
    }


def make_record(worker: Worker, spec: PromptSpec, prompt_ids: Sequence[int], result: GenerationResult) -> dict:
    cfg, s = worker.cfg, result.stats
    la = result.lookahead or (worker.policy.lookahead if worker.policy is not None else cfg.lookahead)  # that ran
    return {
        "id": spec.id,
        "prompt_ids": list(prompt_ids),
        "output_ids": result.output_ids,
        "text": worker.tokenizer.decode(result.output_ids, skip_special_tokens=True),
        "new_tokens": len(result.output_ids),
        "forwards": s.forwards,
        "seconds": round(s.seconds, 6),
        "tokens_per_forward": round(s.tokens_per_forward, 4),
        "tokens_per_s": round(s.tokens_per_s, 3),
        "model": str(worker.model_path),
        "window_size": la.window_size,
        "ngram_size": la.ngram_size,
        "verification_set_size": la.verification_set_size,
        "pool_from_prompt": la.pool_from_prompt,
        "workers": worker.comm.world_size,
        "group": worker.group,  # which of the parallel.groups LP groups generated it (0 with one group)
        "dist_backend": worker.comm.backend,
        "do_sample": cfg.generation.do_sample,
        "stats": s.summary(),
        "policy": worker.policy.describe() if worker.policy is not None else {"preset": "off"},
        "config_digest": output_digest(cfg),  # what ``--resume`` checks: same settings, same weights
        "weights_checksum": model_checksum(worker),
        "config": output_settings(cfg),
        "run": run_info(worker),
    }


def package_versions() -> dict[str, str]:
    import transformers

    from lp_runner import __version__

    return {
        "lp_runner": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


@functools.cache
def _device_label(device: torch.device) -> str:
    return device_name(device)  # reads /proc/cpuinfo on a CPU: once per process


def choose_forward(
    worker: Worker, job_tokens: int, cache_root: Path, say=None, arena_tokens: int = 0, batch: int = 1
) -> CompileChoice:
    """Eager or compiled rounds for this job (``model.compile``, ``compile_choice``): rank 0 decides, every rank of
    the group follows; a compiled adapter replaces ``worker.adapter`` after compiling (timed). With ``on`` (or
    ``auto`` capturing a CUDA device's first long job), rank 0 records what compiling cost and saved on this device
    (when it has no record, or on ``--recalibrate``), which is what ``auto`` decides from next time; each row
    bucket's capture seconds go to the job's records (``CompileChoice.capture_s``). ``arena_tokens``: the K/V
    positions the job's longest generation can hold (``LookaheadEngine.capacity``), ``batch`` of them in flight;
    the warm-up compiles and captures on the job arena at that size, the one the job's rounds then run on, so no
    prompt of the job grows it mid-generation (a new arena means every captured graph recorded again, while the
    other ranks wait)."""
    mode, adapter, comm = worker.cfg.model.compile, worker.adapter, worker.comm
    if mode == "off":
        return CompileChoice(mode, False, "off")
    key = record_key(adapter.device, adapter.dtype, model_checksum(worker), adapter.backend.key())
    path = record_file(cache_root, key)
    record = None if worker.cfg.run.recalibrate else load_record(path, key)
    compiled, reason = decide(mode, record, job_tokens, adapter.device.type)
    if comm.world_size > 1:  # rank 0's choice: the ranks of a group run one forward
        compiled, reason = json.loads(comm.all_gather_strings(json.dumps([compiled, reason]))[0])
    if not compiled:
        return CompileChoice(mode, False, reason)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root / "inductor"))  # reused by the next run
    if say is not None:
        say(f"compiling the forward ({reason}); compiled kernels are cached for next runs")
    fast = ModelAdapter(adapter.model, compile=True, backend=adapter.backend)
    # the arena sized for the calibration that follows first: it must not grow under the warm-up's graphs
    calibrating = RoundPolicy.arena_slots(worker.cfg, fast, cache_root, lambda: model_checksum(worker))
    try:
        compile_s = fast.warm_up(max(RECORD_KV + 64, arena_tokens), batch, calibrating)
    except Exception as exc:  # no C++ compiler, an op inductor cannot lower, ...: eager is the fallback
        reason = f"{reason}: compilation failed ({first_line(exc)}), eager"
        log.warning("model.compile: %s", reason)
        return CompileChoice(mode, False, reason)
    if say is not None:
        say(f"compiled in {compile_s:.1f} s")
    if comm.rank == 0 and worker.group == 0 and record is None:  # on, or auto capturing to measure (CUDA)
        sync = synchronizer(adapter.device)
        try:
            save_record(path, key, measure_record(adapter, fast, compile_s, sync))
        except OSError as exc:  # a read-only cache costs the record, not the run
            log.warning("cannot save the compile record at %s: %s", path, exc.strerror or exc)
    worker.adapter = fast
    capture_s = {rows: round(s, 3) for rows, s in fast.rounds.capture_s.items()} if fast.rounds else None
    return CompileChoice(mode, True, reason, round(compile_s, 3), capture_s)  # per bucket: in every record


def run_info(worker: Worker) -> dict:
    """What a record needs besides its ``weights_checksum`` to be re-run: the whole resolved config (every
    section, and ``explicit``: the keys the user set, which the auto preset leaves alone), the package versions
    and the device that ran it. ``config_from_dict(rec["run"]["config"])`` rebuilds the Config; a YAML file of
    the ``explicit`` keys' values gives the same Config through ``--config`` on the same lp_runner version.

    Example: ``{"config": {"model": {...}, ..., "explicit": ["generation.max_new_tokens"]}, "versions":
    {"lp_runner": "0.1.0", "torch": "2.13.0", ...}, "device": {"type": "cpu", "name": "AMD EPYC",
    "threads": 1, "dtype": "float32", "tf32": false, "dtype_choice": "auto: float32 on a CPU",
    "load_peak_host_mib": 1410.2}}``."""
    dev = worker.device
    device = {
        "type": dev.type,
        "name": _device_label(dev),
        "threads": torch.get_num_threads(),  # model.threads resolved (0: the cores per rank)
    }
    if worker.placement is not None:  # model.dtype resolved (auto), and what loading cost the host
        device.update(
            worker.placement.describe(),
            load_peak_host_mib=round(worker.load_peak_mib, 1),
            load_peak_host_mib_ranks=worker.load_peaks_mib or [round(worker.load_peak_mib, 1)],  # every rank's
        )
    return {"config": worker.cfg.to_dict(), "versions": package_versions(), "device": device}


class TextStreamer:
    """Prints committed tokens as text as soon as they decode to complete characters.

    Each round decodes a window of the last rounds' tokens, not the whole output (the incremental detokenizing of
    vLLM and TGI): ``ids[prefix:read]`` was printed when ``read`` was the end, and where the text of ``ids[prefix:]``
    ends in a complete character, what follows the text of ``ids[prefix:read]`` is new. The window starts a round
    back, at a token whose text was printed whole, so what a decoder does at a sequence's start (a split
    character's bytes, SentencePiece's leading space) it does in both decodes alike, and the printed text is the
    whole output's decode (tested on multi-byte characters with the embedded byte-level BPE tokenizer).

    Example: rounds commit [a, b], [c], [d]: round 2 decodes [a, b, c] and [a, b] and prints the text after the
    latter; round 3 decodes [c, d] and [c]."""

    def __init__(
        self, tokenizer: Any, write: Callable[[str], None], shown: Sequence[int] = (), printed: int | None = None
    ) -> None:
        """``shown``: tokens already on screen (a resumed generation); ``printed``: how many characters of their
        text were written, when known exactly (default: all complete characters)."""
        self.tokenizer = tokenizer
        self.write = write
        self.ids: list[int] = list(shown)
        self.prefix, self.read = 0, len(self.ids)  # the window's first token; the end of what is printed
        if printed is None:
            printed = len(self._decode(0, None).rstrip("\ufffd")) if shown else 0
        self.printed = printed  # characters of the window's text written

    def _decode(self, start: int, stop: int | None) -> str:
        return self.tokenizer.decode(self.ids[start:stop], skip_special_tokens=True)

    def __call__(self, tokens: Sequence[int]) -> None:
        self.ids.extend(tokens)
        text = self._decode(self.prefix, None)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            return
        self.write(text[self.printed :])
        done = self._decode(self.read, None)  # the next window: from this round's first token
        if done:  # (a round of special tokens only gives no text to anchor the next window: keep this one)
            self.prefix, self.printed = self.read, len(done)
        else:
            self.printed = len(text)
        self.read = len(self.ids)


def run_prompts(
    worker: Worker,
    specs: Sequence[PromptSpec],
    on_record: Callable[[dict], None] | None = None,
    stream: Callable[[str], None] | None = None,
    committed: Sequence[Sequence[int]] | None = None,
    on_commit: Callable[[int, Sequence[int]], None] | None = None,
    later: int | None = 0,
) -> list[dict]:
    """Generate for every prompt on every rank; records (and callbacks) only on rank 0, as each prompt finishes:
    in file order one at a time, in the order they finish with ``run.batch`` > 1 (the policy's batch: prompts
    join in file order as earlier ones finish, ``scheduler.RoundLoop``).

    ``committed[i]`` resumes prompt i from tokens already generated (e.g. before a worker was lost); its record
    holds the whole output, as if never interrupted, and ``stream`` shows only what follows the prefix.
    ``on_commit(i, tokens)`` sees the tokens committed by every round of prompt i (rank 0 only).
    ``later``: prompts this worker runs after these in the same job (None: unknown); with the ones left here, the
    auto preset's count of generations still to start (``preset.payback``).

    Every prompt is tokenized and checked before the first is generated; a bad one (empty, too long for the
    model) ends the run with an InputError naming its id and line (``run.on_error=stop``), or gets an error
    record ``{id, error}`` in its place (``skip``)."""
    policy = worker.policy or RoundPolicy.fixed(worker.cfg.lookahead)
    engine = job_engine(worker, policy)
    prefixes = [list(c) for c in committed] if committed is not None else [[] for _ in specs]
    if len(prefixes) != len(specs):
        raise ValueError(f"committed has {len(prefixes)} entries for {len(specs)} prompts")
    prompt_ids, problems = check_prompts(worker, engine, specs)
    records = []

    def deliver(rec: dict) -> None:  # rank 0 only
        records.append(rec)
        if on_record is not None:
            on_record(rec)

    later_good = [0] * (len(specs) + 1)  # later_good[k]: prompts from index k on that will run
    for k in reversed(range(len(specs))):
        later_good[k] = later_good[k + 1] + (problems[k] is None)
    started = [0]  # the index past the last prompt handed out

    def next_index() -> int | None:  # in file order; a bad prompt gets its error record in its place
        for i in range(started[0], len(specs)):
            started[0] = i + 1
            if problems[i] is None:
                return i
            if worker.is_main:  # every rank skips it alike
                deliver(make_error_record(worker, specs[i], f"{specs[i].describe()}: {problems[i]}"))
        return None

    def remaining() -> int | None:  # generations still to start on this worker, the same on every rank
        return None if later is None else later_good[started[0]] + later

    def callbacks_for(i: int) -> list[Callable[[Sequence[int]], None]]:
        if not worker.is_main:
            return []
        callbacks: list[Callable[[Sequence[int]], None]] = []
        if stream:
            callbacks.append(TextStreamer(worker.tokenizer, stream, shown=prefixes[i]))
        if on_commit is not None:
            callbacks.append(lambda tokens, i=i: on_commit(i, tokens))
        return callbacks

    feed = JobFeed(next_index, remaining, callbacks_for, post=deliver if worker.is_main else None)
    run_jobs(worker, engine, policy, specs, prompt_ids, prefixes, feed)
    save_store(worker)
    return records


@dataclass(frozen=True)
class JobFeed:
    """Where a group's prompts come from and where their records go: what differs between the prompt loops
    (``run_prompts``: a list in file order; ``queue.run_queued``: the D groups' shared queue). ``next_index``: the
    next prompt to run (the same on every rank of the group), None when none is left; ``remaining``: generations
    still to start on this group (None: not known), for the auto preset; ``callbacks``: prompt i's per-round
    callbacks (streaming, progress); ``post``: where prompt i's record goes (None: this rank writes none)."""

    next_index: Callable[[], int | None]
    remaining: Callable[[], int | None]
    callbacks: Callable[[int], list[Callable[[Sequence[int]], None]]]
    post: Callable[[dict], None] | None


def run_jobs(
    worker: Worker,
    engine: LookaheadEngine,
    policy: RoundPolicy,
    specs: Sequence[PromptSpec],
    prompt_ids: Sequence[Sequence[int]],
    prefixes: Sequence[Sequence[int]],
    feed: JobFeed,
) -> None:
    """The one job loop every launcher runs (one process, torchrun ranks, D groups, Ray actors): the prompts
    ``feed`` hands out, ``policy.batch`` in flight through ``engine.run`` (``scheduler.RoundLoop``), each from its
    committed prefix, its sampling streams named by its id; as each finishes, its record (with the setting that
    ran) goes to ``feed.post`` and the policy observes it (every rank the same tokens, in one order)."""

    def next_job() -> Job | None:
        i = feed.next_index()
        if i is None:
            return None
        on_commit = chain_callbacks(feed.callbacks(i))
        return Job(prompt_ids[i], prefixes[i], f"id:{specs[i].id}", on_commit, tag=i)

    def on_done(job: Job, result: GenerationResult) -> None:
        i = job.tag
        if feed.post is not None:
            feed.post(make_record(worker, specs[i], prompt_ids[i], result))
        if policy.observe(prompt_ids[i], result.output_ids, result.stats.records, result.lookahead, feed.remaining()):
            engine.set_lookahead(policy.lookahead)

    engine.run(next_job, on_done, batch=policy.batch)


def job_engine(worker: Worker, policy: RoundPolicy) -> LookaheadEngine:
    """The engine a worker's prompt loop runs: ``policy``'s setting and row plan, the group's communicator, and
    the worker's job store (``pool_scope=job``: fed by the prompts it runs)."""
    return LookaheadEngine(
        worker.adapter,
        policy.lookahead,
        worker.cfg.generation,
        eos_token_ids(worker),
        worker.comm,
        policy.row_plan,
        store=worker.store,
    )


def check_prompts(
    worker: Worker, engine: LookaheadEngine, specs: Sequence[PromptSpec]
) -> tuple[list[list[int]], list[str | None]]:
    """Every prompt's token ids and what is wrong with it (None: nothing), before the first is generated; under
    ``run.on_error=stop`` the first bad one raises an InputError naming it instead."""
    prompt_ids, problems = [], []
    for spec in specs:
        ids, problem = check_prompt(worker, engine, spec)
        if problem is not None and worker.cfg.run.on_error == "stop":
            raise InputError(f"{spec.describe()}: {problem}")
        prompt_ids.append(ids)
        problems.append(problem)
    return prompt_ids, problems


def check_prompt(worker: Worker, engine: LookaheadEngine, spec: PromptSpec) -> tuple[list[int], str | None]:
    """(token ids, None) for a usable prompt, ([], what is wrong) otherwise."""
    problem = prompt_problem(spec)
    if problem is not None:
        return [], problem
    key = json.dumps(spec.to_json(), sort_keys=True)  # start-up checks every prompt, the job loop reads them again
    ids = worker.encoded.get(key)
    if ids is None:
        try:
            ids = encode(worker.tokenizer, spec)
        except ValueError as exc:  # e.g. messages for a tokenizer without a chat template
            return [], f"cannot tokenize: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        worker.encoded[key] = ids
    try:
        engine.check_prompt(ids)
    except InputError as exc:
        return [], str(exc)
    return ids, None


def chain_callbacks(callbacks: list[Callable[[Sequence[int]], None]]) -> Callable[[Sequence[int]], None] | None:
    """One on_commit callback that calls each of ``callbacks`` in order (None when there are none)."""
    if not callbacks:
        return None

    def call_all(tokens: Sequence[int]) -> None:
        for callback in callbacks:
            callback(tokens)

    return call_all

"""One worker's job: join the group (if any), load the replica, check peers, run prompts, report records.

The same function runs as the only process (P = 1), as a torchrun rank, and inside a Ray actor, so every path
produces the same records. Only rank 0 streams, writes and reports.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import platform
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from lp_runner.backends import check_backend, select_backend
from lp_runner.backends.adapter import ModelAdapter
from lp_runner.config import Config, GenerationConfig
from lp_runner.decoding.engine import GenerationResult, LookaheadEngine
from lp_runner.decoding.job_store import JobPool, tokenizer_fingerprint
from lp_runner.decoding.layout import check_model_fits, longest_candidate, max_round_rows
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
from lp_runner.errors import ConfigError, DistributedError, first_line
from lp_runner.jobs.output import output_digest, output_settings
from lp_runner.jobs.prompts import JobPrompts, PromptSpec, prepare_prompts
from lp_runner.limits import quote
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
from lp_runner.tuning.acceptance import fingerprint
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
    """What one process's job holds, built once by ``start_worker``: the job loop's entry points (``run_prompts``,
    ``queue.run_queued``, the Ray actor) keep it, and its methods hand the fields each step uses to functions
    that take only those (``make_record``, ``job_engine``, ...), so a step can be read and tested alone."""

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
    prompts: JobPrompts = field(default_factory=lambda: JobPrompts((), (), ()))  # the job's, tokenized at start

    @property
    def is_main(self) -> bool:
        """The writing rank: rank 0 of the world (with D groups, the leader of group 0)."""
        return self.comm.rank == 0 and self.group == 0

    def prepare(self, specs: Sequence[PromptSpec]) -> JobPrompts:
        """``specs`` tokenized and checked against this worker's model (``prompts.prepare_prompts``)."""
        gen, on_error = self.cfg.generation, self.cfg.run.on_error
        return prepare_prompts(specs, self.tokenizer, gen.max_new_tokens, self.adapter.max_positions, on_error)

    def run_info(self) -> dict:
        """``run_info`` of this worker's run, read at each record (the thread count can change mid-job)."""
        return run_info(self.cfg, self.device, self.placement, self.load_peak_mib, self.load_peaks_mib)

    def record(self, spec: PromptSpec, prompt_ids: Sequence[int], result: GenerationResult) -> dict:
        """``make_record`` with what this worker ran: the job loop's records are made here, on the writing rank."""
        return make_record(
            spec,
            prompt_ids,
            result,
            tokenizer=self.tokenizer,
            cfg=self.cfg,
            policy=self.policy,
            model_path=self.model_path,
            workers=self.comm.world_size,
            group=self.group,
            dist_backend=self.comm.backend,
            checksum=model_checksum(self.adapter.model),
            run=self.run_info(),
        )

    def error_record(self, spec: PromptSpec, error: str) -> dict:
        """``make_error_record`` with this worker's config, weights and run."""
        return make_error_record(spec, error, self.cfg, model_checksum(self.adapter.model), self.run_info())

    def engine(self, policy: RoundPolicy) -> LookaheadEngine:
        """``job_engine`` over this worker's model, group and job store."""
        eos = eos_token_ids(self.adapter.model.generation_config, self.tokenizer)
        return job_engine(self.adapter, policy, self.cfg.generation, eos, self.comm, self.store)


def _rank0_timings(comm: Communicator, ms: dict[str, float]) -> dict[str, float]:
    """What rank 0 of this LP group measured when choosing the backend's kernels: its ranks choose alike."""
    return json.loads(comm.all_gather_strings(json.dumps(ms))[0])


def distributed_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun / Ray environment; (0, 1, 0) when alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


def start_worker(cfg: Config, specs: Sequence[PromptSpec] = ()) -> Worker:
    """Join the process group, load the model, and check that all ranks agree.

    ``specs``: the job's prompts, tokenized and checked (against the model's context) once, as soon as the
    tokenizer is loaded (``Worker.prompts``, which the job loop then runs): under ``run.on_error=stop`` a bad
    prompt file fails before the start-up calibration is measured. The batch never exceeds the job's prompts
    (``scheduler.batch_for``) and the compiled forward is warmed up on the arena its longest prompt needs.

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
    model_fingerprint = fingerprint(model)  # likewise: it picks the model's own acceptance table (auto preset)
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
    if (control or comm).world_size > 1:  # every rank of the job, not only of its group
        worker.load_peaks_mib = check_peers(cfg, model_checksum(model), load_peak_mib, control or comm)
    worker.prompts = worker.prepare(specs)  # on_error=stop: the first bad prompt raises here
    arena_tokens = arena_positions(cfg, max(map(len, worker.prompts.ids), default=0)) if specs else 0
    job_tokens = len(specs) * cfg.generation.max_new_tokens
    batch, why_not = batch_for(cfg.run.batch, worker.adapter, len(specs))
    if why_not and worker.is_main:
        log.warning(why_not)
    compile_choice = choose_forward(  # compiles the job's one adapter where it chooses to
        cfg,
        adapter,
        comm,
        job_tokens,
        cache_root,
        say=_log if worker.is_main else None,
        arena_tokens=arena_tokens,
        batch=batch,
        keeps_record=worker.is_main,
    )
    worker.policy = RoundPolicy.build(
        cfg,
        worker.adapter,
        comm,
        cache_root=cache_root,
        weights_checksum=lambda: model_checksum(model),
        log=_log if worker.is_main else None,
        batch=batch,
        model_fingerprint=model_fingerprint,
    )
    worker.policy.compile = compile_choice.describe()
    worker.policy.backend = worker.adapter.backend.describe()  # transformers' layers where it compiled
    return worker


def arena_positions(cfg: Config, longest_prompt: int) -> int:
    """The K/V positions the job's longest generation can hold at the config's setting (what
    ``LookaheadEngine.capacity`` gives a job engine without a row plan): its prompt, every token it can commit
    and one round's rows."""
    la = cfg.lookahead
    return longest_prompt + cfg.generation.max_new_tokens + max_round_rows(la) + longest_candidate(la)


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


def save_store(store: JobPool | None, path: str, tokenizer: Any) -> None:
    """``advanced.pool_out`` (``path``; empty: not asked for): the job's store after the job's last prompt, under
    ``tokenizer``'s fingerprint. The writing rank calls it (one file per job)."""
    if path and store is not None:
        store.save(path, tokenizer_fingerprint(tokenizer))


def _log(message: str) -> None:
    log.info(message)


def check_peers(cfg: Config, checksum: str, load_peak_mib: float, comm: Communicator) -> list[float]:
    """Every rank must run the same config on the same weights, or outputs would silently fork.

    ``comm``: the ranks to compare (the whole job); ranks in errors are its ranks. The same message carries each
    rank's peak host memory at load (``load_peak_mib``): returns every rank's, in rank order, for the records."""
    mine = f"{cfg.digest()}|{checksum}|{load_peak_mib:.1f}"
    everyone = comm.all_gather_strings(mine)
    peaks = [float(s.split("|")[2]) for s in everyone]
    cfgs = {s.split("|")[0] for s in everyone}
    if len(cfgs) > 1:
        bad = [r for r, s in enumerate(everyone) if s.split("|")[0] != everyone[0].split("|")[0]]
        raise DistributedError(f"config mismatch between ranks: ranks {bad} differ from rank 0")
    if len({s.split("|")[1] for s in everyone}) > 1:
        bad = [r for r, s in enumerate(everyone) if s.split("|")[1] != everyone[0].split("|")[1]]
        raise DistributedError(f"model weights differ between ranks: ranks {bad} differ from rank 0")
    return peaks


def eos_token_ids(generation_config: Any, tokenizer: Any) -> list[int]:
    """The ids that end a generation: the model's ``generation_config``'s, else the tokenizer's (none: [])."""
    ids = generation_config.eos_token_id
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


_CHECKSUMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_checksum(model: torch.nn.Module) -> str:
    """``weights_checksum`` of ``model``, computed once per model (one pass over the weights)."""
    if model not in _CHECKSUMS:
        _CHECKSUMS[model] = weights_checksum(model)
    return _CHECKSUMS[model]


def make_error_record(spec: PromptSpec, error: str, cfg: Config, checksum: str, run: dict) -> dict:
    """``run.on_error=skip``: what the output keeps of a prompt that could not run (resume skips it too):
    ``error``, and the job's settings, weights ``checksum`` and ``run`` (``run_info``) as a record has them."""
    return {
        "id": spec.id,
        "error": error,
        "config_digest": output_digest(cfg),
        "weights_checksum": checksum,
        "config": output_settings(cfg),
        "run": run,
    }


def make_record(
    spec: PromptSpec,
    prompt_ids: Sequence[int],
    result: GenerationResult,
    *,
    tokenizer: Any,
    cfg: Config,
    policy: RoundPolicy | None,
    model_path: Path,
    workers: int,
    group: int,
    dist_backend: str,
    checksum: str,
    run: dict,
) -> dict:
    """The output's record of one finished generation: its tokens and text (``tokenizer``), its statistics, the
    setting that ran (the result's, else ``policy``'s, else the config's), which group of how many ``workers``
    made it, and what ``--resume`` checks (``cfg``'s digest, the weights ``checksum``) and re-runs (``run``)."""
    s = result.stats
    la = result.lookahead or (policy.lookahead if policy is not None else cfg.lookahead)  # the setting that ran
    return {
        "id": spec.id,
        "prompt_ids": list(prompt_ids),
        "output_ids": result.output_ids,
        "text": tokenizer.decode(result.output_ids, skip_special_tokens=True),
        "new_tokens": len(result.output_ids),
        "forwards": s.forwards,
        "seconds": round(s.seconds, 6),
        "tokens_per_forward": round(s.tokens_per_forward, 4),
        "tokens_per_s": round(s.tokens_per_s, 3),
        "model": str(model_path),
        "window_size": la.window_size,
        "ngram_size": la.ngram_size,
        "verification_set_size": la.verification_set_size,
        "pool_from_prompt": la.pool_from_prompt,
        "workers": workers,
        "group": group,  # which of the parallel.groups LP groups generated it (0 with one group)
        "dist_backend": dist_backend,
        "do_sample": cfg.generation.do_sample,
        "stats": s.summary(),
        "policy": policy.describe() if policy is not None else {"preset": "off"},
        "config_digest": output_digest(cfg),  # what ``--resume`` checks: same settings, same weights
        "weights_checksum": checksum,
        "config": output_settings(cfg),
        "run": run,
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
    cfg: Config,
    adapter: ModelAdapter,
    comm: Communicator,
    job_tokens: int,
    cache_root: Path,
    say: Callable[[str], None] | None = None,
    arena_tokens: int = 0,
    batch: int = 1,
    keeps_record: bool = False,
) -> CompileChoice:
    """Eager or compiled rounds for this job (``model.compile``, ``compile_choice``): rank 0 of ``comm`` decides,
    every rank of the group follows. Compiles ``adapter`` itself where it chooses to (``ModelAdapter.compile``,
    timed; the job's one adapter, left eager should compiling fail) and returns the choice. With ``on`` (or ``auto``
    capturing a CUDA device's first long job), the rank that ``keeps_record`` (the writing rank) records what
    compiling cost and saved on this device (when it has no record, or on ``--recalibrate``), which is what ``auto``
    decides from next time; each row bucket's capture seconds go to the job's records (``CompileChoice.capture_s``).
    ``arena_tokens``: the K/V positions the job's longest generation can hold (``LookaheadEngine.capacity``),
    ``batch`` of them in flight; the warm-up compiles and captures on the job arena at that size, the one the job's
    rounds then run on, so no prompt of the job grows it mid-generation (a new arena means every captured graph
    recorded again, while the other ranks wait)."""
    mode = cfg.model.compile
    if mode == "off":
        return CompileChoice(mode, False, "off")
    checksum = model_checksum(adapter.model)
    key = record_key(adapter.device, adapter.dtype, checksum, adapter.backend.key())
    path = record_file(cache_root, key)
    record = None if cfg.run.recalibrate else load_record(path, key)
    compiled, reason = decide(mode, record, job_tokens, adapter.device.type)
    if comm.world_size > 1:  # rank 0's choice: the ranks of a group run one forward
        compiled, reason = json.loads(comm.all_gather_strings(json.dumps([compiled, reason]))[0])
    if not compiled:
        return CompileChoice(mode, False, reason)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root / "inductor"))  # reused by the next run
    if say is not None:
        say(f"compiling the forward ({reason}); compiled kernels are cached for next runs")
    try:  # the job's own adapter, compiled; its arena sized for the calibration that follows first (it must not
        # grow under the warm-up's graphs), priced on the compiled adapter (a calibration is keyed by it)
        compile_s = adapter.compile(
            [max(RECORD_KV + 64, arena_tokens)] * batch,
            lambda compiled: RoundPolicy.arena_needs(cfg, compiled, cache_root, lambda: checksum),
        )
    except Exception as exc:  # no C++ compiler, an op inductor cannot lower, ...: eager is the fallback
        reason = f"{reason}: compilation failed ({first_line(exc)}), eager"
        log.warning("model.compile: %s", reason)
        return CompileChoice(mode, False, reason)
    if say is not None:
        say(f"compiled in {compile_s:.1f} s")
    if keeps_record and record is None:  # on, or auto capturing to measure (CUDA)
        sync = synchronizer(adapter.device)
        try:
            save_record(path, key, measure_record(adapter, compile_s, sync))
        except OSError as exc:  # a read-only cache costs the record, not the run
            log.warning("cannot save the compile record at %s: %s", path, exc.strerror or exc)
    capture_s = {rows: round(s, 3) for rows, s in adapter.rounds.capture_s.items()}
    return CompileChoice(mode, True, reason, round(compile_s, 3), capture_s)  # per bucket: in every record


def run_info(
    cfg: Config,
    device: torch.device,
    placement: Placement | None = None,
    load_peak_mib: float = 0.0,
    load_peaks_mib: list[float] | None = None,
) -> dict:
    """What a record needs besides its ``weights_checksum`` to be re-run: the whole resolved config (every
    section, and ``explicit``: the keys the user set, which the auto preset leaves alone), the package versions
    and the device that ran it. ``config_from_dict(rec["run"]["config"])`` rebuilds the Config; a YAML file of
    the ``explicit`` keys' values gives the same Config through ``--config`` on the same lp_runner version.

    Example: ``{"config": {"model": {...}, ..., "explicit": ["generation.max_new_tokens"]}, "versions":
    {"lp_runner": "0.1.0", "torch": "2.13.0", ...}, "device": {"type": "cpu", "name": "AMD EPYC",
    "threads": 1, "dtype": "float32", "tf32": false, "dtype_choice": "auto: float32 on a CPU",
    "load_peak_host_mib": 1410.2}}``.

    ``placement``: the device, dtype and TF32 as resolved (None: only the device's type and name are known);
    ``load_peak_mib``: this rank's peak host memory after loading, ``load_peaks_mib`` every rank's
    (``check_peers``; None: this rank's alone)."""
    described = {
        "type": device.type,
        "name": _device_label(device),
        "threads": torch.get_num_threads(),  # model.threads resolved (0: the cores per rank)
    }
    if placement is not None:  # model.dtype resolved (auto), and what loading cost the host
        described.update(
            placement.describe(),
            load_peak_host_mib=round(load_peak_mib, 1),
            load_peak_host_mib_ranks=load_peaks_mib or [round(load_peak_mib, 1)],  # every rank's
        )
    return {"config": cfg.to_dict(), "versions": package_versions(), "device": described}


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


class Feeder(Protocol):
    """Where a group's prompts come from and where their records go: what differs between launchers, while the
    job loop (``run_jobs``) is one. ``next_index``: the next prompt to start (the same on every rank of the
    group), None when none is left; it is called whenever a slot of the batch frees, so a slot refills as its
    generation ends. ``post``: prompt ``index``'s record, on the rank that ``writes``. ``remaining``: the
    generations still to start on this group (None: not known), for the auto preset."""

    writes: bool

    def next_index(self) -> int | None: ...

    def post(self, index: int, record: dict) -> None: ...

    def remaining(self) -> int | None: ...


@dataclass
class PromptFeed:
    """The one feeder: the job's queue order (``JobPrompts.order``, longest first), a position of it taken per
    started generation through ``claim``, which is what differs between launchers: a counter of this process
    (one group: every rank counts alike), the launcher's store (``queue.run_queued``: D torchrun groups) or the
    Ray driver's queue (``ray.Replica.run``), each leader's claim shared with its group (``claim_for_group``).

    ``first``: prompts handed out before any claim (a rebuilt Ray group resumes the ones its lost group had in
    flight). ``deliver``: where records go on the writing rank (None elsewhere). ``groups``: how many groups
    share the queue, for ``remaining``; ``later``: generations this group runs after the queue's (None: unknown).

    Example (D 2, order [a, c, b]): group 0 claims 0 (a), group 1 claims 1 (c); whichever finishes first claims
    2 (b); the next claim is 3, past the end: that group has nothing left to start."""

    order: Sequence[int]
    claim: Callable[[], int]
    deliver: Callable[[int, dict], None] | None = None
    groups: int = 1
    later: int | None = 0
    first: list[int] = field(default_factory=list)
    claimed: int = 0  # positions of ``order`` taken by every group, as this group last saw

    @property
    def writes(self) -> bool:
        return self.deliver is not None

    def next_index(self) -> int | None:
        if self.first:
            return self.first.pop(0)
        k = self.claim()
        self.claimed = max(self.claimed, min(k + 1, len(self.order)))
        return self.order[k] if k < len(self.order) else None

    def post(self, index: int, record: dict) -> None:
        if self.deliver is not None:
            self.deliver(index, record)

    def remaining(self) -> int | None:
        if self.later is None:
            return None
        return len(self.first) + -(-(len(self.order) - self.claimed) // self.groups) + self.later


def local_claims() -> Callable[[], int]:
    """Positions 0, 1, 2, ... for a queue that only this group reads (every rank of it counts alike)."""
    return itertools.count().__next__


def run_prompts(
    worker: Worker,
    prompts: JobPrompts,
    on_record: Callable[[dict], None] | None = None,
    stream: Callable[[str], None] | None = None,
    committed: Sequence[Sequence[int]] | None = None,
    on_commit: Callable[[int, Sequence[int]], None] | None = None,
    later: int | None = 0,
) -> list[dict]:
    """Generate for every prompt on every rank of one group; records (and callbacks) only on the writing rank, in
    the order they finish. The prompts start in the queue order (``JobPrompts.order``: longest first), up to the
    policy's batch at a time, each slot refilled as its generation ends (``scheduler.RoundLoop``); a bad prompt's
    error record ``{id, error}`` (``run.on_error=skip``) comes first.

    ``committed[i]`` resumes prompt i from tokens already generated; its record holds the whole output, as if
    never interrupted, and ``stream`` shows only what follows the prefix. ``on_commit(i, tokens)`` sees the tokens
    committed by every round of prompt i (writing rank only). ``later``: prompts this worker runs after these in
    the same job (None: unknown); with the ones left here, the auto preset's count of generations still to start
    (``preset.payback``)."""
    policy = worker.policy or RoundPolicy.fixed(worker.cfg.lookahead)
    engine = worker.engine(policy)
    prefixes = {i: list(c) for i, c in enumerate(committed)} if committed is not None else {}
    if committed is not None and len(committed) != len(prompts.specs):
        raise ValueError(f"committed has {len(committed)} entries for {len(prompts.specs)} prompts")
    records: list[dict] = []

    def deliver(i: int, rec: dict) -> None:  # the writing rank only
        records.append(rec)
        if on_record is not None:
            on_record(rec)

    if worker.is_main:
        for i, rec in error_records(prompts, worker.error_record):
            deliver(i, rec)
    streamers: dict[int, TextStreamer] = {}

    def hook(i: int, tokens: Sequence[int]) -> None:
        if stream is not None:
            if i not in streamers:
                streamers[i] = TextStreamer(worker.tokenizer, stream, shown=prefixes.get(i, ()))
            streamers[i](tokens)
        if on_commit is not None:
            on_commit(i, tokens)

    feed = PromptFeed(prompts.order(), local_claims(), deliver if worker.is_main else None, later=later)
    hooked = worker.is_main and (stream is not None or on_commit is not None)
    run_jobs(engine, policy, prompts, feed, worker.record, hook if hooked else None, prefixes)
    if worker.is_main:
        save_store(worker.store, worker.cfg.run.pool_out, worker.tokenizer)
    return records


def error_records(prompts: JobPrompts, error_record: Callable[[PromptSpec, str], dict]) -> list[tuple[int, dict]]:
    """(index, error record) of every prompt that cannot run (``run.on_error=skip``), in file order: the writer
    puts them first, before any generation (no group runs them). ``error_record(spec, error)`` makes one
    (``Worker.error_record``)."""
    return [
        (i, error_record(spec, f"{spec.describe()}: {problem}"))
        for i, (spec, problem) in enumerate(zip(prompts.specs, prompts.problems, strict=True))
        if problem is not None
    ]


def run_jobs(
    engine: LookaheadEngine,
    policy: RoundPolicy,
    prompts: JobPrompts,
    feed: Feeder,
    record: Callable[[PromptSpec, Sequence[int], GenerationResult], dict],
    on_commit: Callable[[int, Sequence[int]], None] | None = None,
    prefixes: dict[int, Sequence[int]] | None = None,
) -> None:
    """The one job loop every launcher runs (one process, torchrun ranks, D groups, Ray actors): the prompts
    ``feed`` hands out, ``policy.batch`` in flight through ``engine.run`` (``scheduler.RoundLoop``), each slot
    refilled from ``feed`` as its generation ends, each from its committed prefix (``prefixes``, by index), its
    sampling streams named by its id; as each finishes, its record (``record(spec, prompt_ids, result)``, with
    the setting that ran: ``Worker.record``) goes to ``feed.post`` on the writing rank, and the policy observes it
    (every rank the same tokens, in one order)."""
    prefixes = prefixes or {}
    finished = [0]  # this group's generations finished so far

    def next_job() -> Job | None:
        i = feed.next_index()
        if i is None:
            return None
        # which slot refilled when: a job's starts, read back by the tests that check the refill rule
        log.debug("start %s after %d finished", quote(prompts.specs[i].id), finished[0])
        hook = None if on_commit is None else functools.partial(on_commit, i)
        return Job(list(prompts.ids[i]), list(prefixes.get(i, ())), f"id:{prompts.specs[i].id}", hook, tag=i)

    def on_done(job: Job, result: GenerationResult) -> None:
        i = job.tag
        finished[0] += 1
        if feed.writes:
            feed.post(i, record(prompts.specs[i], prompts.ids[i], result))
        if policy.observe(prompts.ids[i], result.output_ids, result.stats.records, result.lookahead, feed.remaining()):
            engine.set_lookahead(policy.lookahead)

    engine.run(next_job, on_done, batch=policy.batch)


def job_engine(
    adapter: ModelAdapter,
    policy: RoundPolicy,
    generation: GenerationConfig,
    eos: Sequence[int],
    comm: Communicator,
    store: JobPool | None,
) -> LookaheadEngine:
    """The engine a prompt loop runs: ``policy``'s setting and row plan, the group's communicator, and the job
    store (``pool_scope=job``: fed by the prompts it runs; None otherwise)."""
    return LookaheadEngine(adapter, policy.lookahead, generation, eos, comm, policy.row_plan, store=store)

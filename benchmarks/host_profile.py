"""Where a round's host time goes, in process: the round loop's steps per round, under cProfile and without it.

    python benchmarks/host_profile.py                       # calibration8's first 4 prompts, 128 new tokens
    python benchmarks/host_profile.py --prompts 8 --repeat 3 --top 40
    PYTHONPATH=../other python benchmarks/host_profile.py --wall-only   # another checkout's lp_runner, same job

Runs the default job (the auto preset and its padded rows, the CPU backend a CLI job selects) on the embedded
model for prompts that ``host_time.py``'s bench16 does not hold (``benchmarks/results/calibration8.jsonl``), once
to build the round policy, then ``--repeat`` times timed. Reports per round:

* ``host`` (records): the rounds' ``host_s``, as ``host_time.py`` reads it (the round less its forward, read-back
  included, and its collective; the record itself is made after that clock stops);
* ``loop`` (wall): a generation's wall time less its forwards and collectives, over its rounds: the record, the
  start and the close included, i.e. everything a CPU spends between forwards;
* ``adapter before launch`` (wall): the forward's own host part, from ``ModelAdapter.run``'s entry to the native
  layers' one C call (packing, masks, embedding, rotary tables), which the records count as forward time; with
  ``host`` it is the whole read-back-to-launch path (CPU native layers only: elsewhere there is no such call);
* under cProfile: each host step's cumulative time and calls per round, the host part of ``RoundLoop._round``
  (its cumulative time less the forward and read-back), and the functions with the most own time outside the
  forward.

Other work on the machine makes wall figures noisy: the minimum over repeats is reported, and cProfile's call
counts per round (which do not depend on load) are the structural measure to compare between checkouts. cProfile
inflates Python-heavy code, so its microseconds are larger than the wall figures; compare them with each other.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
PROMPTS = REPO / "benchmarks/results/calibration8.jsonl"

# (label, pstats key suffix "file:function"): the host steps of a round, as ``scheduler.RoundLoop._round`` runs them.
STEPS = (
    ("round (all)", "decoding/scheduler.py", "_round"),
    ("  forward", "backends/adapter.py", "run"),
    ("  read_back_many", "verify/verifier.py", "read_back_many"),
    ("  Generation.lay_out", "decoding/generation.py", "lay_out"),
    ("    Coordinator.plan", "decoding/coordinator.py", "plan"),
    ("    round.lay_out", "decoding/round.py", "lay_out"),
    ("      compile_round", "decoding/layout.py", "compile_round"),
    ("      visibility_mask", "decoding/layout.py", "visibility_mask"),
    ("  verifier.prepare", "verify/verifier.py", "prepare"),
    ("  Generation.verdict", "decoding/generation.py", "verdict"),
    ("    RoundPlan.digest", "decoding/coordinator.py", "digest"),
    ("  agree_batch", "parallel/exchange.py", "agree_batch"),
    ("  Generation.commit", "decoding/generation.py", "commit"),
    ("    publish", "decoding/round.py", "publish"),
    ("    Coordinator.observe", "decoding/coordinator.py", "observe"),
    ("  Generation.record", "decoding/generation.py", "record"),
    ("    GenerationStats.add", "decoding/metrics.py", "add"),
)


def load_prompts(tokenizer, count: int) -> list[list[int]]:
    from lp_runner.jobs.prompts import encode, read_prompts

    return [encode(tokenizer, spec) for spec in read_prompts(PROMPTS)[:count]]


class Job:
    """The default job's setting on the loaded model, as a CLI worker holds it (``jobs.worker``): the round
    policy (the auto preset; its forward-cost curve is cached on disk), one engine whose job store outlives each
    prompt, and the policy observing each output between prompts (outside the profile: it is not a round's)."""

    def __init__(self, model, tokenizer, max_new_tokens: int) -> None:
        from lp_runner.backends.adapter import ModelAdapter
        from lp_runner.config import load_config
        from lp_runner.decoding.engine import LookaheadEngine
        from lp_runner.models.loading import default_cache_dir, weights_checksum
        from lp_runner.parallel.comm import SoloCommunicator
        from lp_runner.tuning.policy import RoundPolicy

        self.cfg = load_config(REPO / "configs/default.yaml", [f"generation.max_new_tokens={max_new_tokens}"])
        adapter = ModelAdapter(model)  # the backend ``prepare_backend`` applied to the model
        self.policy = RoundPolicy.build(
            self.cfg, adapter, SoloCommunicator(), default_cache_dir(), lambda: weights_checksum(model)
        )
        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        eos_ids = [eos] if isinstance(eos, int) else list(eos or ())
        self.engine = LookaheadEngine(
            adapter, self.policy.lookahead, self.cfg.generation, eos_ids, None, self.policy.row_plan
        )

    def run(self, prompts: list[list[int]], prof: cProfile.Profile | None = None):
        """(rounds, host seconds from the records, loop seconds between forwards, outputs) over ``prompts``."""
        from lp_runner.decoding.engine import Job as EngineJob

        jobs = iter([EngineJob(ids, tag=i) for i, ids in enumerate(prompts)])
        totals = {"rounds": 0, "host": 0.0, "loop": 0.0}
        outputs: list[list[int]] = []

        def on_done(job, result) -> None:
            if prof is not None:
                prof.disable()
            stats = result.stats
            totals["rounds"] += stats.rounds
            totals["host"] += stats.host_s
            totals["loop"] += stats.seconds - stats.forward_s - stats.comm_s
            outputs.append(result.output_ids)
            if self.policy.observe(prompts[job.tag], result.output_ids, stats.records, result.lookahead):
                self.engine.set_lookahead(self.policy.lookahead)
            if prof is not None:
                prof.enable()

        if prof is not None:
            prof.enable()
        self.engine.run(lambda: next(jobs, None), on_done)
        if prof is not None:
            prof.disable()
        return totals["rounds"], totals["host"], totals["loop"], outputs


def prepare_backend(model) -> None:
    """The kernels a CLI job runs (``model.backend: auto``, as ``jobs.worker`` selects them at load): on a CPU the
    plug-in's native layers, so the forward and the K/V path are the job's own, not transformers' layers."""
    from lp_runner.backends import select_backend
    from lp_runner.models.loading import default_cache_dir

    select_backend("auto", model, torch.device("cpu"), cache_root=default_cache_dir())


class LaunchClock:
    """Per round, the wall time from ``ModelAdapter.run``'s entry to the native layers' C call (the launch): the
    adapter's host part of a forward. Wraps the two methods for the benchmark's life."""

    def __init__(self) -> None:
        from lp_runner.backends.adapter import ModelAdapter
        from lp_runner.backends.cpu import native

        self.total_ns = self.launches = 0
        entry = [0]
        run, stack_run = ModelAdapter.run, native.LayerStack.run

        def timed_run(adapter, *a, **k):
            entry[0] = time.perf_counter_ns()
            return run(adapter, *a, **k)

        def timed_launch(stack, *a, **k):
            self.total_ns += time.perf_counter_ns() - entry[0]
            self.launches += 1
            return stack_run(stack, *a, **k)

        ModelAdapter.run, native.LayerStack.run = timed_run, timed_launch

    def take(self) -> float | None:
        """Seconds per launch since the last take (None: no native launch)."""
        out = self.total_ns / self.launches / 1e9 if self.launches else None
        self.total_ns = self.launches = 0
        return out


def step_rows(stats: pstats.Stats, rounds: int) -> list[tuple[str, float, float]]:
    """(label, cumulative µs per round, calls per round) of each of ``STEPS`` (summed over same-named matches)."""
    out = []
    for label, file_part, func in STEPS:
        cum, calls = 0.0, 0
        for (path, _, name), (_, ncalls, _, ct, _) in stats.stats.items():
            if name == func and path.endswith(file_part):
                cum += ct
                calls += ncalls
        out.append((label, 1e6 * cum / rounds, calls / rounds))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--top", type=int, default=30, help="functions listed by own time (forward excluded)")
    ap.add_argument("--wall-only", action="store_true", help="the timed repeats only, no cProfile run")
    ap.add_argument("--dump", help="write the cProfile statistics here (pstats, e.g. for print_callees)")
    args = ap.parse_args()

    from lp_runner.models.loading import fetch_embedded_model, load_model_and_tokenizer

    model, tokenizer, _ = load_model_and_tokenizer(fetch_embedded_model(), dtype=torch.float32, device="cpu")
    prepare_backend(model)
    prompts = load_prompts(tokenizer, args.prompts)
    Job(model, tokenizer, 16).run(prompts[:1])  # a warm-up

    clock = LaunchClock()
    best_host = best_loop = best_launch = float("inf")
    for _ in range(args.repeat):
        clock.take()
        rounds, host, loop, outputs = Job(model, tokenizer, args.max_new_tokens).run(prompts)
        launch = clock.take()
        best_host, best_loop = min(best_host, host / rounds), min(best_loop, loop / rounds)
        best_launch = min(best_launch, launch if launch is not None else float("nan"))
    print(f"{len(prompts)} prompts, {rounds} rounds ({rounds / len(prompts):.1f} per prompt), min of {args.repeat}:")
    print(f"  host (records)          {1e6 * best_host:8.1f} µs/round")
    print(f"  loop (wall)             {1e6 * best_loop:8.1f} µs/round")
    print(f"  adapter before launch   {1e6 * best_launch:8.1f} µs/round")
    print(f"  outputs digest {hash(tuple(map(tuple, outputs))) & 0xFFFFFFFF:08x} (equal between checkouts)")

    if args.wall_only:
        return
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof_rounds, *_ = Job(model, tokenizer, args.max_new_tokens).run(prompts, prof)
    wall = time.perf_counter() - t
    stats = pstats.Stats(prof)
    if args.dump:
        stats.dump_stats(args.dump)
    rows = step_rows(stats, prof_rounds)
    print(f"\ncProfile ({prof_rounds} rounds, {wall:.1f} s): µs/round cumulative, calls/round")
    for label, us, calls in rows:
        print(f"  {label:28s} {us:9.1f} {calls:7.2f}")
    by = {label.strip(): us for label, us, _ in rows}
    host = by["round (all)"] - by["forward"] - by["read_back_many"]
    print(f"  {'host part of _round':28s} {host:9.1f}")
    print(f"  {'host part + record':28s} {host + by['Generation.record']:9.1f}")

    # Own time outside the forward: every function's calls from callers outside the forward's subtree.
    forward_keys = {k for k in stats.stats if k[0].endswith("backends/adapter.py") and k[2] == "run"}
    inside = set()
    frontier = list(forward_keys)
    callees: dict = {}
    for key, (*_, callers) in stats.stats.items():
        for caller in callers:
            callees.setdefault(caller, set()).add(key)
    while frontier:
        key = frontier.pop()
        for callee in callees.get(key, ()):
            if callee not in inside:
                inside.add(callee)
                frontier.append(callee)
    own = []  # a function's own time split by caller: only the calls from outside the forward count
    for key, (*_, callers) in stats.stats.items():
        if key in forward_keys:
            continue
        tt = sum(v[2] for c, v in callers.items() if c not in inside and c not in forward_keys)
        nc = sum(v[1] for c, v in callers.items() if c not in inside and c not in forward_keys)
        if nc:
            own.append((tt, nc, key))
    own.sort(reverse=True)
    print(f"\nown time of calls from outside the forward, top {args.top}: µs/round, calls/round")
    for tt, nc, (path, line, name) in own[: args.top]:
        where = f"{Path(path).name}:{line}" if line else path
        print(f"  {1e6 * tt / prof_rounds:8.1f} {nc / prof_rounds:7.2f}  {name} ({where})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

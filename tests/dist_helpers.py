"""Helpers for tests that run real jobs: tiny model folders the CLI can load, the one way every test launches the
CLI (one process, under torchrun, or ranks started by hand), the oracle on a saved folder, and process tools.

Tiny models use the embedded SmolLM2 tokenizer (so prompts JSONL and chat templates work unchanged) with a
random 2-layer body; random tiny models repeat themselves, which makes lookahead candidates hit often.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


# The prompts job tests run: plain text, code, and a chat message (the chat template applied).
JOB_PROMPTS = [
    {"id": "plain", "prompt": "The quick brown fox jumps over the lazy dog. The quick brown"},
    {"id": "code", "prompt": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"},
    {"id": "chat", "messages": [{"role": "user", "content": "List three colours."}]},
]


def make_tiny_folder(path: Path, family: str = "llama", seed: int = 0) -> Path:
    """A loadable model folder (safetensors + tokenizer) with a random tiny body."""
    from helpers import tiny_model
    from transformers import AutoTokenizer

    from lp_runner.models.loading import embedded_model_dir, fetch_embedded_model

    fetch_embedded_model()
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    model = tiny_model(  # the SmolLM2 vocabulary and special tokens, so its tokenizer and chat template apply
        family, seed, vocab_size=49152, hidden_size=32, intermediate_size=64, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
    )  # fmt: skip
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_prompts(path: Path, prompts: list[dict]) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def env_with_repo(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def lp_runner_cmd(*args: str) -> list[str]:
    """``python -m lp_runner ARGS``."""
    return [sys.executable, "-m", "lp_runner", *args]


def job_args(model: Path | str, prompts: Path, out: Path, *extra: str, max_new_tokens: int = 24) -> list[str]:
    """The ``run`` arguments every job test starts from: the model, one thread per rank, the budget, no progress bar
    (the test reads stderr); ``extra`` comes last, and a ``--set`` key it gives replaces the default's (the CLI
    refuses a key set twice)."""
    return last_set_wins([
        "--prompts", str(prompts), "--output", str(out), "--set", f"model.path={model}", "--set", "model.threads=1",
        "--set", f"generation.max_new_tokens={max_new_tokens}", "--set", "advanced.progress=false", *extra,
    ])  # fmt: skip


def last_set_wins(args: Sequence[str]) -> list[str]:
    """``args`` with each ``--set KEY=...`` key once, at its first place, with its last value (helpers layer their
    defaults under a test's own settings; the CLI itself refuses a key given twice).

    ``["--set", "a.b=1", "--x", "--set", "a.b=2"]`` -> ``["--set", "a.b=2", "--x"]``."""
    last = {args[i + 1].split("=", 1)[0]: args[i + 1] for i in range(len(args) - 1) if args[i] == "--set"}
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] == "--set" and i + 1 < len(args):
            key = args[i + 1].split("=", 1)[0]
            if key in last:
                out += ["--set", last.pop(key)]
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


def job_cmd(args: list[str], torchrun: int = 0) -> list[str]:
    """The CLI with ``args``: one process, or under torchrun with ``torchrun`` ranks."""
    return torchrun_cmd(torchrun, *args) if torchrun else lp_runner_cmd(*args)


def run_job(
    args: list[str], *, torchrun: int = 0, timeout: float = 300, check: bool = True, **env: str
) -> subprocess.CompletedProcess:
    """Run the CLI to its end (text output); ``check``: it must succeed (its stderr's tail in the failure)."""
    proc = subprocess.run(job_cmd(args, torchrun), env=env_with_repo(**env), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def start_job(args: list[str], *, torchrun: int = 0, **env: str) -> subprocess.Popen:
    """Start the CLI (bytes output) for a test that signals or kills it while it runs."""
    return subprocess.Popen(
        job_cmd(args, torchrun),
        env=env_with_repo(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=default_sigint,  # a SIGINT test must not inherit a background shell's "ignore"
    )


@functools.cache
def _folder_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy_of(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The oracle (``helpers.hf_greedy``) on the model a job loaded from ``model_dir``, stopping at the model's own
    EOS as lp_runner does."""
    from helpers import hf_greedy

    model = _folder_model(Path(model_dir))
    eos = model.generation_config.eos_token_id
    return hf_greedy(model, prompt_ids, max_new_tokens, eos_ids=[eos] if isinstance(eos, int) else list(eos or []))


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "lp_runner", *args,
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(world: int, args_per_rank: list[list[str]]) -> list[subprocess.Popen]:
    """Start ``world`` ranks by hand (env rendezvous, no torchrun agent): a peer failure is then seen only by
    the surviving ranks themselves, as on a multi-node job where the failed node's agent is gone too."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = env_with_repo(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
        cmd = [sys.executable, "-m", "lp_runner", *args_per_rank[rank]]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def complete_lines(path: Path) -> int:
    """Complete JSONL lines (records) in ``path`` so far."""
    return path.read_bytes().count(b"\n") if path.exists() else 0


def wait_for(predicate, timeout: float, proc: subprocess.Popen) -> None:
    """Until ``predicate()``, while ``proc`` runs (its stderr in the failure), at most ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(entry.path, "stat").read_text()
                fields = stat[stat.rfind(")") + 2 :].split()
                if fields[0] != "Z":
                    children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still run (not zombies)."""
    left = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z":
                left.add(pid)
    return left


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def wait_for_file_lines(path: Path, lines: int, timeout: float) -> bool:
    """Wait until ``path`` holds at least ``lines`` JSONL records (generation is under way)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and len(path.read_text().splitlines()) >= lines:
            return True
        time.sleep(0.1)
    return False


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait()


def default_sigint() -> None:
    """``preexec_fn`` for a child a test will Ctrl-C: SIGINT back to its default disposition. A shell starts a
    background job (``pytest ... &``) with SIGINT ignored, the child inherits that across exec, and Python then
    never raises KeyboardInterrupt: the test would see the shell's choice, not lp_runner's handling."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class LocalGroup:
    """P communicators in one process (ranks on threads) whose all_gather meets at a barrier (one slot per rank):
    LP's protocol without processes."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=60)

    def comm(self, rank: int) -> LocalCommunicator:
        return LocalCommunicator(self, rank)

    def run_ranks(self, work: Callable[[int], object], timeout: float) -> list:
        """``work(rank)`` of every rank, concurrently on threads; their results by rank. The first rank that
        raises is raised here, after every thread ended: it breaks the barrier, so the others fail at once
        instead of waiting for it."""
        results: list = [None] * self.world_size
        errors: list[BaseException] = []

        def run(rank: int) -> None:
            try:
                results[rank] = work(rank)
            except BaseException as exc:
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        if errors:
            raise errors[0]
        return results


class LocalCommunicator:
    backend = "local"

    def __init__(self, group: LocalGroup, rank: int) -> None:
        self.group, self.rank, self.world_size, self.collectives = group, rank, group.world_size, 0

    def host_payload(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    def all_gather(self, payload: torch.Tensor) -> torch.Tensor:
        self.group.slots[self.rank] = payload.clone()
        self.group.barrier.wait()  # every slot written
        out = torch.stack(self.group.slots)  # type: ignore[arg-type]
        self.group.barrier.wait()  # every rank has read before the next round overwrites
        self.collectives += 1
        return out

    def all_gather_strings(self, text: str) -> list[str]:
        raise NotImplementedError("start-up only")

"""Helpers for multi-process tests: tiny model folders the CLI can load, and real launches.

Tiny models use the embedded SmolLM2 tokenizer (so prompts JSONL and chat templates work unchanged) with a
random 2-layer body; random tiny models repeat themselves, which makes lookahead candidates hit often.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


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


class LocalCommunicator:
    backend = "local"

    def __init__(self, group: LocalGroup, rank: int) -> None:
        self.group, self.rank, self.world_size, self.collectives = group, rank, group.world_size, 0

    def all_gather(self, payload: torch.Tensor) -> torch.Tensor:
        self.group.slots[self.rank] = payload.clone()
        self.group.barrier.wait()  # every slot written
        out = torch.stack(self.group.slots)  # type: ignore[arg-type]
        self.group.barrier.wait()  # every rank has read before the next round overwrites
        self.collectives += 1
        return out

    def all_gather_strings(self, text: str) -> list[str]:
        raise NotImplementedError("start-up only")

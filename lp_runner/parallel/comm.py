"""Communicators: how the ranks of one run exchange a round's fixed-size integer payload.

``SoloCommunicator`` is the P = 1 case (a no-op); ``TorchCommunicator`` wraps a torch.distributed process group
(gloo on CPU, NCCL on CUDA). Every collective carries the group's timeout, so a dead or stalled peer turns into a
``DistributedError`` instead of a hang.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from lp_runner.errors import DistributedError


class Communicator(Protocol):
    rank: int
    world_size: int
    backend: str  # "none" without a process group, else gloo | nccl
    collectives: int  # collectives issued so far (telemetry)

    def all_gather(self, payload: torch.Tensor) -> torch.Tensor:
        """[L] int64 on every rank -> [P, L], row r from rank r."""
        ...

    def all_gather_strings(self, text: str) -> list[str]:
        """Start-up only (config digest, weights checksum): not for the hot path."""
        ...


class SoloCommunicator:
    rank = 0
    world_size = 1
    backend = "none"  # no process group: a plain ``python -m lp_runner``

    def __init__(self) -> None:
        self.collectives = 0

    def all_gather(self, payload: torch.Tensor) -> torch.Tensor:
        return payload.unsqueeze(0)

    def all_gather_strings(self, text: str) -> list[str]:
        return [text]


class TorchCommunicator:
    """torch.distributed all_gather on a fixed-size int64 tensor; no pickled objects per round.

    ``group``: the process group it gathers over (None: the whole world); with ``parallel.groups = D`` each LP
    group of P ranks has its own (``parallel.groups.form_groups``), and ``rank`` / ``world_size`` are within it."""

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))  # gloo | nccl
        self.device = device  # NCCL needs tensors on the rank's GPU; gloo takes CPU tensors
        self.collectives = 0

    def all_gather(self, payload: torch.Tensor) -> torch.Tensor:
        local = payload.to(self.device)
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        try:
            dist.all_gather(out, local, group=self.group)
        except Exception as exc:  # gloo raises RuntimeError, NCCL DistBackendError; both mean a lost peer
            raise DistributedError(peer_failure_message(exc)) from None
        self.collectives += 1
        return torch.stack(out).cpu()

    def all_gather_strings(self, text: str) -> list[str]:
        out: list[str] = [""] * self.world_size
        try:
            dist.all_gather_object(out, text, group=self.group)
        except Exception as exc:
            raise DistributedError(peer_failure_message(exc)) from None
        return out


def peer_failure_message(exc: BaseException) -> str:
    return f"a peer worker died or stalled during a collective ({first_line(exc)})"


def init_process_group(dist_backend: str, timeout_s: float) -> str:
    """Join the torchrun (or Ray) rendezvous from the environment; returns the backend used."""
    backend = dist_backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise DistributedError("parallel.dist_backend=nccl needs CUDA devices; use gloo on CPU")
    if not dist.is_initialized():
        kwargs = {}
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        try:
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
        except Exception as exc:  # DistStoreError, RuntimeError: a peer never joined, or the address is wrong
            raise DistributedError(
                f"could not form the {backend} process group within {timeout_s:g} s "
                f"({first_line(exc)}); check that every worker started and MASTER_ADDR/MASTER_PORT are reachable"
            ) from None
    return backend


def first_line(exc: BaseException) -> str:
    """An exception's first line, at most 200 characters (for one-line ``error:`` messages)."""
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__

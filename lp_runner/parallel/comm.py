"""Communicators: how the ranks of one run exchange a round's fixed-size integer payload.

``SoloCommunicator`` is the P = 1 case (a no-op); ``TorchCommunicator`` wraps a torch.distributed process group
(gloo on CPU, NCCL on CUDA; start-up strings always over gloo). Every collective is bounded by
``parallel.timeout_s``, so a dead or stalled peer turns into a ``DistributedError`` instead of a hang.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from lp_runner.device import pins_host_memory
from lp_runner.errors import DistributedError, first_line

DEFAULT_TIMEOUT_S = 120.0  # parallel.timeout_s's default


class Communicator(Protocol):
    rank: int
    world_size: int
    backend: str  # "none" without a process group, else gloo | nccl
    collectives: int  # collectives issued so far (telemetry)

    def host_payload(self, values: Sequence[int]) -> torch.Tensor:
        """``values`` as the [L] int64 host tensor ``all_gather`` takes, written once; pinned where the collective
        runs on a GPU, so that its one copy to the device is asynchronous."""
        ...

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

    def host_payload(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    def all_gather(self, payload: torch.Tensor) -> torch.Tensor:
        return payload.unsqueeze(0)

    def all_gather_strings(self, text: str) -> list[str]:
        return [text]


class TorchCommunicator:
    """torch.distributed over a process group: the round's all_gather of a fixed-size int64 tensor (no pickled
    objects per round), and start-up strings.

    ``group``: the ranks it gathers over (None: the whole world); with ``parallel.groups = D`` each LP group of P
    ranks has its own (``parallel.groups.form_groups``), and ``rank`` / ``world_size`` are within it. ``device``:
    where the round's tensors live (``Placement.collective_device``: the rank's GPU under NCCL, else the host).
    ``strings``: a gloo group of the same ranks for the start-up strings (None: ``group`` is gloo itself), so no
    start-up message touches a GPU: NCCL's object collectives would stage them on the *current* CUDA device.
    ``timeout_s``: how long a round's collective may wait for a peer before it is a ``DistributedError``.

    The round's collective is issued asynchronously and waited for within ``timeout_s`` (``wait_bounded``): gloo's
    wait blocks the host and honours the group's timeout itself, but NCCL's only orders the GPU's streams, so a
    stalled peer would otherwise hold the host in the read-back until NCCL's watchdog aborts the process with a
    stack dump instead of an ``error:`` line."""

    def __init__(
        self,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        strings: dist.ProcessGroup | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.group = group
        self.strings = strings
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))  # gloo | nccl
        self.device = device
        self.timeout_s = timeout_s
        self.collectives = 0
        self._pin = pins_host_memory(device)
        self._payloads: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # length -> a host buffer and its numpy view

    def host_payload(self, values: Sequence[int]) -> torch.Tensor:
        """One host buffer per payload length, kept and rewritten each round (through its numpy view: no tensor
        made a round, no pinned allocation). Reusing it is safe: ``all_gather`` returns only after its collective,
        and so its copy from this buffer, has completed."""
        held = self._payloads.get(len(values))
        if held is None:
            buffer = torch.empty(len(values), dtype=torch.long, pin_memory=self._pin)  # [L]
            held = self._payloads[len(values)] = (buffer, buffer.numpy())
        held[1][:] = values
        return held[0]

    def all_gather(self, payload: torch.Tensor) -> torch.Tensor:
        """[L] int64 on the host (``host_payload``) -> [P, L] on the host: one copy in (asynchronous from pinned
        memory under NCCL), one collective, one read-back."""
        local = payload.to(self.device, non_blocking=True)  # [L]
        out = torch.empty(self.world_size * local.numel(), dtype=local.dtype, device=self.device)  # [P * L]
        try:
            work = _all_gather_single()(out, local, group=self.group, async_op=True)
            wait_bounded(work, self.timeout_s, host_blocks=self.device.type == "cpu")
        except DistributedError:
            raise
        except Exception as exc:  # gloo raises RuntimeError, NCCL DistBackendError; both mean a lost peer
            raise DistributedError(peer_failure_message(exc)) from None
        self.collectives += 1
        return out.view(self.world_size, -1).cpu()  # [P, L]: the round's one read-back of the exchange

    def all_gather_strings(self, text: str) -> list[str]:
        out: list[str] = [""] * self.world_size
        try:
            dist.all_gather_object(out, text, group=self.strings if self.strings is not None else self.group)
        except Exception as exc:
            raise DistributedError(peer_failure_message(exc)) from None
        return out


def _all_gather_single():
    """torch's gather of equal tensors into one output: ``all_gather_single`` (``all_gather_into_tensor``, its
    name before torch 2.13, warns there as deprecated)."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


SPIN_S = 5e-3  # how long a bounded wait on the host polls without sleeping: longer than a round's collective
POLL_S = 100e-6  # then its fixed sleep between polls: a peer that is late by more than SPIN_S is late by far more


def wait_bounded(work: dist.Work, timeout_s: float, host_blocks: bool) -> None:
    """Wait for ``work`` at most ``timeout_s``; a peer that never joins is a ``DistributedError``.

    ``host_blocks`` (gloo): ``work.wait()`` itself blocks until done and raises at the group's timeout. Otherwise
    (NCCL) ``wait`` returns at once (it only orders the GPU's streams), and NCCL's ``wait(timeout)`` polls in
    sleeps of a millisecond or more, so the host polls ``is_completed`` (a query of the collective's CUDA event)
    itself: without sleeping for the first ``SPIN_S`` (each poll gives up the GIL, so the rank's other threads
    run), then every ``POLL_S`` until the deadline. The collective is seen within one poll of its completion,
    a few microseconds, as long as it completes within ``SPIN_S``; after that, within ``POLL_S``.

    Worked example: a collective done 1.0 ms after the call is seen at about 1.0 ms (sleeps doubling from 50 us
    would see it at 1.55 ms: 50 + 100 + 200 + 400 + 800 us); one done at 8.0 ms by 8.1 ms; a dead peer raises
    at ``timeout_s``, having cost one core for ``SPIN_S`` and a wake-up every ``POLL_S`` after."""
    if host_blocks:
        work.wait()
        return
    start = time.monotonic()
    deadline, spin_until = start + timeout_s, start + SPIN_S
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            raise DistributedError(
                f"a peer worker died or stalled during a collective (no answer within parallel.timeout_s="
                f"{timeout_s:g} s)"
            )
        time.sleep(0.0 if now < spin_until else POLL_S)
    work.wait()  # raises the collective's own error, if it ended in one


def peer_failure_message(exc: BaseException) -> str:
    return f"a peer worker died or stalled during a collective ({first_line(exc)})"


NCCL_WATCHDOG_MARGIN_S = 60.0  # NCCL's own timeout is parallel.timeout_s + this: the bounded wait fires first


def init_process_group(backend: str, timeout_s: float, device: torch.device | None = None) -> None:
    """Join the torchrun (or Ray) rendezvous from the environment on ``backend`` (already resolved:
    ``device.resolve_dist_backend``).

    Under NCCL the group is bound to ``device``, the rank's own GPU, which ``device.bind`` made the current device
    before (NCCL creates its communicator on it), and NCCL's watchdog gets ``timeout_s`` + NCCL_WATCHDOG_MARGIN_S:
    a stalled peer is caught by the round's bounded wait (``wait_bounded``: one ``error:`` line, exit 3) before
    the watchdog would abort the process with a stack dump."""
    if dist.is_initialized():
        return
    kwargs: dict = {"timeout": timedelta(seconds=timeout_s)}
    if backend == "nccl":
        kwargs = {"timeout": timedelta(seconds=timeout_s + NCCL_WATCHDOG_MARGIN_S), "device_id": device}
    try:
        dist.init_process_group(backend=backend, **kwargs)
    except Exception as exc:  # DistStoreError, RuntimeError: a peer never joined, or the address is wrong
        raise DistributedError(
            f"could not form the {backend} process group within {timeout_s:g} s "
            f"({first_line(exc)}); check that every worker started and MASTER_ADDR/MASTER_PORT are reachable"
        ) from None


def strings_group(timeout_s: float, ranks: list[int] | None = None) -> dist.ProcessGroup | None:
    """A gloo group of ``ranks`` (None: the world) for start-up strings where the world is not gloo, else None
    (the group itself carries them). Collective: every rank of the world calls it, in the same order."""
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))

"""Forward backends: the one adapter around a Hugging Face model's forward and K/V cache (packed rounds, static
and compiled rounds, the attention mask), and the kernels its forward runs on, chosen once at load.

``select_backend`` is the one place a backend is chosen (``model.backend``; the runner calls it right after
loading, before the adapter exists): transformers' layers (``torch_backend``) on a GPU or where asked, lp_runner's
CPU kernels (the ``backends.cpu`` plug-in) on a CPU where they work. ``detect_backend`` finds the backend of a model
already prepared (what ``ModelAdapter(model)`` runs when given none: the tests, ``lp_runner.generate``). The
plug-in is imported only for a model on a CPU, so a GPU job never loads it; this module itself imports no backend
at import time, so the records' settings (``weights_rounding``) cost the CLI no torch import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lp_runner.backends.base import ForwardBackend
from lp_runner.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from lp_runner.config import ModelConfig

# model.backend's values that run lp_runner's CPU kernels and nothing else: refused for a model on another device
_CPU_ONLY = ("native", "native-bf16")
# model.backend's values that change the model itself, not only how it runs: the records' settings name the change
# (so --resume across it is refused), the other values run the same model (their tokens differ at most at fp32
# rounding) and are left out of the records' digest
_ROUNDS_WEIGHTS = {"native-bf16": "bfloat16"}

__all__ = ["ForwardBackend", "check_backend", "detect_backend", "select_backend", "weights_rounding"]


def weights_rounding(name: str) -> str | None:
    """The dtype ``model.backend=name`` rounds the linear weights to (another model's tokens), else None."""
    return _ROUNDS_WEIGHTS.get(name)


def check_backend(name: str, device: torch.device) -> None:
    """Refuse, before the model is loaded, a backend that cannot run on ``device`` (one line)."""
    if name in _CPU_ONLY and device.type != "cpu":
        raise ConfigError(
            f"model.backend={name} runs lp_runner's CPU kernels, but the model goes to {device}; "
            "use model.backend=auto or torch"
        )


def select_backend(
    name: str,
    model: torch.nn.Module,
    device: torch.device,
    *,
    config: ModelConfig | None = None,
    cache_root: Path | None = None,
    agree: Callable[[dict[str, float]], dict[str, float]] | None = None,
) -> ForwardBackend:
    """The backend ``model`` (loaded on ``device``) runs for ``model.backend=name``, applied to it: ``auto`` is the
    CPU kernels on a CPU where they work and transformers' layers elsewhere; ``torch`` is transformers' layers;
    ``native`` / ``native-bf16`` are the CPU kernels or a one-line ``ConfigError``. Called once, at load, by every
    rank of a group alike: ``agree`` (a collective over the group) makes its ranks choose the same kernels, and
    is called by each of them exactly once where the CPU kernels are measured (``auto`` on a CPU), never
    elsewhere. ``config``: the plug-in's options (``advanced.huge_pages``, ``advanced.native_layers``)."""
    from lp_runner.backends.torch_backend import TorchBackend

    check_backend(name, device)
    if name == "torch":
        return TorchBackend(name)
    if device.type != "cpu":
        return TorchBackend(name, f"the model is on {device}")
    from lp_runner.backends.cpu import backend as cpu  # the plug-in: imported for a model on a CPU only

    options = {} if config is None else {"huge_pages": config.huge_pages, "native_layers": config.native_layers}
    return cpu.prepare(model, name, cache_root=cache_root, agree=agree, **options)


def detect_backend(model: torch.nn.Module) -> ForwardBackend:
    """The backend of a model already prepared (or never): the CPU kernels' where its linear layers are packed,
    transformers' layers otherwise (and always off a CPU)."""
    from lp_runner.backends.torch_backend import TorchBackend

    if next(model.parameters()).device.type != "cpu":
        return TorchBackend()
    from lp_runner.backends.cpu import backend as cpu  # the plug-in: imported for a model on a CPU only

    return cpu.detect(model) or TorchBackend()

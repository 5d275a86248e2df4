"""Forward backends: the one adapter around a Hugging Face model's forward and K/V cache (packed rounds, static
and compiled rounds, the attention mask), and the kernels its forward runs on, chosen once at load.

``select_backend`` is the one place a backend is chosen (``model.backend``; the runner calls it right after
loading, before the adapter exists): transformers' layers (``torch_backend``) on a GPU or where asked, lp_runner's
CPU kernels (the ``backends.cpu`` plug-in) on a CPU where they work. ``detect_backend`` finds the backend of a model
already prepared (what ``ModelAdapter(model)`` runs when given none: the tests, ``lp_runner.generate``). The
plug-in is imported only by ``select_backend`` for a model on a CPU that may run it, so a GPU job (or
``model.backend: torch``) never loads it. ``BACKENDS`` is the registry of ``model.backend``'s values; with
``record_settings`` (what the records' digest sees of them) it imports no backend, so the CLI pays no torch import.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lp_runner.backends.base import ForwardBackend
from lp_runner.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from lp_runner.config import ModelConfig


@dataclass(frozen=True)
class BackendValue:
    """One value of ``model.backend``: what the config accepts, where it runs, what it does to the model."""

    name: str
    runs: str  # what it runs, for messages and docs
    devices: tuple[str, ...] = ()  # the device types it runs on; (): any (``check_backend``)
    # the dtype it rounds the linear weights to: it runs another model (its tokens are that model's), so the
    # records' settings name it (``record_settings``) and a --resume across it is refused; None: the same model
    weights: str | None = None


# The registry of model.backend's values (the config's choices are these, ``test_architecture`` checks).
BACKENDS = (
    BackendValue("auto", "lp_runner's CPU kernels on a CPU where they work, transformers' layers elsewhere"),
    BackendValue("torch", "transformers' layers on torch's kernels"),
    BackendValue("native", "lp_runner's CPU kernels (native products, attention and decoder layers)", ("cpu",)),
    BackendValue(
        "native-bf16", "lp_runner's CPU kernels on the linear weights rounded to bfloat16", ("cpu",), "bfloat16"
    ),
)
NAMES = tuple(value.name for value in BACKENDS)
_BY_NAME = {value.name: value for value in BACKENDS}
# The config fields (``advanced.*``) the CPU plug-in reads: how the model runs, not which tokens it gives
PLUGIN_OPTIONS = ("huge_pages", "native_layers")

__all__ = [
    "BACKENDS",
    "NAMES",
    "ForwardBackend",
    "check_backend",
    "detect_backend",
    "record_settings",
    "select_backend",
    "weights_rounding",
]


def weights_rounding(name: str) -> str | None:
    """The dtype ``model.backend=name`` rounds the linear weights to (another model's tokens), else None."""
    return _BY_NAME[name].weights


def record_settings(model: dict[str, Any]) -> dict[str, Any]:
    """The model section as the records' settings (and their digest) carry it: ``model.backend`` and the plug-in's
    options left out, as they run the same model (tokens that differ at most at fp32 rounding) and a --resume may
    change them; a backend that rounds the weights named instead (``model.linear_weights``, absent otherwise, so
    files written before it keep their digest)."""
    out = {k: v for k, v in model.items() if k != "backend" and k not in PLUGIN_OPTIONS}
    rounded = weights_rounding(model.get("backend", "auto"))
    if rounded is not None:
        out["linear_weights"] = rounded
    return out


def check_backend(name: str, device: torch.device) -> None:
    """Refuse, before the model is loaded, a backend that cannot run on ``device`` (one line)."""
    value = _BY_NAME.get(name)
    if value is None:
        raise ConfigError(f"model.backend must be one of {', '.join(NAMES)}, got {name!r}")
    if value.devices and device.type not in value.devices:
        raise ConfigError(
            f"model.backend={name} runs {value.runs}, but the model goes to {device}; use model.backend=auto or torch"
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
    transformers' layers otherwise. It imports the plug-in only where it is loaded already: a model holds packed
    layers only where their module was imported (``select_backend``, a test or benchmark packing them itself)."""
    from lp_runner.backends.torch_backend import TorchBackend

    if "lp_runner.backends.cpu.prepack" not in sys.modules or next(model.parameters()).device.type != "cpu":
        return TorchBackend()
    from lp_runner.backends.cpu import backend as cpu  # loaded already: this import costs nothing

    return cpu.detect(model) or TorchBackend()

"""lp_runner's CPU kernels as a forward backend: what ``model.backend: auto`` runs on a CPU where they work, and
``native`` / ``native-bf16`` ask for.

``prepare`` applies them to a loaded model once, before the adapter exists (as gpt-fast's ``_load_model`` applies
quantization before the loop): the linear layers packed for the faster product that works here (``prepack.py``:
oneDNN's or the native one, rank 0's measurement deciding for a group, the weights in huge pages where asked), and
the decoder layers' weights gathered for the native layers (``native_layers.py``) where the model has Llama-family
layers on native products. What it returns, a ``CpuBackend``, is all the adapter and the records see of them: the
attention a packed round runs, the whole-layer forward, the key fields of the cost curve and the summary line.
"""

from __future__ import annotations

import weakref

import torch

from lp_runner.backends.base import ForwardBackend
from lp_runner.backends.cpu import native, native_layers
from lp_runner.backends.cpu.attention import native_round_attention
from lp_runner.backends.cpu.native_layers import NATIVE_LAYERS_SUFFIX, LayerWeights, native_layer_weights
from lp_runner.backends.cpu.prepack import KERNELS, NATIVE_KERNELS, PrepackChoice, apply_prepack, packed_choice
from lp_runner.backends.round_mask import round_attention
from lp_runner.backends.torch_backend import TorchBackend


class CpuBackend:
    """A model whose linear layers are packed (``choice``), attending with the native loop where its products are
    native, and running its decoder layers whole where ``layer_weights`` holds them (one per layer; empty:
    transformers' layers, as a compiled adapter traces them)."""

    name = "cpu"

    def __init__(
        self, choice: PrepackChoice, layer_weights: tuple[LayerWeights, ...] = (), layers_note: str = ""
    ) -> None:
        """``layers_note``: why the decoder layers do not run natively on native products (one line), if asked."""
        self.choice = choice
        self.layer_weights = layer_weights
        self.layers_note = layers_note
        self.whole_layers = len(layer_weights)
        self.stacks: native_layers.Stacks = weakref.WeakKeyDictionary()  # the layers bound to each live cache
        self.native = KERNELS[choice.kernel] in NATIVE_KERNELS
        self.kernels = choice.kernels + (NATIVE_LAYERS_SUFFIX if layer_weights else "")  # each forward: its curve
        # a round on transformers' layers attends natively on native products (the mask untiled), else with sdpa
        self.round_attention = native_round_attention if self.native else round_attention
        self.tiled_mask = not self.native

    def key(self) -> dict[str, str]:
        """The kernels' name and, on native products, the build of the library that runs them (a new version of
        the sources, another compiler or other flags cost a forward something else)."""
        return {"kernels": self.kernels, "build": native.build_id() if self.native else ""}

    def forward_model(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask,
        cache,
        logit_rows: torch.Tensor,
        spans,
    ) -> torch.Tensor:
        return native_layers.forward_model(
            model, self.layer_weights, self.stacks, input_ids, position_ids, mask, cache, logit_rows, spans
        )

    def transformers_layers(self) -> CpuBackend:
        return CpuBackend(self.choice) if self.layer_weights else self

    def describe(self) -> dict:
        linear = self.choice.describe()
        out = {"name": self.name, **linear, "kernels": self.kernels, "linear_kernels": linear["kernels"]}
        out["native_layers"] = self.whole_layers
        if self.layers_note:
            out["native_layers_note"] = self.layers_note
        return {**out, "summary": self.summary()}

    def summary(self) -> str:
        """e.g. ``forward: linear layers native (211 in 121 products), decoder layers native (30, one call a
        round); model.backend=auto``."""
        c = self.choice
        line = f"forward: linear layers {KERNELS[c.kernel].label} ({c.layers} in {c.products} products), "
        if self.whole_layers:
            line += f"decoder layers native ({self.whole_layers}, one call a round)"
        else:
            line += "transformers' decoder layers" + (f" ({self.layers_note})" if self.layers_note else "")
        line += f"; model.backend={c.mode}" if c.mode else f"; {c.reason}"
        if c.huge_pages:
            line += "; weights in huge pages"
        elif c.huge_pages_note:
            line += f"; huge pages asked, not granted ({c.huge_pages_note})"
        return line


def prepare(
    model: torch.nn.Module,
    mode: str,
    *,
    cache_root=None,
    agree=None,
    huge_pages: bool = False,
    native_layers: bool = True,
) -> ForwardBackend:
    """Apply the CPU kernels to ``model`` (in place: its linear layers are replaced) for ``model.backend=mode``
    (``auto``, ``native``, ``native-bf16``; ``prepack.apply_prepack`` says what each packs, ``cache_root``, ``agree``
    and ``huge_pages`` included) and return the backend that runs it. ``auto`` where no kernel works here: the
    torch backend, saying why; ``native`` / ``native-bf16`` fail in one line instead (``ConfigError``).
    ``native_layers`` (``advanced.native_layers``): the decoder layers natively where the model and kernel allow."""
    choice = apply_prepack(model, mode, cache_root, agree, huge_pages)
    if not choice.layers:
        return TorchBackend(mode, f"lp_runner's CPU kernels cannot run it here ({choice.reason})")
    return _backend(model, choice, native_layers)


def detect(model: torch.nn.Module) -> CpuBackend | None:
    """The backend of a model whose linear layers were packed before (``prepack_linears`` or ``prepare``), with its
    decoder layers natively where they can be; None for a model with no packed layer."""
    choice = packed_choice(model)
    return None if choice is None else _backend(model, choice, True)


def _backend(model: torch.nn.Module, choice: PrepackChoice, whole_layers: bool) -> CpuBackend:
    if not (whole_layers and KERNELS[choice.kernel] in NATIVE_KERNELS):
        return CpuBackend(choice)
    found = native_layer_weights(model)
    return CpuBackend(choice, layers_note=found) if isinstance(found, str) else CpuBackend(choice, found)

"""transformers' own layers as a forward backend: what a model on a GPU runs, and any model under
``model.backend: torch``.

A round still attends through ``round_mask.round_attention`` (the K/V heads read in place, not repeated per query
head, over the live part of the arena); everything else is transformers' and torch's code.
"""

from __future__ import annotations

from dataclasses import dataclass

from lp_runner.backends.round_mask import round_attention

TORCH_KEY = {"kernels": "torch", "build": ""}  # the calibration and compile-record key fields of torch's kernels


@dataclass(frozen=True)
class TorchBackend:
    """transformers' layers, torch's kernels. ``mode``: ``model.backend`` as written ("" for a model the adapter
    found unprepared); ``reason``: why this backend (the summary says it)."""

    mode: str = ""
    reason: str = ""

    name = "torch"
    kernels = "torch"
    round_attention = staticmethod(round_attention)
    tiled_mask = True
    whole_layers = 0

    def key(self) -> dict[str, str]:
        return dict(TORCH_KEY)

    def forward_model(self, model, input_ids, position_ids, mask, cache, logit_rows, spans):
        raise RuntimeError("transformers' layers run every round here: the torch backend has no whole layers")

    def transformers_layers(self) -> TorchBackend:
        return self

    def describe(self) -> dict:
        return {
            "name": self.name,
            "mode": self.mode,
            "kernels": self.kernels,
            "reason": self.reason,
            "summary": self.summary(),
        }

    def summary(self) -> str:
        """e.g. ``forward: torch's linear layers, transformers' decoder layers; model.backend=auto: the model is on
        cuda:0``."""
        why = f"model.backend={self.mode}" if self.mode else ""
        why += (": " if why and self.reason else "") + self.reason
        return "forward: torch's linear layers, transformers' decoder layers" + (f"; {why}" if why else "")

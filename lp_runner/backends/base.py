"""What a forward backend is: the kernels a model's forward runs on, chosen once at load (``backends.select_backend``).

The adapter (``backends.adapter.ModelAdapter``) asks its backend, and nothing else, which attention a round
runs, whether the backend runs the decoder layers itself, and what names its forwards in cache keys and records;
it never tests a kernel's name. Two backends exist: transformers' own layers (``torch_backend.TorchBackend``: what
a GPU and ``model.backend: torch`` run) and lp_runner's CPU kernels (the ``backends.cpu`` plug-in, imported only
when a model on a CPU is given to it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch


class ForwardBackend(Protocol):
    """A model's forward kernels, as the adapter and the records need them."""

    name: str  # the backend in records: "torch" or "cpu"
    kernels: str  # the forward's kernels, as cache keys and records name them (e.g. "torch")
    # a round's attention on transformers' layers, passed by keyword (``round_mask.round_attention``'s contract)
    round_attention: Callable
    tiled_mask: bool  # whether ``round_attention`` reads the mask tiled for the packed query heads
    # decoder layers the backend runs whole, in one call, on static K/V buffers (``forward_model``); 0: none
    whole_layers: int

    def key(self) -> dict[str, str]:
        """The fields the calibration curve and the compile record are keyed by (each forward has its own curve):
        ``{"kernels": ..., "build": ...}``, the build naming the compiled code where the backend has any."""
        ...

    def forward_model(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,  # [B]
        position_ids: torch.Tensor,  # [B]
        mask,  # the round's [1, 1, B, K] additive mask (``round_mask``, not tiled), or {layer type: such a mask}
        cache,  # the arena's DynamicCache (``kv_cache.ArenaLayer``s), write slots set
        logit_rows: torch.Tensor,  # [L]
        spans: Sequence[tuple[int, int, int]],  # per generation: its rows, its region's first slot, its keys
    ) -> torch.Tensor:
        """A whole round through the backend's own layers: logits [L, vocab]. Called only where ``whole_layers``
        is non-zero (the round function decides once, at construction)."""
        ...

    def transformers_layers(self) -> ForwardBackend:
        """The same kernels under transformers' decoder layers (no whole layers): what a compiled adapter traces."""
        ...

    def describe(self) -> dict:
        """What the records carry (``policy.backend``), ``summary`` included."""
        ...

    def summary(self) -> str:
        """The backend's one line in the job's summary."""
        ...

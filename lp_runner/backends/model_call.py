"""The one call of the model's forward that every round makes, eager or compiled.

A round hands the model its rows (ids, positions), its masks, the arena's cache and the rows whose logits it
reads; transformers' keyword for the cache moved (``past_key_values`` up to 5.23, ``cache`` from 5.24) and hybrid
models take one mask per layer type. ``ModelCall`` resolves both once (the adapter builds it from the model's own
signature and cache layout) for the one round function (``rounds.Rounds``), eager or compiled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelCall:
    """``model``'s forward as a round calls it. ``mask_windows``: each layer type's sliding window (None: full
    attention; ``{"": w}`` where one mask serves every layer); ``per_type``: the model takes a mask per layer
    type (a dict keyed by ``model.config.layer_types``) instead of one 4-D mask."""

    model: torch.nn.Module
    cache_kw: str
    mask_windows: Mapping[str, int | None]
    per_type: bool

    def mask(self, by_window: Mapping[int | None, torch.Tensor]):
        """The masks per window as the model takes them: one per layer type (a hybrid model) or one for all."""
        per_type = {layer_type: by_window[window] for layer_type, window in self.mask_windows.items()}
        return per_type if self.per_type else next(iter(per_type.values()))

    def __call__(
        self,
        input_ids: torch.Tensor,  # [R]
        position_ids: torch.Tensor,  # [R]
        by_window: Mapping[int | None, torch.Tensor],  # window -> its [1, 1, R or groups * R, K] mask
        cache,  # the arena's DynamicCache
        logit_rows: torch.Tensor,  # [L]
        **kwargs,
    ) -> torch.Tensor:  # [L, vocab]
        out = self.model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=position_ids.unsqueeze(0),
            attention_mask=self.mask(by_window),
            use_cache=True,
            logits_to_keep=logit_rows,
            **{self.cache_kw: cache},
            **kwargs,
        )
        return out.logits[0]  # [L, vocab]

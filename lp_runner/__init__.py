"""Exact Lookahead Decoding with Lookahead Parallelism for Hugging Face causal LMs.

``lp_runner.generate(model, input_ids, ...)`` (``lp_runner.api``) runs lookahead generation on a model already
loaded; ``python -m lp_runner`` is the command line. The API is imported on first use, so that ``import
lp_runner`` (the CLI, ``python -m lp_runner.fetch``) does not load torch and transformers for it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["generate"]


def __getattr__(name: str) -> Any:
    if name == "generate":
        from lp_runner.api import generate

        return generate
    raise AttributeError(f"module 'lp_runner' has no attribute {name!r}")

"""Exact Lookahead Decoding with Lookahead Parallelism for Hugging Face causal LMs.

``lp_runner.generate(model, input_ids, ...)`` (``lp_runner.api``) runs lookahead generation on a model already
loaded; ``python -m lp_runner`` is the command line. The API is imported on first use, so that ``import
lp_runner`` (the CLI, ``python -m lp_runner.models.fetch``) does not load torch and transformers for it.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

__all__ = ["__version__", "generate"]

try:
    __version__ = version("lp_runner")  # pyproject.toml's version, as installed
except PackageNotFoundError:  # a source tree on PYTHONPATH that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "generate":
        from lp_runner.api import generate

        return generate
    raise AttributeError(f"module 'lp_runner' has no attribute {name!r}")

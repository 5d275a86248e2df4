"""Files under the cache root that hold a result together with the key it was computed for.

The calibration curve, the compile record and the auto preset's start-up choice are each a pure function of
their key (device, weights, code, inputs): the file is named by the key's digest and keeps the key itself, so a
reader takes the result only when the key matches in full, and anything absent, unreadable or written for another
key reads as nothing (the caller computes it again). Writes go to a private name and are renamed into place, so
the ranks of one node, or two jobs, never read half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def keyed_path(cache_root: Path, folder: str, stem: str, key: dict) -> Path:
    """``cache_root/folder/stem-<digest of key>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_root) / folder / f"{stem}-{digest}.json"


def read_keyed(path: Path, key: dict, parse: Callable[[dict], T]) -> T | None:
    """``parse`` of the file's fields when it was written for ``key``; None when absent, unreadable, for another
    key, or fields ``parse`` cannot read (a file of an older version)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    as_stored = json.loads(json.dumps(key))  # the key as JSON gives it back (tuples as lists)
    if not isinstance(data, dict) or data.get("key") != as_stored:
        return None
    try:
        return parse(data)
    except (KeyError, TypeError, ValueError):
        return None


def write_keyed(path: Path, key: dict, **fields: object) -> None:
    """Write ``{"key": key, **fields, "when": now}`` atomically (a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, **fields, "when": time.time()}, indent=1), encoding="utf-8")
    os.replace(tmp, path)

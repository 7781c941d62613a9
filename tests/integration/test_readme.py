"""The README works as written: its runnable blocks run, and serving a real model goes as it says.

Blocks marked ``<!-- runnable: demo -->`` run against a daemon on the built-in demo
config; ``<!-- config: real -->`` is the README's worked config for a Hub model and
``<!-- runnable: real... -->`` the commands and client code that go with it. The Hub
download is stood in for by the tiny demo model placed in a Hugging Face cache
(``HF_HUB_OFFLINE=1``: what a second start, after the first download, finds); with
an empty cache the same config gives the offline error the README promises. The only
substitutions are this test's addresses: the daemon's URL for ``127.0.0.1:8080``,
its files for ``~/...``, and this interpreter's ``bin`` for ``.venv/bin``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mlxd.engines.model_files.demo_model import write_demo_model
from tests.support.daemon import REPO, DaemonProcess

README = (REPO / "README.md").read_text()
MARKED = re.compile(r"<!-- (runnable|config): ([\w-]+) -->\n```(\w+)\n(.*?)```", re.S)
HUB_REPO = "mlx-community/Qwen2.5-0.5B-Instruct-4bit"

pytestmark = pytest.mark.mlx


def blocks(kind: str, tag: str) -> list[tuple[str, str]]:
    """``(language, code)`` of the README's blocks marked ``<!-- kind: tag -->``."""
    return [(lang, code) for k, t, lang, code in MARKED.findall(README) if (k, t) == (kind, tag)]


def localize(code: str, url: str, files: dict[str, Path]) -> str:
    code = code.replace("http://127.0.0.1:8080", url)
    code = code.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    for written, real in files.items():
        code = code.replace(written, str(real))
    return code


def run_block(lang: str, code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = ["bash", "-euo", "pipefail", "-c", code] if lang == "sh" else [sys.executable, "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
                          check=False)


def test_the_readme_marks_what_this_test_runs() -> None:
    """The marked blocks exist: the demo's commands, the worked config, its check and its client."""
    assert blocks("runnable", "demo") and blocks("config", "real")
    assert blocks("runnable", "real") and blocks("runnable", "real-python")
    assert HUB_REPO in blocks("config", "real")[0][1]


def test_the_demo_blocks_run_against_the_demo_config(tmp_path: Path) -> None:
    """`curl`, `mlxd status`, `mlxd history` and the sqlite3 query of the README work on the demo daemon."""
    with DaemonProcess(REPO / "etc" / "models.demo.yaml", tmp_path) as d:
        env = {**d.env, "MLXD_URL": d.url}
        files = {"~/.local/state/mlxd/journal.db": tmp_path / "journal.db"}
        outputs = []
        for lang, code in blocks("runnable", "demo"):
            r = run_block(lang, localize(code, d.url, files), env)
            assert r.returncode == 0, (code, r.stdout, r.stderr)
            outputs.append(r.stdout)
    assert '"object":"chat.completion"' in outputs[0].replace(" ", "")
    assert "demo" in outputs[0] and "loaded" in outputs[0]
    assert "request" in outputs[1]  # the journal's reason for demo's load


def _hub_cache(root: Path, with_model: bool) -> Path:
    """A Hugging Face cache that has the README's repo (the tiny demo model standing in), or nothing."""
    cache = root / "hub"
    if with_model:
        repo_dir = cache / f"models--{HUB_REPO.replace('/', '--')}"
        revision = "0" * 40
        write_demo_model(repo_dir / "snapshots" / revision, "tiny")
        (repo_dir / "refs").mkdir(parents=True)
        (repo_dir / "refs" / "main").write_text(revision)
    cache.mkdir(parents=True, exist_ok=True)
    return cache


def _real_config(tmp_path: Path) -> Path:
    (_, text), = blocks("config", "real")
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return path


def test_a_person_serves_the_readmes_real_model_and_asks_it(tmp_path: Path) -> None:
    """The README's config checks, serves (its model from the Hugging Face cache, offline) and answers the README's client code."""
    config = _real_config(tmp_path)
    env = {**os.environ, "HF_HUB_CACHE": str(_hub_cache(tmp_path, True)), "HF_HUB_OFFLINE": "1",
           "MLXD_STATE_DIR": str(tmp_path / "state")}
    files = {"~/.config/mlxd/models.yaml": config}
    for lang, code in blocks("runnable", "real"):
        r = run_block(lang, localize(code, "", files), env)
        assert r.returncode == 0, (code, r.stdout, r.stderr)
        assert "qwen" in r.stdout and "valid" in r.stdout
    (tmp_path / "state").mkdir(exist_ok=True)
    with DaemonProcess(config, tmp_path / "state", env=env) as d:
        (lang, code), = blocks("runnable", "real-python")
        r = run_block(lang, localize(code, d.url, files), env)
        assert r.returncode == 0, (r.stdout, r.stderr, d.log())
        assert r.stdout.strip()  # the random-weight stand-in says something


def test_without_network_or_cache_the_request_says_so(tmp_path: Path) -> None:
    """The README's config with nothing in the cache and no Hub: the request fails at once with 502 model_load_failed saying why."""
    config = _real_config(tmp_path)
    env = {"HF_HUB_CACHE": str(_hub_cache(tmp_path, False)), "HF_HUB_OFFLINE": "1"}
    (tmp_path / "state").mkdir(exist_ok=True)
    with DaemonProcess(config, tmp_path / "state", env=env) as d:
        r = httpx.post(f"{d.url}/v1/chat/completions", timeout=60, json={
            "model": "qwen", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "model_load_failed"
    assert "offline" in error["message"].lower() or "cache" in error["message"].lower(), error

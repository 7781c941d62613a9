"""The `ollama` npm package (Ollama's official JavaScript client) against the real daemon: one smoke test.

The client is installed into ``tests/js/node_modules`` (``make test`` does it;
this test does it too when it is missing). Without ``node`` and ``npm`` the
test skips, saying so.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.integration.conftest import config_of
from tests.support.daemon import serving

JS = Path(__file__).resolve().parents[1] / "js"


@pytest.fixture(scope="session")
def ollama_js() -> Path:
    """The installed npm client's directory (installed now if missing)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are needed for the ollama npm client smoke test (apt-get install nodejs npm)")
    if not (JS / "node_modules" / "ollama").is_dir():
        done = subprocess.run([npm, "install", "--prefix", str(JS), "--no-audit", "--no-fund"],
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, f"npm install failed:\n{done.stderr[-2000:]}"
    return JS


@pytest.fixture
def cfg(tiny_model: Path, bert_model: Path, tmp_path: Path) -> Any:
    models: list[dict[str, Any]] = [{"name": "tiny", "path": str(tiny_model), "estimated_memory_gb": 0.05}]
    if importlib.util.find_spec("mlx_embeddings") is not None:  # the embeddings extra serves bert
        models.append({"name": "bert", "path": str(bert_model), "embedding": True,
                       "estimated_memory_gb": 0.01})
    return config_of({"manager": {"memory_budget_gb": 2}, "models": models}, tmp_path)


async def test_the_ollama_npm_client_lists_chats_streams_embeds_and_sees_errors(
    cfg: Any, tmp_path: Path, ollama_js: Path
) -> None:
    """list, show, chat whole and streamed, generate streamed, embed, ps and an unknown model's 404,
    all through the npm client."""
    embedder = "bert" if cfg.model("bert") is not None else ""
    async with serving(cfg, tmp_path) as s:
        with trio.fail_after(120):
            done = await trio.run_process(
                [shutil.which("node") or "node", str(ollama_js / "ollama_smoke.mjs"), s.url, "tiny", embedder],
                capture_stdout=True, capture_stderr=True, check=False, cwd=ollama_js)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    out = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert set(out["names"]) == {m.name for m in cfg.models}
    assert out["capabilities"] == ["completion", "tools"]
    assert out["whole"]["done"] and out["whole"]["eval_count"] == 8 and out["whole"]["content"]
    assert out["streamed"]["content"] == out["whole"]["content"] and out["streamed"]["last_done"]
    assert out["streamed"]["count"] > 2 and out["generated"]
    assert out["vectors"] == (2 if embedder else 0)
    assert "tiny" in [m["name"] for m in out["running"]]
    assert out["unknown"]["status"] == 404 and "does not exist" in out["unknown"]["error"]

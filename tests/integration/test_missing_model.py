"""`mlxd serve` with a model directory that is not there (an external volume not mounted yet)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from tests.integration.conftest import fake
from tests.support.daemon import MLXD, REPO, DaemonProcess, write_config


def test_serve_starts_with_a_missing_model_directory(tmp_path: Path) -> None:
    """The daemon starts; the model whose directory is missing is failed with a last_error naming it, requests to it get 502, the others serve; check-config stays strict (exit 2)."""
    gone = tmp_path / "volume" / "qwen"
    cfg = write_config(tmp_path / "models.yaml", {
        "manager": {"memory_budget_gb": 1},
        "models": [{"name": "offline", "path": str(gone), "estimated_memory_gb": 0.1},
                   fake("a", 0.1)],
    })
    with DaemonProcess(cfg, tmp_path) as d, httpx.Client(base_url=d.url, timeout=30) as c:
        offline = c.get("/v1/models/offline").json()
        assert offline["status"] == "failed", offline
        assert str(gone) in offline["last_error"] and "does not exist" in offline["last_error"]
        r = c.post("/v1/completions", json={"model": "offline", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 502 and r.json()["error"]["code"] == "model_load_failed"
        assert "does not exist" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
        assert c.get("/health").json()["status"] == "ok"
    check = subprocess.run([*MLXD, "check-config", str(cfg)], capture_output=True, text=True,
                           cwd=REPO, timeout=60, check=False)
    assert check.returncode == 2 and "does not exist" in check.stderr, check.stderr

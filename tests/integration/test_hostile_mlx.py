"""Issue 10's hostile scenarios that need the real MLX engine (tiny demo model), through HTTP."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.integration.conftest import config_of
from tests.support.daemon import serving


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


async def test_an_mlx_engine_whose_stop_failed_is_never_handed_to_a_request(
    tiny_model: Path, tmp_path: Path
) -> None:
    """An MLX engine whose stop fails once keeps its bytes counted and is never handed to a request; the stop is retried, and the next request is served by a fresh engine (issue 10, scenario 8)."""
    cfg = config_of(
        {
            "manager": {"memory_budget_gb": 2},
            "models": [{"name": "tiny", "path": str(tiny_model), "estimated_memory_gb": 0.01,
                        "faults": {"stop": "raise_once"}}],
        },
        tmp_path,
    )
    async with serving(cfg, tmp_path) as s, s.client(timeout=60) as c:
        assert (await c.post("/v1/chat/completions", json=chat("tiny"))).status_code == 200
        r = await c.post("/admin/models/tiny/unload")
        assert r.status_code == 502 and "injected failure of stop 1" in r.json()["error"]["message"]
        model = (await c.get("/v1/models/tiny")).json()
        assert model["status"] == "unloading" and model["memory_bytes"] > 0
        status = (await c.get("/admin/status")).json()
        assert status["committed_bytes"] == model["memory_bytes"]
        health = (await c.get("/health")).json()
        assert health["status"] == "degraded"
        assert any("stopping its engine failed 1 time" in why for why in health["reasons"])
        t0 = time.monotonic()
        r = await c.post("/v1/chat/completions", json=chat("tiny"))
        assert r.status_code == 200, r.text  # served by a fresh engine after the retried stop
        assert time.monotonic() - t0 < 30
        rows = [(t["from_state"], t["to_state"], t["reason"]) for t in
                (await c.get("/admin/history", params={"model": "tiny"})).json()]
        assert rows[2:] == [
            ("loaded", "unloading", "admin"),
            ("unloading", "loaded", "unload_failed"),
            ("loaded", "unloading", "unload_failed"),
            ("unloading", "unloaded", "admin"),
            ("unloaded", "loading", "request"),
            ("loading", "loaded", "request"),
        ]
        assert (await c.get("/health")).json()["status"] == "ok"

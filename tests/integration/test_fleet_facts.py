"""What a fleet router reads from each daemon, and X-Mlxd-Require-Resident: neither ever loads a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from mlxd.engines.model_files.demo_model import write_demo_model
from tests.integration.conftest import config_of, fake
from tests.support.daemon import Served, serving

GB = 1024**3
CHAT = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
ROUTING_FACTS = {"state", "committed_bytes", "queued", "running", "kv_in_use", "expected_load_seconds"}
RESIDENT = {"X-Mlxd-Require-Resident": "1"}


def _config(tmp_path: Path, **more: Any) -> Any:
    return config_of({"manager": {"memory_budget_gb": 1}, "models": [
        fake("a", 0.25, load_seconds=0.2, tokens_per_second=50), fake("b", 0.5), *more.get("models", [])]},
        tmp_path)


async def _rows(s: Served, c: Any, kind: str) -> list[dict[str, Any]]:
    return (await c.get("/admin/history", params={"kind": kind})).json()  # type: ignore[no-any-return]


async def test_status_carries_the_routing_facts(tmp_path: Path) -> None:
    """/admin/status gives per model state, committed bytes, queued, running, KV in use and expected load seconds, and the daemon's free bytes."""
    async with serving(_config(tmp_path), tmp_path) as s, s.client() as c:
        before = (await c.get("/admin/status")).json()
        assert before["free_bytes"] == before["budget_bytes"] == 1 * GB
        assert set(before["models"]["a"]) >= ROUTING_FACTS
        assert before["models"]["a"]["expected_load_seconds"] is None
        assert (await c.post("/admin/models/a/load")).status_code == 200
        body = {"model": "a", "stream": True, "max_tokens": 200,
                "messages": [{"role": "user", "content": "hi"}]}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            async for _chunk in r.aiter_bytes():  # the stream has started: its lease is held
                break
            st = (await c.get("/admin/status")).json()
        a, b = st["models"]["a"], st["models"]["b"]
        assert (a["state"], a["committed_bytes"], a["running"], a["queued"], a["kv_in_use"]) == (
            "loaded", int(0.25 * GB), 1, 0, 0)
        assert a["expected_load_seconds"] >= 0.2
        assert (b["state"], b["committed_bytes"], b["running"], b["queued"]) == ("unloaded", 0, 0, 0)
        assert st["free_bytes"] == st["budget_bytes"] - st["committed_bytes"] == 1 * GB - int(0.25 * GB)


async def test_require_resident_refuses_every_model_route_before_any_byte(tmp_path: Path) -> None:
    """With X-Mlxd-Require-Resident: 1 and the model not loaded, chat, completions, messages, count_tokens and embeddings answer 503 model_not_resident with Retry-After: 0, and nothing is loaded or leased."""
    bert = tmp_path / "bert"
    write_demo_model(bert, "embedding")
    config = _config(tmp_path, models=[{"name": "bert", "path": str(bert), "embedding": True,
                                        "estimated_memory_gb": 0.05}])
    requests = [
        ("/v1/chat/completions", {"model": "a", **CHAT}),
        ("/v1/chat/completions", {"model": "a", "stream": True, **CHAT}),
        ("/v1/completions", {"model": "a", "prompt": "hi", "max_tokens": 2}),
        ("/v1/completions", {"model": "a", "prompt": "hi", "max_tokens": 2, "stream": True}),
        ("/v1/messages", {"model": "a", **CHAT}),
        ("/v1/messages", {"model": "a", "stream": True, **CHAT}),
        ("/v1/messages/count_tokens", {"model": "a", "messages": CHAT["messages"]}),
        ("/v1/embeddings", {"model": "bert", "input": "hello"}),
    ]
    async with serving(config, tmp_path) as s, s.client() as c:
        for path, body in requests:
            r = await c.post(path, json=body, headers=RESIDENT)
            assert (r.status_code, r.headers.get("retry-after")) == (503, "0"), (path, r.text)
            assert r.headers["content-type"].startswith("application/json"), path  # not a stream
            error = r.json()["error"]
            code = error.get("code") or error.get("type")
            assert code in ("model_not_resident", "overloaded_error"), (path, error)
            assert "not resident" in error["message"], error
        assert await _rows(s, c, "transitions") == []
        assert await _rows(s, c, "leases") == []
        bad = await c.post("/v1/chat/completions", json={"model": "a", **CHAT},
                           headers={"X-Mlxd-Require-Resident": "yes please"})
        assert bad.status_code == 400 and "X-Mlxd-Require-Resident" in bad.json()["error"]["message"]
        unknown = await c.post("/v1/chat/completions", json={"model": "zz", **CHAT}, headers=RESIDENT)
        assert unknown.status_code == 404  # an unknown model is still a 404
        assert (await c.post("/admin/models/a/load")).status_code == 200
        ok = await c.post("/v1/chat/completions", json={"model": "a", **CHAT}, headers=RESIDENT)
        assert ok.status_code == 200, ok.text
        off = await c.post("/v1/chat/completions", json={"model": "b", **CHAT},
                           headers={"X-Mlxd-Require-Resident": "0"})
        assert off.status_code == 200  # "0" is the header's absence: b loads


async def test_status_and_require_resident_hold_under_100_concurrent_polls(tmp_path: Path) -> None:
    """100 concurrent status polls and 100 concurrent require-resident requests all get their answer (200, 503) and load nothing."""
    answers: list[int] = []
    async with serving(_config(tmp_path), tmp_path) as s, s.client(timeout=60) as c:
        async def poll() -> None:
            answers.append((await c.get("/admin/status")).status_code)

        async def refused() -> None:
            r = await c.post("/v1/chat/completions", json={"model": "a", **CHAT}, headers=RESIDENT)
            answers.append(r.status_code)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for _ in range(100):
                    nursery.start_soon(poll)
                    nursery.start_soon(refused)
        assert sorted(answers) == [200] * 100 + [503] * 100
        assert await _rows(s, c, "transitions") == []
        assert s.manager.model_snapshot("a").state.value == "unloaded"

"""Residency seen through Ollama's routes (fake engines, the real journal): preemption mid-stream
and contention errors keep mlxd's behaviour in Ollama's shapes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
import trio

from tests.integration.test_http_residency import policy_config, rows, transitions
from tests.support.daemon import serving
from tests.support.official import run

CHAT = "/api/chat"


def body(model: str, *, stream: bool, tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream,
            "options": {"num_predict": tokens}}


async def ndjson_lines(client: httpx.AsyncClient, payload: dict[str, Any], sink: list[dict[str, Any]],
                       first: trio.Event) -> None:
    async with client.stream("POST", CHAT, json=payload) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        async for line in r.aiter_lines():
            sink.append(json.loads(line))
            if len(sink) >= 2:
                first.set()


async def test_a_preempted_ollama_stream_ends_with_an_error_line(tmp_path: Path) -> None:
    """Under `preempt`, an NDJSON stream on A ends with {"error": ...preempted...} when B is asked
    for; B is served; the lease rows name /api/chat with outcomes preempted and completed."""
    async with serving(policy_config(tmp_path, "preempt"), tmp_path) as s, s.client() as c:
        a_lines: list[dict[str, Any]] = []
        first = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(ndjson_lines, c, body("a", stream=True, tokens=10_000), a_lines, first)
            await first.wait()
            rb = await c.post(CHAT, json=body("b", stream=False, tokens=5))
        assert rb.status_code == 200 and rb.json()["done"] is True
        assert list(a_lines[-1]) == ["error"] and "preempted" in a_lines[-1]["error"]
        assert not any(line.get("done") for line in a_lines)
        await s.journal.wait_committed()
        assert dict(rows(s, "SELECT model, outcome FROM leases")) == {"a": "preempted", "b": "completed"}
        assert {r[0] for r in rows(s, "SELECT route FROM leases")} == {CHAT}
        assert ("loaded", "draining", "preempted") in transitions(s, "a")


async def test_contention_is_a_503_with_retry_after_in_ollamas_shape(tmp_path: Path) -> None:
    """With A busy and no room for B, X-Mlxd-Contention: fail gets a 503 {"error"} with
    Retry-After at once, which the official client raises as a ResponseError."""
    async with serving(policy_config(tmp_path, "wait_then_fail"), tmp_path) as s, s.client() as c:
        a_lines: list[dict[str, Any]] = []
        first = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(ndjson_lines, c, body("a", stream=True, tokens=60), a_lines, first)
            await first.wait()
            r = await c.post(CHAT, json=body("b", stream=False, tokens=5),
                             headers={"X-Mlxd-Contention": "fail"})
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
            assert list(r.json()) == ["error"] and r.json()["error"]
            client = ollama.Client(host=s.url, headers={"X-Mlxd-Contention": "fail"})
            s.on_close(client.close)
            with pytest.raises(ollama.ResponseError) as e:
                await run(lambda: client.chat("b", [{"role": "user", "content": "hi"}]))
            assert e.value.status_code == 503
        assert a_lines[-1]["done"] is True

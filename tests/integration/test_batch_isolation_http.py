"""Through HTTP: a chat whose schema cannot be enforced is a 400 and the streams sharing its model run on (issue 32, finding 1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio

from tests.integration.conftest import config_of
from tests.support.daemon import Served, serving

ENDLESS = {"$defs": {"n": {"type": "object", "required": ["c"],
                           "properties": {"c": {"$ref": "#/$defs/n"}}}},
           "$ref": "#/$defs/n"}


async def stream(s: Served, i: int, first: trio.Event, out: list[list[dict[str, Any]]]) -> None:
    """One streamed chat of 60 tokens; its chunks go to ``out[i]``; ``first`` is set at its first chunk."""
    body = {"model": "tiny", "stream": True, "max_tokens": 60, "temperature": 0,
            "messages": [{"role": "user", "content": f"stream number {i}"}]}
    async with s.client(timeout=120) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out[i].append(json.loads(line[6:]))
                first.set()


async def test_an_unenforceable_schema_is_a_400_and_the_streams_go_on(tiny_model: Path, tmp_path: Path) -> None:
    """Three streams run; a chat whose schema has no finite instance gets a short 400 naming the field, and every stream ends normally."""
    cfg = config_of({"manager": {"memory_budget_gb": 2},
                     "models": [{"name": "tiny", "path": str(tiny_model),
                                 "estimated_memory_gb": 0.01}]}, tmp_path)
    chunks: list[list[dict[str, Any]]] = [[], [], []]
    async with serving(cfg, tmp_path) as s:
        async with trio.open_nursery() as n:
            firsts = [trio.Event() for _ in range(3)]
            for i in range(3):
                n.start_soon(stream, s, i, firsts[i], chunks)
            for ev in firsts:
                await ev.wait()
            async with s.client(timeout=60) as c:
                r = await c.post("/v1/chat/completions", json={
                    "model": "tiny", "max_tokens": 60, "messages": [{"role": "user", "content": "x"}],
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "n", "schema": ENDLESS}}})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "response_format.json_schema.schema"
        assert "no finite instance" in error["message"] and len(error["message"]) < 400
        await s.journal.wait_committed()
        outcomes = [row["outcome"] for row in s.journal.leases(model="tiny")]
    for got in chunks:
        assert not any("error" in c for c in got)
        assert got[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert sorted(outcomes) == ["completed", "completed", "completed", "error"], outcomes


async def test_a_schema_refusal_names_the_field_of_the_route_that_took_it(tiny_model: Path,
                                                                         tmp_path: Path) -> None:
    """An unenforceable schema given to /v1/responses, /v1/messages or /api/chat is refused naming that route's field (text.format.schema, output_config.format.schema, format), not chat's response_format."""
    cfg = config_of({"manager": {"memory_budget_gb": 2},
                     "models": [{"name": "tiny", "path": str(tiny_model),
                                 "estimated_memory_gb": 0.01}]}, tmp_path)
    dangling = {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}
    chat = [{"role": "user", "content": "x"}]
    cases = [
        ("/v1/responses", {"model": "tiny", "input": "x", "text": {"format": {
            "type": "json_schema", "name": "n", "schema": ENDLESS}}}, "text.format.schema"),
        ("/v1/responses", {"model": "tiny", "input": "x", "text": {"format": {
            "type": "json_schema", "name": "n", "schema": dangling}}}, "text.format.schema"),
        ("/v1/messages", {"model": "tiny", "max_tokens": 8, "messages": chat, "output_config": {
            "format": {"type": "json_schema", "schema": dangling}}}, "output_config.format.schema"),
        ("/api/chat", {"model": "tiny", "stream": False, "messages": chat, "format": ENDLESS},
         "format"),
    ]
    async with serving(cfg, tmp_path) as s, s.client(timeout=60) as c:
        for path, body, param in cases:
            r = await c.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            message = r.json()["error"] if path == "/api/chat" else r.json()["error"]["message"]
            assert message.startswith(f"{param}: "), (path, message)
            if path == "/v1/responses":
                assert r.json()["error"]["param"] == param

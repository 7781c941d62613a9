"""Malformed requests on Ollama's routes (``/api/*``): each a 4xx in Ollama's ``{"error": "..."}``.

The same generated approach as test_malformed.py (whose helpers it uses): a
table of field mutations per route, raw bodies that are not JSON, wrong
content types, an oversize body, wrong methods, unknown models and routes, and
random JSON in every field. Every answer is a 4xx whose body is exactly
``{"error": <message>}`` with no traceback, the message naming the field;
afterwards the daemon is healthy, holds no lease, logged no error, and serves
a valid Ollama chat.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.integration.malformed_clients import MISSING, MODEL
from tests.integration.test_malformed import (
    JSON_CT,
    JSON_VALUES,
    MAX_BODY_MB,
    Bad,
    config,
    dumps,
    mutate,
    raw_bodies,
    send,
    short,
)
from tests.support.daemon import Served, serving

CHAT, GENERATE, EMBED, EMBEDDINGS = "/api/chat", "/api/generate", "/api/embed", "/api/embeddings"
SHOW, PULL = "/api/show", "/api/pull"
UNKNOWN = "no-such-model"
_FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
_CALL = {"function": {"name": "f", "arguments": {}}}

BODIES: dict[str, dict[str, Any]] = {
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 4}},
    GENERATE: {"model": MODEL, "prompt": "hi", "options": {"num_predict": 4}},
    EMBED: {"model": MODEL, "input": "hi"},
    EMBEDDINGS: {"model": MODEL, "prompt": "hi"},
    SHOW: {"model": MODEL},
    PULL: {"model": "org/repo"},
}
#: shared by chat and generate: field -> wrong values, each a 400 whose message names the field
GENERATION_MUTATIONS: dict[str, list[Any]] = {
    "model": [MISSING, None, 1, True, [], {}, [MODEL], "", "   ", "x" * 300],
    "stream": ["yes", 1, 0, [], {}],
    "keep_alive": ["5 minutes", "5 m", True, [], {}, "m5", "1e3", float("nan")],
    "options": [1, "x", [], True],
    "format": ["xml", "JSON", 1, [], True, {"type": "nonsense"}, "json", {"type": "object"}],
    "think": ["very", 1, [], {}, True, "high"],
    "logprobs": ["yes", 1, []],
    "top_logprobs": [21, -1, "3", 1.5, 5],
}
OPTION_MUTATIONS: list[dict[str, Any]] = [
    {"temperature": "hot"}, {"temperature": 3}, {"temperature": -1}, {"temperature": True},
    {"top_p": 2}, {"top_p": "x"}, {"top_k": -1}, {"top_k": 1.5}, {"seed": "1"}, {"seed": 2**70},
    {"num_predict": 10**9}, {"num_predict": "4"}, {"num_ctx": 0}, {"num_ctx": -5}, {"num_ctx": "8"},
    {"stop": 1}, {"stop": [1]}, {"stop": [""]}, {"stop": ["a"] * 17}, {"stop": ["x" * 257]},
]
CHAT_MUTATIONS: dict[str, list[Any]] = {
    "messages": ["hi", 1, {}, True, [1], [None], [{}], [{"role": "wizard"}], [{"role": "USER"}],
                [{"role": "user", "content": 1}], [{"role": "user", "content": ["hi"]}],
                [{"role": "user", "images": "aGk="}], [{"role": "user", "images": ["aGk="]}],
                [{"role": "user", "tool_calls": [_CALL]}],
                [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}],
                [{"role": "assistant", "tool_calls": [{"function": {"name": ""}}]}],
                [{"role": "assistant", "tool_calls": 1}],
                [{"role": "tool", "content": "x", "tool_name": 5}],
                [{"role": "assistant", "content": "x", "thinking": 1}]],
    "tools": [1, "x", {}, [1], [{"type": "x", "function": {"name": "f"}}], [{"function": {"name": ""}}],
              [{"function": {"name": "f", "parameters": {"type": "string"}}}], [_FN, _FN], [_FN] * 200, [_FN]],
}
GENERATE_MUTATIONS: dict[str, list[Any]] = {
    "prompt": [1, [], {}, True],
    "system": [1, [], {}],
    "raw": ["yes", 1, []],
    "images": ["x", 1, ["aGk="], [1]],
    "template": ["{{ .Prompt }}", 1, True],
    "suffix": ["end", 1],
    "context": [[1, 2], "x", 1],
}
OTHER_MUTATIONS: dict[str, dict[str, list[Any]]] = {
    EMBED: {"model": [MISSING, None, 1, "", MODEL], "input": [MISSING, None, 1, "", [], [""], [1], {}, ["x"] * 2049],
            "truncate": ["yes", 1], "dimensions": [0, -1, "8", 1.5, True], "options": ["x", 1],
            "keep_alive": ["soon"]},
    EMBEDDINGS: {"model": [MISSING, None, 1, "", MODEL], "prompt": [MISSING, None, 1, "", []],
                 "options": ["x"]},
    SHOW: {"model": [MISSING, None, 1, "", [MODEL]], "verbose": ["yes", 1]},
    PULL: {"model": [MISSING, None, 1, "", "llama3.2", "a/b/c", "a b/c", "-a/b", "a--b/c", "a/b.git",
                     "a/b:7b", "a/", "/b"],
           "insecure": ["yes", 1], "stream": ["yes", 1]},
}
#: raw bodies whose expectations do not depend on OpenAI's fields
GENERIC_RAW = ("empty", "whitespace", "truncated {", "truncated object", "truncated string",
               "trailing garbage", "two objects", "single quotes", "trailing comma", "bare word",
               "NaN model", "nested arrays", "nested objects", "invalid utf-8", "utf-16 garbage",
               "top-level array", "top-level string", "top-level null", "BOM, unknown model")


def field_cases() -> Iterator[Bad]:
    for path in (CHAT, GENERATE):
        table = {**GENERATION_MUTATIONS, **(CHAT_MUTATIONS if path == CHAT else GENERATE_MUTATIONS)}
        for field, values in table.items():
            for value in values:
                yield Bad(f"{path} {field}={short(value)}", "POST", path,
                          dumps(mutate(BODIES[path], field, value)), status=400, param=field)
        for opts in OPTION_MUTATIONS:
            (key,) = opts
            yield Bad(f"{path} options.{key}={short(opts[key])}", "POST", path,
                      dumps({**BODIES[path], "options": opts}), status=400, param=f"options.{key}")
    chat = BODIES[CHAT]
    for choice in ("sometimes", 1, "required", {"type": "function", "function": {"name": "nope"}}):
        yield Bad(f"chat options.tool_choice={short(choice)}", "POST", CHAT,
                  dumps({**chat, "options": {"tool_choice": choice}}), status=400, param="options.tool_choice")
    yield Bad("chat tool calls in the history of a fake", "POST", CHAT,
              dumps({**chat, "messages": [{"role": "assistant", "tool_calls": [_CALL]}]}), status=400,
              param="tools")
    yield Bad("generate raw with system", "POST", GENERATE,
              dumps({**BODIES[GENERATE], "raw": True, "system": "s"}), status=400, param="system")
    for path, table in OTHER_MUTATIONS.items():
        for field, values in table.items():
            for value in values:
                yield Bad(f"{path} {field}={short(value)}", "POST", path,
                          dumps(mutate(BODIES[path], field, value)), status=400, param=field)


def other_cases() -> Iterator[Bad]:
    for path in (CHAT, GENERATE, EMBED, EMBEDDINGS, SHOW):
        for name in (UNKNOWN, UNKNOWN + ":latest", MODEL + ":7b", MODEL.upper(), "\u001c"):
            yield Bad(f"{path} unknown model {name!r}", "POST", path,
                      dumps({**BODIES[path], "model": name}), status=404, param="does not exist")
    for path in (CHAT, GENERATE):
        base = BODIES[path]
        for label, content, status, _ in raw_bodies(dumps(base), dumps({**base, "model": UNKNOWN})):
            if label in GENERIC_RAW:
                yield Bad(f"{path} body {label}", "POST", path, content, status=status)
        for ct in ("application/xml", ""):
            yield Bad(f"{path} content-type {ct!r}", "POST", path, dumps(base),
                      headers=(("Content-Type", ct),), status=415)
        for ct in ("text/plain", "application/x-www-form-urlencoded"):  # what a web page may send
            yield Bad(f"{path} content-type {ct!r}", "POST", path, dumps(base),
                      headers=(("Content-Type", ct),), status=403)
        yield Bad(f"{path} 2 MB body", "POST", path, dumps({**base, "pad": "x" * (2 * 1024 * 1024)}),
                  status=413)
    for path, methods in ((CHAT, ("GET", "PUT", "DELETE")), (GENERATE, ("GET",)), ("/api/tags", ("POST", "DELETE")),
                          ("/api/ps", ("POST",)), ("/api/version", ("POST",)), (SHOW, ("GET",)),
                          (PULL, ("GET",)), (EMBED, ("GET",)), ("/api/delete", ("POST", "GET"))):
        for method in methods:
            yield Bad(f"{method} {path}", method, path, dumps(BODIES.get(path, {})), status=405)
    for path in ("/api/nothing", "/api/chat/x", "/api/tag", "/api/models"):
        yield Bad(f"unknown route {path}", "POST", path, dumps(BODIES[CHAT]), status=404)


def check_ollama(case: Bad, status: int, headers: httpx.Headers, text: str) -> None:
    """A 4xx whose body is exactly ``{"error": message}``, the message naming ``case.param``."""
    where = f"{case.label}: {status} {text[:300]!r}"
    assert 400 <= status <= 499, where
    assert "Traceback" not in text, where
    assert headers.get("content-type", "").startswith("application/json"), where
    body = json.loads(text)
    assert list(body) == ["error"] and isinstance(body["error"], str) and body["error"], where
    if case.status is not None:
        assert status == case.status, where
    if case.param is not None:
        assert case.param in body["error"], where
    if status == 405:
        assert headers.get("allow"), where


async def assert_serves_ollama(served: Served, client: httpx.AsyncClient) -> None:
    health = await client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    ok = await client.post(CHAT, json={**BODIES[CHAT], "stream": False})
    assert ok.status_code == 200 and ok.json()["done"] is True, ok.text
    assert served.manager.status()["leases"] == []


async def test_generated_malformed_ollama_requests_get_4xx_in_ollamas_shape(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Over 300 malformed requests on /api/* each get a 4xx {"error"} naming the problem; none is a 5xx."""
    cases = [*field_cases(), *other_cases()]
    assert len(cases) >= 300, len(cases)
    caplog.set_level(logging.WARNING, logger="mlxd")
    async with serving(config(tmp_path), tmp_path, max_body_mb=MAX_BODY_MB) as served, \
            served.client() as client:
        for case in cases:
            response = await send(client, case)
            check_ollama(case, response.status_code, response.headers, response.text)
        await assert_serves_ollama(served, client)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_routes_mlxd_does_not_serve_are_501_saying_why(tmp_path: Path) -> None:
    """delete, copy, create, push and blobs answer 501 {"error"} saying mlxd reads its models from its config."""
    async with serving(config(tmp_path), tmp_path) as served, served.client() as client:
        for method, path in (("DELETE", "/api/delete"), ("POST", "/api/copy"), ("POST", "/api/create"),
                             ("POST", "/api/push"), ("POST", "/api/blobs/sha256:00"),
                             ("HEAD", "/api/blobs/sha256:00")):
            r = await client.request(method, path, json={"model": MODEL})
            assert r.status_code == 501, (path, r.text)
            if method != "HEAD":
                assert list(r.json()) == ["error"] and "config" in r.json()["error"], r.text


FIELDS = {CHAT: ["model", "messages", "tools", "options", *GENERATION_MUTATIONS],
          GENERATE: ["model", "prompt", "options", *GENERATE_MUTATIONS, *GENERATION_MUTATIONS]}


async def test_random_json_in_any_ollama_field_is_a_4xx_naming_it(tmp_path: Path, stress: bool) -> None:
    """Random JSON in any field of an Ollama chat or generate body is a 400 naming it, or the unknown model's 404."""
    examples = 2000 if stress else 200
    seen: list[int] = []
    async with serving(config(tmp_path), tmp_path) as served, served.client() as client:

        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(data=st.data(), path=st.sampled_from([CHAT, GENERATE]))
        def check(data: st.DataObject, path: str) -> None:
            field = data.draw(st.sampled_from(FIELDS[path]), label="field")
            value = data.draw(JSON_VALUES, label="value")
            assume(field != "model" or not isinstance(value, str) or not value.startswith(("alpha", "beta")))
            body = {**BODIES[path], "model": UNKNOWN, field: value}
            response = sync_client.post(path, content=dumps(body), headers=dict(JSON_CT))
            seen.append(response.status_code)
            case = Bad(f"{path} {field}={short(value)}", "POST", path,
                       param=field if response.status_code == 400 else "does not exist")
            check_ollama(case, response.status_code, response.headers, response.text)

        with httpx.Client(base_url=served.url, timeout=30) as sync_client:
            await trio.to_thread.run_sync(check)
        await assert_serves_ollama(served, client)
    assert 400 in seen and 404 in seen

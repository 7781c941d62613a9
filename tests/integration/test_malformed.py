"""Malformed requests against a live daemon: each gets a 4xx in the OpenAI envelope, never a 5xx.

The cases are generated: a table of field mutations (wrong types, missing,
out of range, huge) crossed with the routes that read them, raw bodies that
are not JSON, wrong content types, oversize bodies, wrong methods, unknown
models, bad query strings and odd headers, and then a Hypothesis strategy that
puts random JSON into every field. Every answer must be a 4xx whose body is
the envelope ``{"error": {"message", "type", "param", "code"}}`` with no
traceback; afterwards the daemon is still healthy, holds no lease, logged no
unexpected error, and serves a valid chat request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mlxd.config import Config
from tests.integration.conftest import config_of, fake
from tests.integration.malformed_clients import (
    CHAT_MUTATIONS,
    COMPLETION_MUTATIONS,
    EMBEDDINGS,
    EMBEDDINGS_BODY,
    EMBEDDINGS_MUTATIONS,
    MESSAGES,
    MESSAGES_BODY,
    MESSAGES_MUTATIONS,
    MISSING,
    MODEL,
    RESPONSES,
)
from tests.support.daemon import Served, serving

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATION = (CHAT, COMPLETIONS)
UNKNOWN = "no-such-model"
MAX_BODY_MB = 1
JSON_CT = (("Content-Type", "application/json"),)

CHAT_BODY: dict[str, Any] = {
    "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
}
COMPLETION_BODY: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 4}



@dataclass(frozen=True)
class Bad:
    """One malformed request and what its answer must say beyond "a 4xx envelope"."""

    label: str
    method: str
    path: str
    content: bytes | None = None
    headers: tuple[tuple[str, str], ...] = JSON_CT
    params: tuple[tuple[str, str], ...] = ()
    status: int | None = None
    code: str | None = None
    #: error.param must start with this (a field path such as ``messages[0].content``)
    param: str | None = None
    chunked: bool = False


def config(tmp: Path) -> Config:
    return config_of(
        {
            "manager": {"memory_budget_gb": 8, "contention_policy": {"strategy": "fail"}},
            "models": [
                fake(MODEL, 1, load_seconds=0.01, tokens_per_second=5000),
                fake("beta-text", 1, load_seconds=0.01, tokens_per_second=5000),
            ],
        },
        tmp,
    )


def dumps(body: object) -> bytes:
    return json.dumps(body).encode()  # NaN and Infinity stay literals, as a sloppy client sends them


# ---- the systematic table ------------------------------------------------------------------

#: field -> wrong values; every one is refused with a 400 naming that field
COMMON_MUTATIONS: dict[str, list[Any]] = {
    "model": [MISSING, None, 1, 1.5, True, [], {}, [MODEL], "", "   ", "x" * 300],
    "max_tokens": ["10", "abc", 1.5, True, False, 0, -1, 10**12, 2**70, -(2**70), [], {}, [4],
                   131_073, float("nan"), float("inf")],
    "max_completion_tokens": ["10", 2.5, True, 0, -5, 10**12, 2**70, [], {}, float("inf")],
    "temperature": ["1", "NaN", True, -1, -0.001, 2.0001, 1e308, -1e308, [], {}, [0.5],
                    float("nan"), float("inf"), float("-inf")],
    "top_p": [-0.1, 1.5, "0.5", True, [], {}, float("nan"), 1e308],
    "stop": [1, True, [1], [None], [""], "", ["a"] * 100, ["a"] * 5, ["x" * 257], "x" * 900_000,
             ["x" * 900_000], {}, [[]], [{"a": 1}]],
    "seed": [2**70, -(2**70), 2**64, 1.5, "1", True, [], {}, float("nan")],
    "n": [2, 0, -1, 100, "1", 1.5, True, [], {}],
    "stream": ["true", "yes", 1, 0, [], {}, 1.0],
    "stream_options": ["x", [], 1, True, {"include_usage": True}, {"anything": 1}],
}

#: messages -> wrong values for chat; the param names the exact element
MESSAGE_MUTATIONS: list[tuple[Any, str]] = [
    (MISSING, "messages"), (None, "messages"), ("hi", "messages"), (1, "messages"),
    (True, "messages"), ({}, "messages"), ([], "messages"), ([1], "messages[0]"),
    (["hi"], "messages[0]"), ([None], "messages[0]"), ([[]], "messages[0]"),
    ([{}], "messages[0].role"), ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": 1, "content": "x"}], "messages[0].role"),
    ([{"role": "USER", "content": "x"}], "messages[0].role"),
    ([{"role": None, "content": "x"}], "messages[0].role"),
    ([{"role": ["user"], "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "system", "content": 1}], "messages[0].content"),
    ([{"role": "user", "content": []}], "messages[0].content"),
    ([{"role": "user", "content": {}}], "messages[0].content"),
    ([{"role": "user", "content": {"type": "text", "text": "x"}}], "messages[0].content"),
    ([{"role": "user", "content": [1]}], "messages[0].content[0]"),
    ([{"role": "user", "content": ["text"]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "file", "file": {}}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": None}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "image_url",
                                    "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}],
     "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "text", "text": "see"},
                                   {"type": "image_url", "image_url": "https://x/y.png"}]}],
     "messages[0].content[1]"),
    ([{"role": "user", "content": "ok"}, {"role": "robot", "content": "y"}], "messages[1].role"),
    ([{"role": "user", "content": "ok"}, {"role": "tool", "content": [{}]}],
     "messages[1].content[0].type"),
    ([{"role": "user", "content": "ok"}, {"role": "tool", "content": "42"}], "messages[1].tool_call_id"),
    ([{"role": "tool", "content": "42", "tool_call_id": 7}], "messages[0].tool_call_id"),
    ([{"role": "assistant", "content": "x", "tool_call_id": True}], "messages[0].tool_call_id"),
    ([{"role": "assistant", "tool_calls": 1}], "messages[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]}], "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"id": "", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages[0].tool_calls[0].id"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}],
     "tools"),
    ([{"role": "user", "content": "x", "name": 5}], "messages[0].name"),
]

PROMPT_MUTATIONS: list[Any] = [MISSING, None, 1, True, [], ["a", "b"], [1], [None], {}, [["a"]]]


def mutate(base: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    body = dict(base)
    if value is MISSING:
        body.pop(field, None)
    else:
        body[field] = value
    if field == "stream_options" and isinstance(value, dict) and "include_usage" in value:
        body.pop("stream", None)  # options without stream: refused
    return body


def short(value: Any) -> str:
    text = "<missing>" if value is MISSING else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def field_cases() -> Iterator[Bad]:
    for path, base in ((CHAT, CHAT_BODY), (COMPLETIONS, COMPLETION_BODY)):
        for field, values in COMMON_MUTATIONS.items():
            for value in values:
                yield Bad(f"{path} {field}={short(value)}", "POST", path,
                          dumps(mutate(base, field, value)), status=400, param=field)
    for path, base, table in ((CHAT, CHAT_BODY, CHAT_MUTATIONS),
                              (COMPLETIONS, COMPLETION_BODY, COMPLETION_MUTATIONS)):
        for field, values in table.items():
            for value in values:
                yield Bad(f"{path} {field}={short(value)}", "POST", path,
                          dumps(mutate(base, field, value)), status=400, param=field)
    for field, values in MESSAGES_MUTATIONS.items():
        for value in values:
            yield Bad(f"messages {field}={short(value)}", "POST", MESSAGES,
                      dumps(mutate(MESSAGES_BODY, field, value)), status=400, param=field)
    for field, values in EMBEDDINGS_MUTATIONS.items():
        for value in values:
            yield Bad(f"embeddings {field}={short(value)}", "POST", EMBEDDINGS,
                      dumps(mutate(EMBEDDINGS_BODY, field, value)), status=400, param=field)
    for name in (UNKNOWN, "\u001c"):  # U+001C is white space to str.strip, not to the document
        yield Bad(f"embeddings unknown model {name!r}", "POST", EMBEDDINGS,
                  dumps({**EMBEDDINGS_BODY, "model": name}), status=404, code="model_not_found")
    for path in (MESSAGES, MESSAGES + "/count_tokens"):
        yield Bad(f"{path} unknown model", "POST", path, dumps({**MESSAGES_BODY, "model": UNKNOWN}),
                  status=404)
    for value, param in MESSAGE_MUTATIONS:
        yield Bad(f"chat messages={short(value)}", "POST", CHAT,
                  dumps(mutate(CHAT_BODY, "messages", value)), status=400, param=param)
    for value in PROMPT_MUTATIONS:
        yield Bad(f"completion prompt={short(value)}", "POST", COMPLETIONS,
                  dumps(mutate(COMPLETION_BODY, "prompt", value)), status=400, param="prompt")
    # a stream_options value that is fine only with stream: its own field is wrong
    yield Bad("chat stream_options.include_usage='yes'", "POST", CHAT,
              dumps({**CHAT_BODY, "stream": True, "stream_options": {"include_usage": "yes"}}),
              status=400, param="stream_options.include_usage")
    yield Bad("chat stream_options.include_usage=null", "POST", CHAT,
              dumps({**CHAT_BODY, "stream": True, "stream_options": {"include_usage": None}}),
              status=400, param="stream_options.include_usage")
    for path, base in ((CHAT, CHAT_BODY), (COMPLETIONS, COMPLETION_BODY)):
        for name in (UNKNOWN, MODEL.upper(), MODEL + " ", "\u0000", "\u001c", "模型", "../" + MODEL):
            yield Bad(f"{path} unknown model {name!r}", "POST", path,
                      dumps({**base, "model": name}), status=404, code="model_not_found",
                      param="model")


def raw_bodies(valid: bytes, unknown: bytes) -> list[tuple[str, bytes, int, str | None]]:
    """(label, body, status, param) of bodies that are not a JSON object a route can use."""
    deep = 100_000
    return [
        ("empty", b"", 400, None),
        ("whitespace", b"  \n\t ", 400, None),
        ("truncated {", b"{", 400, None),
        ("truncated object", valid[: len(valid) // 2], 400, None),
        ("truncated string", b'{"model": "alp', 400, None),
        ("trailing garbage", valid + b"garbage", 400, None),
        ("trailing brace", valid + b"}", 400, None),
        ("two objects", valid + b" " + valid, 400, None),
        ("single quotes", b"{'model': 'alpha-text'}", 400, None),
        ("comment", b'{"model": "alpha-text" /* hi */}', 400, None),
        ("trailing comma", b'{"model": "alpha-text",}', 400, None),
        ("bare word", b"hello", 400, None),
        ("NaN model", b'{"model": NaN}', 400, "model"),
        ("NaN temperature", valid[:-1] + b', "temperature": NaN}', 400, "temperature"),
        ("Infinity top_p", valid[:-1] + b', "top_p": Infinity}', 400, "top_p"),
        ("-Infinity max_tokens", valid[:-1] + b', "max_tokens": -Infinity}', 400, "max_tokens"),
        ("1e999 temperature", valid[:-1] + b', "temperature": 1e999}', 400, "temperature"),
        ("5000-digit integer", valid[:-1] + b', "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
        ("nested arrays", b"[" * deep + b"]" * deep, 400, None),
        ("nested objects", b'{"a":' * deep + b"1" + b"}" * deep, 400, None),
        ("nested in a field", valid[:-1] + b', "extra": ' + b"[" * deep + b"]" * deep + b"}",
         400, None),
        ("invalid utf-8", b'{"model": "\xff\xfe"}', 400, None),
        ("overlong utf-8", b'{"model": "\xc0\xaf"}', 400, None),
        ("utf-8 surrogate", b'{"model": "\xed\xa0\x80"}', 400, None),
        ("latin-1 body", '{"model": "caf\u00e9"}'.encode("latin-1"), 400, None),
        ("nul bytes", b"\x00" * 16, 400, None),
        ("nul inside", valid[:-1] + b"\x00}", 400, None),
        ("utf-8 BOM then bad", b"\xef\xbb\xbf{", 400, None),
        ("utf-16 garbage", '{"model": '.encode("utf-16"), 400, None),
        ("BOM, unknown model", b"\xef\xbb\xbf" + unknown, 404, "model"),
        ("escaped lone surrogate", unknown[:-1] + b', "n": "\\ud800"}', 400, "n"),
        ("top-level array", b"[]", 400, None),
        ("top-level list of bodies", b"[" + valid + b"]", 400, None),
        ("top-level string", b'"alpha-text"', 400, None),
        ("top-level number", b"1", 400, None),
        ("top-level true", b"true", 400, None),
        ("top-level null", b"null", 400, None),
    ]


def raw_body_cases() -> Iterator[Bad]:
    for path, base in ((CHAT, CHAT_BODY), (COMPLETIONS, COMPLETION_BODY)):
        for label, content, status, param in raw_bodies(dumps(base),
                                                        dumps({**base, "model": UNKNOWN})):
            yield Bad(f"{path} body {label}", "POST", path, content, status=status, param=param,
                      code="model_not_found" if status == 404 else None)


def content_type_cases() -> Iterator[Bad]:
    body = dumps(CHAT_BODY)
    types: list[tuple[tuple[str, str], ...]] = [
        (), (("Content-Type", "application/xml"),),
        (("Content-Type", "application/json-patch+json"),), (("Content-Type", "text/json"),),
        (("Content-Type", "json"),), (("Content-Type", ""),), (("Content-Type", "application/jsonx"),),
        (("Content-Type", "image/png"),),
    ]
    # the body types a web page may send unasked are refused before routing (mlxd.http.origins)
    simple = [(("Content-Type", "text/plain"),), (("Content-Type", "application/x-www-form-urlencoded"),),
              (("Content-Type", "multipart/form-data; boundary=xyz"),)]
    for path in (*GENERATION, RESPONSES):
        for headers in types:
            label = headers[0][1] if headers else "none"
            yield Bad(f"{path} content-type {label!r}", "POST", path, body, headers=headers,
                      status=415, code="unsupported_media_type")
        for headers in simple:
            yield Bad(f"{path} content-type {headers[0][1]!r}", "POST", path, body, headers=headers,
                      status=403, code="json_body_required")
        yield Bad(f"{path} form body", "POST", path, b"model=alpha-text&prompt=hi",
                  headers=(("Content-Type", "application/x-www-form-urlencoded"),),
                  status=403, code="json_body_required")


def oversize_cases() -> Iterator[Bad]:
    big = dumps({**CHAT_BODY, "pad": "x" * (2 * 1024 * 1024)})  # 2 MB > max_body_mb (1 MB)
    for path in GENERATION:
        yield Bad(f"{path} 2 MB body", "POST", path, big, status=413, code="request_too_large")
        yield Bad(f"{path} 2 MB chunked body", "POST", path, big, status=413,
                  code="request_too_large", chunked=True)
        yield Bad(f"{path} 2 MB body, unknown model", "POST", path,
                  dumps({**CHAT_BODY, "model": UNKNOWN, "pad": "x" * (2 * 1024 * 1024)}),
                  status=413, code="request_too_large")


def method_and_route_cases() -> Iterator[Bad]:
    wrong = [
        (CHAT, ("GET", "PUT", "DELETE", "PATCH")),
        (RESPONSES, ("GET", "PUT", "DELETE")),
        (RESPONSES + "/resp_1", ("POST", "PUT", "PATCH")),
        (COMPLETIONS, ("GET", "PUT", "DELETE", "PATCH")),
        (f"/v1/models/{MODEL}", ("POST", "PUT", "DELETE")),
        ("/v1/models", ("POST", "DELETE")),
        (f"/admin/models/{MODEL}/load", ("GET", "PUT", "DELETE")),
        (f"/admin/models/{MODEL}/unload", ("GET", "DELETE")),
        ("/admin/history", ("POST", "DELETE")),
        ("/admin/events", ("POST", "PUT")),
        ("/admin/reload", ("GET",)),
    ]
    for path, methods in wrong:
        for method in methods:
            yield Bad(f"{method} {path}", method, path, dumps(CHAT_BODY), status=405,
                      code="method_not_allowed")
    for path in ("/v1/chat/completion", "/v1/chat/completions/x", "/v1/chat", "/admin/models",
                 f"/admin/models/{MODEL}", f"/admin/models/{MODEL}/reload", "/v2/models"):
        yield Bad(f"unknown route {path}", "POST", path, dumps(CHAT_BODY), status=404,
                  code="not_found")


def unknown_model_path_cases() -> Iterator[Bad]:
    ids = [UNKNOWN, MODEL.upper(), "alpha-text%20", "%00", "a" * 2000, "a/b", "..%2F..", "%E6%A8%A1",
           "%ff", "alpha-text/"]
    for model_id in ids:
        label = model_id if len(model_id) < 30 else model_id[:20] + "..."
        yield Bad(f"GET /v1/models/{label}", "GET", f"/v1/models/{model_id}", None,
                  status=404, code="model_not_found", param="model")
        for action in ("load", "unload"):
            yield Bad(f"POST /admin/models/{label}/{action}", "POST",
                      f"/admin/models/{model_id}/{action}", None, status=404,
                      code="model_not_found", param="model")


def query_cases() -> Iterator[Bad]:
    history = [
        ("limit", "-1"), ("limit", "0"), ("limit", "abc"), ("limit", "1.5"), ("limit", "10001"),
        ("limit", "9" * 30), ("limit", "0x10"), ("limit", "1e3"),
        ("since", "garbage"), ("since", "0001-01-01"), ("since", "2026-13-45"),
        ("since", "1 parsec"), ("since", "-5d"), ("since", "5 weeks"),
        ("kind", "bogus"), ("kind", ""), ("kind", "TRANSITIONS"),
    ]
    for name, value in history:
        yield Bad(f"history {name}={value[:20]!r}", "GET", "/admin/history", None,
                  params=((name, value),), status=400, param=name)
    for name, values in (("limit", ("5", "abc")), ("kind", ("leases", "transitions")),
                         ("since", ("1h", "2h")), ("model", ("a", "b"))):
        yield Bad(f"history {name} given twice", "GET", "/admin/history", None,
                  params=tuple((name, v) for v in values), status=400, param=name)
    yield Bad("unload preempt given twice", "POST", f"/admin/models/{MODEL}/unload", None,
              params=(("preempt", "true"), ("preempt", "false")), status=400, param="preempt")
    for value in ("maybe", "2", "truee", "ja", "-1", "null"):
        yield Bad(f"unload preempt={value!r}", "POST", f"/admin/models/{MODEL}/unload", None,
                  params=(("preempt", value),), status=400, param="preempt")
    for value in ("abc", "-1", "1.5", "9" * 25, "0x10", "1e3", "+5", "١٢"):
        yield Bad(f"events Last-Event-ID={value[:20]!r}", "GET", "/admin/events", None,
                  headers=(("Last-Event-ID", value),) if value.isascii() else (),
                  params=() if value.isascii() else (("last_event_id", value),),
                  status=400, param="Last-Event-ID")
    for value in ("x", "-3"):
        yield Bad(f"events last_event_id={value!r}", "GET", "/admin/events", None,
                  params=(("last_event_id", value),), status=400, param="Last-Event-ID")


def header_cases() -> Iterator[Bad]:
    no_messages = dumps({"model": MODEL})
    odd: list[tuple[str, tuple[tuple[str, str], ...]]] = [
        ("Authorization garbage", (("Authorization", "garbage"),)),
        ("Authorization scheme only", (("Authorization", "Bearer"),)),
        ("Authorization huge", (("Authorization", "Bearer " + "x" * 8000),)),
        ("Authorization basic", (("Authorization", "Basic Zm9vOmJhcg=="),)),
        ("X-Request-Id huge", (("X-Request-Id", "r" * 10_000),)),
        ("X-Request-Id tabbed", (("X-Request-Id", "a\tb"),)),
        ("header 12 KB", (("X-Junk", "j" * 12_000),)),
        ("Accept html", (("Accept", "text/html"),)),
        ("Content-Encoding gzip (not gzipped)", (("Content-Encoding", "gzip"),)),
        ("Expect 100-continue", (("Expect", "100-continue"),)),
        ("Last-Event-ID on chat", (("Last-Event-ID", "abc"),)),
        ("many headers", tuple((f"X-H{i}", str(i)) for i in range(100))),
    ]
    for label, extra in odd:
        yield Bad(f"{label} + no messages", "POST", CHAT, no_messages,
                  headers=JSON_CT + extra, status=400, param="messages")
        yield Bad(f"{label} + unknown model", "GET", f"/v1/models/{UNKNOWN}", None,
                  headers=extra, status=404, code="model_not_found", param="model")
    yield Bad("Content-Length 0", "POST", CHAT, b"", status=400)
    yield Bad("chunked tiny bad body", "POST", COMPLETIONS, b'{"model": 1}', status=400,
              param="model", chunked=True)


def all_cases() -> list[Bad]:
    return [
        *field_cases(), *raw_body_cases(), *content_type_cases(), *oversize_cases(),
        *method_and_route_cases(), *unknown_model_path_cases(), *query_cases(), *header_cases(),
    ]


# ---- checking one answer ------------------------------------------------------------------


def check_anthropic_envelope(case: Bad, status: int, text: str, where: str) -> None:
    """Anthropic's envelope: {"type": "error", "error": {"type", "message"}}; the message names the field."""
    body = json.loads(text)
    assert body["type"] == "error", where
    err = body["error"]
    assert isinstance(err["type"], str) and isinstance(err["message"], str) and err["message"], where
    if case.status is not None:
        assert status == case.status, where
    if case.param is not None:
        assert case.param in err["message"], where
    if status == 404:
        assert err["type"] == "not_found_error", where


def check_envelope(case: Bad, status: int, headers: httpx.Headers, text: str) -> None:
    where = f"{case.label}: {status} {text[:300]!r}"
    assert 400 <= status <= 499, where
    assert "Traceback" not in text, where
    assert headers.get("content-type", "").startswith("application/json"), where
    if case.path.startswith(MESSAGES):
        check_anthropic_envelope(case, status, text, where)
        return
    err = json.loads(text)["error"]
    assert isinstance(err["message"], str) and err["message"], where
    assert isinstance(err["type"], str) and err["type"], where
    assert "code" in err and "param" in err, where
    if err["code"] == "model_not_found":
        assert status == 404 and err["param"] == "model", where
    if case.status is not None:
        assert status == case.status, where
    if case.code is not None:
        assert err["code"] == case.code, where
    if case.param is not None:
        assert isinstance(err["param"], str) and err["param"].startswith(case.param), where
    if status == 405:
        assert headers.get("allow"), where
    if status == 400 and err["code"] == "invalid_request":
        assert err["type"] == "invalid_request_error", where


async def chunks(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), 64 * 1024):
        yield data[i : i + 64 * 1024]


async def send(client: httpx.AsyncClient, case: Bad) -> httpx.Response:
    content: Any = case.content
    if case.chunked and content is not None:
        content = chunks(content)
    request = client.build_request(case.method, case.path, content=content,
                                   headers=list(case.headers), params=list(case.params))
    if case.path == "/admin/events":
        with trio.fail_after(10):  # a good id would stream forever: fail instead of hanging
            response = await client.send(request, stream=True)
            try:
                await response.aread()
            finally:
                await response.aclose()
        return response
    return await client.send(request)


async def assert_healthy(served: Served, client: httpx.AsyncClient) -> None:
    health = await client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    ok = await client.post(CHAT, json={**CHAT_BODY, "max_tokens": 3})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["content"]
    leases = served.manager.status()["leases"]
    assert leases == [], leases


# ---- the tests ------------------------------------------------------------------------------


async def test_generated_malformed_requests_get_typed_4xx_and_leave_the_daemon_healthy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Over 300 generated malformed requests each get a 4xx envelope naming the problem; none is a 5xx."""
    cases = all_cases()
    assert len(cases) >= 300, len(cases)
    caplog.set_level(logging.WARNING, logger="mlxd")
    counts: dict[str, int] = {}
    async with serving(config(tmp_path), tmp_path, max_body_mb=MAX_BODY_MB) as served, \
            served.client() as client:
        for case in cases:
            response = await send(client, case)
            check_envelope(case, response.status_code, response.headers, response.text)
            counts[case.path] = counts.get(case.path, 0) + 1
        await assert_healthy(served, client)
    unexpected = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert unexpected == [], unexpected
    assert sum(counts.values()) >= 300
    for path in (CHAT, COMPLETIONS, RESPONSES, f"/v1/models/{UNKNOWN}", "/admin/history", "/admin/events"):
        assert counts.get(path, 0) > 0, (path, counts)
    assert any(p.startswith("/admin/models/") and p.endswith("/load") for p in counts)
    assert any(p.startswith("/admin/models/") and p.endswith("/unload") for p in counts)


async def test_every_refused_body_leaves_the_connection_reusable(tmp_path: Path) -> None:
    """An answer sent before the body was read (413, 415, 403, 405) keeps the connection serving requests."""
    big = dumps({**CHAT_BODY, "pad": "x" * (2 * 1024 * 1024)})
    near = dumps({**CHAT_BODY, "pad": "x" * (900 * 1024)})
    early = [
        Bad("413", "POST", CHAT, big, status=413), Bad("413 chunked", "POST", CHAT, big,
                                                       status=413, chunked=True),
        Bad("415", "POST", CHAT, near, headers=(("Content-Type", "application/xml"),), status=415),
        Bad("403", "POST", CHAT, near, headers=(("Content-Type", "text/plain"),), status=403),
        Bad("405", "PUT", CHAT, near, status=405),
        Bad("404", "POST", "/v1/nothing", near, status=404),
    ]
    async with serving(config(tmp_path), tmp_path, max_body_mb=MAX_BODY_MB) as served, \
            served.client(timeout=10) as client:
        for case in early:
            with trio.fail_after(10):
                response = await send(client, case)
                assert response.status_code == case.status, case.label
                follow = await client.get("/health")  # the same keep-alive connection
                assert follow.status_code == 200, case.label


async def test_a_header_block_past_the_protocol_limit_is_refused_without_harm(tmp_path: Path) -> None:
    """A request head far past hypercorn's h11 limit gets 431 from the server layer; the daemon serves on."""
    # h11 refuses an incomplete head over 16 KiB; one that arrives whole in a single 64 KiB
    # read slips through, so this one is well past both
    async with serving(config(tmp_path), tmp_path) as served, served.client() as client:
        response = await client.get("/v1/models", headers={"X-Junk": "j" * 256_000})
        assert response.status_code == 431
        assert "Traceback" not in response.text
        await assert_healthy(served, client)


#: any JSON value, the way a careless or hostile client might put one in a field
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)
CHAT_FIELDS = ["model", "messages", *(f for f in COMMON_MUTATIONS if f != "model")]
COMPLETION_FIELDS = ["model", "prompt", *(f for f in COMMON_MUTATIONS if f != "model")]


async def test_random_json_in_any_field_is_a_4xx_naming_that_field(
    tmp_path: Path, stress: bool
) -> None:
    """Random JSON in any field of a chat or completion body is a 400 naming that field or a 404 for the model."""
    examples = 2000 if stress else 200
    seen: list[int] = []
    async with serving(config(tmp_path), tmp_path, max_body_mb=MAX_BODY_MB) as served, \
            served.client() as client:
        url = served.url

        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(data=st.data(), chat=st.booleans())
        def check(data: st.DataObject, chat: bool) -> None:
            fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
            field = data.draw(st.sampled_from(fields), label="field")
            value = data.draw(JSON_VALUES, label="value")
            assume(not (field == "model" and isinstance(value, str) and value.strip() in (
                MODEL, "beta-text")))
            base = CHAT_BODY if chat else COMPLETION_BODY
            body = {**base, "model": UNKNOWN, field: value}
            path = CHAT if chat else COMPLETIONS
            response = sync_client.post(path, content=dumps(body), headers=dict(JSON_CT))
            seen.append(response.status_code)
            case = Bad(f"{path} {field}={short(value)}", "POST", path)
            check_envelope(case, response.status_code, response.headers, response.text)
            err = response.json()["error"]
            if response.status_code == 400:
                assert err["param"] is not None and err["param"].startswith(field), (field, err)
            else:
                assert response.status_code == 404 and err["code"] == "model_not_found"

        with httpx.Client(base_url=url, timeout=30) as sync_client:
            await trio.to_thread.run_sync(check)
        await assert_healthy(served, client)
    assert len(seen) >= min(examples, 100)
    assert 400 in seen and 404 in seen


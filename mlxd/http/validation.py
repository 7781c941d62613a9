"""Request bodies of the OpenAI routes, validated into engine requests.

Every problem raises :class:`mlxd.errors.InvalidRequest` whose ``param`` names
the field (``messages[1].content``), so clients get a typed 400 that says what
to fix. Fields of the OpenAI API that mlxd does not use (``user``,
``presence_penalty``, ...) are accepted and ignored, as OpenAI-compatible
servers commonly do; ``n`` other than 1 is refused. The fields mlxd acts on
beyond plain generation (``tools``, ``tool_choice``, ``response_format``,
``logprobs``, tool history) are checked in :mod:`mlxd.http.structured`. The
extension field ``keep_alive`` is read by :mod:`mlxd.http.preferences`.

Text must be valid Unicode: every string of every body (a lone UTF-16
surrogate is a 400 naming its JSON path) is checked where bodies are read, by
:mod:`mlxd.http.text`, before this module sees it. ``top_p: 0`` keeps only the most likely token: the request is
greedy (temperature 0), whatever its ``temperature``.

Every optional field may be ``null`` (it then takes its default). Integer
fields accept a number with no fractional part (``16.0``), as JSON Schema's
``integer`` does; booleans are never numbers. The scalar fields are read
through :data:`SAMPLING` (:mod:`mlxd.http.fields`), the table
:mod:`mlxd.http.openapi` documents them from, so generated requests and this
module agree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from mlxd.engines.base import ChatMessage, GenerationRequest
from mlxd.errors import InvalidRequest
from mlxd.http.fields import Boolean, Integer, Kind, Number, Stops, bad, read
from mlxd.http.preferences import Headers, Preferences, preferences
from mlxd.http.structured import (
    MAX_MODEL_NAME,
    MODEL_NAME_PATTERN,
    assistant_tool_calls,
    openai_fields,
)

#: upper bound on max_tokens; a larger value is a 400, not a silent clamp
MAX_TOKENS_LIMIT = 131_072
DEFAULT_MAX_TOKENS = 512
ROLES = {"system", "user", "assistant", "developer", "tool"}
MAX_STOP = 4


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    model: str
    generation: GenerationRequest
    stream: bool
    include_usage: bool
    #: keep_alive (body field or header) and X-Mlxd-Contention
    preferences: Preferences = field(default_factory=Preferences)


#: the scalar fields of a chat or completion body (read here, documented from this table)
SAMPLING: dict[str, Kind] = {
    "max_tokens": Integer(1, MAX_TOKENS_LIMIT),
    "max_completion_tokens": Integer(1, MAX_TOKENS_LIMIT),
    "temperature": Number(0, 2),
    "top_p": Number(0, 1),
    "stop": Stops(MAX_STOP),
    "seed": Integer(-(2**63), 2**64 - 1),
    "n": Integer(1, 1, hint="only n=1 is supported"),
    "stream": Boolean(),
}


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise bad("model", "is required")
    if not isinstance(model, str) or re.search(MODEL_NAME_PATTERN, model) is None:
        raise bad("model", "must be a non-empty string")
    if len(model) > MAX_MODEL_NAME:
        raise bad("model", "is too long")
    return model


def _max_tokens(body: dict[str, Any]) -> int:
    """``max_completion_tokens`` wins over ``max_tokens``; both are checked."""
    newer = read(body, "max_completion_tokens", SAMPLING["max_completion_tokens"], None)
    older = read(body, "max_tokens", SAMPLING["max_tokens"], None)
    chosen = newer if newer is not None else older
    return chosen if chosen is not None else DEFAULT_MAX_TOKENS


def _seed(body: dict[str, Any]) -> int | None:
    seed = read(body, "seed", SAMPLING["seed"], None)
    return None if seed is None else int(seed) % (2**32)


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = read(body, "stream", SAMPLING["stream"], False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options", "must be an object")
        iu = opts.get("include_usage", False)
        if not isinstance(iu, bool):
            raise bad("stream_options.include_usage", "must be a boolean")
        if not stream and opts:
            raise bad("stream_options", "is only allowed when stream is true")
        include_usage = iu
    return stream, include_usage


def _content(v: object, param: str, *, allow_images: bool) -> str | list[dict[str, Any]]:
    if isinstance(v, str):
        return v
    if not isinstance(v, list) or not v:
        raise bad(param, "must be a string or a non-empty list of content parts")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(v):
        p = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise bad(p, "must be an object with a 'type'")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise bad(f"{p}.text", "must be a string")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            if not allow_images:
                raise bad(p, "image parts are only accepted by vision (mllm) models")
            iu = part.get("image_url")
            url = iu.get("url") if isinstance(iu, dict) else iu
            if not isinstance(url, str) or not url:
                raise bad(f"{p}.image_url.url", "must be a string URL")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise bad(f"{p}.type", "must be 'text' or 'image_url'")
    return parts


def _messages(body: dict[str, Any], *, allow_images: bool) -> tuple[ChatMessage, ...]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "is required")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list")
    out: list[ChatMessage] = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(p, "must be an object with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad(f"{p}.role", f"must be one of {', '.join(sorted(ROLES))}")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        parsed = _content(content, f"{p}.content", allow_images=allow_images)
        calls = assistant_tool_calls(m.get("tool_calls"), f"{p}.tool_calls")
        if calls and role != "assistant":
            raise bad(f"{p}.tool_calls", "only assistant messages carry tool calls")
        call_id = m.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad(f"{p}.tool_call_id", "must be a string")
        if role == "tool" and not call_id:
            raise bad(f"{p}.tool_call_id", "is required in a tool message (the id of the call it answers)")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad(f"{p}.name", "must be a string")
        out.append(ChatMessage(role, parsed, calls, call_id if role == "tool" else None, name))
    return tuple(out)


def _prompt(body: dict[str, Any]) -> str:
    v = body.get("prompt")
    if v is None:
        raise bad("prompt", "is required")
    if isinstance(v, list):
        if len(v) != 1 or not isinstance(v[0], str):
            raise bad("prompt", "must be a string (or a list of exactly one string)")
        v = v[0]
    if not isinstance(v, str):
        raise bad("prompt", "must be a string")
    return v


def parse_request(
    body: object,
    *,
    kind: str,
    allow_images: bool = False,
    request_id: str | None = None,
    headers: Headers | None = None,
) -> ParsedRequest:
    """Validate a chat (``kind="chat"``) or completion body into a :class:`ParsedRequest`.

    ``headers`` may carry ``X-Mlxd-Keep-Alive`` and ``X-Mlxd-Contention``
    (:mod:`mlxd.http.preferences`).
    """
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = _model(body)
    read(body, "n", SAMPLING["n"], 1)
    stream, include_usage = _stream(body)
    chat = kind == "chat"
    top_p = read(body, "top_p", SAMPLING["top_p"], 1.0)
    temperature = read(body, "temperature", SAMPLING["temperature"], 1.0)
    if top_p == 0.0:
        temperature = 0.0  # the nucleus holds only the most likely token: greedy
    fields = openai_fields(body, chat=chat)
    gen = GenerationRequest(
        kind="chat" if chat else "completion",
        messages=_messages(body, allow_images=allow_images) if chat else (),
        prompt=None if chat else _prompt(body),
        max_tokens=_max_tokens(body),
        temperature=temperature,
        top_p=top_p,
        stop=read(body, "stop", SAMPLING["stop"], ()),
        seed=_seed(body),
        request_id=request_id,
        tools=fields.tools,
        tool_choice=fields.tool_choice,
        tool_name=fields.tool_name,
        constraint=fields.constraint,
        logprobs=fields.logprobs,
    )
    return ParsedRequest(model, gen, stream, include_usage, preferences(body, headers or {}))

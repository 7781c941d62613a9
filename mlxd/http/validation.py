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
``integer`` does; booleans are never numbers. ``mlxd/openapi.py`` describes
exactly these rules, so generated requests and this module agree.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from mlxd.engines.base import ChatMessage, GenerationRequest
from mlxd.errors import InvalidRequest
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


def _bad(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param=param)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: object) -> bool:
    if isinstance(v, float):
        return math.isfinite(v) and v.is_integer()
    return isinstance(v, int) and not isinstance(v, bool)


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise _bad("model", "is required")
    if not isinstance(model, str) or re.search(MODEL_NAME_PATTERN, model) is None:
        raise _bad("model", "must be a non-empty string")
    if len(model) > MAX_MODEL_NAME:
        raise _bad("model", "is too long")
    return model


def _optional_number(body: dict[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not _is_number(v):
        raise _bad(key, f"must be a number between {lo:g} and {hi:g}")
    if not lo <= float(v) <= hi:
        raise _bad(key, f"must be between {lo:g} and {hi:g} (got {v})")
    return float(v)


def _max_tokens(body: dict[str, Any]) -> int:
    chosen: int | None = None
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if v is None:
            continue
        if not _is_int(v):
            raise _bad(key, "must be an integer")
        if not 1 <= v <= MAX_TOKENS_LIMIT:
            raise _bad(key, f"must be between 1 and {MAX_TOKENS_LIMIT} (got {v})")
        if chosen is None:
            chosen = int(v)
    return chosen if chosen is not None else DEFAULT_MAX_TOKENS


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or len(v) > MAX_STOP:
        raise _bad("stop", f"must be a string or a list of at most {MAX_STOP} strings")
    for i, s in enumerate(v):
        if not isinstance(s, str) or not s:
            raise _bad(f"stop[{i}]", "must be a non-empty string")
        if len(s) > 256:
            raise _bad(f"stop[{i}]", "is too long (at most 256 characters)")
    return tuple(v)


def _seed(body: dict[str, Any]) -> int | None:
    v = body.get("seed")
    if v is None:
        return None
    if not _is_int(v) or not -(2**63) <= v < 2**64:
        raise _bad("seed", "must be an integer from -2**63 to 2**64-1")
    return int(v) % (2**32)


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("stream", "must be a boolean")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("stream_options", "must be an object")
        iu = opts.get("include_usage", False)
        if not isinstance(iu, bool):
            raise _bad("stream_options.include_usage", "must be a boolean")
        if not stream and opts:
            raise _bad("stream_options", "is only allowed when stream is true")
        include_usage = iu
    return stream, include_usage


def _n(body: dict[str, Any]) -> None:
    n = body.get("n")
    if n is None:
        return
    if not _is_int(n):
        raise _bad("n", "must be an integer")
    if n != 1:
        raise _bad("n", "only n=1 is supported")


def _content(v: object, param: str, *, allow_images: bool) -> str | list[dict[str, Any]]:
    if isinstance(v, str):
        return v
    if not isinstance(v, list) or not v:
        raise _bad(param, "must be a string or a non-empty list of content parts")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(v):
        p = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise _bad(p, "must be an object with a 'type'")
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise _bad(f"{p}.text", "must be a string")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            if not allow_images:
                raise _bad(p, "image parts are only accepted by vision (mllm) models")
            iu = part.get("image_url")
            url = iu.get("url") if isinstance(iu, dict) else iu
            if not isinstance(url, str) or not url:
                raise _bad(f"{p}.image_url.url", "must be a string URL")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise _bad(f"{p}.type", "must be 'text' or 'image_url'")
    return parts


def _messages(body: dict[str, Any], *, allow_images: bool) -> tuple[ChatMessage, ...]:
    msgs = body.get("messages")
    if msgs is None:
        raise _bad("messages", "is required")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty list")
    out: list[ChatMessage] = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(p, "must be an object with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(f"{p}.role", f"must be one of {', '.join(sorted(ROLES))}")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        parsed = _content(content, f"{p}.content", allow_images=allow_images)
        calls = assistant_tool_calls(m.get("tool_calls"), f"{p}.tool_calls")
        if calls and role != "assistant":
            raise _bad(f"{p}.tool_calls", "only assistant messages carry tool calls")
        call_id = m.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise _bad(f"{p}.tool_call_id", "must be a string")
        if role == "tool" and not call_id:
            raise _bad(f"{p}.tool_call_id", "is required in a tool message (the id of the call it answers)")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad(f"{p}.name", "must be a string")
        out.append(ChatMessage(role, parsed, calls, call_id if role == "tool" else None, name))
    return tuple(out)


def _prompt(body: dict[str, Any]) -> str:
    v = body.get("prompt")
    if v is None:
        raise _bad("prompt", "is required")
    if isinstance(v, list):
        if len(v) != 1 or not isinstance(v[0], str):
            raise _bad("prompt", "must be a string (or a list of exactly one string)")
        v = v[0]
    if not isinstance(v, str):
        raise _bad("prompt", "must be a string")
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
    _n(body)
    stream, include_usage = _stream(body)
    chat = kind == "chat"
    top_p = _optional_number(body, "top_p", 0.0, 1.0, 1.0)
    temperature = _optional_number(body, "temperature", 0.0, 2.0, 1.0)
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
        stop=_stop(body),
        seed=_seed(body),
        request_id=request_id,
        tools=fields.tools,
        tool_choice=fields.tool_choice,
        tool_name=fields.tool_name,
        constraint=fields.constraint,
        logprobs=fields.logprobs,
    )
    return ParsedRequest(model, gen, stream, include_usage, preferences(body, headers or {}))

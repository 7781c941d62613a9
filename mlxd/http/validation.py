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
``integer`` does; booleans are never numbers. A body's structure is checked
against its description (:func:`chat_body`, :data:`COMPLETION_BODY`, built with
:mod:`mlxd.http.shapes` from :data:`SAMPLING` and the client fields of
:mod:`mlxd.http.structured`), the one :mod:`mlxd.http.openapi` documents, so
generated requests and this module agree; the code here then converts it and
checks the rules that are not structure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from mlxd.engines.base import ChatMessage, GenerationRequest
from mlxd.errors import InvalidRequest
from mlxd.http.fields import (
    Boolean,
    Choice,
    Integer,
    Kind,
    Number,
    Stops,
    Text,
    bad,
    nullable,
    read,
)
from mlxd.http.preferences import Headers, Preferences, preferences
from mlxd.http.shapes import AnyOf, Array, Const, Obj, Refused, Tagged, check
from mlxd.http.structured import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MAX_MODEL_NAME,
    MODEL_NAME_PATTERN,
    REQUIRED_NEEDS_TOOLS,
    TOOL_CALL,
    TOP_NEEDS_LOGPROBS,
    assistant_tool_calls,
    openai_fields,
    response_format_kind,
    tool_choice_kind,
    tools_kind,
)

#: upper bound on max_tokens; a larger value is a 400, not a silent clamp
MAX_TOKENS_LIMIT = 131_072
DEFAULT_MAX_TOKENS = 512
ROLES = {"system", "user", "assistant", "developer", "tool"}
MAX_STOP = 4
BODY = "the request body must be a JSON object"


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


STREAM_OPTIONS = Obj({"include_usage": Boolean()}, not_null=("include_usage",))
#: ``stream_options`` with any option in it is only allowed when ``stream`` is true (:func:`_stream`)
STREAM_OPTIONS_NEED_STREAM = {
    "if": {
        "required": ["stream_options"],
        "properties": {"stream_options": {"type": "object", "minProperties": 1}},
    },
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = read(body, "stream", SAMPLING["stream"], False)
    opts = body.get("stream_options") or {}
    if opts and not stream:
        raise bad("stream_options", "is only allowed when stream is true")
    return stream, opts.get("include_usage", False)


_URL = Text(1)
_IMAGE = AnyOf((Obj({"url": _URL}, required=("url",)), _URL), hint='must be a string URL (or {"url": ...})')
_PARTS = {
    "text": Obj({"text": Text()}, required=("text",)),
    "image_url": Obj({"image_url": _IMAGE}, required=("image_url",), notes={
        "image_url": "a data:image/...;base64 URL or a file inside the model's image_dir"}),
}
_NO_CALLS = nullable(Array(TOOL_CALL, max_items=0).schema())
#: the rules of :func:`_messages` about roles, for the document
_ROLE_RULES = (
    {"if": {"properties": {"role": {"const": "tool"}}},
     "then": {"required": ["tool_call_id"],
              "properties": {"tool_call_id": {"type": "string", "minLength": 1}}}},
    {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
     "then": {"properties": {"tool_calls": _NO_CALLS}}},
)


def message_kind(*, images: bool = True, tools: bool = True) -> Obj:
    """A chat message; the document's variants for models without images or tools leave them out."""
    content = AnyOf((Text(), Array(Tagged("type", _PARTS if images else {"text": _PARTS["text"]}),
                                   min_items=1)),
                    hint="must be a string or a non-empty list of content parts")
    # only an assistant message may leave its content out (or null)
    content_rule = {"if": {"properties": {"role": {"const": "assistant"}}},
                    "else": {"required": ["content"], "properties": {"content": content.schema()}}}
    return Obj({
        "role": Choice(tuple(sorted(ROLES))),
        "content": content,
        "tool_calls": Array(TOOL_CALL, hint="must be a list of tool calls") if tools
        else Array(TOOL_CALL, max_items=0),
        "tool_call_id": Text(),
        "name": Text(),
    }, required=("role",), hint="must be an object with 'role' and 'content'",
        rules=(content_rule, *_ROLE_RULES))


def chat_body(*, images: bool = True, tools: bool = True, grammar: bool = True,
              logprobs: bool = True) -> Obj:
    """A chat body but ``model`` and ``keep_alive``; the validator checks the variant with
    everything, the document shows one per group of models (:mod:`mlxd.http.openapi_chat`)."""
    fields: dict[str, Kind] = {
        **SAMPLING,
        "stream_options": STREAM_OPTIONS,
        "messages": Array(message_kind(images=images, tools=tools), min_items=1,
                          hint="must be a non-empty list"),
        **CHAT_FIELDS,
        "tools": tools_kind(tools),
        "tool_choice": tool_choice_kind(tools),
        "response_format": response_format_kind(grammar),
    }
    if not logprobs:  # the engine has none to give: only "off" is valid
        fields |= {"logprobs": Const(False), "top_logprobs": Refused("needs a model that gives logprobs")}
    return Obj(fields, required=("messages",), hint=BODY,
               rules=(STREAM_OPTIONS_NEED_STREAM, TOP_NEEDS_LOGPROBS, REQUIRED_NEEDS_TOOLS))


#: a text completion body but ``model`` and ``keep_alive``
COMPLETION_BODY = Obj({
    **SAMPLING,
    "stream_options": STREAM_OPTIONS,
    **COMPLETION_FIELDS,
    # chat fields are refused (they would be silently lost otherwise)
    **dict.fromkeys(("tools", "tool_choice", "response_format"),
                    Refused("is only for /v1/chat/completions")),
    "prompt": AnyOf((Text(), Array(Text(), 1, 1)),
                    hint="must be a string (or a list of exactly one string)"),
}, required=("prompt",), hint=BODY, rules=(STREAM_OPTIONS_NEED_STREAM,))
CHAT_BODY = chat_body()


def _content(v: str | list[dict[str, Any]], param: str, *, allow_images: bool) -> str | list[dict[str, Any]]:
    if isinstance(v, str):
        return v
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(v):
        if part["type"] == "text":
            parts.append({"type": "text", "text": part["text"]})
            continue
        if not allow_images:
            raise bad(f"{param}[{i}]", "image parts are only accepted by vision (mllm) models")
        url = part["image_url"]
        parts.append({"type": "image_url", "image_url": {"url": url if isinstance(url, str) else url["url"]}})
    return parts


def _messages(body: dict[str, Any], *, allow_images: bool) -> tuple[ChatMessage, ...]:
    out: list[ChatMessage] = []
    for i, m in enumerate(body["messages"]):
        p = f"messages[{i}]"
        role, content, call_id = m["role"], m.get("content"), m.get("tool_call_id")
        if content is None and role != "assistant":
            raise bad(f"{p}.content", "must be a string or a non-empty list of content parts")
        parsed = _content(content or "", f"{p}.content", allow_images=allow_images)
        calls = assistant_tool_calls(m.get("tool_calls"), f"{p}.tool_calls")
        if calls and role != "assistant":
            raise bad(f"{p}.tool_calls", "only assistant messages carry tool calls")
        if role == "tool" and not call_id:
            raise bad(f"{p}.tool_call_id", "is required in a tool message (the id of the call it answers)")
        out.append(ChatMessage(role, parsed, calls, call_id if role == "tool" else None, m.get("name")))
    return tuple(out)


def _prompt(body: dict[str, Any]) -> str:
    v = body["prompt"]
    return v[0] if isinstance(v, list) else v  # type: ignore[no-any-return]


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
        raise InvalidRequest(BODY)
    model = _model(body)
    chat = kind == "chat"
    check(CHAT_BODY if chat else COMPLETION_BODY, body)
    stream, include_usage = _stream(body)
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

"""OpenAPI pieces of the Anthropic Messages routes (``/v1/messages``, ``/v1/messages/count_tokens``).

Assembled by :mod:`mlxd.http.openapi`. Errors on these routes use Anthropic's
envelope (``AnthropicError``). As for chat completions, fake engines take no
tools and no grammar, so their request variant has neither tools nor
``output_config.format``. Claude Code's fields (system-role messages,
``thinking``, ``context_management``, ``output_config``, ``service_tier``) are
described for every model.
"""

from __future__ import annotations

from typing import Any

from mlxd.http.anthropic_fields import EFFORT, SERVICE_TIER, SYSTEM_ROLES
from mlxd.http.anthropic_shapes import FIELDS, MAX_TOKENS
from mlxd.http.bodies_anthropic import (
    AnthropicError,
    AnthropicMessage,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    MessageDelta,
    MessageStart,
    MessageStop,
    Ping,
    TokenCount,
)
from mlxd.http.body_schemas import event_data, ref
from mlxd.http.fields import documented, nullable
from mlxd.http.openapi_clients import ANY_MODEL_NAME, NAME, OBJECT_SCHEMA, OPEN, error_responses
from mlxd.http.structured import MAX_TOOLS

_TEXT = {"type": "object", "required": ["type", "text"],
         "properties": {"type": {"const": "text"}, "text": {"type": "string"}}, **OPEN}
_TOOL_USE = {"type": "object", "required": ["type", "id", "name", "input"],
             "properties": {"type": {"const": "tool_use"}, "id": {"type": "string", "minLength": 1},
                            "name": NAME, "input": {"type": "object"}}, **OPEN}
_TOOL_RESULT = {"type": "object", "required": ["type", "tool_use_id"],
                "properties": {"type": {"const": "tool_result"},
                               "tool_use_id": {"type": "string", "minLength": 1},
                               "content": {"anyOf": [{"type": "string"},
                                                     {"type": "array", "items": _TEXT}]},
                               "is_error": nullable({"type": "boolean"})}, **OPEN}


_THINKING = {"type": "object", "required": ["type", "thinking"],
             "properties": {"type": {"const": "thinking"}, "thinking": {"type": "string"},
                            "signature": {"type": "string"}}, **OPEN}
_REDACTED = {"type": "object", "required": ["type"],
             "properties": {"type": {"const": "redacted_thinking"}, "data": {"type": "string"}}, **OPEN}
_SYSTEM_TEXT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT}]}


def _message(*, tools: bool) -> dict[str, Any]:
    user_blocks = [_TEXT, _TOOL_RESULT] if tools else [_TEXT]
    assistant_blocks = [_TEXT, _TOOL_USE, _THINKING, _REDACTED] if tools else [_TEXT, _THINKING, _REDACTED]

    def variant(role: str, blocks: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "object", "required": ["role", "content"],
                "properties": {"role": {"const": role},
                               "content": {"anyOf": [{"type": "string"},
                                                     {"type": "array", "minItems": 1,
                                                      "items": {"anyOf": blocks}}]}},
                **OPEN}

    return {"anyOf": [variant("user", user_blocks), variant("assistant", assistant_blocks)]}


def _fields(*, tools: bool) -> dict[str, Any]:
    """Claude Code's fields (:mod:`mlxd.http.anthropic_fields`)."""
    fmt = {"type": "object", "required": ["type", "schema"],
           "properties": {"type": {"const": "json_schema"}, "schema": OBJECT_SCHEMA}}
    config: dict[str, Any] = {"effort": nullable(EFFORT.schema())}
    if tools:  # a grammar: not on fake engines
        config["format"] = nullable(fmt)
    out = {
        "thinking": nullable({"anyOf": [
            {"type": "object", "required": ["type"],
             "properties": {"type": {"const": "enabled"},
                            "budget_tokens": nullable({"type": "integer", "minimum": 0})}},
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["adaptive", "disabled"]}}},
        ]}),
        "output_config": nullable({"type": "object", "properties": config}),
        "context_management": nullable({"type": "object", "properties": {
            "edits": nullable({"type": "array", "items": {"type": "object"}})}}),
        "service_tier": nullable(SERVICE_TIER.schema()),
    }
    if tools:
        out["output_format"] = nullable(fmt)
    return out


def _request(names: list[str], *, tools: bool, counting: bool) -> dict[str, Any]:
    model = {"type": "string", "enum": names} if names else ANY_MODEL_NAME
    tool = {"type": "object", "required": ["name", "input_schema"],
            "properties": {"name": NAME, "description": {"type": "string"},
                           "input_schema": OBJECT_SCHEMA,
                           "type": nullable({"const": "custom",
                                             "description": "only custom tools are served here"})},
            **OPEN}
    system_message = {"type": "object", "required": ["role", "content"],
                      "properties": {"role": {"enum": list(SYSTEM_ROLES)}, "content": _SYSTEM_TEXT}}
    turn = _message(tools=tools)
    props: dict[str, Any] = {
        "model": model,
        "messages": {"type": "array", "minItems": 1, "items": {"anyOf": [*turn["anyOf"], system_message]},
                     "contains": turn,
                     "description": "system and developer messages join the system prompt, in order"},
        "system": nullable(_SYSTEM_TEXT),
        **_fields(tools=tools),
        "tools": nullable({"type": "array", "items": tool, "maxItems": MAX_TOOLS} if tools
                          else {"type": "array", "maxItems": 0}),
        "tool_choice": nullable(
            {"anyOf": [{"type": "object", "required": ["type"],
                        "properties": {"type": {"enum": ["auto", "none"]}}},
                       *([{"type": "object", "required": ["type"],
                           "properties": {"type": {"const": "any"}}},
                          {"type": "object", "required": ["type", "name"],
                           "properties": {"type": {"const": "tool"}, "name": NAME}}] if tools else [])]}),
    }
    required = ["model", "messages"]
    if not counting:
        props.update({"max_tokens": MAX_TOKENS.schema(), **documented(FIELDS),
                      "metadata": nullable({"type": "object"})})
        required.append("max_tokens")
    return {"type": "object", "required": required, "properties": props,
            "description": "'any' and 'tool' tool_choice need tools; a named tool must be declared",
            **OPEN}


def _variants(groups: dict[str, list[str]], *, counting: bool) -> dict[str, Any]:
    parts = [_request(groups["text"], tools=True, counting=counting)] if groups["text"] else []
    others = groups["fake"] + groups["vision"]
    if others:
        parts.append(_request(others, tools=False, counting=counting))
    if not parts:
        return _request([], tools=True, counting=counting)
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


#: one SSE event of a streamed message: its name is its data's type
_EVENT = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "event": {"enum": ["message_start", "ping", "content_block_start", "content_block_delta",
                           "content_block_stop", "message_delta", "message_stop", "error"]},
        "data": {"type": "string", "pattern": r"^\{[\s\S]*\}$",
                 **event_data(MessageStart, Ping, ContentBlockStart, ContentBlockDelta,
                              ContentBlockStop, MessageDelta, MessageStop, AnthropicError)},
    },
}
_DESCRIPTIONS = {
    400: "invalid_request_error (the message names the field), e.g. tools_not_supported",
    401: "authentication_error: send x-api-key or Authorization: Bearer",
    404: "not_found_error: unknown model",
    413: "request_too_large",
    415: "invalid_request_error: the body is not sent as application/json",
    502: "api_error: the model failed to load or generate",
    503: "overloaded_error (capacity, preemption, queue, shutdown); retry after Retry-After seconds",
}


def _errors(*codes: int) -> dict[str, Any]:
    return error_responses(_DESCRIPTIONS, "AnthropicError", *codes)


def anthropic_paths(groups: dict[str, list[str]]) -> dict[str, Any]:
    def body(schema: dict[str, Any]) -> dict[str, Any]:
        return {"required": True, "content": {"application/json": {"schema": schema}}}

    statuses = _errors(400, 401, 404, 413, 415, 502, 503)
    return {
        "/v1/messages": {"post": {
            "summary": "Anthropic Messages (whole, or an event stream with stream=true)",
            "requestBody": body(_variants(groups, counting=False)),
            "responses": {"200": {"description": "the message, or its event stream",
                                  "content": {"application/json": {"schema": ref(AnthropicMessage)},
                                              "text/event-stream": {"schema": _EVENT}}},
                          **statuses},
        }},
        "/v1/messages/count_tokens": {"post": {
            "summary": "The prompt's tokens under the model's template (loads the model)",
            "requestBody": body(_variants(groups, counting=True)),
            "responses": {"200": {"description": "the count", "content": {"application/json": {
                "schema": ref(TokenCount)}}},
                          **statuses},
        }},
    }

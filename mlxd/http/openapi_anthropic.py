"""OpenAPI pieces of the Anthropic Messages routes (``/v1/messages``, ``/v1/messages/count_tokens``).

Assembled by :mod:`mlxd.http.openapi`. Errors on these routes use Anthropic's
envelope (``AnthropicError``). The request schema is the validator's own
description (:func:`mlxd.http.anthropic_shapes.body_kind`). As for chat
completions, fake engines take no tools and no grammar, so their request
variant has neither tools nor ``output_config.format``. Claude Code's fields (system-role messages,
``thinking``, ``context_management``, ``output_config``, ``service_tier``) are
described for every model.
"""

from __future__ import annotations

from typing import Any

from mlxd.http.anthropic_shapes import body_kind
from mlxd.http.openapi_clients import ANY_MODEL_NAME, NAME, OPEN, error_responses, with_model

ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"],
                  "properties": {"type": {"type": "string"}, "message": {"type": "string"}}},
    },
}

#: content blocks of a response
_TEXT = {"type": "object", "required": ["type", "text"],
         "properties": {"type": {"const": "text"}, "text": {"type": "string"}}, **OPEN}
_TOOL_USE = {"type": "object", "required": ["type", "id", "name", "input"],
             "properties": {"type": {"const": "tool_use"}, "id": {"type": "string", "minLength": 1},
                            "name": NAME, "input": {"type": "object"}}, **OPEN}
_THINKING = {"type": "object", "required": ["type", "thinking"],
             "properties": {"type": {"const": "thinking"}, "thinking": {"type": "string"},
                            "signature": {"type": "string"}}, **OPEN}


def _request(names: list[str], *, tools: bool, counting: bool) -> dict[str, Any]:
    model = {"type": "string", "enum": names} if names else ANY_MODEL_NAME
    return with_model(body_kind(tools=tools, counting=counting), {"model": model})


def _variants(groups: dict[str, list[str]], *, counting: bool) -> dict[str, Any]:
    parts = [_request(groups["text"], tools=True, counting=counting)] if groups["text"] else []
    others = groups["fake"] + groups["vision"]
    if others:
        parts.append(_request(others, tools=False, counting=counting))
    if not parts:
        return _request([], tools=True, counting=counting)
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


_MESSAGE = {
    "type": "object",
    "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
    "properties": {
        "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
        "model": {"type": "string"},
        "content": {"type": "array", "items": {"anyOf": [_TEXT, _TOOL_USE, _THINKING]}},
        "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "stop_sequence": {"type": ["string", "null"]},
        "usage": {"type": "object", "required": ["input_tokens", "output_tokens"],
                  "properties": {"input_tokens": {"type": "integer", "minimum": 0},
                                 "output_tokens": {"type": "integer", "minimum": 0},
                                 "cache_read_input_tokens": {"type": "integer", "minimum": 0},
                                 "cache_creation_input_tokens": {"type": "integer", "minimum": 0},
                                 "service_tier": {"type": "string"},
                                 "mlxd_cached_tokens": {
                                     "$ref": "#/components/schemas/CachedTokens"}}},
    },
}
_EVENT = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "event": {"enum": ["message_start", "ping", "content_block_start", "content_block_delta",
                           "content_block_stop", "message_delta", "message_stop", "error"]},
        "data": {"type": "string", "pattern": r"^\{[\s\S]*\}$", "contentMediaType": "application/json"},
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
                                  "content": {"application/json": {"schema": _MESSAGE},
                                              "text/event-stream": {"schema": _EVENT}}},
                          **statuses},
        }},
        "/v1/messages/count_tokens": {"post": {
            "summary": "The prompt's tokens under the model's template (loads the model)",
            "requestBody": body(_variants(groups, counting=True)),
            "responses": {"200": {"description": "the count", "content": {"application/json": {
                "schema": {"type": "object", "required": ["input_tokens"],
                           "properties": {"input_tokens": {"type": "integer", "minimum": 0}}}}}},
                          **statuses},
        }},
    }

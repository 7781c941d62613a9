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
from mlxd.http.openapi_clients import ANY_MODEL_NAME, error_responses, with_model


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

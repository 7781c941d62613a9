"""OpenAPI pieces of the Responses API routes (assembled by :mod:`mlxd.http.openapi`).

The request schema is the validator's own description
(:func:`mlxd.http.responses_fields.body_kind`), with one variant per engine
group as the chat route has (:mod:`mlxd.http.openapi_chat`): mlx-lm text
models take function tools (a history of function calls included) and
``text.format`` grammars; vision models take image parts and neither; fake
engines take neither. Tools of any other type are accepted everywhere: they
are left out of the prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxd.http.bodies_responses import EVENTS, DeletedResponse, ResponseObject
from mlxd.http.body_schemas import event_data, ref
from mlxd.http.openapi_chat import Named, per_group
from mlxd.http.openapi_clients import with_model
from mlxd.http.responses_fields import body_kind

#: what each engine group takes: (images, function tools, grammar)
_GROUPS = {"text": (False, True, True), "vision": (True, False, False), "fake": (False, False, False)}


def responses_request(groups: dict[str, list[str]], named: Named) -> dict[str, Any]:
    """One variant per engine group; a generic (text) one without models."""
    def variant(names: list[str], kind: str) -> dict[str, Any]:
        images, functions, grammar = _GROUPS[kind]
        return with_model(body_kind(images=images, functions=functions, grammar=grammar), named(names))

    return per_group(groups, variant)


#: one SSE event of a streamed response (Open API 3.1: the stream's ``schema`` is one event)
_EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string", "pattern": r"^response\.[a-z_.]+$"},
    "data": {"type": "string", "pattern": r"^\{[\s\S]*\}$", **event_data(*EVENTS)},
}}
_RESPONSE_ID = {"name": "response_id", "in": "path", "required": True,
                "schema": {"type": "string", "minLength": 1}}


def responses_paths(
    request: dict[str, Any], errors: Callable[..., dict[str, Any]], headers: list[dict[str, Any]],
    guarded: tuple[int, ...],
) -> dict[str, Any]:
    """``errors(*codes)``: the error responses (OpenAI envelope); ``headers``: the preference headers."""
    ok = {"description": "the response (whole), or with stream: true an SSE stream of response.* "
          "events ending in response.completed, response.incomplete or response.failed",
          "content": {"application/json": {"schema": ref(ResponseObject)},
                      "text/event-stream": {"schema": _EVENT}}}
    return {
        "/v1/responses": {"post": {
            "summary": "OpenAI Responses API: items in, items out (whole, or SSE with stream=true)",
            "parameters": headers,
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {"200": ok, **errors(400, 404, 413, 415, 502, *guarded)},
        }},
        "/v1/responses/{response_id}": {
            "get": {
                "summary": "A stored response (store: true); 404 once deleted or pruned",
                "parameters": [_RESPONSE_ID],
                "responses": {"200": {"description": "the response",
                                      "content": {"application/json": {"schema": ref(ResponseObject)}}},
                              **errors(404, *guarded)},
            },
            "delete": {
                "summary": "Delete a stored response",
                "parameters": [_RESPONSE_ID],
                "responses": {"200": {"description": "deleted",
                                      "content": {"application/json": {"schema": ref(DeletedResponse)}}},
                              **errors(404, *guarded)},
            },
        },
    }

"""OpenAPI pieces of the Responses API routes (assembled by :mod:`mlxd.http.openapi`).

The request schema follows :mod:`mlxd.http.responses_fields` and
:mod:`mlxd.http.responses_items` rule for rule, with one variant per engine
group as the chat route has (:mod:`mlxd.http.openapi_clients`): mlx-lm text
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
from mlxd.http.fields import documented, nullable
from mlxd.http.openapi_clients import NAME, OBJECT_SCHEMA, OPEN
from mlxd.http.responses_fields import (
    FIELDS,
    LOGPROBS_INCLUDE,
    MAX_METADATA_KEY,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE,
    REASONING,
    VERBOSITY,
)
from mlxd.http.responses_items import LEFT_OUT, MAX_ITEMS, TEXT_PARTS
from mlxd.http.structured import MAX_TOOLS

_STRING = nullable({"type": "string"})
_BOOL = nullable({"type": "boolean"})
#: the sampling fields of a request naming one of ``names`` (model, temperature, ...)
Sampling = Callable[[list[str]], dict[str, Any]]


def _obj(required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties, **OPEN}


def _part(kind: str, key: str = "text") -> dict[str, Any]:
    return _obj(["type", key], {"type": {"const": kind}, key: {"type": "string"}})


_TEXT = [_part(k) for k in TEXT_PARTS]
_IMAGE = _obj(["type", "image_url"], {"type": {"const": "input_image"},
                                      "image_url": {"type": "string", "minLength": 1,
                                                    "description": "a data URL, or a file in the "
                                                    "model's image_dir"}})


def _message(roles: list[str], parts: list[dict[str, Any]]) -> dict[str, Any]:
    return _obj(["role", "content"], {
        "type": {"const": "message"},
        "role": {"enum": roles},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": parts}}]},
    })


def _items(*, images: bool, calls: bool) -> dict[str, Any]:
    variants = [
        _message(["user"], [*_TEXT, _IMAGE] if images else _TEXT),
        _message(["assistant"], [*_TEXT, _part("refusal", "refusal")]),
        _message(["system", "developer"], _TEXT),
        _obj(["type", "call_id", "output"], {
            "type": {"const": "function_call_output"},
            "call_id": {"type": "string", "minLength": 1},
            "output": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": _TEXT}}]},
        }),
        _obj(["type"], {"type": {"enum": sorted(LEFT_OUT)}}),
    ]
    if calls:
        variants.append(_obj(["type", "call_id", "name", "arguments"], {
            "type": {"const": "function_call"},
            "call_id": {"type": "string", "minLength": 1},
            "name": NAME,
            "arguments": {"anyOf": [{"type": "object"},
                                    {"type": "string", "contentMediaType": "application/json"}],
                          "description": "JSON text of an object (or the object)"},
        }))
    return {"type": "array", "maxItems": MAX_ITEMS, "items": {"anyOf": variants}}


#: a tool mlxd does not run (a built-in, custom or namespace tool): left out of the prompt
_OTHER_TOOL = _obj(["type"], {"type": {"type": "string", "not": {"const": "function"}}})
_FUNCTION_TOOL = _obj(["type", "name"], {
    "type": {"const": "function"},
    "name": NAME,
    "description": _STRING,
    "parameters": nullable(OBJECT_SCHEMA),
    "strict": _BOOL,
})


def _tools(*, functions: bool) -> dict[str, Any]:
    tool = {"anyOf": [_FUNCTION_TOOL, _OTHER_TOOL]} if functions else _OTHER_TOOL
    return nullable({"type": "array", "maxItems": MAX_TOOLS, "items": tool})


def _tool_choice(*, functions: bool) -> dict[str, Any]:
    # a listed function names a declared one; other types are left out as they are in tools
    function = {"if": {"properties": {"type": {"const": "function"}}},
                "then": {"required": ["name"], "properties": {"name": NAME}}}
    listed = {"type": "array", "items": {**_obj(["type"], {"type": {"type": "string"}}), **function}
              if functions else _OTHER_TOOL}
    allowed = _obj(["type", "mode", "tools"], {
        "type": {"const": "allowed_tools"},
        "mode": {"enum": ["auto", "required"]} if functions else {"const": "auto"},
        "tools": listed,
    })
    if not functions:
        return {"anyOf": [{"enum": ["auto", "none"]}, allowed, {"type": "null"}]}
    named = _obj(["type", "name"], {"type": {"const": "function"}, "name": NAME})
    return {"anyOf": [{"enum": ["auto", "none", "required"]}, named, allowed, {"type": "null"}],
            "description": "'required' needs a function tool; a named function must be declared; "
            "forcing a tool of another type is a 400 naming it"}


def _text(*, grammar: bool) -> dict[str, Any]:
    formats: list[dict[str, Any]] = [_obj(["type"], {"type": {"const": "text"}})]
    if grammar:
        formats += [
            _obj(["type"], {"type": {"const": "json_object"}}),
            _obj(["type", "name", "schema"], {
                "type": {"const": "json_schema"}, "name": NAME, "schema": {"type": "object"},
                "strict": _BOOL, "description": _STRING}),
        ]
    return nullable(_obj([], {
        "format": nullable({"anyOf": formats}),
        "verbosity": nullable(VERBOSITY.schema()),
    }))


_METADATA = nullable({"type": "object", "maxProperties": MAX_METADATA_KEYS,
                      "propertyNames": {"maxLength": MAX_METADATA_KEY},
                      "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE}})
#: top_logprobs only with include: ["message.output_text.logprobs"]
_TOP_NEEDS_INCLUDE = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["include"],
             "properties": {"include": {"type": "array", "contains": {"const": LOGPROBS_INCLUDE}}}},
}
_REQUIRED_NEEDS_FUNCTION = {
    "if": {"required": ["tool_choice"], "properties": {"tool_choice": {"const": "required"}}},
    "then": {"required": ["tools"], "properties": {"tools": {
        "type": "array", "contains": {"type": "object", "properties": {"type": {"const": "function"}}}}}},
}
#: what each engine group takes: (images, function tools, grammar)
_GROUPS = {"text": (False, True, True), "vision": (True, False, False), "fake": (False, False, False)}


def responses_request(groups: dict[str, list[str]], sampling: Sampling) -> dict[str, Any]:
    """One variant per engine group; a generic (text) one without models."""
    def variant(names: list[str], kind: str) -> dict[str, Any]:
        images, functions, grammar = _GROUPS[kind]
        given = sampling(names)
        return {
            "type": "object",
            "required": ["model", "input"],
            "properties": {
                "model": given["model"], "keep_alive": given["keep_alive"],
                **documented(FIELDS),
                "input": {"anyOf": [{"type": "string"}, _items(images=images, calls=functions)]},
                "tools": _tools(functions=functions),
                "tool_choice": _tool_choice(functions=functions),
                "text": _text(grammar=grammar),
                "include": nullable({"type": "array", "items": {"type": "string"}}),
                "metadata": _METADATA,
                "reasoning": nullable(_obj([], documented(REASONING))),
                "stream_options": nullable({"type": "object"}),
                "background": {"anyOf": [{"const": False}, {"type": "null"}],
                               "description": "background responses are not supported"},
                "prompt": {"type": "null", "description": "stored prompts are not supported"},
                "conversation": {"type": "null", "description": "use previous_response_id"},
            },
            "allOf": [_TOP_NEEDS_INCLUDE, _REQUIRED_NEEDS_FUNCTION],
            **OPEN,
        }

    variants = [variant(names, kind) for kind, names in groups.items() if names]
    if not variants:
        return variant([], "text")
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


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

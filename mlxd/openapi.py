"""The OpenAPI 3.1 description of every route (served at ``/openapi.json``).

Schemas describe what the daemon accepts and answers, so tools (and the
schemathesis test) can generate requests from it. Error replies share the
OpenAI envelope ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any

from mlxd import __version__

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_MODEL = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by", "status", "loaded"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"},
        "status": {
            "enum": ["unloaded", "loading", "loaded", "draining", "unloading", "failed"]
        },
        "loaded": {"type": "boolean"},
        "pinned": {"type": "boolean"},
        "memory_bytes": {"type": ["integer", "null"]},
        "memory_source": {"type": ["string", "null"]},
        "last_used_at": {"type": ["number", "null"]},
        "last_error": {"type": ["string", "null"]},
    },
}

_SAMPLING = {
    "model": {"type": "string", "minLength": 1},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 131072},
    "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 131072},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "stop": {
        "oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 4},
        ]
    },
    "seed": {"type": "integer"},
    "n": {"const": 1},
    "stream": {"type": "boolean"},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean"}},
    },
}

_CONTENT_PART = {
    "oneOf": [
        {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        },
        {
            "type": "object",
            "required": ["type", "image_url"],
            "properties": {
                "type": {"const": "image_url"},
                "image_url": {
                    "type": "object",
                    "required": ["url"],
                    "properties": {"url": {"type": "string"}},
                },
            },
        },
    ]
}

_CHAT_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        **_SAMPLING,
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"enum": ["system", "user", "assistant", "developer", "tool"]},
                    "content": {
                        "oneOf": [
                            {"type": "string"},
                            {"type": "array", "minItems": 1, "items": _CONTENT_PART},
                        ]
                    },
                },
            },
        },
    },
}

_COMPLETION_REQUEST = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {**_SAMPLING, "prompt": {"type": "string"}},
}

_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
    },
}

_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"enum": ["chat.completion", "text_completion"]},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array"},
        "usage": _USAGE,
    },
}


def _errors(*codes: int) -> dict[str, Any]:
    descriptions = {
        400: "invalid request (names the field), or model_exceeds_budget",
        401: "missing or wrong API key",
        404: "model_not_found",
        405: "method not allowed",
        409: "conflict",
        413: "body larger than server.max_body_mb",
        415: "body is not JSON",
        502: "model_load_failed",
        503: "model_capacity, capacity_timeout, preempted, overloaded, shutting_down, "
        "journal_unavailable (with Retry-After)",
    }
    return {
        str(code): {
            "description": descriptions[code],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        for code in codes
    }


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_MODEL_ID = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
_GENERATION_ERRORS = _errors(400, 401, 404, 413, 415, 502, 503)


def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "mlxd",
            "version": __version__,
            "description": "OpenAI-compatible MLX model server with journaled residency management.",
        },
        "paths": {
            "/v1/models": {
                "get": {
                    "summary": "List models with their residency state",
                    "responses": {
                        "200": _json({"type": "object", "required": ["object", "data"],
                                      "properties": {"object": {"const": "list"},
                                                     "data": {"type": "array", "items": _MODEL}}}),
                        **_errors(401),
                    },
                }
            },
            "/v1/models/{model_id}": {
                "get": {
                    "summary": "One model with its residency state",
                    "parameters": [_MODEL_ID],
                    "responses": {"200": _json(_MODEL), **_errors(401, 404)},
                }
            },
            "/v1/chat/completions": {
                "post": {
                    "summary": "Chat completion (whole, or SSE with stream=true)",
                    "requestBody": {"required": True, "content": {"application/json": {"schema": _CHAT_REQUEST}}},
                    "responses": {
                        "200": {
                            "description": "the completion, or an SSE stream of chunks ending in [DONE]",
                            "content": {"application/json": {"schema": _COMPLETION},
                                        "text/event-stream": {"schema": {"type": "string"}}},
                        },
                        **_GENERATION_ERRORS,
                    },
                }
            },
            "/v1/completions": {
                "post": {
                    "summary": "Text completion (whole, or SSE with stream=true)",
                    "requestBody": {"required": True, "content": {"application/json": {"schema": _COMPLETION_REQUEST}}},
                    "responses": {
                        "200": {
                            "description": "the completion, or an SSE stream",
                            "content": {"application/json": {"schema": _COMPLETION},
                                        "text/event-stream": {"schema": {"type": "string"}}},
                        },
                        **_GENERATION_ERRORS,
                    },
                }
            },
            "/admin/status": {
                "get": {"summary": "Budget, committed bytes, every model's state, waiters, leases",
                        "responses": {"200": _json({"type": "object"}), **_errors(401)}}
            },
            "/admin/models/{model_id}/load": {
                "post": {
                    "summary": "Load a model; replies once loaded and journaled",
                    "parameters": [_MODEL_ID],
                    "responses": {"200": _json(_MODEL), **_errors(400, 401, 404, 502, 503)},
                }
            },
            "/admin/models/{model_id}/unload": {
                "post": {
                    "summary": "Unload a model (drains live requests, or preempts them)",
                    "parameters": [
                        _MODEL_ID,
                        {"name": "preempt", "in": "query", "required": False,
                         "schema": {"type": "boolean"}},
                    ],
                    "responses": {"200": _json(_MODEL), **_errors(400, 401, 404, 409, 502, 503)},
                }
            },
            "/admin/events": {
                "get": {
                    "summary": "SSE of transitions and lease events; the id is the journal sequence",
                    "parameters": [
                        {"name": "Last-Event-ID", "in": "header", "required": False,
                         "schema": {"type": "string", "pattern": "^[0-9]+$"}},
                    ],
                    "responses": {
                        "200": {"description": "event stream",
                                "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                        **_errors(400, 401),
                    },
                }
            },
            "/admin/history": {
                "get": {
                    "summary": "Journal rows as JSON",
                    "parameters": [
                        {"name": "model", "in": "query", "required": False, "schema": {"type": "string"}},
                        {"name": "since", "in": "query", "required": False, "schema": {"type": "string"}},
                        {"name": "limit", "in": "query", "required": False,
                         "schema": {"type": "integer", "minimum": 1, "maximum": 10000}},
                        {"name": "kind", "in": "query", "required": False,
                         "schema": {"enum": ["transitions", "leases"]}},
                    ],
                    "responses": {"200": _json({"type": "array", "items": {"type": "object"}}),
                                  **_errors(400, 401)},
                }
            },
            "/admin/reload": {
                "post": {"summary": "Re-read the config; add, remove or replace dormant models",
                         "responses": {"200": _json({"type": "object"}), **_errors(400, 401, 409)}}
            },
            "/health": {
                "get": {"summary": "Liveness and readiness (ok / degraded with reasons)",
                        "responses": {"200": _json({"type": "object", "required": ["status"],
                                                    "properties": {"status": {"enum": ["ok", "degraded"]}}}),
                                      "503": _json({"type": "object"}, "shutting down")}}
            },
            "/metrics": {
                "get": {"summary": "Prometheus metrics",
                        "responses": {"200": {"description": "Prometheus text format",
                                              "content": {"text/plain": {"schema": {"type": "string"}}}}}}
            },
            "/openapi.json": {
                "get": {"summary": "This document", "responses": {"200": _json({"type": "object"})}}
            },
        },
        "components": {"schemas": {"Error": _ERROR}},
    }

"""The OpenAPI 3.1 description of every route (served at ``/openapi.json``).

The document describes exactly what the daemon accepts and answers, so tools
(and the schemathesis test) can generate meaningful requests from it:

- Request bodies are generated from the descriptions the validators check them
  with, so the two cannot drift: scalar fields from the kinds of
  :mod:`mlxd.http.fields` (``SAMPLING``, ``CHAT_FIELDS``, the ``FIELDS`` and
  ``OPTIONS`` tables), and every nested shape (messages, parts and blocks,
  tools, tool_choice, formats, Responses items, Ollama's messages and options,
  embeddings input) from the composite kinds of :mod:`mlxd.http.shapes`: each
  route's body is one description (``validation.chat_body`` and
  ``COMPLETION_BODY``, ``embeddings_api.BODY``, ``responses_fields.body_kind``,
  ``anthropic_shapes.body_kind``, ``ollama_shapes.body_kind`` and its embed
  bodies) whose ``schema()`` is the request schema, one variant per engine
  group where models take different things (images, tools, grammars). The
  document adds only what depends on the config (the model ``enum``) and
  ``keep_alive``. Rules that are not structure (a tool message needs
  ``tool_call_id``, image parts only for ``mllm`` models, ``stream_options``
  needs ``stream: true``, ``required`` needs tools) are the validators' code,
  stated beside it as JSON Schema ``if``/``then`` in the description's
  ``rules``. Every optional field may be ``null``; integers may be written
  ``16.0``; unknown fields are accepted and ignored (``additionalProperties:
  true``, stated explicitly), as OpenAI-compatible servers do.
  ``tests/unit/test_request_fields.py`` checks every kind's check against its
  schema, value for value.
- When the document is built for a config, model ids are an ``enum`` of the
  configured names (the document is rendered per request, so it follows
  ``/admin/reload``); any other id is a 404 ``model_not_found``.
- Response bodies are not written here: each JSON body is a ``TypedDict`` in a
  ``bodies_*`` module of its family, which the code that builds the body
  returns (so ``mypy`` holds the daemon to it), and ``components.schemas``
  are generated from those ``TypedDict`` by pydantic
  (:mod:`mlxd.http.body_schemas`); a response points at its body with
  ``ref(Body)``. A stream's events (SSE ``data:``, NDJSON lines) name theirs
  with ``contentSchema`` (``event_data``), which schemathesis checks event
  by event. ``tests/unit/test_response_bodies.py`` fails on a JSON answer
  whose schema is not such a reference.
- Every status a route can return is listed, with the OpenAI error envelope
  ``{"error": {"message", "type", "param", "code"}}`` (``ErrorEnvelope``,
  :mod:`mlxd.errors`); 503s carry ``Retry-After``.
  Every ``/v1`` and ``/admin`` route may also answer 401 (API key set) and
  503 ``shutting_down`` (draining).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlxd import __version__
from mlxd.errors import ErrorEnvelope
from mlxd.http import origins
from mlxd.http.bodies_admin import AdminPlan, AdminStatus, HistoryRows, OpenAPIDocument, Reloaded
from mlxd.http.bodies_openai import (
    ChatCompletion,
    ChatCompletionChunk,
    ModelList,
    ModelObject,
    TextCompletion,
    TextCompletionChunk,
)
from mlxd.http.body_schemas import components, event_data, ref
from mlxd.http.openapi_anthropic import anthropic_paths
from mlxd.http.openapi_chat import chat_request, engine_groups
from mlxd.http.openapi_clients import ANY_MODEL_NAME, error_responses, json_response, with_model
from mlxd.http.openapi_embeddings import embeddings_path
from mlxd.http.openapi_ollama import ollama_paths
from mlxd.http.openapi_operations import operations_paths
from mlxd.http.openapi_responses import responses_paths, responses_request
from mlxd.http.preferences import (
    CONTENTION_HEADER,
    KEEP_ALIVE_HEADER,
    KEEP_ALIVE_PATTERN,
    REQUIRE_RESIDENT_HEADER,
)
from mlxd.http.validation import COMPLETION_BODY
from mlxd.residency.policy import STRATEGIES

if TYPE_CHECKING:
    from mlxd.config import Config


#: what ``since`` generators should produce: empty or a duration (ISO times are accepted too)
_SINCE = r"^(\s*[0-9]{1,9}(\.[0-9]{1,6})?\s*[smhd]\s*)?$"


def _model_name(names: list[str]) -> dict[str, Any]:
    if names:
        return {"type": "string", "enum": names}
    return ANY_MODEL_NAME  # no such model can be named right now: any other name is a 404


def _named(names: list[str]) -> dict[str, Any]:
    """The fields a generation body adds to its description: the model, ``keep_alive``."""
    return {
        "model": _model_name(names),
        "keep_alive": {"anyOf": [{"type": "number"}, _KEEP_ALIVE, {"type": "null"}]},
    }


#: Ollama's keep_alive as a string: seconds or a Go duration ("5m"); negative: until evicted
_KEEP_ALIVE = {"type": "string", "pattern": KEEP_ALIVE_PATTERN}
_STRATEGY = {"enum": list(STRATEGIES)}
_PREFERENCE_HEADERS = [
    {"name": KEEP_ALIVE_HEADER, "in": "header", "required": False, "schema": _KEEP_ALIVE,
     "description": "how long the model stays after this request (the body's keep_alive wins)"},
    {"name": CONTENTION_HEADER, "in": "header", "required": False, "schema": _STRATEGY,
     "description": "ask for less waiting or preemption than the model's policy (fail: fail fast)"},
    {"name": REQUIRE_RESIDENT_HEADER, "in": "header", "required": False,
     "schema": {"enum": ["1", "0", "true", "false"]},
     "description": "1: serve only if the model is loaded now, else 503 model_not_resident "
     "(Retry-After: 0) and nothing is loaded"},
]

def _generation_event(chunk: type) -> dict[str, Any]:
    """One SSE event of a generation stream (OpenAPI 3.1: the stream's ``schema`` is one event)."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"const": "message"},
            "data": {
                "description": "a chunk object, an error envelope, or the final [DONE]",
                "anyOf": [{"const": "[DONE]"},
                          {"type": "string", "pattern": r"^\{[\s\S]*\}$",
                           **event_data(chunk, ErrorEnvelope)}],
            },
        },
    }


#: one SSE event of /admin/events: the id is the journal sequence, the data a JSON payload;
#: live load_progress events (not journaled) have no id
_ADMIN_EVENT = {
    "type": "object",
    "required": ["data", "event"],
    "properties": {
        "id": {"type": "string", "pattern": "^[0-9]+$"},
        "event": {"type": "string"},
        "data": {"type": "string", "pattern": r"^\{[\s\S]*\}$",
                 "contentMediaType": "application/json"},
    },
}


_DESCRIPTIONS = {
    400: "invalid request (param names the field), context_length_exceeded, or "
    "model_exceeds_budget (x-should-retry: false)",
    401: "missing or wrong API key (only when an API key is set)",
    403: "insufficient_scope: the key lacks the scope this route needs (server.keys)",
    404: "model_not_found (param: model)",
    409: "conflict: the change needs a model that is live",
    413: "request_too_large: the body is larger than server.max_body_mb",
    415: "unsupported_media_type: the body is not sent as application/json",
    502: "model_load_failed or engine_error",
    503: "model_capacity, capacity_timeout, preempted, overloaded, shutting_down or "
    "journal_unavailable; retry after Retry-After seconds",
}


def _errors(*codes: int) -> dict[str, Any]:
    return error_responses(_DESCRIPTIONS, "ErrorEnvelope", *codes)


def _model_id(names: list[str]) -> dict[str, Any]:
    schema = {"type": "string", "enum": names} if names else {"type": "string", "minLength": 1}
    return {"name": "model_id", "in": "path", "required": True, "schema": schema}


#: what every guarded route (/v1, /admin) may answer besides its own statuses
_GUARDED = (401, 403, 503)
_HISTORY_KIND = {
    "name": "kind", "in": "query", "required": False,
    "description": "journal rows (transitions, leases) or where retention's pruning left each "
    "model (checkpoints)",
    "schema": {"enum": ["transitions", "leases", "checkpoints"]},
}
_REQUEST_ID = {"X-Request-Id": {"required": False, "schema": {"type": "string"}}}


def _generation(summary: str, request: dict[str, Any], whole: type, chunk: type) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "parameters": _PREFERENCE_HEADERS,
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {
                "200": {
                    "description": "the completion, or (stream: true) an SSE stream of chunks "
                    "ending in data: [DONE]",
                    "headers": _REQUEST_ID,
                    "content": {
                        "application/json": {"schema": ref(whole)},
                        "text/event-stream": {"schema": _generation_event(chunk)},
                    },
                },
                **_errors(400, 404, 413, 415, 502, *_GUARDED),
            },
        }
    }


def _openai_paths(config: Config | None, model_id: dict[str, Any]) -> dict[str, Any]:
    models = list(config.models) if config is not None else []
    names = [m.name for m in models]
    groups = engine_groups(config)
    return {
        "/v1/models": {
            "get": {
                "summary": "List models with their residency state",
                "responses": {"200": json_response(ref(ModelList)), **_errors(*_GUARDED)},
            }
        },
        "/v1/models/{model_id}": {
            "get": {
                "summary": "One model with its residency state",
                "parameters": [model_id],
                "responses": {"200": json_response(ref(ModelObject)), **_errors(404, *_GUARDED)},
            }
        },
        "/v1/chat/completions": _generation(
            "Chat completion (whole, or SSE with stream=true)",
            chat_request(groups, _named),
            ChatCompletion, ChatCompletionChunk,
        ),
        "/v1/completions": _generation(
            "Text completion (whole, or SSE with stream=true)",
            with_model(COMPLETION_BODY, _named(names)),
            TextCompletion, TextCompletionChunk,
        ),
    }


def _admin_paths(model_id: dict[str, Any]) -> dict[str, Any]:
    return {
        "/admin/status": {
            "get": {
                "summary": "Budget, committed and free bytes, every model's state, waiters, "
                "leases, and per model the routing facts (committed_bytes, queued, running, "
                "kv_in_use, expected_load_seconds); loads nothing",
                "responses": {"200": json_response(ref(AdminStatus)), **_errors(401, 403)},
            }
        },
        "/admin/plan": {
            "get": {
                "summary": "What acquiring a model now would do (action, victims and why), "
                "computed on a copy of the residency state: nothing changes",
                "parameters": [
                    {"name": "model", "in": "query", "required": True,
                     "schema": {"type": "string", "minLength": 1}},
                    {"name": "contention", "in": "query", "required": False,
                     "description": "plan for a request with this X-Mlxd-Contention header",
                     "schema": _STRATEGY},
                    {"name": "tokens", "in": "query", "required": False,
                     "description": "plan for a request of this many tokens (prompt + "
                     "max_tokens): its KV beyond the model's floor is reserved in the budget; "
                     "over the model's context the plan fails with context_length_exceeded",
                     "schema": {"type": "string", "pattern": "^[1-9][0-9]{0,11}$"}},
                ],
                "responses": {"200": json_response(ref(AdminPlan)), **_errors(400, 404, *_GUARDED)},
            }
        },
        "/admin/models/{model_id}/load": {
            "post": {
                "summary": "Load a model; replies once it is loaded and journaled",
                "parameters": [model_id],
                "responses": {"200": json_response(ref(ModelObject)), **_errors(400, 404, 502, *_GUARDED)},
            }
        },
        "/admin/models/{model_id}/unload": {
            "post": {
                "summary": "Unload a model (drains live requests, or preempts them)",
                "parameters": [
                    model_id,
                    {
                        "name": "preempt",
                        "in": "query",
                        "required": False,
                        "schema": {"enum": ["true", "false", "1", "0", "yes", "no", "on",
                                            "off", ""]},
                    },
                ],
                "responses": {"200": json_response(ref(ModelObject)), **_errors(400, 404, 502, *_GUARDED)},
            }
        },
    }


def _admin_journal_paths() -> dict[str, Any]:
    return {
        "/admin/events": {
            "get": {
                "summary": "SSE of transitions and lease events; the event id is the journal "
                "sequence, and Last-Event-ID resumes after it; live load_progress events "
                "(not journaled) carry no id",
                "parameters": [
                    {"name": "Last-Event-ID", "in": "header", "required": False,
                     "schema": {"type": "string", "pattern": "^[0-9]{0,18}$"}},
                    {"name": "last_event_id", "in": "query", "required": False,
                     "schema": {"type": "string", "pattern": "^[0-9]{0,18}$"}},
                ],
                "responses": {
                    "200": {"description": "event stream (never ends by itself)",
                            "content": {"text/event-stream": {"schema": _ADMIN_EVENT}}},
                    **_errors(400, 401, 403),
                },
            }
        },
        "/admin/history": {
            "get": {
                "summary": "Journal rows as JSON",
                "parameters": [
                    {"name": "model", "in": "query", "required": False,
                     "schema": {"type": "string"}},
                    {"name": "since", "in": "query", "required": False,
                     "description": "an ISO time (2026-11-29T10:00) or a duration ago "
                     "(90s, 15m, 2h, 7d)",
                     "schema": {"type": "string", "pattern": _SINCE}},
                    {"name": "limit", "in": "query", "required": False,
                     "description": "rows to return (empty: 100)",
                     "schema": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 10000},
                                          {"type": "string", "maxLength": 0}]}},
                    _HISTORY_KIND,
                ],
                "responses": {
                    "200": json_response(ref(HistoryRows)),
                    **_errors(400, 401, 403),
                },
            }
        },
        "/admin/reload": {
            "post": {
                "summary": "Re-read the config; add, remove or replace dormant models",
                "responses": {"200": json_response(ref(Reloaded)),
                              **_errors(400, 409, *_GUARDED)},
            }
        },
    }


def openapi_document(config: Config | None = None) -> OpenAPIDocument:
    """The document; with ``config``, model ids are an enum of its model names."""
    model_id = _model_id([m.name for m in config.models] if config is not None else [])
    return origins.describe({
        "openapi": "3.1.0",
        "info": {
            "title": "mlxd",
            "version": __version__,
            "description": "OpenAI-compatible MLX model server with journaled residency management.",
        },
        "paths": {
            **_openai_paths(config, model_id),
            **anthropic_paths(engine_groups(config)),
            **responses_paths(responses_request(engine_groups(config), _named), _errors,
                              _PREFERENCE_HEADERS, _GUARDED),
            **embeddings_path([m.name for m in (config.models if config else ()) if m.embedding],
                              [m.name for m in (config.models if config else ()) if not m.embedding],
                              _errors(400, 404, 413, 415, 502, *_GUARDED)),
            **ollama_paths(config),
            **_admin_paths(model_id),
            **_admin_journal_paths(),
            **operations_paths(_errors),
        },
        "components": {"schemas": components()},
    })


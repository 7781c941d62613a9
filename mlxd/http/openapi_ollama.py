"""OpenAPI pieces of Ollama's API (``/api/*``), assembled by :mod:`mlxd.http.openapi`.

The request schemas are the validator's own descriptions
(:func:`mlxd.http.ollama_shapes.body_kind`), per
engine group as the OpenAI chat variants do (:mod:`mlxd.http.openapi_chat`):
mlx-lm text models take tools (``options.tool_choice``) and ``format``;
vision models take ``images``; fake engines take neither. ``think: true``
and ``options.num_ctx`` depend on the model's tokenizer and on the prompt's
length, which a schema cannot say: ``think`` is documented as ``false`` (a
model with thinking markers takes ``true``, see ``/api/show``), ``num_ctx``
with the 400 a longer prompt gets. Model names may carry ``:latest``.

Errors are Ollama's ``{"error": "..."}`` (``OllamaError``). The routes mlxd
does not serve (``/api/delete``, ``/api/copy``, ``/api/create``,
``/api/push``, ``/api/blobs``) are described with their only answer, 501
(schemathesis leaves them out: a 501 is all they can say).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from mlxd.http.bodies_ollama import (
    OllamaEmbed,
    OllamaEmbedding,
    OllamaError,
    OllamaReply,
    OllamaRunningList,
    OllamaShow,
    OllamaTags,
    OllamaVersion,
    PullProgress,
)
from mlxd.http.body_schemas import event_data, ref
from mlxd.http.fields import documented, nullable
from mlxd.http.ollama_pull import REPO_PATTERN, REPO_REFUSED
from mlxd.http.ollama_shapes import EMBED_BODY, EMBEDDINGS_BODY, PULL, SHOW, body_kind
from mlxd.http.openapi_chat import engine_groups
from mlxd.http.openapi_clients import (
    ANY_MODEL_NAME,
    OPEN,
    error_responses,
    json_response,
    with_model,
)
from mlxd.http.preferences import CONTENTION_HEADER, KEEP_ALIVE_HEADER, KEEP_ALIVE_PATTERN

if TYPE_CHECKING:
    from mlxd.config import Config

_KEEP_ALIVE_TEXT = {"type": "string", "pattern": KEEP_ALIVE_PATTERN}
_KEEP_ALIVE = {"anyOf": [{"type": "number"}, _KEEP_ALIVE_TEXT, {"type": "null"}],
               "description": "seconds or a duration (\"5m\"); 0 unloads after the request, "
               "negative keeps the model until evicted; absent: the model's idle_unload_seconds"}
_HEADERS = [
    {"name": KEEP_ALIVE_HEADER, "in": "header", "required": False, "schema": _KEEP_ALIVE_TEXT},
    {"name": CONTENTION_HEADER, "in": "header", "required": False,
     "schema": {"enum": ["fail", "wait", "wait_then_fail", "preempt", "wait_then_preempt"]}},
]

_DESCRIPTIONS = {
    400: "the request is wrong (the message names the field)",
    401: "missing or wrong API key",
    403: "the key lacks the route's scope (inference; admin for /api/pull)",
    404: "no such model",
    413: "the body is larger than server.max_body_mb",
    415: "the body is not sent as application/json",
    502: "the model failed to load, the engine failed, or the Hugging Face Hub failed (pull)",
    503: "no room now, preempted, overloaded or shutting down; retry after Retry-After seconds",
}


def _errors(*codes: int) -> dict[str, Any]:
    return error_responses(_DESCRIPTIONS, "OllamaError", *codes)


_GUARDED = (401, 403, 503)
_BODY_ERRORS = (400, 404, 413, 415, *_GUARDED)


def _model(names: list[str], others: list[str]) -> dict[str, Any]:
    """One of ``names`` (or ``name:latest``); without any, any name but ``others`` (404)."""
    if names:
        return {"type": "string", "enum": [*names, *(f"{n}:latest" for n in names)]}
    refused = [*others, *(f"{n}:latest" for n in others)]
    return {**ANY_MODEL_NAME, "not": {"enum": refused}} if refused else ANY_MODEL_NAME


#: the groups' capabilities: (images, tools and format)
_GROUPS = {"text": (False, True), "vision": (True, False), "fake": (False, False)}


def _request(kind: Literal["chat", "generate"]) -> Callable[[list[str], list[str], str], dict[str, Any]]:
    """The request schema of ``kind`` for a group: the validator's description
    (:func:`mlxd.http.ollama_shapes.body_kind`) for what the group's engine takes."""
    def build(names: list[str], others: list[str], group: str) -> dict[str, Any]:
        images, tools = _GROUPS[group]
        body = body_kind(kind, images=images, tools=tools, thinking=False)
        return with_model(body, {"model": _model(names, others), "keep_alive": _KEEP_ALIVE})
    return build


def _variants(build: Callable[[list[str], list[str], str], dict[str, Any]], groups: dict[str, list[str]], others: list[str]) -> dict[str, Any]:
    parts = [build(names, others, kind) for kind, names in groups.items() if names]
    if not parts:
        return build([], others, "text")
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def _ndjson(line: type) -> dict[str, Any]:
    return {"type": "string", "description": "one JSON object per line: replies with done false, "
            "then one with done true (or {\"error\": ...})", **event_data(line, OllamaError)}


def _model_or_name(named: dict[str, Any]) -> list[dict[str, Any]]:
    """``model``, or the older ``name`` when ``model`` is absent or null (beside ``model``,
    ``name`` is any model name and is not used)."""
    return [{"required": ["model"], "properties": {"model": named, "name": nullable(ANY_MODEL_NAME)}},
            {"required": ["name"], "properties": {"model": {"type": "null"}, "name": named}}]


def _post(summary: str, request: dict[str, Any], ok: type, *errors: int,
          streamed: bool = False, headers: bool = True) -> dict[str, Any]:
    """``headers``: the route reads X-Mlxd-Keep-Alive and X-Mlxd-Contention (it takes a lease)."""
    content: dict[str, Any] = {"application/json": {"schema": ref(ok)}}
    if streamed:
        content["application/x-ndjson"] = {"schema": _ndjson(ok)}
    return {"post": {
        "summary": summary,
        "parameters": _HEADERS if headers else [],
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {"200": {"description": "OK", "content": content}, **_errors(*errors)},
    }}


#: the routes mlxd does not serve (501), as (path, method)
NOT_SERVED = (("/api/delete", "delete"), ("/api/copy", "post"), ("/api/create", "post"),
              ("/api/push", "post"), ("/api/blobs/{digest}", "post"))


def _not_served() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, method in NOT_SERVED:
        op: dict[str, Any] = {
            "summary": "Not served: mlxd reads its models from its config",
            "responses": {"501": {"description": "not served (the message says why)", "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/OllamaError"}}}},
                **_errors(*_GUARDED)}}
        if "{digest}" in path:
            op["parameters"] = [{"name": "digest", "in": "path", "required": True, "schema": {"type": "string"}}]
        out[path] = {method: op}
    return out


def ollama_paths(config: Config | None) -> dict[str, Any]:
    models = list(config.models) if config is not None else []
    embedding = [m.name for m in models if m.embedding]
    generators = [m.name for m in models if not m.embedding]
    groups = engine_groups(config)
    every = [m.name for m in models]
    embed_model = _model(embedding, generators)
    embed_request = with_model(EMBED_BODY, {"model": embed_model, "keep_alive": _KEEP_ALIVE})
    embeddings_request = with_model(EMBEDDINGS_BODY, {"model": embed_model, "keep_alive": _KEEP_ALIVE})
    repo = {"type": "string", "pattern": REPO_PATTERN, "not": {"pattern": REPO_REFUSED},
            "description": "a Hugging Face repo id (org/name)"}
    pull_request = {"type": "object", "anyOf": _model_or_name(repo), "properties": documented(PULL),
                    **OPEN}
    return {
        "/api/version": {"get": {"summary": "The Ollama API version mlxd speaks (and mlxd's own)",
                                 "responses": {"200": json_response(ref(OllamaVersion)),
                                               **_errors(*_GUARDED)}}},
        "/api/tags": {"get": {"summary": "Every configured model, loaded or not",
                              "responses": {"200": json_response(ref(OllamaTags)),
                                            **_errors(*_GUARDED)}}},
        "/api/ps": {"get": {"summary": "The models holding memory, with expires_at from keep_alive",
                            "responses": {"200": json_response(ref(OllamaRunningList)),
                                          **_errors(*_GUARDED)}}},
        "/api/show": _post("A model's details, capabilities, context length and template",
                           {"type": "object", "anyOf": _model_or_name(_model(every, [])),
                            "properties": documented(SHOW), **OPEN},
                           OllamaShow, *_BODY_ERRORS, headers=False),
        "/api/chat": _post("Chat (NDJSON stream by default; stream: false for one reply)",
                           _variants(_request("chat"), groups, embedding), OllamaReply, 502, *_BODY_ERRORS, streamed=True),
        "/api/generate": _post("Generate from a prompt (NDJSON stream by default)",
                               _variants(_request("generate"), groups, embedding), OllamaReply, 502, *_BODY_ERRORS,
                               streamed=True),
        "/api/embed": _post("Embeddings of texts (embedding: true models)", embed_request,
                            OllamaEmbed, 502, *_BODY_ERRORS),
        "/api/embeddings": _post("One prompt's embedding (the older route)", embeddings_request,
                                 OllamaEmbedding, 502, *_BODY_ERRORS),
        "/api/pull": _post("Download a Hugging Face repo into the local cache (scope admin)", pull_request,
                           PullProgress, 400, 413, 415, 502, *_GUARDED, streamed=True, headers=False),
        **_not_served(),
    }

"""OpenAPI pieces of Ollama's API (``/api/*``), assembled by :mod:`mlxd.http.openapi`.

The request schemas follow :mod:`mlxd.http.ollama_shapes` rule for rule, per
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
from typing import TYPE_CHECKING, Any

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
from mlxd.http.embeddings_api import MAX_INPUTS
from mlxd.http.fields import documented, nullable
from mlxd.http.ollama_pull import REPO_PATTERN, REPO_REFUSED
from mlxd.http.ollama_shapes import DEFAULT_NUM_PREDICT, EMBED, GENERATE, OPTIONS, PULL, ROLES, SHOW
from mlxd.http.openapi_chat import engine_groups
from mlxd.http.openapi_clients import (
    ANY_MODEL_NAME,
    NAME,
    OBJECT_SCHEMA,
    OPEN,
    TOP_NEEDS_LOGPROBS,
    error_responses,
    json_response,
    tool_choice,
)
from mlxd.http.preferences import CONTENTION_HEADER, KEEP_ALIVE_HEADER, KEEP_ALIVE_PATTERN
from mlxd.http.structured import CHAT_FIELDS, MAX_TOOLS

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


def _tool_choice(tools: bool) -> dict[str, Any]:
    return tool_choice(tools, "mlxd's extension: 'required' or a named function forces a call "
                              "(needs tools; the name must be declared)")


def _options(choice_schema: dict[str, Any] | None) -> dict[str, Any]:
    """``options``; ``choice_schema``: its ``tool_choice`` (None: not read, as on /api/generate)."""
    choice = {} if choice_schema is None else {"tool_choice": choice_schema}
    return nullable({
        "type": "object",
        "properties": {
            **documented(OPTIONS, {"top_k": "0: no limit; 1: greedy",
                                   "num_predict": f"0 or negative: {DEFAULT_NUM_PREDICT}",
                                   "num_ctx": "a prompt of more tokens is a 400"}),
            **choice,
        },
        "description": "other options are ignored, as Ollama does",
        **OPEN,
    })


_NO_LIST = nullable({"type": "array", "maxItems": 0})
_IMAGES = nullable({"type": "array", "items": {"type": "string", "minLength": 1,
                                               "description": "a base64-encoded image"}})
_TOOL_CALL = {"type": "object", "required": ["function"],
              "properties": {"id": {"type": "string"},
                             "function": {"type": "object", "required": ["name"],
                                          "properties": {"name": NAME, "arguments": {"type": "object"}},
                                          **OPEN}},
              **OPEN}
_TOOL = {"type": "object", "required": ["function"],
         "properties": {"type": {"const": "function"},
                        "function": {"type": "object", "required": ["name"],
                                     "properties": {"name": NAME, "description": {"type": "string"},
                                                    "parameters": nullable(OBJECT_SCHEMA)}, **OPEN}},
         **OPEN}


def _messages(*, images: bool) -> dict[str, Any]:
    message = {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"enum": list(ROLES)},
            "content": nullable({"type": "string"}),
            "images": _IMAGES if images else _NO_LIST,
            "thinking": nullable({"type": "string"}),
            "tool_calls": nullable({"type": "array", "items": _TOOL_CALL}),
            "tool_name": nullable({"type": "string"}),
            "tool_call_id": nullable({"type": "string"}),
        },
        # only an assistant message carries tool calls
        "if": {"properties": {"role": {"not": {"const": "assistant"}}}},
        "then": {"properties": {"tool_calls": _NO_LIST}},
        **OPEN,
    }
    return nullable({"type": "array", "items": message, "description": "empty: the load call"})


#: the groups' capabilities: (images, tools and format)
_GROUPS = {"text": (False, True), "vision": (True, False), "fake": (False, False)}
_FORCED = {"properties": {"options": {"type": "object", "required": ["tool_choice"],
                                      "properties": {"tool_choice": {"anyOf": [
                                          {"const": "required"}, {"type": "object"}]}}}},
           "required": ["options"]}
#: a forced call needs tools, and takes no format
_FORCED_RULE = {"if": _FORCED, "then": {
    "required": ["tools"],
    "properties": {"tools": {"type": "array", "minItems": 1}, "format": nullable({"const": ""})}}}


def _common(names: list[str], others: list[str]) -> dict[str, Any]:
    return {
        "model": _model(names, others),
        **documented({"stream": GENERATE["stream"]}, {"stream": "default true (NDJSON)"}),
        "keep_alive": _KEEP_ALIVE,
        "format": {"anyOf": [{"const": ""}, {"type": "null"}, {"const": "json"},
                             {"type": "object", "description": "a JSON Schema"}]},
        "think": nullable({"const": False, "description": "true or a level: models with thinking"}),
        **documented({key: CHAT_FIELDS[key] for key in ("logprobs", "top_logprobs")}),
    }


#: what an engine without tools or grammar (fake, vision) refuses, also on the load call
_NO_GRAMMAR = {"format": nullable({"const": ""})}
_NO_TOOLS = {**_NO_GRAMMAR, "tools": _NO_LIST,
             "options": {"properties": {"tool_choice": _tool_choice(False)}},
             "messages": {"items": {"properties": {"tool_calls": _NO_LIST}}}}


def _chat(names: list[str], others: list[str], kind: str) -> dict[str, Any]:
    images, tools = _GROUPS[kind]
    rules: list[dict[str, Any]] = [_FORCED_RULE, TOP_NEEDS_LOGPROBS]
    if not tools:
        rules.append({"properties": _NO_TOOLS})
    return {
        "type": "object",
        "required": ["model"],
        "properties": {
            **_common(names, others),
            "options": _options(_tool_choice(True)),
            "messages": _messages(images=images),
            "tools": nullable({"type": "array", "items": _TOOL, "maxItems": MAX_TOOLS}),
        },
        "allOf": rules,
        **OPEN,
    }


def _generate(names: list[str], others: list[str], kind: str) -> dict[str, Any]:
    images, grammar = _GROUPS[kind]
    empty = nullable({"const": ""})
    rules: list[dict[str, Any]] = [
        TOP_NEEDS_LOGPROBS,
        {"if": {"required": ["raw"], "properties": {"raw": {"const": True}}},
         "then": {"properties": {"system": empty, "images": _NO_LIST}}}]
    if not grammar:
        rules.append({"properties": _NO_GRAMMAR})
    return {
        "type": "object",
        "required": ["model"],
        "properties": {
            **_common(names, others),
            "options": _options(None),
            **documented(GENERATE, {"prompt": "empty: the load call", "stream": "default true (NDJSON)"}),
            "images": _IMAGES if images else _NO_LIST,
            "template": {**empty, "description": "refused: mlxd uses the model's own template"},
            "suffix": {**empty, "description": "refused: no fill-in-the-middle"},
            "context": {**_NO_LIST, "description": "refused: send the history to /api/chat"},
        },
        "allOf": rules,
        **OPEN,
    }


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
    text = {"type": "string", "minLength": 1}
    embed_request = {"type": "object", "required": ["model", "input"], "properties": {
        "model": embed_model,
        "input": {"anyOf": [text, {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": text}],
                  "description": "over the model's context: 400"},
        **documented(EMBED, {"dimensions": "only the model's own"}),
        "options": nullable({"type": "object"}), "keep_alive": _KEEP_ALIVE}, **OPEN}
    embeddings_request = {"type": "object", "required": ["model", "prompt"], "properties": {
        "model": embed_model, "prompt": text, "options": nullable({"type": "object"}),
        "keep_alive": _KEEP_ALIVE}, **OPEN}
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
                           _variants(_chat, groups, embedding), OllamaReply, 502, *_BODY_ERRORS, streamed=True),
        "/api/generate": _post("Generate from a prompt (NDJSON stream by default)",
                               _variants(_generate, groups, embedding), OllamaReply, 502, *_BODY_ERRORS,
                               streamed=True),
        "/api/embed": _post("Embeddings of texts (embedding: true models)", embed_request,
                            OllamaEmbed, 502, *_BODY_ERRORS),
        "/api/embeddings": _post("One prompt's embedding (the older route)", embeddings_request,
                                 OllamaEmbedding, 502, *_BODY_ERRORS),
        "/api/pull": _post("Download a Hugging Face repo into the local cache (scope admin)", pull_request,
                           PullProgress, 400, 413, 415, 502, *_GUARDED, streamed=True, headers=False),
        **_not_served(),
    }

"""OpenAPI pieces of ``/v1/chat/completions`` requests: messages and one variant per engine group.

Kept beside :mod:`mlxd.http.openapi`, which assembles the document (and
passes its sampling fields in). What each group accepts is in
:mod:`mlxd.http.openapi_clients`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mlxd.http.openapi_clients import (
    OPEN,
    REQUIRED_NEEDS_TOOLS,
    TOP_NEEDS_LOGPROBS,
    chat_fields,
    message_extras,
)
from mlxd.http.validation import ROLES

if TYPE_CHECKING:
    from mlxd.config import Config

#: the sampling fields of a request naming one of ``names`` (model, max_tokens, ...)
Sampling = Callable[[list[str]], dict[str, Any]]

#: ``stream_options`` with any option in it is only allowed when ``stream`` is true
STREAM_OPTIONS_NEED_STREAM = {
    "if": {
        "required": ["stream_options"],
        "properties": {"stream_options": {"type": "object", "minProperties": 1}},
    },
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}

_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    **OPEN,
}

_URL = {"type": "string", "minLength": 1}
_IMAGE_PART = {
    "type": "object",
    "required": ["type", "image_url"],
    "properties": {
        "type": {"const": "image_url"},
        "image_url": {
            "anyOf": [
                {"type": "object", "required": ["url"], "properties": {"url": _URL}, **OPEN},
                _URL,
            ],
            "description": "a data:image/...;base64 URL or a file inside the model's image_dir",
        },
    },
    **OPEN,
}


def _messages(*, images: bool, tools: bool = False) -> dict[str, Any]:
    part = {"anyOf": [_TEXT_PART, _IMAGE_PART]} if images else _TEXT_PART
    content = {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": part}]}
    extras, rules = message_extras(tools=tools)
    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"enum": sorted(ROLES)},
                "content": {"anyOf": [*content["anyOf"], {"type": "null"}]},
                **extras,
            },
            "allOf": [
                # only an assistant message may leave its content out (or null)
                {"if": {"properties": {"role": {"const": "assistant"}}},
                 "else": {"required": ["content"], "properties": {"content": content}}},
                *rules,
            ],
            **OPEN,
        },
    }


#: what each engine group takes: (images, tools, grammar, logprobs)
_GROUPS = {"text": (False, True, True, True), "vision": (True, False, False, False),
           "fake": (False, False, False, True)}


def chat_request(groups: dict[str, list[str]], sampling: Sampling) -> dict[str, Any]:
    """One variant per engine group (see :mod:`mlxd.http.openapi_clients`); a generic one without models."""
    def variant(names: list[str], kind: str) -> dict[str, Any]:
        images, tools, grammar, logprobs = _GROUPS[kind]
        return {
            "type": "object",
            "required": ["model", "messages"],
            "properties": {
                **sampling(names),
                "messages": _messages(images=images, tools=tools),
                **chat_fields(tools=tools, grammar=grammar, logprobs=logprobs),
            },
            "allOf": [STREAM_OPTIONS_NEED_STREAM, TOP_NEEDS_LOGPROBS, REQUIRED_NEEDS_TOOLS],
            **OPEN,
        }

    variants = [variant(names, kind) for kind, names in groups.items() if names]
    if not variants:
        return variant([], "text")
    return variants[0] if len(variants) == 1 else {"anyOf": variants}



def engine_groups(config: Config | None) -> dict[str, list[str]]:
    """Model names by what their engine accepts (see :mod:`mlxd.http.openapi_clients`)."""
    models = list(config.models) if config is not None else []
    real = [m for m in models if m.engine_kind.constrains]  # the others: the "fake" group
    return {
        "text": [m.name for m in real if not m.mllm and not m.embedding],
        "vision": [m.name for m in real if m.mllm],
        "fake": [m.name for m in models if not m.engine_kind.constrains],
    }

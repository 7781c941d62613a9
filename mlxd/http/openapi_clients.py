"""OpenAPI pieces shared by the routes' modules (error and JSON responses, names), and the
real-client fields: tools, response_format, logprobs (``/v1/chat/completions``).

Kept beside :mod:`mlxd.http.openapi`, which assembles the document. What a
model accepts depends on its engine: mlx-lm text models take tools (when
their template has tool support, else 400 ``tools_not_supported``),
grammar-constrained ``response_format`` and logprobs; vision models take
none of these; fake engines take logprobs only. The document gives each
group its own request variant, so generated "valid" requests are valid.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxd.http.fields import documented, nullable
from mlxd.http.structured import (
    CHAT_FIELDS,
    MAX_MODEL_NAME,
    MAX_TOOLS,
    MODEL_NAME_PATTERN,
    NAME_PATTERN,
)

#: JSON Schema keyword kept explicit: unknown fields are ignored, not refused
OPEN = {"additionalProperties": True}
#: a function or tool name
NAME = {"type": "string", "pattern": NAME_PATTERN}



def error_responses(descriptions: Mapping[int, str], envelope: str, *codes: int) -> dict[str, Any]:
    """The responses for ``codes``: each described, with the error body
    ``#/components/schemas/<envelope>``; a 503 carries ``Retry-After``."""
    out: dict[str, Any] = {}
    for code in codes:
        response: dict[str, Any] = {
            "description": descriptions[code],
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{envelope}"}}},
        }
        if code == 503:
            response["headers"] = {
                "Retry-After": {"required": True, "schema": {"type": "string", "pattern": "^[0-9]+$"}}
            }
        out[str(code)] = response
    return out


def json_response(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}

#: a model name when no configured model can be named there: any non-blank string up to 256
#: characters (the routes' validation refuses blank and longer names with 400; the rest are 404)
ANY_MODEL_NAME: dict[str, Any] = {"type": "string", "minLength": 1, "maxLength": MAX_MODEL_NAME,
                                   "pattern": MODEL_NAME_PATTERN}


#: a JSON Schema of type object (tool parameters); the daemon checks it against the meta-schema
OBJECT_SCHEMA = {
    "type": "object",
    "properties": {"type": {"const": "object"}, "properties": {"type": "object"}},
    "description": "a JSON Schema of type object",
    **OPEN,
}

_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": NAME,
                "description": {"type": "string"},
                "parameters": OBJECT_SCHEMA,
            },
            **OPEN,
        },
    },
    **OPEN,
}

_TOOL_CALL = {
    "type": "object",
    "required": ["id", "function"],
    "properties": {
        "id": {"type": "string", "minLength": 1},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": NAME, "arguments": {"type": "string",
                                                        "contentMediaType": "application/json"}},
        },
    },
    **OPEN,
}

#: no tools: absent, null or an empty list
_NO_TOOLS = nullable({"type": "array", "maxItems": 0})


def tool_choice(tools: bool, description: str) -> dict[str, Any]:
    """OpenAI's ``tool_choice`` (also Ollama's ``options.tool_choice``); without tools, only
    ``auto`` and ``none``."""
    if not tools:
        return nullable({"enum": ["auto", "none"]})
    return {"anyOf": [{"enum": ["auto", "none", "required"]},
                      {"type": "object", "required": ["type", "function"],
                       "properties": {"type": {"const": "function"},
                                      "function": {"type": "object", "required": ["name"],
                                                   "properties": {"name": NAME}}}},
                      {"type": "null"}],
            "description": description}


def chat_fields(*, tools: bool, grammar: bool, logprobs: bool) -> dict[str, Any]:
    """The properties of a chat request for a group of models with these capabilities."""
    out = documented(CHAT_FIELDS)
    out["tools"] = nullable({"type": "array", "items": _TOOL, "maxItems": MAX_TOOLS}) if tools else _NO_TOOLS
    out["tool_choice"] = tool_choice(
        tools, "'required' and a named function need tools; the name must be declared")
    formats: list[dict[str, Any]] = [{"type": "object", "required": ["type"],
                                      "properties": {"type": {"const": "text"}}}]
    if grammar:
        formats += [
            {"type": "object", "required": ["type"], "properties": {"type": {"const": "json_object"}}},
            {"type": "object", "required": ["type", "json_schema"],
             "properties": {"type": {"const": "json_schema"},
                            "json_schema": {"type": "object", "required": ["name", "schema"],
                                            "properties": {"name": NAME,
                                                           "schema": {"type": "object"},
                                                           "strict": nullable({"type": "boolean"})}}}},
        ]
    out["response_format"] = nullable({"anyOf": formats})
    if not logprobs:  # the engine has none to give: only "off" is valid
        out["logprobs"] = nullable({"const": False})
        out["top_logprobs"] = {"type": "null"}
    return out


#: top_logprobs only with logprobs: true
TOP_NEEDS_LOGPROBS = {
    "if": {"required": ["top_logprobs"],
           "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}
#: 'required' needs tools
REQUIRED_NEEDS_TOOLS = {
    "if": {"required": ["tool_choice"], "properties": {"tool_choice": {"const": "required"}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
}


def message_extras(*, tools: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Extra message properties (tool_calls, tool_call_id, name) and the rules tying them to roles."""
    props: dict[str, Any] = {
        "tool_calls": nullable({"type": "array", "items": _TOOL_CALL}) if tools else _NO_TOOLS,
        "tool_call_id": nullable({"type": "string"}),
        "name": nullable({"type": "string"}),
    }
    rules: list[dict[str, Any]] = [
        {"if": {"properties": {"role": {"const": "tool"}}},
         "then": {"required": ["tool_call_id"],
                  "properties": {"tool_call_id": {"type": "string", "minLength": 1}}}},
        {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
         "then": {"properties": {"tool_calls": _NO_TOOLS}}},
    ]
    return props, rules

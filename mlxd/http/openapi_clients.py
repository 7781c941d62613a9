"""OpenAPI pieces shared by the routes' modules: error and JSON responses, names, a body's
schema with its model (:func:`with_model`), and the response shapes of the OpenAI routes.

Kept beside :mod:`mlxd.http.openapi`, which assembles the document. Request
schemas are not written here: they are the validators' own descriptions
(:mod:`mlxd.http.shapes`), one variant per engine group where models take
different things (:mod:`mlxd.http.openapi_chat`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxd.http import structured
from mlxd.http.fields import nullable
from mlxd.http.shapes import Obj
from mlxd.http.structured import MAX_MODEL_NAME, MODEL_NAME_PATTERN, tool_choice_kind

#: JSON Schema keyword kept explicit: unknown fields are ignored, not refused
OPEN = {"additionalProperties": True}
#: a function or tool name
NAME = structured.NAME.schema()



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
OBJECT_SCHEMA = {**structured.OBJECT_SCHEMA.schema(), "description": "a JSON Schema of type object"}


def with_model(kind: Obj, fields: dict[str, Any]) -> dict[str, Any]:
    """The schema of a body's description (``kind``) with ``fields`` (the model, named by the
    config) put first, ``model`` required."""
    out = kind.schema()
    out["properties"] = {**fields, **out["properties"]}
    out["required"] = ["model", *out.get("required", [])]
    return out


def tool_choice(tools: bool, description: str) -> dict[str, Any]:
    """OpenAI's ``tool_choice`` (also Ollama's ``options.tool_choice``)."""
    return {**nullable(tool_choice_kind(tools).schema()), "description": description}

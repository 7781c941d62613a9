"""The request fields tables (:mod:`mlxd.http.fields`) against ``/openapi.json`` and the validators.

Three promises keep the document from drifting from validation:

- each kind's check and its JSON Schema accept exactly the same values;
- each route's document shows its table's fields with the table's schema (it is built
  from the table, so a field added to a table is documented without a second edit);
- every body field a route's validator reads is documented on that route, and every
  documented field is read (``tests/unit/test_documented_reads.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jsonschema
import pytest

from mlxd.http import (
    anthropic_fields,
    anthropic_shapes,
    embeddings_api,
    ollama_shapes,
    responses_fields,
)
from mlxd.http.fields import MAX_STOP_LENGTH, Choice, Integer, Kind, Number, Stops, Text, documented
from mlxd.http.openapi import openapi_document
from mlxd.http.structured import CHAT_FIELDS, COMPLETION_FIELDS
from mlxd.http.validation import SAMPLING

#: every table, by where it sits in a body
TABLES: dict[str, Mapping[str, Kind]] = {
    "openai sampling": SAMPLING,
    "openai chat": CHAT_FIELDS,
    "openai completion": COMPLETION_FIELDS,
    "embeddings": embeddings_api.FIELDS,
    "responses": responses_fields.FIELDS,
    "responses reasoning": responses_fields.REASONING,
    "responses text": {"verbosity": responses_fields.VERBOSITY},
    "anthropic": {**anthropic_shapes.FIELDS, "max_tokens": anthropic_shapes.MAX_TOKENS},
    "anthropic accepted": {"service_tier": anthropic_fields.SERVICE_TIER},
    "anthropic output_config": {"effort": anthropic_fields.EFFORT},
    "ollama options": ollama_shapes.OPTIONS,
    "ollama generate": ollama_shapes.GENERATE,
    "ollama embed": ollama_shapes.EMBED,
    "ollama pull": ollama_shapes.PULL,
    "ollama show": ollama_shapes.SHOW,
}
KINDS = [(f"{where}.{key}", kind) for where, table in TABLES.items() for key, kind in table.items()]


def probes(kind: Kind) -> list[object]:
    """Values on both sides of ``kind``'s edges, and of every other JSON type."""
    out: list[object] = [True, False, 0, 1, -1, 0.5, 16.0, "", "x", "auto", [], ["x"], {}, {"a": 1},
                         2**63, 2**64, -(2**63) - 1, 1e300]
    if isinstance(kind, (Number, Integer)):
        for edge in (kind.lo, kind.hi):
            if edge is not None:
                out += [edge, edge - 1, edge + 1, edge - 0.5, edge + 0.5, float(edge)]
    if isinstance(kind, Text):
        out += ["a" * n for n in (kind.min_length, kind.min_length + 1)]
        if kind.max_length is not None:
            out += ["a" * kind.max_length, "a" * (kind.max_length + 1)]
    if isinstance(kind, Choice):
        out += [*kind.values, *(v.upper() for v in kind.values)]
    if isinstance(kind, Stops):
        longest = "s" * MAX_STOP_LENGTH
        out += [longest, longest + "s", ["s"] * kind.most, ["s"] * (kind.most + 1), [longest + "s"],
                [""], [1], "s"]
    return out


@pytest.mark.parametrize(("where", "kind"), KINDS, ids=[where for where, _ in KINDS])
def test_each_kind_accepts_exactly_what_its_schema_accepts(where: str, kind: Kind) -> None:
    """For values on and around each field's edges, the validator's check passes iff its documented schema does."""
    checker = jsonschema.Draft202012Validator(kind.schema())
    disagree = [(v, kind.complaint(v)) for v in probes(kind)
                if (kind.complaint(v) is None) != checker.is_valid(v)]
    assert disagree == [], where


def variants(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The object variants of a (possibly anyOf'd, nullable) request schema."""
    own = [schema] if schema.get("type") == "object" or "properties" in schema else []
    return own + [v for part in schema.get("anyOf", []) for v in variants(part)]


def properties(schema: dict[str, Any]) -> dict[str, Any]:
    """Every property any object variant of ``schema`` documents (the first wins)."""
    out: dict[str, Any] = {}
    for variant in variants(schema):
        for key, value in variant.get("properties", {}).items():
            out.setdefault(key, value)
    return out


def request_schema(path: str) -> dict[str, Any]:
    operation = openapi_document(None)["paths"][path]["post"]
    schema: dict[str, Any] = operation["requestBody"]["content"]["application/json"]["schema"]
    return schema


#: (route, the field holding the table: "" for the top level, table)
SHOWN = [
    ("/v1/chat/completions", "", SAMPLING), ("/v1/chat/completions", "", CHAT_FIELDS),
    ("/v1/completions", "", SAMPLING), ("/v1/completions", "", COMPLETION_FIELDS),
    ("/v1/embeddings", "", embeddings_api.FIELDS),
    ("/v1/responses", "", responses_fields.FIELDS),
    ("/v1/responses", "reasoning", responses_fields.REASONING),
    ("/v1/responses", "text", {"verbosity": responses_fields.VERBOSITY}),
    ("/v1/messages", "", anthropic_shapes.FIELDS),
    ("/v1/messages", "", {"service_tier": anthropic_fields.SERVICE_TIER}),
    ("/v1/messages", "output_config", {"effort": anthropic_fields.EFFORT}),
    ("/api/chat", "options", ollama_shapes.OPTIONS),
    ("/api/generate", "options", ollama_shapes.OPTIONS), ("/api/generate", "", ollama_shapes.GENERATE),
    ("/api/embed", "", ollama_shapes.EMBED), ("/api/pull", "", ollama_shapes.PULL),
    ("/api/show", "", ollama_shapes.SHOW),
]


@pytest.mark.parametrize(("path", "field", "table"), SHOWN, ids=[f"{p} {f}" for p, f, _ in SHOWN])
def test_each_route_documents_its_table(path: str, field: str, table: Mapping[str, Kind]) -> None:
    """The route's request schema shows each field of its table as the table describes it (or null)."""
    shown = properties(request_schema(path))
    if field:
        shown = properties(shown[field])
    for key, expected in documented(table).items():
        got = {k: v for k, v in shown[key].items() if k != "description"}
        assert got == {k: v for k, v in expected.items() if k != "description"}, (path, key)
    assert anthropic_shapes.MAX_TOKENS.schema() == properties(request_schema("/v1/messages"))["max_tokens"]

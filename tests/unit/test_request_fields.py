"""The request fields tables (:mod:`mlxd.http.fields`) against ``/openapi.json`` and the validators.

Three promises keep the document from drifting from validation:

- each kind's check and its JSON Schema accept exactly the same values;
- each route's document shows its table's fields with the table's schema (it is built
  from the table, so a field added to a table is documented without a second edit);
- every body field a route's validator reads is documented on that route, and every
  documented field is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
from mlxd.http.anthropic_shapes import parse_messages
from mlxd.http.fields import MAX_STOP_LENGTH, Choice, Integer, Kind, Number, Stops, Text, documented
from mlxd.http.openapi import openapi_document
from mlxd.http.responses_fields import parse_responses
from mlxd.http.structured import CHAT_FIELDS, COMPLETION_FIELDS
from mlxd.http.validation import SAMPLING, parse_request

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


class Recorder(dict[str, Any]):
    """A body that notes every key its reader looks up (``where`` prefixes nested objects)."""

    def __init__(self, seen: set[str], where: str, **fields: Any) -> None:
        super().__init__(fields)
        self.seen, self.where = seen, where

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self.seen.add(self.where + key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.seen.add(self.where + key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.seen.add(self.where + str(key))
        return super().__contains__(key)


HI = [{"role": "user", "content": "hi"}]
#: route -> (a valid body as a Recorder, holding Recorders at the nested fields read, its reader)
Reader = Callable[[Recorder], object]
READERS: dict[str, tuple[Callable[[set[str]], Recorder], Reader]] = {
    "/v1/chat/completions": (
        lambda s: Recorder(s, "", model="m", messages=HI, stream_options=Recorder(s, "stream_options.")),
        lambda body: parse_request(body, kind="chat")),
    "/v1/completions": (lambda s: Recorder(s, "", model="m", prompt="hi"),
                        lambda body: parse_request(body, kind="completion")),
    "/v1/messages": (
        lambda s: Recorder(s, "", model="m", max_tokens=4, messages=HI,
                           output_config=Recorder(s, "output_config."),
                           context_management=Recorder(s, "context_management.", edits=[])),
        lambda body: parse_messages(body, request_id="r")),
    "/v1/responses": (
        lambda s: Recorder(s, "", model="m", input="hi", reasoning=Recorder(s, "reasoning."),
                           text=Recorder(s, "text.")),
        lambda body: parse_responses(body)),
    "/api/chat": (lambda s: Recorder(s, "", model="m", messages=HI, options=Recorder(s, "options.")),
                  lambda body: ollama_shapes.parse(body, "chat", known=lambda _: True,
                                                   allow_images=lambda _: False, request_id="r",
                                                   headers={})),
    "/api/generate": (lambda s: Recorder(s, "", model="m", prompt="hi", options=Recorder(s, "options.")),
                      lambda body: ollama_shapes.parse(body, "generate", known=lambda _: True,
                                                       allow_images=lambda _: False, request_id="r",
                                                       headers={})),
}
def documented_keys(schema: dict[str, Any], nested: set[str]) -> set[str]:
    shown = properties(schema)
    out = set(shown)
    for field in nested:
        out |= {f"{field}.{key}" for key in properties(shown[field])}
    return out


@pytest.mark.parametrize("path", list(READERS))
def test_every_field_a_route_reads_is_documented_and_back(path: str) -> None:
    """The keys a route's validator looks up in a valid body are the fields its document shows."""
    seen: set[str] = set()
    make, reader = READERS[path]
    body = make(seen)
    reader(body)
    nested = {key for key, value in body.items() if isinstance(value, Recorder)}
    shown = documented_keys(request_schema(path), nested)
    assert seen - shown == set(), "read but not documented"
    assert shown - seen == set(), "documented but never read"

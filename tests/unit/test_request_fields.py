"""The request descriptions (:mod:`mlxd.http.fields`, :mod:`mlxd.http.shapes`) against ``/openapi.json``.

Four promises keep the document from drifting from validation:

- each kind's check and its JSON Schema accept exactly the same values: the scalar kinds
  of every table, and every composite kind of every described body (and each part of it),
  over valid values and their one-step mutations;
- a composite kind's problem names the full path of what is wrong;
- each route's document shows its table's fields with the table's schema (it is built
  from the table, so a field added to a table is documented without a second edit);
- every body field a route's validator reads is documented on that route, and every
  documented field is read (``tests/unit/test_documented_reads.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
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
from mlxd.http.fields import (
    MAX_STOP_LENGTH,
    Boolean,
    Choice,
    Integer,
    Kind,
    Number,
    Stops,
    Text,
    documented,
)
from mlxd.http.openapi import openapi_document
from mlxd.http.shapes import (
    AnyOf,
    Array,
    Composite,
    Const,
    Map,
    Obj,
    Pattern,
    Refused,
    Tagged,
    problem,
)
from mlxd.http.structured import CHAT_FIELDS, COMPLETION_FIELDS, NAME_PATTERN
from mlxd.http.validation import CHAT_BODY, COMPLETION_BODY, SAMPLING, chat_body

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


# ---- composite kinds ----------------------------------------------------------------------

#: every described body, by route (the validator's variant and the document's others)
BODIES: dict[str, Kind] = {
    "chat": CHAT_BODY,
    "chat vision": chat_body(images=True, tools=False, grammar=False, logprobs=False),
    "chat fake": chat_body(images=False, tools=False, grammar=False, logprobs=True),
    "completion": COMPLETION_BODY,
    "embeddings": embeddings_api.BODY,
    "responses": responses_fields.BODY,
    "responses vision": responses_fields.body_kind(images=True, functions=False, grammar=False),
    "messages": anthropic_shapes.BODY,
    "messages fake": anthropic_shapes.body_kind(tools=False),
    "count_tokens": anthropic_shapes.COUNTING_BODY,
    **{f"ollama {kind}": body for kind, body in ollama_shapes.BODIES.items()},
    "ollama chat fake": ollama_shapes.body_kind("chat", images=False, tools=False, thinking=False),
    "ollama generate vision": ollama_shapes.body_kind("generate", tools=False, thinking=False),
    "ollama embed": ollama_shapes.EMBED_BODY,
    "ollama embeddings": ollama_shapes.EMBEDDINGS_BODY,
}
#: a string each pattern accepts
MATCHING = {NAME_PATTERN: "get_weather"}


def parts(kind: Kind) -> Iterator[Kind]:
    """``kind`` and every kind inside it."""
    yield kind
    match kind:
        case Obj(fields=fields):
            for sub in fields.values():
                yield from parts(sub)
        case Array(item=item):
            yield from parts(item)
        case AnyOf(options=options):
            for sub in options:
                yield from parts(sub)
        case Tagged(variants=variants, others=others):
            for sub in [*variants.values(), *([others] if others else [])]:
                yield from parts(sub)
        case Map(value=value):
            yield from parts(value)


COMPOSITES = [(f"{where} {i}", kind) for where, body in BODIES.items()
              for i, kind in enumerate(k for k in parts(body) if isinstance(k, Composite))]


def sample(kind: Kind) -> object:
    """A value ``kind`` accepts (with every optional field of an object filled in)."""
    match kind:
        case Obj(fields=fields):
            return {key: sample(sub) for key, sub in fields.items() if not isinstance(sub, Refused)}
        case Array(item=item, min_items=least, max_items=most):
            return [] if most == 0 else [sample(item)] * max(least, 1)
        case AnyOf(options=options):
            return sample(options[0])
        case Tagged(tag=tag, variants=variants):
            if not variants:
                return {tag: "web_search"}
            value, variant = next(iter(variants.items()))
            return {tag: value, **sample(variant)}  # type: ignore[dict-item]
        case Const(value=value):
            return value
        case Pattern(regex=regex):
            return MATCHING[regex]
        case Text(min_length=least):
            return "a" * max(least, 1)
        case Number(lo=lo) | Integer(lo=lo) if lo is not None:
            return lo
        case Choice(values=values):
            return values[0]
        case Stops():
            return ["s"]
        case Map(value=value):
            return {"k": sample(value)}
        case Boolean():
            return True
    return 0


def mutations(kind: Kind, depth: int) -> list[object]:
    """Values on both sides of ``kind``'s edges, ``depth`` levels into it."""
    if not isinstance(kind, Composite):
        return [sample(kind), *probes(kind)] if depth else [sample(kind), None, "x", 1]
    out: list[object] = [sample(kind), None, True, 0, 1.5, "", "x", [], {}, [{}]]
    match kind:
        case Obj(fields=fields):
            base: dict[str, object] = sample(kind)  # type: ignore[assignment]
            for key, sub in fields.items():
                out.append({k: v for k, v in base.items() if k != key})
                out += [{**base, key: v} for v in mutations(sub, depth - 1)] if depth else []
        case Array(item=item, min_items=least, max_items=most):
            one = sample(item)
            out += [[one] * n for n in {least, least + 1, max(least - 1, 0)}]
            if most is not None:
                out += [[one] * most, [one] * (most + 1)]
            out += [[v] for v in mutations(item, depth - 1)] if depth else []
        case AnyOf(options=options):
            for sub in options:
                out += mutations(sub, depth)
        case Tagged(tag=tag, variants=variants):
            for value, variant in variants.items():
                full = {tag: value, **sample(variant)}  # type: ignore[dict-item]
                out += [full, {**full, tag: value.upper()}, {k: v for k, v in full.items() if k != tag}]
                out += [{tag: value, **v} for v in mutations(variant, depth) if isinstance(v, dict)]
            out += [{tag: "item_reference"}, {tag: "web_search"}, {tag: 5}]
        case Map(value=value, max_keys=most, max_key=longest):
            out += [{"k" * longest: sample(value)}, {"k" * (longest + 1): sample(value)},
                    {str(i): sample(value) for i in range(most + 1)}]
            out += [{"k": v} for v in mutations(value, depth - 1)] if depth else []
    return out


def structure(schema: object) -> object:
    """``schema`` without its ``rules`` (the ``allOf`` of if/then the validator's code checks)."""
    if isinstance(schema, dict):
        return {k: structure(v) for k, v in schema.items() if k != "allOf"}
    if isinstance(schema, list):
        return [structure(v) for v in schema]
    return schema


@pytest.mark.parametrize(("where", "kind"), COMPOSITES, ids=[where for where, _ in COMPOSITES])
def test_each_composite_kind_accepts_exactly_what_its_schema_accepts(where: str, kind: Kind) -> None:
    """For valid values of each nested shape and their mutations, the check passes iff its documented structure does."""
    checker = jsonschema.Draft202012Validator(structure(kind.schema()))  # type: ignore[arg-type]
    values = mutations(kind, 2)
    disagree = [(v, kind.complaint(v)) for v in values if (kind.complaint(v) is None) != checker.is_valid(v)]
    assert disagree == [], where
    assert any(kind.complaint(v) is None for v in values) and any(kind.complaint(v) for v in values)


TEXT = {"role": "user", "content": "hi"}
#: (body, the param its problem names, words of its message)
PATHS = [
    ({}, "messages", "is required"),
    ({"messages": [TEXT, TEXT, {"role": "user", "content": [{"type": "audio"}]}]},
     "messages[2].content[0].type", "must be 'text' or 'image_url'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages[0].content[0].text", "must be a string"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "non-empty list of content parts"),
    ({"messages": [{"role": "wizard"}]}, "messages[0].role", "must be one of assistant, developer"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "is required"),
    ({"messages": [TEXT], "tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name", "letters, digits"),
    ({"messages": [TEXT], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools[0].function.parameters", "of type 'object'"),
    ({"messages": [TEXT], "tool_choice": {"type": "function", "function": {}}},
     "tool_choice.function.name", "is required"),
    ({"messages": [TEXT], "tool_choice": "sometimes"}, "tool_choice", "'auto', 'none', 'required'"),
    ({"messages": [TEXT], "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": 1}}},
     "response_format.json_schema.schema", "JSON Schema object"),
    ({"messages": [TEXT], "stream_options": {"include_usage": None}}, "stream_options.include_usage",
     "must be a boolean"),
]


@pytest.mark.parametrize(("body", "param", "words"), PATHS, ids=[p for _, p, _ in PATHS])
def test_a_composite_problem_names_its_full_path(body: dict[str, Any], param: str, words: str) -> None:
    """The chat body's first problem is reported at the path of the value that is wrong."""
    found = problem(CHAT_BODY, body, "")
    assert found is not None and found[0] == param and words in found[1], found


@pytest.mark.parametrize(("value", "param"), [
    (["ok", ""], "input[1]"), ([[1, -2]], "input[0]"), ([], "input"), ([1, "a"], "input"),
    ("", "input"), ([["a"]], "input[0]")])
def test_an_embeddings_input_problem_names_the_input(value: object, param: str) -> None:
    """Among the array forms of input, the one its first item chooses names the problem."""
    found = problem(embeddings_api.BODY, {"input": value}, "")
    assert found is not None and found[0] == param, found


RULED = [(f"{where} {i}", kind) for where, body in BODIES.items()
         for i, kind in enumerate(k for k in parts(body) if isinstance(k, Obj) and k.rules)]


@pytest.mark.parametrize(("where", "kind"), RULED, ids=[where for where, _ in RULED])
def test_a_null_field_is_judged_by_the_documented_rules_as_if_it_were_left_out(where: str, kind: Obj) -> None:
    """The validator reads an optional field sent as null as absent; each if/then rule of the
    document must too (CI's schemathesis found ``tool_choice: null`` taken for a forced choice)."""
    rules = jsonschema.Draft202012Validator({"allOf": list(kind.rules)})
    full = sample(kind)
    assert isinstance(full, dict)
    nullable_keys = [k for k in kind.fields if k not in kind.required and k not in kind.not_null]
    for key in nullable_keys:
        for without in ({k: v for k, v in full.items() if k != key}, {}):
            assert rules.is_valid({**without, key: None}) == rules.is_valid(without), (where, key, without)

"""Schemas the grammar library cannot enforce are refused before compiling, and real ones pass.

Each refused shape was measured to fail with llguidance 1.9 (mlxd.engines.grammar.schema_bounds):
no finite instance ("Too many items" at the first token), reference chains
that crash its matcher, forced instances that cost milliseconds a token, and
objects whose optional properties overflow its parser's row.
"""

from __future__ import annotations

from typing import Any

import pytest

from mlxd.engines.grammar import schema_bounds
from mlxd.engines.grammar.schema_bounds import (
    MAX_NESTING,
    MAX_OPTIONAL_PROPERTIES,
    MAX_SMALLEST_BYTES,
    check_enforceable,
)
from mlxd.errors import InvalidRequest


def chain(n: int, *, required: bool) -> dict[str, Any]:
    """``d0 -> d1 -> ... -> dn``: each an object whose property ``c`` is the next."""
    defs: dict[str, Any] = {
        f"d{i}": {"type": "object", "properties": {"c": {"$ref": f"#/$defs/d{i + 1}"}},
                  **({"required": ["c"]} if required else {})}
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def obj(n: int, **kw: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}, **kw}


ENFORCEABLE = {
    "plain": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
    "empty": {},
    "true": True,
    "optional recursion": {"type": "object", "properties": {"c": {"$ref": "#"}}},
    "recursion with an exit": {"type": "object", "required": ["c"],
                               "properties": {"c": {"anyOf": [{"$ref": "#"}, {"type": "integer"}]}}},
    "array or null": {"anyOf": [{"type": "null"},
                                {"type": "array", "minItems": 1, "items": {"$ref": "#"}}]},
    "untyped recursion": {"required": ["c"], "properties": {"c": {"$ref": "#"}}},
    "a short chain": chain(50, required=True),
    "a 1 KB const": {"const": "x" * 1000},
    "400 optional properties": obj(MAX_OPTIONAL_PROPERTIES),
    "600 required properties": obj(600, required=[f"p{i}" for i in range(600)]),
    "unknown remote reference": {"$ref": "https://example.com/schema.json"},
}

REFUSED = {
    "endless object": ({"$defs": {"n": {"type": "object", "required": ["c"],
                                        "properties": {"c": {"$ref": "#/$defs/n"}}}},
                        "$ref": "#/$defs/n"}, "no finite instance"),
    "endless array": ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, "no finite instance"),
    "endless additional property": ({"type": "object", "required": ["c"],
                                     "additionalProperties": {"$ref": "#"}}, "no finite instance"),
    "an endless optional branch": ({"type": "object", "properties": {
        "x": {"type": "array", "minItems": 1, "items": {"$ref": "#/properties/x"}}}},
        "no finite instance"),
    "a chain that crashes the matcher": (chain(1000, required=False), f"{MAX_NESTING} levels"),
    "a required chain": (chain(3000, required=True), f"{MAX_NESTING} levels"),
    "a 10 KB const": ({"type": "object", "required": ["a"],
                       "properties": {"a": {"const": "x" * 10_000}}}, "smallest instance"),
    "a long minLength": ({"type": "string", "minLength": 100_000}, f"{MAX_SMALLEST_BYTES:,}"),
    "1,000 optional properties": (obj(1000), "1,000 optional properties"),
}


@pytest.mark.parametrize("name", ENFORCEABLE)
def test_enforceable_schemas_pass(name: str) -> None:
    """A schema llguidance enforces passes the checks."""
    check_enforceable(ENFORCEABLE[name], "response_format.json_schema.schema")


@pytest.mark.parametrize("name", REFUSED)
def test_unenforceable_schemas_are_a_400_naming_the_field(name: str) -> None:
    """A schema llguidance cannot enforce is an InvalidRequest naming the field and saying why, in one bounded line."""
    schema, why = REFUSED[name]
    with pytest.raises(InvalidRequest) as exc:
        check_enforceable(schema, "tools", "the parameters of 'f'")
    assert exc.value.param == "tools" and why in exc.value.message
    assert "\n" not in exc.value.message and len(exc.value.message) < 300


def test_the_checks_stay_linear_on_shared_references(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty levels of definitions each referring ten times to the next are measured once each, not 10**20 times."""
    defs = {f"d{i}": {"type": "object",
                      "properties": {f"k{j}": {"$ref": f"#/$defs/d{i + 1}"} for j in range(10)}}
            for i in range(20)}
    defs["d20"] = {"type": "string"}
    visits = {"nesting": 0, "smallest": 0}
    for name in visits:
        original = getattr(schema_bounds._Schema, name)

        def counted(self: Any, *args: Any, _f: Any = original, _n: str = name) -> Any:
            visits[_n] += 1
            return _f(self, *args)

        monkeypatch.setattr(schema_bounds._Schema, name, counted)
    check_enforceable({"$defs": defs, "$ref": "#/$defs/d0"}, "p")
    assert visits["nesting"] < 1000 and visits["smallest"] < 5000, visits

"""Composite request kinds: one description of each nested request shape, for the validator and the document.

The scalar kinds of :mod:`mlxd.http.fields` describe one value; the kinds here
put them together: :class:`Obj` (which keys, of which kinds, which required),
:class:`Array`, :class:`AnyOf`, :class:`Tagged` (objects told apart by a key
such as ``type``), :class:`Const`, :class:`Pattern`, :class:`Anything` and
:class:`Refused`. A route describes its body once with them; its validator
calls :func:`check` (a 400 whose ``param`` is the full path of the first
problem, ``messages[2].content[0].type``) and then converts the body, which it
may now read without checking types again; :mod:`mlxd.http.openapi` shows the
same description's :meth:`schema`.

Rules that are not about structure (a tool message needs ``tool_call_id``,
image parts only for vision models, ``stream_options`` needs ``stream``) stay
in the validator's code; where the document states one, its JSON Schema
``if``/``then`` is an :class:`Obj`'s ``rules``, written beside that code.
``rules`` are documentation only: :meth:`Obj.complaint` does not check them
(``tests/unit/test_request_fields.py`` checks every kind's complaint against
its schema without its rules, value for value).

Checking walks the body once along the description (never the other way round),
so its cost is the body's size over the described keys; nothing is compiled per
request. Optional fields may be ``null`` (they then take their default) unless
the object names them ``not_null``; unknown keys are accepted and ignored
(``additionalProperties: true``), as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxd.errors import InvalidRequest
from mlxd.http.fields import Boolean, Choice, Integer, Kind, Number, Stops, Text, bad, nullable

#: (param, message) of the first problem found in a value
Problem = tuple[str, str]


def at(param: str, key: str) -> str:
    return f"{param}.{key}" if param else key


def quoted(values: object) -> str:
    """``'a', 'b' or 'c'``: the values a field may take, as its complaint lists them."""
    shown = [f"'{v}'" if isinstance(v, str) else json.dumps(v) for v in values]  # type: ignore[attr-defined]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


class Composite:
    """A kind whose problems may sit deeper than the value itself (a key, an item)."""

    __slots__ = ()

    def problem(self, v: object, param: str) -> Problem | None:
        raise NotImplementedError

    def complaint(self, v: object) -> str | None:
        found = self.problem(v, "")
        if found is None:
            return None
        return f"{found[0]}: {found[1]}" if found[0] else found[1]


def problem(kind: Kind, v: object, param: str) -> Problem | None:
    """The first problem of ``v`` as ``kind`` describes it, at its full path under ``param``."""
    if isinstance(kind, Composite):
        return kind.problem(v, param)
    message = kind.complaint(v)
    return None if message is None else (param, message)


def check(kind: Kind, v: object, param: str = "") -> None:
    """A 400 naming the first problem of ``v`` (``param``: where ``v`` sits; empty: the body)."""
    found = problem(kind, v, param)
    if found is not None:
        where, message = found
        raise bad(where, message) if where else InvalidRequest(message)


def json_type(v: object) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, dict):
        return "object"
    if isinstance(v, list):
        return "array"
    return "string" if isinstance(v, str) else "null"


def json_types(kind: Kind) -> frozenset[str]:
    """The JSON types a value of ``kind`` may have (which options of an :class:`AnyOf` fit it)."""
    match kind:
        case Obj() | Tagged() | Map():
            return frozenset({"object"})
        case Array():
            return frozenset({"array"})
        case Text() | Choice() | Pattern():
            return frozenset({"string"})
        case Number() | Integer():
            return frozenset({"number"})
        case Boolean():
            return frozenset({"boolean"})
        case Stops(one_string=one):
            return frozenset({"array", "string"} if one else {"array"})
        case Const(value=value):
            return frozenset({json_type(value)})
        case AnyOf(options=options):
            return frozenset().union(*(json_types(o) for o in options))
    return frozenset({"object", "array", "string", "number", "boolean"})


@dataclass(frozen=True, slots=True)
class Obj(Composite):
    """A JSON object: ``fields`` by key (checked in this order), ``required`` among them."""

    fields: Mapping[str, Kind]
    required: tuple[str, ...] = ()
    #: optional fields that may be left out but not be null (the others may: they then take
    #: their default)
    not_null: tuple[str, ...] = ()
    #: what a value that is not an object is told
    hint: str = "must be an object"
    #: JSON Schema (``if``/``then``) of rules the validator's code checks: documented only
    rules: tuple[dict[str, Any], ...] = ()
    #: descriptions of some fields in the document
    notes: Mapping[str, str] = field(default_factory=dict)
    #: a problem inside is reported at the object, with ``hint`` (a JSON Schema)
    whole: bool = False

    def problem(self, v: object, param: str) -> Problem | None:
        if not isinstance(v, dict):
            return (param, self.hint)
        found = self._inside(v, param)
        return (param, self.hint) if found is not None and self.whole else found

    def _inside(self, v: dict[str, Any], param: str) -> Problem | None:
        for key in self.required:
            if v.get(key) is None:
                return (at(param, key), "is required")
        for key, kind in self.fields.items():
            x = v.get(key)
            if x is None and (key not in self.not_null or key not in v):
                continue
            found = problem(kind, x, at(param, key))
            if found is not None:
                return found
        return None

    def schema(self) -> dict[str, Any]:
        props: dict[str, Any] = {}
        for key, kind in self.fields.items():
            shown = kind.schema()
            optional = key not in self.required and key not in self.not_null
            props[key] = nullable(shown) if optional else shown
            if key in self.notes:
                props[key] = {**props[key], "description": self.notes[key]}
        out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": True}
        if self.required:
            out["required"] = list(self.required)
        if self.rules:
            out["allOf"] = list(self.rules)
        return out


@dataclass(frozen=True, slots=True)
class Array(Composite):
    """A JSON array of ``item``s, ``min_items`` to ``max_items`` long."""

    item: Kind
    min_items: int = 0
    max_items: int | None = None
    #: what a value that is not such a list is told (else its bounds)
    hint: str | None = None
    #: an item's problem is reported at the array, with ``hint`` (lists of scalars)
    whole: bool = False

    def problem(self, v: object, param: str) -> Problem | None:
        if not isinstance(v, list) or len(v) < self.min_items or (
                self.max_items is not None and len(v) > self.max_items):
            return (param, self.hint or self._bounds())
        for i, x in enumerate(v):
            found = problem(self.item, x, f"{param}[{i}]")
            if found is not None:
                return (param, self.hint or found[1]) if self.whole else found
        return None

    def _bounds(self) -> str:
        if self.max_items is None:
            return "must be a list" + (f" of at least {self.min_items} items" if self.min_items else "")
        if self.max_items == 0:
            return "must be an empty list"
        return f"must be a list of {self.min_items} to {self.max_items} items"

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "array", "items": self.item.schema()}
        if self.min_items:
            out["minItems"] = self.min_items
        if self.max_items is not None:
            out["maxItems"] = self.max_items
        return out


@dataclass(frozen=True, slots=True)
class AnyOf(Composite):
    """A value of any of ``options``. A problem is told at the one option of the value's JSON
    type (among arrays, the one whose items have the first item's type) when it sits deeper
    than the value; otherwise ``hint``."""

    options: tuple[Kind, ...]
    hint: str

    def problem(self, v: object, param: str) -> Problem | None:
        fails: list[tuple[Kind, Problem]] = []
        for option in self.options:
            found = problem(option, v, param)
            if found is None:
                return None
            fails.append((option, found))
        kind = json_type(v)
        fitting = [(o, p) for o, p in fails if kind in json_types(o)]
        if len(fitting) > 1 and isinstance(v, list) and v:
            first = json_type(v[0])
            fitting = [(o, p) for o, p in fitting if isinstance(o, Array) and first in json_types(o.item)]
        if len(fitting) == 1 and fitting[0][1][0] != param:
            return fitting[0][1]
        return (param, self.hint)

    def schema(self) -> dict[str, Any]:
        return {"anyOf": [o.schema() for o in self.options]}


@dataclass(frozen=True, slots=True)
class Tagged(Composite):
    """Objects told apart by ``tag`` (``type``, ``role``): ``variants`` by the tag's value, each
    without the tag (a variant may itself be told apart by another key)."""

    tag: str
    variants: Mapping[str, Obj | Tagged]
    #: the variant of an object without the tag
    default: str | None = None
    #: the variant of any other string value (tools mlxd leaves out), if any
    others: Obj | None = None
    #: tag values refused with their own message (``item_reference``)
    refused: Mapping[str, str] = field(default_factory=dict)
    #: what a value that is not an object is told
    hint: str | None = None
    #: the values a wrong tag is told it may take (else the variants, quoted)
    expected: str | None = None

    def problem(self, v: object, param: str) -> Problem | None:
        if not isinstance(v, dict):
            return (param, self.hint or f"must be an object with a '{self.tag}'")
        value = v.get(self.tag, self.default)
        variant = self.variants.get(value) if isinstance(value, str) else None
        if variant is None and isinstance(value, str) and value not in self.refused:
            variant = self.others
        if variant is None:
            if isinstance(value, str) and value in self.refused:
                return (at(param, self.tag), self.refused[value])
            if self.others is not None:
                return (at(param, self.tag), "must be a string")
            got = "" if value is None else f" (got {json.dumps(value)[:60]})"
            return (at(param, self.tag), f"must be {self.expected or quoted(list(self.variants))}{got}")
        return variant.problem(v, param)

    def schema(self) -> dict[str, Any]:
        out: list[dict[str, Any]] = []
        for value, variant in self.variants.items():
            out += _tagged(variant.schema(), self.tag, {"const": value}, value != self.default)
        if self.others is not None:
            known = {"type": "string", "not": {"enum": [*self.variants, *self.refused]}}
            out += _tagged(self.others.schema(), self.tag, known, True)
        return out[0] if len(out) == 1 else {"anyOf": out}


def _tagged(schema: dict[str, Any], tag: str, shown: dict[str, Any], required: bool) -> list[dict[str, Any]]:
    """The object schemas of a variant (its own variants, if it is told apart further) with the tag."""
    if "anyOf" in schema:
        return [x for part in schema["anyOf"] for x in _tagged(part, tag, shown, required)]
    out = {**schema, "properties": {tag: shown, **schema["properties"]}}
    if required:
        out["required"] = [tag, *schema.get("required", [])]
    return [out]


@dataclass(frozen=True, slots=True)
class Map(Composite):
    """A JSON object of any keys (at most ``max_keys``, each at most ``max_key`` characters)
    whose values are ``value``s (``metadata``)."""

    value: Kind
    max_keys: int
    max_key: int
    hint: str

    def problem(self, v: object, param: str) -> Problem | None:
        if not isinstance(v, dict) or len(v) > self.max_keys:
            return (param, self.hint)
        for key, x in v.items():
            if len(key) > self.max_key:
                return (param, f"keys are at most {self.max_key} characters")
            found = problem(self.value, x, at(param, key))
            if found is not None:
                return found
        return None

    def schema(self) -> dict[str, Any]:
        return {"type": "object", "maxProperties": self.max_keys,
                "propertyNames": {"maxLength": self.max_key}, "additionalProperties": self.value.schema()}


@dataclass(frozen=True, slots=True)
class Const:
    value: str | int | bool
    #: what another value is told (else the value)
    hint: str | None = None

    def complaint(self, v: object) -> str | None:
        same = v == self.value and isinstance(v, bool) == isinstance(self.value, bool)
        return None if same else self.hint or f"must be {quoted([self.value])}"

    def schema(self) -> dict[str, Any]:
        return {"const": self.value}


@dataclass(frozen=True, slots=True)
class Pattern:
    """A string matching ``regex`` (searched, as JSON Schema's ``pattern`` is)."""

    regex: str
    hint: str

    def complaint(self, v: object) -> str | None:
        return None if isinstance(v, str) and re.search(self.regex, v) else self.hint

    def schema(self) -> dict[str, Any]:
        return {"type": "string", "pattern": self.regex}


@dataclass(frozen=True, slots=True)
class Anything:
    """Any JSON value (its meaning, if any, is checked by the validator's code)."""

    description: str | None = None

    def complaint(self, v: object) -> str | None:
        return None

    def schema(self) -> dict[str, Any]:
        return {"description": self.description} if self.description else {}


@dataclass(frozen=True, slots=True)
class Refused:
    """A field this route refuses unless absent or null (it belongs to another route)."""

    message: str

    def complaint(self, v: object) -> str | None:
        return self.message

    def schema(self) -> dict[str, Any]:
        return {"not": {}, "description": self.message}
